"""The reference cache's keys: each row's reference values are stored (store.py) under its model side and its
row key, so a row computed once is never computed again, whatever else changed in the data.

    model side  what the values depend on besides the row: the base's weights and config, the SFT adapter's
                files, the reference's dtype and quantization, how log-probs are computed (LOGPS_RULES), and in a
                16-bit dtype the forward's layout (share_prompt rounds differently). Hashed once per build
                (side_components, side_digest).
    row key     a digest of the row's own token ids, prompt, chosen and rejected, after truncation (row_key): the
                ids train feeds the model. A changed text, chat template, tokenizer or max_length that changes a
                row's ids gives it a new key; one that leaves them alone keeps its value (the same ids through the
                same weights give the same numbers).

Reordering the rows, taking a subset, a mixture's fractions, max_train_samples and the eval split never change a
row's key: precompute computes only the rows the store lacks, and train looks each of its rows up. Old values stay
until `python -m lowmem_dpo.precompute RECIPE --prune` drops what the recipe does not use.

The cache of the format before this one (manifest.json and shards, keyed by one fingerprint over the whole data)
is converted once, with a message, when it was built for the recipe's data (convert_legacy).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shlex
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowmem_dpo.data import store as stores
from lowmem_dpo.runtime import folders
from lowmem_dpo.runtime.errors import UserError, log

FORMAT_VERSION = 2  # the per-row store (store.py); 1 was manifest.json and shards
FINGERPRINT_FORMAT = 1  # the "format" in inputs.fingerprint_components: what a format-1 cache's fingerprint holds
LOGPS_RULES = 1  # bump when logps.completion_logps gives other numbers for the same ids and weights
LEGACY_MANIFEST = "manifest.json"
BUILD, REPORT = "build.json", "preflight.json"  # precompute's record of its last build, preflight's report
# A side's components that are the reference's precision: a cache holding another precision can serve train as
# built (ref_dtype, ref_quantization), and the message says so.
PRECISION_COMPONENTS = {"dtype", "quantization"}


# -- the keys ----------------------------------------------------------------------------------------------------
def side_components(weights: dict, dtype: str, quantization: str, shared: bool, ld_alpha: float | None = None) -> dict:
    """The model side: `weights` (inputs.side_files: the base's and the SFT adapter's file digests), the
    reference's dtype and quantization, the log-prob rules, and the forward's layout where it changes rounding (a
    16-bit dtype: the shared-prompt forward rounds differently; in float32 the two agree to ~1e-6). ld_alpha:
    LD-DPO's weighted sums are other values of each row, a side of their own (absent: the plain sums)."""
    out = {"format": FORMAT_VERSION, "logps": LOGPS_RULES, **weights, "dtype": dtype, "quantization": quantization}
    if ld_alpha is not None:
        out["ld_alpha"] = ld_alpha
    if dtype != "float32":
        out["layout"] = "shared" if shared else "unshared"
    return out


def side_digest(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:32]


def row_key(pair) -> bytes:
    """16 bytes of sha256 over a pair's token ids (data.TokenizedPair: prompt, chosen, rejected, each with its
    length, so the boundaries count)."""
    ids = [len(pair.prompt_ids), *pair.prompt_ids, len(pair.chosen_ids), *pair.chosen_ids,
           len(pair.rejected_ids), *pair.rejected_ids]
    return hashlib.sha256(array("q", ids).tobytes()).digest()[:16]


def completion_tokens(prompt_ids: list[int], completion_ids: list[int]) -> int:
    """The completion tokens logps.completion_logps counts for a sequence: each is predicted by the token before
    it, so a completion with no prompt before it loses its first token."""
    return len(completion_ids) - (1 if completion_ids and not prompt_ids else 0)


# -- reading -----------------------------------------------------------------------------------------------------
@dataclass
class RefCache:
    """Reference log-probs of one part's rows (the dataset's, or eval_dataset's), indexed by row; NaN and 0 tokens
    for rows it does not serve (skipped by tokenization, or held out)."""

    chosen: torch.Tensor  # (num_rows,) fp32
    rejected: torch.Tensor  # (num_rows,) fp32
    chosen_tokens: torch.Tensor  # (num_rows,) int32
    rejected_tokens: torch.Tensor  # (num_rows,) int32
    side: str = ""  # the model side its values were computed under (side_digest)
    shared: bool | None = None  # the layout of those values in a 16-bit dtype; None in float32
    counts: dict = field(default_factory=dict)  # the part's rows: tokenization's counts (precompute.part_counts)

    @classmethod
    def empty(cls, num_rows: int, **kwargs) -> "RefCache":
        return cls(torch.full((num_rows,), float("nan")), torch.full((num_rows,), float("nan")),
                   torch.zeros(num_rows, dtype=torch.int32), torch.zeros(num_rows, dtype=torch.int32), **kwargs)

    def fill(self, pairs: list, keys: list[bytes], values: dict) -> None:
        """Put the values of `pairs` (`keys`: their row keys, in `values`) at their rows."""
        for p, key in zip(pairs, keys):
            v = values.get(key)
            if v is not None:
                self.chosen[p.row], self.rejected[p.row] = v.chosen, v.rejected
                self.chosen_tokens[p.row], self.rejected_tokens[p.row] = v.chosen_tokens, v.rejected_tokens


@dataclass(frozen=True)
class Side:
    """A model side of this run, in the layout it prefers, with its twin in the other layout (16-bit only)."""

    components: dict
    other: dict | None = None  # the other layout's components; None in float32

    @property
    def digest(self) -> str:
        return side_digest(self.components)

    @property
    def shared(self) -> bool | None:
        layout = self.components.get("layout")
        return None if layout is None else layout == "shared"

    @property
    def identity(self) -> str:
        """The side whatever the layout: what a checkpoint records of the reference it trained against."""
        return side_digest({k: v for k, v in self.components.items() if k != "layout"})

    def layouts(self) -> dict:
        """layout (None in float32, else whether shared) -> its components."""
        if self.other is None:
            return {None: self.components}
        return {self.shared: self.components, not self.shared: self.other}

    def at(self, shared: bool | None) -> "Side":
        """This side preferring layout `shared` (None: as it is)."""
        if shared is None or self.other is None or shared == self.shared:
            return self
        return Side(self.other, self.components)


def run_side(weights: dict, dtype: str, quantization: str, shared: bool = False,
             ld_alpha: float | None = None) -> Side:
    """A run's Side: in a 16-bit dtype both layouts, `shared` preferred; in float32 one."""
    components = side_components(weights, dtype, quantization, shared, ld_alpha)
    other = side_components(weights, dtype, quantization, not shared, ld_alpha) if "layout" in components else None
    return Side(components, other)


def open_store(cache_dir: Path, create: bool = False) -> stores.Store | None:
    """The cache folder's store; None when it has none (and `create` is off)."""
    try:
        return stores.Store(cache_dir, create=create)
    except FileNotFoundError:
        return None


def lookup(store: stores.Store, side: Side, keys: list[bytes]) -> tuple[dict, bool]:
    """The values `store` holds for row `keys` under `side`, and under its twin for the rows the preferred layout
    lacks; and whether any came from the twin."""
    found = store.get(store.side(side.digest), keys)
    from_other = False
    if side.other is not None and len(found) < len(set(keys)):
        twin = store.get(store.side(side_digest(side.other)), [k for k in keys if k not in found])
        from_other = bool(twin)
        found.update(twin)
    return found, from_other


def part_counts(tok) -> dict:
    """A part's rows as tokenization counted them (data.TokenizedData), for the preflight report."""
    return {"num_rows": tok.num_rows, "num_pairs": len(tok.pairs), "dropped_rows": tok.dropped,
            "skipped": tok.skipped, "truncated": {part: len(rows) for part, rows in tok.truncated.items()}}


def reference(store: stores.Store, side: Side, tok, name_row=str, keys: list[bytes] | None = None
              ) -> tuple[RefCache, list]:
    """The RefCache of one part's rows (tok: the dataset's or eval_dataset's data.TokenizedData; keys: their row
    keys, when the caller has them) from the store, in the side's preferred layout and its twin's; and the pairs
    it lacks. A value whose token counts are not its row's (a key is the row's token ids: only a damaged file
    holds one) is refused, naming the rows."""
    keys = keys if keys is not None else [row_key(p) for p in tok.pairs]
    found, from_other = lookup(store, side, keys)
    wrong = [p for p, k in zip(tok.pairs, keys) if (v := found.get(k)) is not None and (v.chosen_tokens, v.rejected_tokens)
             != (completion_tokens(p.prompt_ids, p.chosen_ids), completion_tokens(p.prompt_ids, p.rejected_ids))]
    if wrong:
        raise UserError(f"the reference cache in {str(store.path.parent)!r} is damaged: its values for {len(wrong)} "
                        f"rows disagree with their token counts ({'; '.join(name_row(p.row) for p in wrong[:3])}); "
                        "point ref_cache_dir at a new folder and run precompute again (this one, which other "
                        "recipes may share, is left as it is)")
    ref = RefCache.empty(tok.num_rows, side=side.digest, counts=part_counts(tok),
                         shared=None if side.shared is None else side.shared != from_other)
    ref.fill(tok.pairs, keys, found)
    return ref, [p for p, k in zip(tok.pairs, keys) if k not in found]


def missing_message(cache_dir: Path, rows: list, total: int, name_row, command: str, store=None,
                    side: Side | None = None) -> str:
    """What to say when `rows` (pairs) of a run's `total` have no value: which, in its file's lines, and the
    command that computes them (only them); when the store knows no part of this model side, what differs from
    the side it knows best."""
    shown = "; ".join(name_row(p.row) for p in rows[:3]) + (f"; and {len(rows) - 3} more" if len(rows) > 3 else "")
    why = "new, or changed since precompute ran"
    if store is not None and side is not None and store.side(side.digest) is None and not (
            side.other and store.side(side_digest(side.other))):
        why = nearest_difference(store, side.components) or why
    return (f"the reference cache in {str(cache_dir)!r} has no reference values for {len(rows)} of the {total} rows "
            f"this run uses ({shown}): {why}. Compute them (only them) with: {command}")


def nearest_difference(store: stores.Store, components: dict) -> str | None:
    """What differs between this model side and the one the store holds most rows of, in words."""
    usage = [u for u in store.usage() if u.rows]
    if not usage:
        return None
    near = usage[0].components
    changed = [describe_change(k, near.get(k), components.get(k)) for k in sorted(set(near) | set(components))
               if near.get(k) != components.get(k) and k != "layout"]
    if not changed:
        return None
    hint = ""
    if {k for k in set(near) | set(components) if near.get(k) != components.get(k)} <= PRECISION_COMPONENTS | {
            "layout"}:
        hint = (f"; or train against the values it holds: ref_quantization={near.get('quantization')} "
                f"ref_dtype={near.get('dtype')}")
    return "the cache holds values for another model side (" + "; ".join(changed) + " changed)" + hint


def rebuild_command(cfg, recipe: str | None) -> str:
    """The command that fills the cache this run needs, for messages: precompute with the run's recipe and the
    same overrides (a dataset, a max_length given on the command line is the cache's too); a config built in code
    names its cache folder."""
    args = list(cfg.overrides) or [f"ref_cache_dir={cfg.ref_cache_dir}"]
    return shlex.join(["python", "-m", "lowmem_dpo.precompute", recipe or "RECIPE.yaml", *args])


# -- what changed, in words ------------------------------------------------------------------------------------
WHAT = {"model": "the base model's weights or config", "adapter": "the SFT adapter's files",
        "tokenizer": "the tokenizer's files", "chat_template": "the chat template's text", "format": "the cache format",
        "logps": "the log-prob rules"}


def describe_change(key: str, old, new, cfg=None) -> str:
    """One changed component (of a model side, or of the format-1 fingerprint) in words: which file's content,
    which key's value."""
    if key in WHAT:
        return WHAT[key] + (" (added)" if old is None else " (removed)" if new is None else "")
    if key == "dataset":
        paths = [s.path for s in cfg.dataset] if cfg is not None else []
        return _data_change("dataset", old, new, paths)
    if key == "eval_dataset":
        return _data_change("eval_dataset", old, new, [cfg.eval_dataset] if cfg is not None else [])
    return f"{key} {old} -> {new}"


def _data_change(key: str, old, new, paths: list) -> str:
    """What differs between two data components (inputs.dataset_component): a file's content, a split, a
    mixture's fractions and rows, the cap, the seed."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return f"{key} ({'added' if old is None else 'removed' if new is None else 'its form'})"
    if ("sources" in old) != ("sources" in new):
        return f"{key}: its sources (one source taken whole, against a mixture or a selection)"
    if "sources" not in old:
        return _source_change(key, old, new, paths[0] if paths else key)
    parts = []
    if len(old["sources"]) != len(new["sources"]):
        parts.append(f"{key}: {len(old['sources'])} -> {len(new['sources'])} sources")
    for i, (a, b) in enumerate(zip(old["sources"], new["sources"])):
        if a != b:
            parts.append(_source_change(f"{key}[{i}]", a, b, paths[i] if i < len(paths) else f"{key}[{i}]"))
    parts += [f"{key} {k} {old.get(k)} -> {new.get(k)}" for k in ("max_train_samples", "seed")
              if old.get(k) != new.get(k)]
    return "; ".join(parts)


def _source_change(key: str, old: dict, new: dict, path: str) -> str:
    parts = []
    if old.get("files") != new.get("files") or old.get("fingerprint") != new.get("fingerprint"):
        parts.append(f"the content of {path}")
    parts += [f"{key}.{k} {old.get(k)} -> {new.get(k)}" for k in ("split", "fraction", "rows", "hub")
              if old.get(k) != new.get(k)]
    return ", ".join(parts) or key


# -- the format before: one fingerprint, manifest.json and shards ---------------------------------------------
def fingerprint_digest(components: dict) -> str:
    """The format-1 cache's fingerprint of inputs.fingerprint_components."""
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


def earlier_cache(cache_dir: Path) -> bool:
    """Whether the folder is a reference cache this tool wrote before it marked its folders: its index, or a
    format-1 cache's manifest, and nothing but what a cache holds (SQLite's files, the reports, the old format's)."""
    manifest = read_legacy(cache_dir)
    old = isinstance(manifest, dict) and {"fingerprint", "shard_dir"} <= set(manifest)
    names = {stores.INDEX, f"{stores.INDEX}-wal", f"{stores.INDEX}-shm", BUILD, REPORT,
             LEGACY_MANIFEST, manifest.get("shard_dir") if old else None}
    return (stores.is_store(cache_dir) or old) and all(n in names or n.startswith("legacy-v1")
                                                       for n in folders.visible(cache_dir))


def read_legacy(cache_dir: Path) -> dict | None:
    """A format-1 cache's manifest, or None."""
    try:
        return json.loads((Path(cache_dir) / LEGACY_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _legacy_values(cache_dir: Path, manifest: dict, part: dict, pairs: list) -> tuple[dict, int]:
    """The values a format-1 cache's part (its manifest, or its "eval" entry) holds for `pairs`, by row key; and
    how many it holds for rows whose token counts are not this tokenization's (a tokenizers upgrade since: they
    are left to compute)."""
    from safetensors.torch import load_file

    by_row = {p.row: p for p in pairs}
    out, other = {}, 0
    for name in part["shards"]:
        t = load_file(Path(cache_dir) / manifest["shard_dir"] / name)
        for i, row in enumerate(t["rows"].tolist()):
            p = by_row.get(row)
            if p is None or not (torch.isfinite(t["chosen"][i]) and torch.isfinite(t["rejected"][i])):
                continue
            counts = (int(t["chosen_tokens"][i]), int(t["rejected_tokens"][i]))
            if counts != (completion_tokens(p.prompt_ids, p.chosen_ids), completion_tokens(p.prompt_ids,
                                                                                           p.rejected_ids)):
                other += 1
                continue
            out[row_key(p)] = stores.Value(float(t["chosen"][i]), float(t["rejected"][i]), *counts)
    return out, other


def convert_legacy(cache_dir: Path, store: stores.Store, fingerprint: dict, side: Side, pairs: list,
                   eval_pairs: list | None, cfg=None) -> int:
    """Convert a format-1 cache in `cache_dir` once, when its fingerprint is this run's (`fingerprint`:
    inputs.fingerprint_components): its rows go into the store under this side in the layout it was built with,
    and its files move to legacy-v1/. Another run's format-1 cache is left alone, with a message. Returns the rows
    converted."""
    manifest = read_legacy(cache_dir)
    if manifest is None:
        return 0
    if manifest.get("fingerprint") != fingerprint_digest(fingerprint):
        old = manifest.get("components", {})
        what = "; ".join(describe_change(k, old.get(k), fingerprint.get(k), cfg)
                         for k in sorted(set(old) | set(fingerprint)) if old.get(k) != fingerprint.get(k))
        log(f"note: {cache_dir} holds a reference cache of the format before rows were keyed by content, built for "
            f"other inputs ({what or 'its format'} changed): its values cannot be matched to these rows and are "
            f"not used; its files ({LEGACY_MANIFEST}, {manifest.get('shard_dir')}/) stay until you remove them")
        return 0
    shared = bool(manifest.get("share_prompt", False))
    components = side.components if side.shared in (None, shared) else side.other
    values, other = _legacy_values(cache_dir, manifest, manifest, pairs)
    if manifest.get("eval") and eval_pairs:
        more, other_eval = _legacy_values(cache_dir, manifest, manifest["eval"], eval_pairs)
        values.update(more)
        other += other_eval
    store.put(store.side(side_digest(components), components), values)
    names = itertools.chain(["legacy-v1"], (f"legacy-v1-{i}" for i in itertools.count(2)))
    moved = next(Path(cache_dir) / n for n in names if not (Path(cache_dir) / n).exists())
    moved.mkdir()
    for name in (LEGACY_MANIFEST, manifest.get("shard_dir")):
        if name and (Path(cache_dir) / name).exists():
            os.replace(Path(cache_dir) / name, moved / name)
    skipped = (f"; {other} rows whose token counts differ from this tokenization (a tokenizers upgrade since) are "
               "left to compute" if other else "")
    log(f"converted the reference cache in {cache_dir} to the per-row format: {len(values)} rows, kept as they were "
        f"computed{skipped}; the old files are in {moved} (remove them when you like)")
    return len(values)
