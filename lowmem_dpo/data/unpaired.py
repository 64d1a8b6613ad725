"""Unpaired rows for KTO, tokenized as TRL 1.16's KTOTrainer does, and the KL sequences it builds from them.

A row is {prompt, completion, label}, label a bool (true: desirable), in text or conversations. Preference rows
{prompt, chosen, rejected} train KTO too: each becomes a desirable and an undesirable row, in TRL's order
(unpair_preference_dataset: per 1000 rows, every chosen, then every rejected). Tokenization is the SFT rows' (a
text completion gets the EOS text unless it ends with it; prompt and prompt + completion tokenized; the
completion starts where their ids part), so a completion tokenizes to the same ids as in a pair and the cache
serves both. A row whose prompt alone reaches max_length is skipped, as TRL drops it; an empty text is kept (a
completion of EOS alone), as TRL keeps it; a null one is skipped.

The KL sequences (with_kl): the kept rows in data order, cut into blocks of per_device_train_batch_size; within a
block row i's KL sequence is its own prompt with the completion of row i - 1 (the first row: the block's last),
each cut to max_length (objectives.kto.kl_partners). A block is one micro-batch, kept whole: its KL estimate is
over its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowmem_dpo.data.encode import (
    COMPLETION,
    Named,
    Tally,
    TokenizedData,
    TokenizedPair,
    Tokenizing,
    _checked_chunks,
    _checked_result,
    _eos_text,
    completion_rows,
    named,
)
from lowmem_dpo.objectives.kto import kl_partners
from lowmem_dpo.runtime.errors import UserError

UNPAIR_BATCH = 1000  # datasets.map's default batch, over which TRL's unpairing puts every chosen before rejected


@dataclass
class TokenizedUnpaired:
    """One KTO row: a prompt, a completion and its label; its KL sequence's completion once with_kl ran."""

    row: int  # the dataset row it came from (a preference row gives two)
    prompt_ids: list[int]
    completion_ids: list[int]  # cut at max_length
    desirable: bool
    kl_completion_ids: list[int] | None = None  # with_kl: another row's completion under this prompt, cut
    kl_matched: bool = False  # with_kl: that row has this row's prompt (a matched pair: no KL evidence)
    uncut: list[int] = field(default_factory=list, repr=False)  # the whole completion: a KL sequence cuts its own

    def as_pair(self, index: int) -> TokenizedPair:
        """The row as the pair code sees it: its completion in chosen's place, its KL sequence's in rejected's
        (none: []), `index` as its row (its place among its part's items: the reference cache's row)."""
        return TokenizedPair(index, self.prompt_ids, self.completion_ids, self.kl_completion_ids or [])


def paired(ds) -> bool:
    """Whether the rows are preference pairs (chosen, rejected) rather than unpaired (completion, label)."""
    columns = set(ds.column_names)
    if {"completion", "label"} <= columns:
        return False
    if {"chosen", "rejected"} <= columns:
        return True
    raise UserError(f"KTO needs rows with prompt, completion and label (a bool: true when the completion is "
                    f"desirable), or preference rows with prompt, chosen and rejected; the data has "
                    f"{', '.join(ds.column_names)}")


def _label(row: dict, spec: str, where: str) -> bool:
    value = row["label"]
    if not isinstance(value, bool):
        raise UserError(f"dataset {spec!r} {where}: label is {value!r}; expected true (a desirable completion) or "
                        "false (an undesirable one)")
    return value


def tokenize_unpaired(ds, tokenizer, max_length: int, max_prompt_length: int | None, spec: str | Named = "dataset",
                      progress: bool = True, strict: bool = False) -> TokenizedData:
    """Every row of `ds` as KTO rows (module doc), in TRL's order; skips logged (strict: refused)."""
    _eos_text(tokenizer)
    rows = named(spec, len(ds))  # a mixture's rows name their place in their source
    spec, where = rows.spec, rows.where
    tokenizing = Tokenizing(tokenizer, max_length, max_prompt_length, spec, where)
    columns = ("chosen", "rejected") if paired(ds) else ("completion",)
    items: list[TokenizedUnpaired] = []
    tally = Tally({"empty_completion": [], "prompt_too_long": []}, {COMPLETION: []})
    for checked, kind in _checked_chunks(ds, spec, where, ("prompt", *columns), progress):
        for column in columns:
            for i, row, prompt, completion, uncut in completion_rows(checked, kind, column, tokenizing, tally,
                                                                     keep_empty=True):
                label = column == "chosen" if len(columns) == 2 else _label(row, spec, where(i))
                items.append(TokenizedUnpaired(i, prompt, completion, label, uncut=uncut))
                if len(completion) < len(uncut):
                    tally.truncated[COMPLETION].append(i)
    tally.skipped = {k: sorted(set(v)) for k, v in tally.skipped.items()}
    return _checked_result(unpair_order(items) if len(columns) == 2 else items, len(ds), tally, tokenizing, strict)


def unpair_order(items: list[TokenizedUnpaired]) -> list[TokenizedUnpaired]:
    """Preference rows' chosen and rejected items in TRL's order: per UNPAIR_BATCH dataset rows, every chosen (in
    row order), then every rejected."""
    return sorted(items, key=lambda it: (it.row // UNPAIR_BATCH, not it.desirable, it.row))


def with_kl(items: list[TokenizedUnpaired], block: int, max_length: int) -> list[TokenizedUnpaired]:
    """`items` (in data order) with their KL completions (module doc): blocks of `block`, each rotated by one."""
    for item, partner in zip(items, kl_partners(len(items), block)):
        item.kl_completion_ids = items[partner].uncut[:max(0, max_length - len(item.prompt_ids))]
        item.kl_matched = items[partner].prompt_ids == item.prompt_ids
    return items
