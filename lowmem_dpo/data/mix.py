"""The rows of `dataset` as a mixture of sources (sources.py): load each, take its share, cap the total, and
tokenize each source's rows on their own, so that a message about a row names its source's file and line.

    mix = load_mixture(cfg.dataset, cfg.dataset_split, cfg.seed, cfg.max_train_samples, data.load_rows)
    tok = tokenize_mixture(mix, lambda rows, spec, where: data.tokenize_rows(rows, ..., spec=data.Named(spec, where)))

Which rows (docs/data.md, Mixtures): a row's score is sha256 of the seed and the row's content (its JSON, keys sorted,
null values left out, so a column that only other rows have does not change it). A source with a fraction or a
row count takes the rows with the lowest scores: k = fraction x its rows rounded half up (at least 1), or
k = rows. max_train_samples then keeps the lowest-scored rows of the whole mixture. So the same recipe always
takes the same rows; adding rows to one source leaves the other sources' rows as they were (and in that source,
a taken row is only replaced by a new row that scores lower); another seed takes other rows.

Order: the sources in the recipe's order, each source's taken rows in its own order. The mixture's row index
(TokenizedPair.row, the cache's row order) counts over that order.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Callable

from lowmem_dpo.config.sources import Source
from lowmem_dpo.data.encode import TokenizedData
from lowmem_dpo.data.rows import row_kind, row_locator
from lowmem_dpo.data.split import prompt_keys
from lowmem_dpo.runtime.errors import UserError, log


def row_key(row: dict) -> str:
    """The text a row is scored by: its JSON with sorted keys, null values left out (at any depth: `datasets`
    fills a key only some rows have with null, so a row's key does not depend on the other rows)."""
    def bare(value):
        if isinstance(value, dict):
            return {k: bare(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [bare(v) for v in value]
        return value

    return json.dumps(bare(row), sort_keys=True, ensure_ascii=False, default=str)


def score(seed: int, key: str) -> int:
    """The row's rank key: the first 8 bytes of sha256(seed, key) as a number."""
    return int.from_bytes(hashlib.sha256(f"{seed}\n{key}".encode("utf-8")).digest()[:8], "big")


def take_count(source: Source, n: int) -> int:
    """How many of a source's n rows it takes: round half up of fraction x n, at least 1; or rows; or n."""
    if source.fraction is not None:
        return max(1, min(n, math.floor(source.fraction * n + 0.5)))
    return n if source.rows is None else source.rows


def row_scores(ds, seed: int) -> list[int]:
    """score() of every row of a datasets.Dataset, in row order (read by chunks)."""
    out: list[int] = []
    for start in range(0, len(ds), 4096):
        chunk = ds[start:start + 4096]
        out += [score(seed, row_key(dict(zip(chunk, vals)))) for vals in zip(*chunk.values())]
    return out


def lowest(scores: list[int], k: int) -> list[int]:
    """The indices of the k lowest scores (ties: the first), in ascending index order."""
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[:k])


@dataclass
class Part:
    """One source's rows in the mixture."""

    name: str  # how messages name it: dataset, or dataset[i] in a list of several
    source: Source
    split: str  # the split read: the source's, or dataset_split
    loaded: object  # every row of the source as loaded (a datasets.Dataset)
    indices: list[int] | None  # the rows taken, as indices into `loaded`, ascending; None: every row
    scores: list[int] | None = None  # score() of every loaded row, once a selection has computed them
    offset: int = 0  # the mixture's index of the part's first row

    @property
    def rows(self):
        """The rows taken (a datasets.Dataset)."""
        return self.loaded if self.indices is None else self.loaded.select(self.indices)

    def __len__(self) -> int:
        return len(self.loaded) if self.indices is None else len(self.indices)

    def format(self) -> str | None:
        """The rows' format, "text" or "conversation": the kind (rows.row_kind) of the first prompt that has one
        (tokenization refuses a source whose rows mix the two); None when every prompt is null."""
        rows = self.rows
        if "prompt" not in rows.column_names:
            return None
        for start in range(0, len(rows), 512):
            for prompt in rows[start:start + 512]["prompt"]:
                kind = row_kind({"prompt": prompt}, None, ("prompt",))
                if kind is not None:
                    return kind
        return None

    def where(self) -> Callable[[int], str] | None:
        """index among the taken rows -> its place in the source file ("row R at line L"); None when every row is
        taken (the tokenizer's own locator then says the same)."""
        if self.indices is None:
            return None
        at, indices = row_locator(self.source.path, len(self.loaded)), self.indices
        return lambda i: at(indices[i])


@dataclass
class Mixture:
    parts: list[Part]

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    @property
    def loaded(self) -> list:
        """Each source as loaded (a hub dataset's fingerprint is read from it)."""
        return [p.loaded for p in self.parts]

    def locate(self, row: int) -> tuple[int, int]:
        """(which part, index into its loaded rows) of the mixture's row."""
        k = max(k for k, p in enumerate(self.parts) if p.offset <= row and len(p))
        part, i = self.parts[k], row - self.parts[k].offset
        return k, (i if part.indices is None else part.indices[i])

    def name(self, row: int) -> str:
        """The mixture's row for messages: its source and its place there ("data/a.jsonl row 3 at line 4")."""
        k, i = self.locate(row)
        part = self.parts[k]
        return f"{part.source.path} {row_locator(part.source.path, len(part.loaded))(i)}"

    def row(self, row: int) -> dict:
        """The mixture's row as its source has it (every column)."""
        k, i = self.locate(row)
        return self.parts[k].loaded[i]

    def prompt_keys(self) -> list[str]:
        """split.prompt_key of every row, in mixture order (the eval hold-out goes by them)."""
        return [k for p in self.parts for k in prompt_keys(p.rows)]

    def dataset(self, columns: tuple[str, ...]):
        """The mixture as one datasets.Dataset of `columns` (a TRL trainer reads one); UserError when the sources
        differ in format (text and conversations)."""
        import datasets

        parts = [p.rows.select_columns(list(columns)) for p in self.parts]
        try:
            return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        except ValueError as e:
            raise UserError(f"the sources of dataset differ in format ({str(e).splitlines()[0][:200]}): one "
                            "dataset needs one format, text or conversations, in every source") from None


def load_mixture(sources: list[Source], default_split: str, seed: int, cap: int | None,
                 load: Callable[[str, str], object]) -> Mixture:
    """Each source loaded with `load(path, split)` (its checks name the source), its rows taken, the total capped
    at `cap` (module doc); one log line per source when any is taken in part or there are several."""
    parts = []
    for i, source in enumerate(sources):
        split = source.split or default_split
        ds = load(source.path, split)
        name = "dataset" if len(sources) == 1 else f"dataset[{i}]"
        if source.rows is not None and source.rows > len(ds):
            raise UserError(f"{name} {source.path!r}: rows={source.rows}, but it has {len(ds)} rows; lower rows, or "
                            "set fraction: 1 to take every row")
        scores = row_scores(ds, seed) if source.selects else None
        indices = lowest(scores, take_count(source, len(ds))) if source.selects else None
        parts.append(Part(name, source, split, ds, indices, scores))
    total = sum(map(len, parts))
    if cap is not None and total > cap:
        _cap(parts, seed, cap)
    offset = 0
    for p in parts:
        p.offset, offset = offset, offset + len(p)
    if len(parts) > 1 or parts[0].indices is not None:
        for p in parts:
            how = (f"fraction={p.source.fraction}" if p.source.fraction is not None
                   else f"rows={p.source.rows}" if p.source.rows is not None else "every row")
            capped = (f"; max_train_samples={cap} keeps {cap} of the {total} taken" if cap is not None and total > cap
                      else "")
            log(f"{p.name} {p.source.path}: {len(p)} of {len(p.loaded)} rows ({how}{capped})")
    return Mixture(parts)


def _cap(parts: list[Part], seed: int, cap: int) -> None:
    """Keep the `cap` lowest-scored rows of all the parts' taken rows (ties: the earlier part, the earlier row)."""
    ranked = []
    for k, p in enumerate(parts):
        taken = range(len(p.loaded)) if p.indices is None else p.indices
        scores = p.scores if p.scores is not None else row_scores(p.loaded, seed)
        ranked += [(scores[i], k, i) for i in taken]
    kept = sorted(ranked)[:cap]
    for k, p in enumerate(parts):
        p.indices = sorted(i for _, part, i in kept if part == k)


def tokenize_mixture(mix: Mixture, tokenize: Callable[[object, str, Callable | None], TokenizedData]
                     ) -> TokenizedData:
    """Each part's rows tokenized by `tokenize(rows, spec, where)` (its messages and skip counts name the source
    file and its rows' lines), then joined, the row indices shifted into the mixture's; with the formats of the
    parts' rows (TokenizedData.formats)."""
    toks = [tokenize(p.rows, p.source.path, p.where()) for p in mix.parts]
    formats = sorted({p.format() for p in mix.parts} - {None})
    if len(toks) == 1:
        toks[0].formats = formats
        return toks[0]
    out = TokenizedData([], 0, [], formats=formats)
    for p, tok in zip(mix.parts, toks):
        for item in tok.pairs:
            item.row += p.offset
        out.pairs += tok.pairs
        out.num_rows += tok.num_rows
        out.dropped += [row + p.offset for row in tok.dropped]
        for reason, rows in tok.skipped.items():
            out.skipped.setdefault(reason, []).extend(row + p.offset for row in rows)
        for part, rows in tok.truncated.items():
            out.truncated.setdefault(part, []).extend(row + p.offset for row in rows)
        out.whole += tok.whole
    return out
