"""Preference (and SFT) rows: read a file, a save_to_disk folder or a hub dataset through `datasets`, after
checking a local file's structure ourselves, because `datasets`' errors carry no line numbers.

Structural problems refuse the data with a UserError naming the file and the line (JSON Lines) or row (docs/data.md,
"Data checks"): no rows, bytes that are not UTF-8, a line that is not a JSON object, a row without prompt,
chosen or rejected, a value that is neither text (or null) nor a list of {role, content} messages, text mixed
with conversations. Well-formed rows that DPO cannot use are encode.py's business (SKIPS).
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Callable, Iterator

from lowmem_dpo.data.implicit import IMPLICIT, implicit_required, is_implicit, with_prompt
from lowmem_dpo.runtime import builtins
from lowmem_dpo.runtime.errors import UserError, log

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
REQUIRED = ("prompt", "chosen", "rejected")


def local_path(spec: str) -> Path:
    """Where a dataset `spec` is on disk if it is local: its path, or a built-in's shipped file (lowmem_dpo:NAME)."""
    return builtins.path(spec, "dataset", "dataset") if builtins.is_builtin(spec) else Path(spec)


def data_files(spec: str) -> list[Path]:
    """The local files whose bytes define the dataset's content (for the digests a checkpoint records); [] for hub data."""
    path = local_path(spec)
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
    if isinstance(value, list) and all(isinstance(message, dict) and isinstance(message.get("role"), str)
                                       and isinstance(message.get("content"), str) for message in value):
        return "conversation"
    return "invalid"


class MissingColumns(ValueError):
    """A row lacks `missing` of the columns it needs."""

    def __init__(self, text: str, missing: list[str]):
        super().__init__(text)
        self.missing = missing


def row_kind(row: dict, kind: str | None, required: tuple[str, ...] = REQUIRED) -> str | None:
    """The kind of the row's `required` values, 'text' or 'conversation' (`kind`, the kind of the rows before
    it, when they are all null); ValueError saying what is wrong for a structural problem. Rows may not mix the
    two kinds."""
    missing = [k for k in required if k not in row]
    if missing:
        raise MissingColumns(f"lacks {', '.join(missing)} (has {', '.join(map(str, row)) or 'no keys'}); every "
                             f"row needs {', '.join(required)}", missing)
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


def _check_rows(rows: Iterator[tuple[str, object]], spec: str, required: tuple[str, ...],
                keys: dict[str, str] | None = None) -> None:
    """Structural checks of (location, parsed JSON value) rows; UserError at the first problem (a missing column
    with the keys that name another: `keys`, the column read -> its key's name, column_hint)."""
    kind, count, implicit = None, 0, None
    for where, row in rows:
        if not isinstance(row, dict):
            what = "a list" if isinstance(row, list) else _what(row)
            raise UserError(f"dataset {spec!r} {where}: {what}, not an object with {', '.join(required)}")
        if implicit is None:  # the first row says whether the prompts are implicit (in chosen and rejected)
            implicit = is_implicit(row, required)
        if implicit and "prompt" in row:
            raise UserError(f"dataset {spec!r} {where}: has a prompt, but the rows before it have none (their "
                            "prompt is the shared start of chosen and rejected); use one format for every row")
        try:
            kind = row_kind(row, kind, implicit_required(required) if implicit else required)
        except MissingColumns as e:
            raise UserError(f"dataset {spec!r} {where}: {e}{column_hint(e.missing, list(row), keys)}") from None
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
            raise UserError(f"dataset {spec!r} line {n}, column {e.colno}: not JSON ({e.msg}) at {at(line, e.pos)}; "
                            f"each line must be one JSON object with {', '.join(required)}") from None


def at(text: str, pos: int) -> str:
    """Where in a line a parse stopped, for messages: the characters around character `pos` (from 0), `pos` marked."""
    before, after = text[max(0, pos - 40):pos], text[pos:pos + 20].rstrip("\r\n")
    return f"{'...' if pos > 40 else ''}{before}>>>{after}{'...' if len(text.rstrip()) > pos + 20 else ''}"


def check_file(path: Path, spec: str, required: tuple[str, ...] = REQUIRED, keys: dict[str, str] | None = None
               ) -> None:
    """Streamed checks of a local file before `datasets` reads it: UTF-8 (.jsonl, .json, .csv) and, for JSON,
    one object per line (or a list of objects) with well-formed `required` values (keys: _check_rows')."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        lines = _decoded_lines(path, spec)
        # the header and the first row, blank lines skipped as datasets skips them; then the rest decoded
        records = list(itertools.islice((record for record in csv.reader(text for _, text in lines) if record), 2))
        for _ in lines:
            pass
        if len(records) < 2:
            raise UserError(f"dataset {spec!r} has no rows{' under its header line' if records else ''}: it needs "
                            f"rows with {', '.join(required)}")
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
            line = (text.splitlines() + [""])[e.lineno - 1]
            raise UserError(f"dataset {spec!r} line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}) at "
                            f"{at(line, e.colno - 1)}; use one JSON object per line, or one list of objects") from None
        if isinstance(whole, list):
            _check_rows(((f"row {i}", row) for i, row in enumerate(whole)), spec, required, keys)
        return  # one object: datasets reads it as columns, checked once loaded
    _check_rows(_json_lines(itertools.chain(head, lines), spec, required), spec, required, keys)


def row_locator(spec: str, num_rows: int) -> Callable[[int], str]:
    """row -> "row R at line L" for a JSON Lines file with num_rows rows, else "row R". The file is read again
    only on the first call (messages only)."""
    lines: list[int] | None = None

    def where(row: int) -> str:
        nonlocal lines
        if lines is None:
            lines = []
            path = local_path(spec)
            if path.is_file() and path.suffix.lower() in (".jsonl", ".json"):
                found = [(n, t) for n, t in _decoded_lines(path, spec) if t.strip()]
                if len(found) == num_rows and found[0][1].lstrip().startswith("{"):
                    lines = [n for n, _ in found]
        return f"row {row} at line {lines[row]}" if lines else f"row {row}"

    return where


def load_rows(spec: str, split: str = "train", required: tuple[str, ...] = REQUIRED,
              columns: dict[str, str] | None = None, turns: bool = False, system_prompt: str | None = None):
    """A `datasets.Dataset` of preference rows (or rows with the `required` columns) from a local file, a
    save_to_disk folder or a hub name; `columns`: the data's column read as each of prompt, chosen and rejected
    where it is called otherwise (the prompt_column, chosen_column and rejected_column keys). turns, system_prompt:
    plain text as chat turns (as_turns; the apply_chat_template and system_prompt keys)."""
    columns = {k: v for k, v in (columns or {}).items() if v and v != k}
    prompt_column = columns.get("prompt")
    ds = _load(spec, split, tuple(columns.get(k, k) for k in required), {columns.get(k, k): k for k in required})
    for key, column in columns.items():
        if column not in ds.column_names:
            raise UserError(f"{key}_column={column}: dataset {spec!r} has no such column (it has "
                            f"{', '.join(ds.column_names)})")
    if columns:  # all at once, so that two columns may swap names; a column of the read name is left out
        ds = ds.remove_columns([c for c in ds.column_names if c in columns and c not in columns.values()])
        ds = ds.rename_columns({column: key for key, column in columns.items()})
    if prompt_column is None and "prompt" in required and "prompt" not in ds.column_names and all(k in ds.column_names for k in IMPLICIT):
        unread = [c for c in ds.column_names if c not in IMPLICIT and _texty(ds.features[c])]
        if unread:
            raise UserError(f"dataset {spec!r} has chosen and rejected but no prompt column, and a column this tool "
                            f"does not read: {', '.join(unread)}. If it holds the prompts, set "
                            f"prompt_column={unread[0]}; to take each prompt as the shared start of chosen and "
                            "rejected (implicit prompts, as TRL), remove that column")
        log(f"dataset {spec!r} has no prompt column: each row's prompt is the shared start of its chosen and "
            "rejected (implicit prompts, as TRL)")
        ds = ds.map(with_prompt, keep_in_memory=True, load_from_cache_file=False)
    missing = [k for k in required if k not in ds.column_names]
    if missing:
        raise UserError(f"dataset {spec!r} lacks column(s) {', '.join(missing)} (has {', '.join(ds.column_names)});"
                        f" each row needs {', '.join(required)}" + column_hint(missing, ds.column_names, columns and
                                                                               {v: k for k, v in columns.items()}))
    if len(ds) == 0:
        raise UserError(f"dataset {spec!r} has no rows")
    if turns or system_prompt is not None:
        ds = _with_turns(ds, spec, turns, system_prompt)
    return ds


COLUMN_KEYS = ("prompt", "chosen", "rejected")  # the columns a recipe may read from others (KEY_column)


def column_hint(missing: list[str], names: list[str], keys: dict[str, str] | None = None) -> str:
    """"; name the columns that hold them: prompt_column=question chosen_column=good rejected_column=bad" for the
    `missing` columns (keys: a column read under another name -> its own, so that `worse` is rejected_column's), each
    with a column of `names` that no key reads, in order (COLUMN when none is left); "" when no key names one."""
    keys = keys or {}
    named = [keys.get(column, column) for column in missing if keys.get(column, column) in COLUMN_KEYS]
    if not named:
        return ""
    free = [c for c in names if c not in COLUMN_KEYS and c not in keys and c not in ("label", "completion")]
    return "; name the columns that hold them: " + " ".join(
        f"{k}_column={c}" for k, c in zip(named, free + ["COLUMN"] * len(named)))


def as_turns(row: dict, columns: tuple[str, ...], turns: bool, system_prompt: str | None) -> dict:
    """One row with chat turns (turns): its text prompt as a user turn and each text value of `columns` (its
    completions) as an assistant turn; with system_prompt a system turn before a prompt that has none. Null
    values stay null; rows already conversations keep their turns."""
    out = dict(row)
    prompt = row.get("prompt")
    if turns and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
        for column in columns:
            if isinstance(row[column], str):
                out[column] = [{"role": "assistant", "content": row[column]}]
    if system_prompt is not None and isinstance(prompt, list) and not any(message["role"] == "system"
                                                                          for message in prompt):
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    out["prompt"] = prompt
    return out


def _with_turns(ds, spec: str, turns: bool, system_prompt: str | None):
    """The rows as_turns; plain text with system_prompt and no turns is a UserError (it has nowhere to go)."""
    first = ds[0].get("prompt")
    if isinstance(first, str) and not turns:
        raise UserError(f"system_prompt is set but dataset {spec!r} is plain text, tokenized as written: set "
                        "apply_chat_template=true to render its rows as chat turns with that system prompt")
    columns = tuple(c for c in ("chosen", "rejected", "completion") if c in ds.column_names)
    return ds.map(lambda row: as_turns(row, columns, turns, system_prompt), keep_in_memory=True,
                  load_from_cache_file=False)


def _texty(feature) -> bool:
    """Whether a column holds text or conversations (what could be prompts), not numbers or labels."""
    import datasets

    if isinstance(feature, datasets.Value):
        return feature.dtype in ("string", "large_string")
    return isinstance(feature, (list, datasets.Sequence, getattr(datasets, "List", datasets.Sequence)))


def _load(spec: str, split: str, required: tuple[str, ...], keys: dict[str, str] | None = None):
    """The rows of a local file (checked first), a save_to_disk folder or a hub name, as `datasets` reads them."""
    import datasets

    datasets.disable_progress_bars()
    path = local_path(spec)
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise UserError(f"dataset {spec!r}: unsupported file type {path.suffix!r}; use "
                                + ", ".join(FILE_BUILDERS))
            if path.stat().st_size == 0:
                raise UserError(f"dataset {spec!r} is empty: it needs rows with prompt, chosen and rejected")
            check_file(path, spec, required, keys)
            ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        elif path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UserError(f"dataset {spec!r} has splits {list(ds)}; set dataset_split to one of them")
                ds = ds[split]
        elif (spec.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS
              or path.parent.exists() and str(path.parent) not in (".", "")):
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
    return ds
