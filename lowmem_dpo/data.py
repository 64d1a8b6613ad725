"""Preference data: load rows through `datasets`, tokenize them as TRL 1.16's DPOTrainer does, and collate
chosen and rejected of a batch into one padded tensor for a single concatenated forward pass.

Tokenization of standard text rows (same numbers as TRL):
  - the EOS token's text is appended to chosen and rejected unless already there;
  - `prompt` and `prompt + completion` are tokenized with the tokenizer's default special tokens;
  - the completion starts where the ids stop sharing a prefix with the prompt's ids;
  - with `max_prompt_length`, the prompt ids are then cut from the left to that many tokens;
  - each prompt+completion sequence keeps its first `max_length` tokens; rows whose prompt alone reaches
    `max_length` are dropped (counted and logged).
Conversational rows (lists of {role, content}) are rendered with the tokenizer's chat template instead
(prompt with the generation prompt; no EOS appended: the template closes the turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo.cli import UserError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
REQUIRED = ("prompt", "chosen", "rejected")


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
    dropped: list[int]  # rows whose prompt alone reaches max_length


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


def is_conversational(row: dict) -> bool:
    return isinstance(row["prompt"], list)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_row(i: int, row: dict, spec: str, conversational: bool) -> None:
    for key in REQUIRED:
        value = row[key]
        ok = isinstance(value, list) if conversational else isinstance(value, str)
        if not ok or not value:
            what = "a list of {role, content} messages" if conversational else "non-empty text"
            raise UserError(f"dataset {spec!r} row {i}: {key} must be {what}, got {str(value)[:60]!r}")


def _chat_ids(tokenizer, messages: list, **kwargs) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def _split_prompt(prompt: list[int], full: list[list[int]], max_length: int, max_prompt_length: int | None):
    """(prompt ids, [completion ids of each of `full`]) as TRL 1.16 cuts them, or None when the prompt alone
    reaches max_length (the row is dropped): the completion starts where the ids stop sharing a prefix with the
    prompt's; with max_prompt_length the prompt is cut from the left; each prompt+completion keeps its first
    max_length tokens."""
    prompt_len = min(_common_prefix_length(prompt, f) for f in full)
    prompt_ids = prompt[:prompt_len]
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[-max_prompt_length:]
    if len(prompt_ids) >= max_length:
        return None
    room = max_length - len(prompt_ids)  # keep the first max_length tokens of prompt+completion
    return prompt_ids, [f[prompt_len:][:room] for f in full]


def _eos_text(tokenizer) -> str:
    if tokenizer.eos_token is None:
        raise UserError("the tokenizer has no eos_token: set one in its tokenizer_config.json")
    return tokenizer.eos_token


def _kept(items: list, num_rows: int, dropped: list[int], spec: str, max_length: int) -> TokenizedData:
    """The tokenized rows, or a UserError when tokenization dropped every one."""
    if not items:
        raise UserError(f"dataset {spec!r}: all {num_rows} rows were dropped because their prompt alone reaches "
                        f"max_length={max_length}; raise max_length or set max_prompt_length")
    return TokenizedData(items, num_rows, dropped)


def tokenize_rows(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str = "dataset",
                  progress: bool = True) -> TokenizedData:
    """Tokenize every row (TRL 1.16 conventions, see module doc). Rows are kept in dataset order."""
    from tqdm.auto import tqdm

    eos = _eos_text(tokenizer)
    pairs, dropped = [], []
    chunk = 512
    bar = tqdm(total=len(ds), desc="tokenize", unit="row", disable=not progress, leave=False)
    for start in range(0, len(ds), chunk):
        rows = ds[start:start + chunk]
        batch = [dict(zip(rows, vals)) for vals in zip(*rows.values())]
        conversational = is_conversational(batch[0])
        for j, row in enumerate(batch):
            _check_row(start + j, row, spec, conversational)
        if conversational:
            tokenized = [
                (_chat_ids(tokenizer, r["prompt"], add_generation_prompt=True),
                 _chat_ids(tokenizer, r["prompt"] + r["chosen"]),
                 _chat_ids(tokenizer, r["prompt"] + r["rejected"]))
                for r in batch]
        else:
            prompts = [r["prompt"] for r in batch]
            chosen = [r["prompt"] + (r["chosen"] if r["chosen"].endswith(eos) else r["chosen"] + eos) for r in batch]
            rejected = [r["prompt"] + (r["rejected"] if r["rejected"].endswith(eos) else r["rejected"] + eos)
                        for r in batch]
            enc = tokenizer(prompts + chosen + rejected)["input_ids"]
            n = len(batch)
            tokenized = list(zip(enc[:n], enc[n:2 * n], enc[2 * n:]))
        for j, (p, pc, pr) in enumerate(tokenized):
            cut = _split_prompt(p, [pc, pr], max_length, max_prompt_length)
            if cut is None:
                dropped.append(start + j)
                continue
            prompt_ids, (chosen_ids, rejected_ids) = cut
            pairs.append(TokenizedPair(start + j, prompt_ids, chosen_ids, rejected_ids))
        bar.update(len(batch))
    bar.close()
    return _kept(pairs, len(ds), dropped, spec, max_length)


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


def tokenize_completions(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str = "dataset",
                         progress: bool = True) -> TokenizedData:
    """SFT rows: prompt + completion (or chosen), tokenized as tokenize_rows tokenizes a chosen completion (text:
    EOS appended unless there, as TRL's SFTTrainer does; conversations: the chat template), so the SFT model's
    completion is the sequence the DPO stage scores."""
    from tqdm.auto import tqdm

    eos = _eos_text(tokenizer)
    column = sft_column(ds, spec)
    items, dropped = [], []
    bar = tqdm(total=len(ds), desc="tokenize", unit="row", disable=not progress, leave=False)
    for start in range(0, len(ds), 512):
        rows = ds[start:start + 512]
        prompts, completions = rows["prompt"], rows[column]
        conversational = isinstance(prompts[0], list)
        for j, (prompt, completion) in enumerate(zip(prompts, completions)):
            for key, value in (("prompt", prompt), (column, completion)):
                if not value or not isinstance(value, list if conversational else str):
                    what = "a list of {role, content} messages" if conversational else "non-empty text"
                    raise UserError(f"dataset {spec!r} row {start + j}: {key} must be {what}, got {str(value)[:60]!r}")
        if conversational:
            tokenized = [(_chat_ids(tokenizer, p, add_generation_prompt=True), _chat_ids(tokenizer, p + c))
                         for p, c in zip(prompts, completions)]
        else:
            full = [p + (c if c.endswith(eos) else c + eos) for p, c in zip(prompts, completions)]
            enc = tokenizer(prompts + full)["input_ids"]
            tokenized = list(zip(enc[:len(full)], enc[len(full):]))
        for j, (p, pc) in enumerate(tokenized):
            cut = _split_prompt(p, [pc], max_length, max_prompt_length)
            if cut is None:
                dropped.append(start + j)
            else:
                items.append(TokenizedCompletion(start + j, cut[0], cut[1][0]))
        bar.update(len(prompts))
    bar.close()
    return _kept(items, len(ds), dropped, spec, max_length)
