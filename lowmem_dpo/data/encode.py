"""Tokenize preference rows as TRL 1.16's DPOTrainer does (and SFT rows as its SFTTrainer does), skipping the
rows DPO cannot use.

Tokenization of standard text rows (same numbers as TRL):
  - the EOS token's text is appended to chosen and rejected unless already there;
  - `prompt` and `prompt + completion` are tokenized with the tokenizer's default special tokens;
  - the completion starts where the ids stop sharing a prefix with the prompt's ids;
  - with `max_prompt_length`, the prompt ids are then cut from the left to that many tokens;
  - each prompt+completion sequence keeps its first `max_length` tokens.
Conversational rows (lists of {role, content}) are rendered with the tokenizer's chat template instead
(prompt with the generation prompt; no EOS appended: the template closes the turn).

Well-formed rows that DPO cannot use are skipped, counted and logged with their first rows (`SKIPS`);
`strict=true` refuses them instead, naming the first. Every row skipped: refused. strict only turns skips into
errors, the rows kept are the same, so it changes nothing in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from lowmem_dpo.data.lengths import Kept, kept_of, prompt_length, whole_length
from lowmem_dpo.data.rows import REQUIRED, row_kind, row_locator
from lowmem_dpo.runtime import builtins
from lowmem_dpo.runtime.errors import UserError, log

# Why a well-formed row is left out -> (what the log says, what to do). Order: the order rows are checked in.
SKIPS = {
    "empty": ("prompt, chosen or rejected is empty", "fill in or remove the row"),
    "identical": ("chosen is identical to rejected", "remove the row (it states no preference)"),
    "prompt_too_long": ("the prompt alone reaches max_length", "raise max_length or set max_prompt_length"),
    "identical_tokens": ("chosen and rejected have the same tokens within max_length", "raise max_length"),
    "empty_completion": ("the prompt or the completion is empty", "fill in or remove the row"),  # SFT rows
}
TRUNCATIONS = ("prompt", "chosen", "rejected")  # prompt: cut by max_prompt_length; completions: at max_length
COMPLETION = "completion"  # the truncated part of SFT's and KTO's rows (one completion each)


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
    whole: list[int] = field(default_factory=list)  # each tokenized row's tokens kept whole (whole_length)
    # The rows' formats, sorted: "text" (tokenized as written) and/or "conversation" (through the chat template);
    # set by mix.tokenize_mixture (a run records them: chat renders prompts as the run's were)
    formats: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Tokenizing:
    """What tokenizing one dataset's rows reads: the tokenizer, the lengths that cut each row (max_length and
    max_prompt_length, as TRL 1.16 cuts: module doc), and for its messages the dataset's `spec` (its path or name)
    and where(i), row i's place there (rows.row_locator; a mixture's rows: their source's file and line)."""

    tokenizer: object
    max_length: int
    max_prompt_length: int | None
    spec: str
    where: Callable[[int], str]


@dataclass(frozen=True)
class Named:
    """A dataset's rows as messages name them: the dataset (`spec`: its path or name) and where(i), row i's place
    there (a mixture's rows: their source's file and line)."""

    spec: str
    where: Callable[[int], str] | None = None  # None: by their place in spec (rows.row_locator)


def named(spec: "str | Named", rows: int) -> Named:
    """`spec` as Named, its `where` filled: a path or name's rows by their place in it (rows.row_locator)."""
    spec = spec if isinstance(spec, Named) else Named(spec)
    return spec if spec.where is not None else Named(spec.spec, row_locator(spec.spec, rows))


@dataclass
class Tally:
    """What tokenizing a dataset leaves out and cuts, filled chunk by chunk: the rows skipped, by reason (SKIPS);
    the kept rows cut, by part (TRUNCATIONS, or COMPLETION); each tokenized row's whole_length; and the datasets
    whose format check_format noted (it says so once)."""

    skipped: dict[str, list[int]]
    truncated: dict[str, list[int]]
    whole: list[int] = field(default_factory=list)
    noted: set = field(default_factory=set)


def _is_empty(value) -> bool:
    if isinstance(value, list):
        return not any(message["content"].strip() for message in value)
    return value is None or not value.strip()


def skip_reason(row: dict) -> str | None:
    """The SKIPS reason of a well-formed row that is unusable before tokenization, or None."""
    if any(_is_empty(row[k]) for k in REQUIRED):
        return "empty"
    if row["chosen"] == row["rejected"]:
        return "identical"
    return None


def check_format(tokenizer, kind: str | None, spec: str, noted: set) -> None:
    """Conversations need a chat template (a UserError naming the chat_template key when the tokenizer has none);
    plain text on a tokenizer with one is tokenized as written, as TRL does, which a chat model may answer with
    nothing: said once per dataset (`noted`)."""
    template = getattr(tokenizer, "chat_template", None)
    if kind == "conversation" and not template:
        raise UserError(f"dataset {spec!r} holds conversations (lists of {{role, content}} messages), and the "
                        "model's tokenizer has no chat template to render them: set chat_template to a Jinja "
                        "template (a .jinja file, or the template text; docs/data.md, Chat templates), or write the "
                        "rows as plain text")
    # The demo's built-in rows are plain text on purpose: its tiny model was pretrained on plain text.
    if kind == "text" and template and spec not in noted and not builtins.is_builtin(spec):
        noted.add(spec)
        log(f"note: dataset {spec!r} is plain text, tokenized as written: the model's chat template is not applied "
            "(as in TRL), and a chat model may answer such prompts with nothing. For the template, set "
            "apply_chat_template=true (each prompt a user turn, each completion an assistant turn; system_prompt "
            "adds a system turn), or write the rows as conversations (docs/data.md, Conversations)")


def _conversation_ids(tokenizer, messages: list, spec: str, where: str, **kwargs) -> list[int]:
    """A conversation's ids by the chat template; a UserError naming the row when the template refuses it."""
    import jinja2

    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise UserError(f"dataset {spec!r} {where}: the chat template cannot render this conversation "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); fix the row, or set chat_template "
                        "to a template that takes it") from None


def _encode(usable: list[tuple[int, dict]], tokenizer, conversational: bool, spec: str,
            where: Callable[[int], str]) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, prompt+chosen ids, prompt+rejected ids) per (index, row)."""
    if conversational:
        return [(_conversation_ids(tokenizer, row["prompt"], spec, where(i), add_generation_prompt=True),
                 _conversation_ids(tokenizer, row["prompt"] + row["chosen"], spec, where(i)),
                 _conversation_ids(tokenizer, row["prompt"] + row["rejected"], spec, where(i))) for i, row in usable]
    rows = [row for _, row in usable]
    eos = tokenizer.eos_token
    prompts = [row["prompt"] for row in rows]
    chosen = [row["prompt"] + (row["chosen"] if row["chosen"].endswith(eos) else row["chosen"] + eos) for row in rows]
    rejected = [row["prompt"] + (row["rejected"] if row["rejected"].endswith(eos) else row["rejected"] + eos)
                for row in rows]
    enc = tokenizer(prompts + chosen + rejected)["input_ids"]
    n = len(rows)
    return list(zip(enc[:n], enc[n:2 * n], enc[2 * n:]))


def _split_prompt(prompt: list[int], full: list[list[int]], max_length: int, max_prompt_length: int | None,
                  prompt_len: int):
    """(prompt ids, [completion ids of each of `full`], prompt cut?, [completion cut?]) as TRL 1.16 cuts them, or
    None when the prompt alone reaches max_length: the completion starts where the ids stop sharing a prefix with
    the prompt's (prompt_len: lengths.prompt_length, which the caller also needs); with max_prompt_length the
    prompt is cut from the left; each prompt+completion keeps its first max_length tokens."""
    prompt_ids = prompt[:prompt_len]
    prompt_cut = max_prompt_length is not None and len(prompt_ids) > max_prompt_length
    if max_prompt_length is not None:
        prompt_ids = prompt_ids[-max_prompt_length:]
    if len(prompt_ids) >= max_length:
        return None
    room = max_length - len(prompt_ids)  # keep the first max_length tokens of prompt+completion
    completions = [f[prompt_len:] for f in full]
    return prompt_ids, [c[:room] for c in completions], prompt_cut, [len(c) > room for c in completions]


def tokenize_rows(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str | Named = "dataset",
                  progress: bool = True, strict: bool = False) -> TokenizedData:
    """Tokenize every row (TRL 1.16 conventions, see module doc), in dataset order. Structural problems are
    UserErrors; unusable rows are skipped and logged (SKIPS), or refused with `strict`; so is every row skipped."""
    _eos_text(tokenizer)
    rows = named(spec, len(ds))  # a mixture's rows name their place in their source
    tokenizing = Tokenizing(tokenizer, max_length, max_prompt_length, rows.spec, rows.where)
    spec, where = rows.spec, rows.where
    pairs: list[TokenizedPair] = []
    tally = Tally({reason: [] for reason in SKIPS}, {part: [] for part in TRUNCATIONS})
    for checked, kind in _checked_chunks(ds, spec, where, REQUIRED, progress):
        usable = []
        for i, row in checked:
            reason = skip_reason(row)
            if reason:
                tally.skipped[reason].append(i)
            else:
                usable.append((i, row))
        check_format(tokenizer, kind, spec, tally.noted)
        encoded = _encode(usable, tokenizer, kind == "conversation", spec, where) if usable else []
        for (i, _), (p, pc, pr) in zip(usable, encoded):
            prompt_len = prompt_length(p, [pc, pr])
            tally.whole.append(whole_length(prompt_len, [pc, pr], max_prompt_length))
            split = _split_prompt(p, [pc, pr], max_length, max_prompt_length, prompt_len)
            if split is None:
                tally.skipped["prompt_too_long"].append(i)
                continue
            prompt_ids, (chosen_ids, rejected_ids), prompt_cut, (chosen_cut, rejected_cut) = split
            cut = {"prompt": prompt_cut, "chosen": chosen_cut, "rejected": rejected_cut}
            if chosen_ids == rejected_ids:
                tally.skipped["identical_tokens"].append(i)
                continue
            for part in TRUNCATIONS:
                if cut[part]:
                    tally.truncated[part].append(i)
            pairs.append(TokenizedPair(i, prompt_ids, chosen_ids, rejected_ids))
    return _checked_result(pairs, len(ds), tally, tokenizing, strict)


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


def _checked_result(items: list, num_rows: int, tally: Tally, tokenizing: Tokenizing, strict: bool) -> TokenizedData:
    """The TokenizedData of the rows kept, its skips checked (strict, every row skipped) and logged."""
    skipped = {k: sorted(v) for k, v in tally.skipped.items() if v}
    tok = TokenizedData(items, num_rows, sorted(row for rows in skipped.values() for row in rows), skipped,
                        tally.truncated, tally.whole)
    check_skips(tok.skipped, tok.num_rows, len(items), tokenizing, strict, kept(tok).whole)
    for line in summary_lines(tok, tokenizing.max_length, tokenizing.max_prompt_length, tokenizing.where,
                              tokenizing.spec):
        log(line)
    return tok


def _reason_text(reason: str, max_length: int) -> str:
    return SKIPS[reason][0].replace("max_length", f"max_length={max_length}")


def check_skips(skipped: dict[str, list[int]], num_rows: int, kept: int, tokenizing: Tokenizing, strict: bool,
                whole: int | None = None) -> None:
    """UserError when rows were skipped and `strict` is set (naming the first), or when every row was (whole: the
    max_length that keeps 95% of the rows whole, lengths.Kept.whole, named when it is above max_length)."""
    if not skipped or (kept and not strict):
        return
    spec, where, max_length = tokenizing.spec, tokenizing.where, tokenizing.max_length
    first, reason = min((rows[0], reason) for reason, rows in skipped.items())
    others = sum(map(len, skipped.values())) - 1
    if kept and strict:
        raise UserError(f"dataset {spec!r} {where(first)}: {_reason_text(reason, max_length)}, and strict=true "
                        f"refuses such rows ({others} more in this data): {SKIPS[reason][1]}, or set strict=false "
                        "to skip them")
    detail = "; ".join(f"{len(rows)} because {_reason_text(cause, max_length)} (first: {where(rows[0])}; "
                       f"{SKIPS[cause][1]})" for cause, rows in skipped.items())
    advice = (f"; max_length={whole} keeps 95% of the rows whole (prompt and longest completion, as tokenized)"
              if whole is not None and whole > max_length else "")
    raise UserError(f"dataset {spec!r}: all {num_rows} rows were skipped, so no row is left to use: {detail}{advice}")


def summary_lines(tok: TokenizedData, max_length: int, max_prompt_length: int | None,
                  where: Callable[[int], str], spec: str = "dataset") -> list[str]:
    """Log lines: the rows kept, skipped and cut, always; the rows skipped by reason with their first rows."""
    lines = [f"dataset {spec!r}: {kept(tok).text(max_length)}"]
    if tok.skipped:
        parts = [f"{len(rows)} because {_reason_text(reason, max_length)} ("
                 + ", ".join(map(where, rows[:3])) + (", ..." if len(rows) > 3 else "") + ")"
                 for reason, rows in tok.skipped.items()]
        lines.append(f"skipped {len(tok.dropped)} of {tok.num_rows} rows: " + "; ".join(parts)
                     + " (strict=true refuses them instead)")
    cut = {part: len(rows) for part, rows in tok.truncated.items() if rows}
    parts = [f"{cut[p]} {p} completions cut at max_length={max_length}" for p in (*TRUNCATIONS[1:], COMPLETION)
             if p in cut]
    if "prompt" in cut:
        parts.append(f"{cut['prompt']} prompts cut to max_prompt_length={max_prompt_length}")
    if parts:
        lines.append(f"kept {len(tok.pairs)} rows, with " + ", ".join(parts))
    return lines


def kept(tok: TokenizedData) -> Kept:
    """The Kept of a TokenizedData: pairs count two completions, SFT's and KTO's rows one."""
    pairs = bool(tok.pairs) and isinstance(tok.pairs[0], TokenizedPair)
    cut = sum(len(tok.truncated.get(part, [])) for part in (*TRUNCATIONS[1:], COMPLETION))
    return kept_of(tok.num_rows, len(tok.dropped), len(tok.pairs) * (2 if pairs else 1), cut, tok.whole)


def skip_reasons(skipped: dict[str, list[int]], max_length: int) -> str:
    """"28 because the prompt alone reaches max_length=38, ...": the rows skipped, by reason."""
    return ", ".join(f"{len(rows)} because {_reason_text(reason, max_length)}" for reason, rows in skipped.items())


# -- SFT rows -----------------------------------------------------------------------------------------------------
SFT_COLUMNS = ("completion", "chosen")  # prompt-completion rows (TRL's format), else preference rows' chosen


def sft_column(ds, spec: str) -> str:
    """The column the SFT loss is on: `completion`, or `chosen` of preference rows."""
    for column in SFT_COLUMNS:
        if column in ds.column_names:
            return column
    raise UserError(f"dataset {spec!r} has no completion or chosen column (has {', '.join(ds.column_names)}); SFT "
                    "needs rows with prompt and completion, or preference rows with prompt and chosen")


def _encode_completions(usable: list[tuple[int, dict]], column: str, tokenizer, conversational: bool, spec: str,
                        where: Callable[[int], str]) -> list[tuple]:
    """(prompt ids, prompt+completion ids) per (index, row), as _encode tokenizes prompt+chosen."""
    if conversational:
        return [(_conversation_ids(tokenizer, row["prompt"], spec, where(i), add_generation_prompt=True),
                 _conversation_ids(tokenizer, row["prompt"] + row[column], spec, where(i))) for i, row in usable]
    rows = [row for _, row in usable]
    eos = tokenizer.eos_token
    full = [row["prompt"] + (row[column] if row[column].endswith(eos) else row[column] + eos) for row in rows]
    enc = tokenizer([row["prompt"] for row in rows] + full)["input_ids"]
    return list(zip(enc[:len(rows)], enc[len(rows):]))


def tokenize_completions(ds, tokenizer, max_length: int, max_prompt_length: int | None,
                         spec: str | Named = "dataset", progress: bool = True, strict: bool = False) -> TokenizedData:
    """SFT rows: prompt + completion (or chosen), tokenized as tokenize_rows tokenizes a chosen completion (text:
    EOS appended unless there, as TRL's SFTTrainer does; conversations: the chat template), so the SFT model's
    completion is the sequence the DPO stage scores. Rows with an empty prompt or completion, or whose prompt
    alone reaches max_length, are skipped and logged (strict: refused)."""
    _eos_text(tokenizer)
    rows = named(spec, len(ds))  # a mixture's rows name their place in their source
    spec = rows.spec
    column = sft_column(ds, spec)
    tokenizing = Tokenizing(tokenizer, max_length, max_prompt_length, spec, rows.where)
    items: list[TokenizedCompletion] = []
    tally = Tally({"empty_completion": [], "prompt_too_long": []}, {COMPLETION: []})
    for checked, kind in _checked_chunks(ds, spec, tokenizing.where, ("prompt", column), progress):
        for i, _, p, c, uncut in completion_rows(checked, kind, column, tokenizing, tally):
            items.append(TokenizedCompletion(i, p, c))
            if len(c) < len(uncut):
                tally.truncated[COMPLETION].append(i)
    return _checked_result(items, len(ds), tally, tokenizing, strict)


def completion_rows(checked: list, kind: str | None, column: str, tokenizing: Tokenizing, tally: Tally,
                    keep_empty: bool = False):
    """(index, row, prompt ids, completion ids, the whole completion's ids) of each usable row of one checked chunk
    (SFT's rows, KTO's), prompt + `column` tokenized as tokenize_rows tokenizes prompt + chosen; the rows left out
    are added to the tally's skipped (empty_completion, prompt_too_long), each tokenized row's whole_length to its
    whole. keep_empty (KTO, as TRL): an empty text is a row too (its completion the EOS alone); only a missing
    (null) one is left out."""
    tokenizer, spec, where = tokenizing.tokenizer, tokenizing.spec, tokenizing.where
    empty = (lambda v: v is None) if keep_empty else _is_empty
    usable = [(i, entry) for i, entry in checked if not (empty(entry["prompt"]) or empty(entry[column]))]
    tally.skipped["empty_completion"] += sorted({i for i, _ in checked} - {i for i, _ in usable})
    check_format(tokenizer, kind, spec, tally.noted)
    encoded = _encode_completions(usable, column, tokenizer, kind == "conversation", spec, where) if usable else []
    for (i, row), (p, pc) in zip(usable, encoded):
        prompt_len = prompt_length(p, [pc])
        tally.whole.append(whole_length(prompt_len, [pc], tokenizing.max_prompt_length))
        split = _split_prompt(p, [pc], tokenizing.max_length, tokenizing.max_prompt_length, prompt_len)
        if split is None:
            tally.skipped["prompt_too_long"].append(i)
        else:
            yield i, row, split[0], split[1][0], pc[prompt_len:]
