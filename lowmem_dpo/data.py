"""Preference data: load rows through `datasets`, tokenize them as TRL 1.16's DPOTrainer does, and collate
chosen and rejected of a batch into one padded tensor for a single concatenated forward pass.

Tokenization of standard text rows (same numbers as TRL):
  - the EOS token's text is appended to chosen and rejected unless already there;
  - `prompt` and `prompt + completion` are tokenized with the tokenizer's default special tokens;
  - the completion starts where the ids stop sharing a prefix with the prompt's ids;
  - with `max_prompt_length`, the prompt ids are then cut from the left to that many tokens;
  - each prompt+completion sequence keeps its first `max_length` tokens.
Conversational rows (lists of {role, content}) are rendered with the tokenizer's chat template instead
(prompt with the generation prompt; no EOS appended: the template closes the turn).

Checks (README, "Data checks"). Structural problems refuse the data with a UserError naming the file and the
line (JSON Lines) or row: no rows, bytes that are not UTF-8, a line that is not a JSON object, a row without
prompt, chosen or rejected, a value that is neither text (or null) nor a list of {role, content} messages,
text mixed with conversations. Well-formed rows that DPO cannot use are skipped, counted and logged with their
first rows (`SKIPS`); `strict=true` refuses them instead, naming the first. Every row skipped: refused. strict
only turns skips into errors, the rows kept are the same, so it is not part of the cache fingerprint.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from lowmem_dpo.cli import UserError, log

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
REQUIRED = ("prompt", "chosen", "rejected")
# Why a well-formed row is left out -> (what the log says, what to do). Order: the order rows are checked in.
SKIPS = {
    "empty": ("prompt, chosen or rejected is empty", "fill in or remove the row"),
    "identical": ("chosen is identical to rejected", "remove the row (it states no preference)"),
    "prompt_too_long": ("the prompt alone reaches max_length", "raise max_length or set max_prompt_length"),
    "identical_tokens": ("chosen and rejected have the same tokens within max_length", "raise max_length"),
    "empty_completion": ("the prompt or the completion is empty", "fill in or remove the row"),  # SFT rows
}
TRUNCATIONS = ("prompt", "chosen", "rejected")  # prompt: cut by max_prompt_length; completions: at max_length


@dataclass
class TokenizedPair:
    row: int  # index in the dataset as loaded (the cache's row order)
    prompt_ids: list[int]
    chosen_ids: list[int]  # completion only
    rejected_ids: list[int]


@dataclass
class TokenizedCompletion:
    """One SFT row: a prompt and the completion the loss is on."""

    row: int  # index in the dataset as loaded
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class TokenizedData:
    pairs: list  # TokenizedPair (tokenize_rows) or TokenizedCompletion (tokenize_completions)
    num_rows: int  # rows in the dataset, dropped ones included
    dropped: list[int]  # every row left out, for any reason (the cache holds NaN for them)
    skipped: dict[str, list[int]] = field(default_factory=dict)  # the same rows by SKIPS reason
    truncated: dict[str, list[int]] = field(default_factory=dict)  # TRUNCATIONS part -> kept rows cut there


@dataclass
class Batch:
    """A micro-batch of B pairs as one forward: rows [0, B) are chosen, rows [B, 2B) rejected. From
    collate_completions (SFT): B sequences, one per row."""

    rows: torch.Tensor  # (B,) dataset row indices
    input_ids: torch.Tensor  # (2B, T)
    attention_mask: torch.Tensor  # (2B, T)
    completion_mask: torch.Tensor  # (2B, T) 1 on completion tokens

    def to(self, device) -> "Batch":
        return Batch(self.rows, self.input_ids.to(device), self.attention_mask.to(device),
                     self.completion_mask.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def data_files(spec: str) -> list[Path]:
    """The local files whose bytes define the dataset's content (for the cache fingerprint); [] for hub data."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    return []


# -- checks on the raw file, before `datasets` (whose errors carry no line numbers) ---------------------------
def _decoded_lines(path: Path, spec: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of a file read as UTF-8 (a leading byte-order mark dropped); bytes that are
    not UTF-8 are a UserError naming the line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                near = raw[max(0, e.start - 30):e.start].decode("utf-8", "replace").strip()
                raise UserError(f"dataset {spec!r} line {n}: not UTF-8 text (byte {raw[e.start]:#04x} at byte "
                                f"{e.start + 1} of the line, after {near!r}); re-save the file as UTF-8") from None
            yield n, (text.lstrip("\ufeff") if n == 1 else text)


def _what(value) -> str:
    """What a JSON value is, for messages."""
    if isinstance(value, list):
        return "a list, but not of {role, content} messages"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "text", dict: "an object",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _value_kind(value) -> str | None:
    """'text', 'conversation' (a list of {role, content} messages), None for null, 'invalid' otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in value):
        return "conversation"
    return "invalid"


def row_kind(row: dict, kind: str | None, required: tuple[str, ...] = REQUIRED) -> str | None:
    """The kind of the row's `required` values, 'text' or 'conversation' (`kind`, the kind of the rows before
    it, when they are all null); ValueError saying what is wrong for a structural problem. Rows may not mix the
    two kinds."""
    missing = [k for k in required if k not in row]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)} (has {', '.join(map(str, row)) or 'no keys'}); every row "
                         f"needs {', '.join(required)}")
    kinds = set()
    for key in required:
        k = _value_kind(row[key])
        if k == "invalid":
            raise ValueError(f"{key} is {_what(row[key])} ({json.dumps(row[key], default=str)[:60]}); expected "
                             "text, or a list of {role, content} messages")
        if k is not None:
            kinds.add(k)
    if len(kinds) > 1:
        raise ValueError(f"mixes text and conversations; {', '.join(required)} must all be text or all be lists "
                         "of {role, content} messages")
    mine = kinds.pop() if kinds else None
    if kind is not None and mine is not None and mine != kind:
        raise ValueError(f"is a {mine} row but the rows before it are {kind} rows; use one format for every row")
    return mine or kind


def _check_rows(rows: Iterator[tuple[str, object]], spec: str, required: tuple[str, ...]) -> None:
    """Structural checks of (location, parsed JSON value) rows; UserError at the first problem."""
    kind, count = None, 0
    for where, row in rows:
        if not isinstance(row, dict):
            what = "a list" if isinstance(row, list) else _what(row)
            raise UserError(f"dataset {spec!r} {where}: {what}, not an object with {', '.join(required)}")
        try:
            kind = row_kind(row, kind, required)
        except ValueError as e:
            raise UserError(f"dataset {spec!r} {where}: {e}") from None
        count += 1
    if count == 0:
        raise UserError(f"dataset {spec!r} has no rows: it needs objects with {', '.join(required)}")


def _json_lines(lines: Iterator[tuple[int, str]], spec: str,
                required: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    for n, line in lines:
        if not line.strip():
            continue  # blank lines are allowed (datasets skips them too)
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"dataset {spec!r} line {n}: not JSON ({e.msg} at column {e.colno}): "
                            f"{line.strip()[:60]!r}; each line must be one JSON object with "
                            f"{', '.join(required)}") from None


def check_file(path: Path, spec: str, required: tuple[str, ...] = REQUIRED) -> None:
    """Streamed checks of a local file before `datasets` reads it: UTF-8 (.jsonl, .json, .csv) and, for JSON,
    one object per line (or a list of objects) with well-formed `required` values."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        for _ in _decoded_lines(path, spec):
            pass
        return
    if suffix not in (".jsonl", ".json"):
        return
    lines = _decoded_lines(path, spec)
    head = []
    for n, line in lines:
        head.append((n, line))
        if line.strip():
            break
    first = head[-1][1].lstrip() if head else ""
    try:
        one_line = json.loads(first) if first else None
    except json.JSONDecodeError:
        one_line = None
    if first.startswith("[") or (suffix == ".json" and first.startswith("{") and not isinstance(one_line, dict)):
        # a JSON list of rows, or one object over several lines (datasets reads columns from it via pandas)
        text = "".join(t for _, t in head) + "".join(t for _, t in lines)
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"dataset {spec!r} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                            "use one JSON object per line, or one list of objects") from None
        if isinstance(whole, list):
            _check_rows(((f"row {i}", row) for i, row in enumerate(whole)), spec, required)
        return  # one object: datasets reads it as columns, checked once loaded
    _check_rows(_json_lines(itertools.chain(head, lines), spec, required), spec, required)


def row_locator(spec: str, num_rows: int) -> Callable[[int], str]:
    """row -> "row R at line L" for a JSON Lines file with num_rows rows, else "row R". The file is read again
    only on the first call (messages only)."""
    lines: list[int] | None = None

    def where(row: int) -> str:
        nonlocal lines
        if lines is None:
            lines = []
            path = Path(spec)
            if path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
                found = [(n, t) for n, t in _decoded_lines(path, spec) if t.strip()]
                if len(found) == num_rows and found[0][1].lstrip().startswith("{"):
                    lines = [n for n, _ in found]
        return f"row {row} at line {lines[row]}" if lines else f"row {row}"

    return where


def load_rows(spec: str, split: str = "train", required: tuple[str, ...] = REQUIRED):
    """A `datasets.Dataset` of preference rows (or rows with the `required` columns) from a local file, a
    save_to_disk folder or a hub name."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(spec)
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UserError(f"dataset {spec!r}: unsupported file type {path.suffix!r}; use "
                                + ", ".join(FILE_BUILDERS))
            if path.stat().st_size == 0:
                raise UserError(f"dataset {spec!r} is empty: it needs rows with prompt, chosen and rejected")
            check_file(path, spec, required)
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        elif path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"dataset {spec!r} has splits {list(ds)}; set dataset_split to one of them")
                ds = ds[split]
        elif spec.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS or path.parent.exists() \
                and str(path.parent) not in (".", ""):
            raise UserError(f"dataset {spec!r} not found: give the path of a .jsonl/.json/.parquet/.csv file or "
                            "a datasets save_to_disk folder")
        else:
            try:
                ds = datasets.load_dataset(spec, split=split)
            except Exception as e:
                raise UserError(f"dataset {spec!r} is not a local file or folder, and loading it from the hub "
                                f"failed ({type(e).__name__}); save it locally and pass the path") from None
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for unreadable data: report, no traceback
        raise UserError(f"dataset {spec!r} could not be read: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        " (check that the file matches its extension)") from None
    missing = [k for k in required if k not in ds.column_names]
    if missing:
        raise UserError(f"dataset {spec!r} lacks column(s) {', '.join(missing)} (has {', '.join(ds.column_names)});"
                        f" each row needs {', '.join(required)}")
    if len(ds) == 0:
        raise UserError(f"dataset {spec!r} has no rows")
    return ds


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _is_empty(value) -> bool:
    if isinstance(value, list):
        return not any(m["content"].strip() for m in value)
    return value is None or not value.strip()


def skip_reason(row: dict) -> str | None:
    """The SKIPS reason of a well-formed row that is unusable before tokenization, or None."""
    if any(_is_empty(row[k]) for k in REQUIRED):
        return "empty"
    if row["chosen"] == row["rejected"]:
        return "identical"
    return None


def _chat_ids(tokenizer, messages: list, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def _encode(rows: list[dict], tokenizer, conversational: bool) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, prompt+chosen ids, prompt+rejected ids) per row."""
    if conversational:
        return [(_chat_ids(tokenizer, r["prompt"], add_generation_prompt=True),
                 _chat_ids(tokenizer, r["prompt"] + r["chosen"]),
                 _chat_ids(tokenizer, r["prompt"] + r["rejected"])) for r in rows]
    eos = tokenizer.eos_token
    prompts = [r["prompt"] for r in rows]
    chosen = [r["prompt"] + (r["chosen"] if r["chosen"].endswith(eos) else r["chosen"] + eos) for r in rows]
    rejected = [r["prompt"] + (r["rejected"] if r["rejected"].endswith(eos) else r["rejected"] + eos) for r in rows]
    enc = tokenizer(prompts + chosen + rejected)["input_ids"]
    n = len(rows)
    return list(zip(enc[:n], enc[n:2 * n], enc[2 * n:]))


def _split_prompt(prompt: list[int], full: list[list[int]], max_length: int, max_prompt_length: int | None):
    """(prompt ids, [completion ids of each of `full`], prompt cut?, [completion cut?]) as TRL 1.16 cuts them, or
    None when the prompt alone reaches max_length: the completion starts where the ids stop sharing a prefix with
    the prompt's; with max_prompt_length the prompt is cut from the left; each prompt+completion keeps its first
    max_length tokens."""
    prompt_len = min(_common_prefix_length(prompt, f) for f in full)
    prompt_ids = prompt[:prompt_len]
    prompt_cut = max_prompt_length is not None and len(prompt_ids) > max_prompt_length
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[-max_prompt_length:]
    if len(prompt_ids) >= max_length:
        return None
    room = max_length - len(prompt_ids)  # keep the first max_length tokens of prompt+completion
    completions = [f[prompt_len:] for f in full]
    return prompt_ids, [c[:room] for c in completions], prompt_cut, [len(c) > room for c in completions]


def tokenize_rows(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str = "dataset",
                  progress: bool = True, strict: bool = False) -> TokenizedData:
    """Tokenize every row (TRL 1.16 conventions, see module doc), in dataset order. Structural problems are
    UserErrors; unusable rows are skipped and logged (SKIPS), or refused with `strict`; so is every row skipped."""
    _eos_text(tokenizer)
    where = row_locator(spec, len(ds))
    pairs: list[TokenizedPair] = []
    skipped: dict[str, list[int]] = {reason: [] for reason in SKIPS}
    truncated: dict[str, list[int]] = {part: [] for part in TRUNCATIONS}
    for checked, kind in _checked_chunks(ds, spec, where, REQUIRED, progress):
        usable = []
        for i, row in checked:
            reason = skip_reason(row)
            if reason:
                skipped[reason].append(i)
            else:
                usable.append((i, row))
        encoded = _encode([r for _, r in usable], tokenizer, kind == "conversation") if usable else []
        for (i, _), (p, pc, pr) in zip(usable, encoded):
            split = _split_prompt(p, [pc, pr], max_length, max_prompt_length)
            if split is None:
                skipped["prompt_too_long"].append(i)
                continue
            prompt_ids, (chosen_ids, rejected_ids), prompt_cut, (chosen_cut, rejected_cut) = split
            cut = {"prompt": prompt_cut, "chosen": chosen_cut, "rejected": rejected_cut}
            if chosen_ids == rejected_ids:
                skipped["identical_tokens"].append(i)
                continue
            for part in TRUNCATIONS:
                if cut[part]:
                    truncated[part].append(i)
            pairs.append(TokenizedPair(i, prompt_ids, chosen_ids, rejected_ids))
    return _checked_result(pairs, len(ds), skipped, truncated, spec, max_length, max_prompt_length, strict, where)


def _eos_text(tokenizer) -> str:
    if tokenizer.eos_token is None:
        raise UserError("the tokenizer has no eos_token: set one in its tokenizer_config.json")
    return tokenizer.eos_token


def _checked_chunks(ds, spec: str, where: Callable[[int], str], required: tuple[str, ...], progress: bool):
    """The rows as (index, row) lists of up to 512, each with the rows' kind so far (row_kind: a structural
    problem is a UserError naming the row), under a progress bar."""
    from tqdm.auto import tqdm

    kind = None
    bar = tqdm(total=len(ds), desc="tokenize", unit="row", disable=not progress, leave=False)
    for start in range(0, len(ds), 512):
        rows = ds[start:start + 512]
        checked = []
        for i, row in enumerate((dict(zip(rows, vals)) for vals in zip(*rows.values())), start):
            try:
                kind = row_kind(row, kind, required)
            except ValueError as e:
                raise UserError(f"dataset {spec!r} {where(i)}: {e}") from None
            checked.append((i, row))
        yield checked, kind
        bar.update(len(checked))
    bar.close()


def _checked_result(items: list, num_rows: int, skipped: dict[str, list[int]], truncated: dict[str, list[int]],
                    spec: str, max_length: int, max_prompt_length: int | None, strict: bool,
                    where: Callable[[int], str]) -> TokenizedData:
    """The TokenizedData of the rows kept, its skips checked (strict, every row skipped) and logged."""
    skipped = {k: sorted(v) for k, v in skipped.items() if v}
    tok = TokenizedData(items, num_rows, sorted(r for rows in skipped.values() for r in rows), skipped, truncated)
    check_skips(tok.skipped, tok.num_rows, len(items), spec, max_length, strict, where)
    for line in summary_lines(tok, max_length, max_prompt_length, where):
        log(line)
    return tok


def _reason_text(reason: str, max_length: int) -> str:
    return SKIPS[reason][0].replace("max_length", f"max_length={max_length}")


def check_skips(skipped: dict[str, list[int]], num_rows: int, kept: int, spec: str, max_length: int,
                strict: bool, where: Callable[[int], str] | None = None) -> None:
    """UserError when rows were skipped and `strict` is set (naming the first), or when every row was."""
    if not skipped or (kept and not strict):
        return
    where = where or row_locator(spec, num_rows)
    first, reason = min((rows[0], reason) for reason, rows in skipped.items())
    others = sum(map(len, skipped.values())) - 1
    if kept and strict:
        raise UserError(f"dataset {spec!r} {where(first)}: {_reason_text(reason, max_length)}, and strict=true "
                        f"refuses such rows ({others} more in this data): {SKIPS[reason][1]}, or set strict=false "
                        "to skip them")
    detail = "; ".join(f"{len(rows)} because {_reason_text(r, max_length)} (first: {where(rows[0])}; "
                       f"{SKIPS[r][1]})" for r, rows in skipped.items())
    raise UserError(f"dataset {spec!r}: all {num_rows} rows were skipped, so nothing is left to train on: {detail}")


def manifest_skips(manifest: dict) -> dict[str, list[int]]:
    """Rows a cache left out, by SKIPS reason (caches built before reasons were recorded only left out rows
    whose prompt reached max_length)."""
    if "skipped" in manifest:
        return manifest["skipped"]
    dropped = manifest.get("dropped_rows", [])
    return {"prompt_too_long": dropped} if dropped else {}


def summary_lines(tok: TokenizedData, max_length: int, max_prompt_length: int | None,
                  where: Callable[[int], str]) -> list[str]:
    """Log lines: rows skipped, by reason with their first rows, and rows kept with a cut prompt or completion."""
    lines = []
    if tok.skipped:
        parts = [f"{len(rows)} because {_reason_text(r, max_length)} ("
                 + ", ".join(map(where, rows[:3])) + (", ..." if len(rows) > 3 else "") + ")"
                 for r, rows in tok.skipped.items()]
        lines.append(f"skipped {len(tok.dropped)} of {tok.num_rows} rows: " + "; ".join(parts)
                     + " (strict=true refuses them instead)")
    cut = {part: len(rows) for part, rows in tok.truncated.items() if rows}
    parts = [f"{cut[p]} {p} completions cut at max_length={max_length}" for p in ("chosen", "rejected") if p in cut]
    if "prompt" in cut:
        parts.append(f"{cut['prompt']} prompts cut to max_prompt_length={max_prompt_length}")
    if parts:
        lines.append(f"kept {len(tok.pairs)} rows, with " + ", ".join(parts))
    return lines


def collate(pairs: list[TokenizedPair], pad_token_id: int) -> Batch:
    """Right-padded [chosen..., rejected...] batch. Right padding keeps every real token's position, so a row's
    log-probs do not depend on its batch-mates."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    comp = [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    return _padded([p.row for p in pairs], seqs, comp, pad_token_id)


def collate_completions(items: list[TokenizedCompletion], pad_token_id: int) -> Batch:
    """Right-padded batch of B prompt+completion sequences (SFT), completion_mask on the completions."""
    seqs = [c.prompt_ids + c.completion_ids for c in items]
    return _padded([c.row for c in items], seqs, [len(c.completion_ids) for c in items], pad_token_id)


def _padded(rows: list[int], seqs: list[list[int]], comp: list[int], pad_token_id: int) -> Batch:
    """N sequences right-padded to the longest; the last comp[i] tokens of sequence i are its completion."""
    T = max(len(s) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, T), pad_token_id, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((n, T), dtype=torch.long)  # (N, T)
    completion_mask = torch.zeros((n, T), dtype=torch.long)  # (N, T)
    for i, (s, c) in enumerate(zip(seqs, comp)):
        input_ids[i, :len(s)] = torch.tensor(s)
        attention_mask[i, :len(s)] = 1
        completion_mask[i, len(s) - c:len(s)] = 1
    return Batch(torch.tensor(rows, dtype=torch.long), input_ids, attention_mask, completion_mask)


def pad_token_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id  # padding is masked out; any id works


# -- SFT rows -----------------------------------------------------------------------------------------------------
SFT_COLUMNS = ("completion", "chosen")  # prompt-completion rows (TRL's format), else preference rows' chosen


def sft_column(ds, spec: str) -> str:
    """The column the SFT loss is on: `completion`, or `chosen` of preference rows."""
    for column in SFT_COLUMNS:
        if column in ds.column_names:
            return column
    raise UserError(f"dataset {spec!r} has no completion or chosen column (has {', '.join(ds.column_names)}); SFT "
                    "needs rows with prompt and completion, or preference rows with prompt and chosen")


def _encode_completions(rows: list[dict], column: str, tokenizer, conversational: bool) -> list[tuple]:
    """(prompt ids, prompt+completion ids) per row, as _encode tokenizes prompt+chosen."""
    if conversational:
        return [(_chat_ids(tokenizer, r["prompt"], add_generation_prompt=True),
                 _chat_ids(tokenizer, r["prompt"] + r[column])) for r in rows]
    eos = tokenizer.eos_token
    full = [r["prompt"] + (r[column] if r[column].endswith(eos) else r[column] + eos) for r in rows]
    enc = tokenizer([r["prompt"] for r in rows] + full)["input_ids"]
    return list(zip(enc[:len(rows)], enc[len(rows):]))


def tokenize_completions(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str = "dataset",
                         progress: bool = True, strict: bool = False) -> TokenizedData:
    """SFT rows: prompt + completion (or chosen), tokenized as tokenize_rows tokenizes a chosen completion (text:
    EOS appended unless there, as TRL's SFTTrainer does; conversations: the chat template), so the SFT model's
    completion is the sequence the DPO stage scores. Rows with an empty prompt or completion, or whose prompt
    alone reaches max_length, are skipped and logged (strict: refused)."""
    _eos_text(tokenizer)
    column = sft_column(ds, spec)
    where = row_locator(spec, len(ds))
    items: list[TokenizedCompletion] = []
    skipped: dict[str, list[int]] = {"empty_completion": [], "prompt_too_long": []}
    for checked, kind in _checked_chunks(ds, spec, where, ("prompt", column), progress):
        usable = [(i, r) for i, r in checked if not (_is_empty(r["prompt"]) or _is_empty(r[column]))]
        skipped["empty_completion"] += sorted({i for i, _ in checked} - {i for i, _ in usable})
        encoded = _encode_completions([r for _, r in usable], column, tokenizer, kind == "conversation") \
            if usable else []
        for (i, _), (p, pc) in zip(usable, encoded):
            split = _split_prompt(p, [pc], max_length, max_prompt_length)
            if split is None:
                skipped["prompt_too_long"].append(i)
            else:
                items.append(TokenizedCompletion(i, split[0], split[1][0]))
    return _checked_result(items, len(ds), skipped, {}, spec, max_length, max_prompt_length, strict, where)
