"""How much of a dataset tokenization kept, and what max_length would keep it whole: pure functions of the counts
and lengths data.encode records (TokenizedData.whole), for the stages' lines, their limits (max_skipped_share,
max_truncated_share) and plan's length percentiles."""

from __future__ import annotations

import math
from dataclasses import dataclass

WHOLE_SHARE = 0.95  # the share of rows the advised max_length keeps whole


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_length(prompt: list[int], full: list[list[int]]) -> int:
    """Where the completions start: the tokens the prompt's ids share with every prompt+completion's (a template
    may tokenize the prompt's end differently once a completion follows it)."""
    return min(common_prefix_length(prompt, f) for f in full)


def whole_length(prompt_len: int, full: list[list[int]], max_prompt_length: int | None) -> int:
    """The max_length that keeps a row whole: its prompt (its prompt_length, cut to max_prompt_length) and its
    longest completion, split as encode._split_prompt splits them."""
    kept_prompt = prompt_len if max_prompt_length is None else min(prompt_len, max_prompt_length)
    return kept_prompt + max(len(f) - prompt_len for f in full)


@dataclass(frozen=True)
class Kept:
    """How much of a dataset tokenization kept: rows kept of all, completions cut at max_length of those kept,
    and the max_length that keeps WHOLE_SHARE of the tokenized rows whole (None: no row was tokenized)."""

    rows: int
    kept: int
    completions: int
    cut: int
    whole: int | None

    @property
    def skipped_share(self) -> float:
        return 1 - self.kept / self.rows if self.rows else 0.0

    @property
    def cut_share(self) -> float:
        return self.cut / self.completions if self.completions else 0.0

    def text(self, max_length: int) -> str:
        """"kept 12 of 40 rows (28 skipped, 70%); 12 of 24 completions (50%) cut at max_length=38"."""
        skipped = self.rows - self.kept
        out = f"kept {self.kept} of {self.rows} rows" + (f" ({skipped} skipped, {self.skipped_share:.0%})"
                                                          if skipped else ", none skipped")
        if self.cut:
            return out + f"; {self.cut} of {self.completions} completions ({self.cut_share:.0%}) cut at max_length={max_length}"
        return out + f"; no completion cut at max_length={max_length}"


def kept_of(rows: int, dropped: int, completions: int, cut: int, whole: list[int]) -> Kept:
    """The Kept of `rows` of which `dropped` were skipped, `cut` of the `completions` kept cut, and each tokenized
    row's whole_length."""
    return Kept(rows, rows - dropped, completions, cut, nearest_rank(whole, WHOLE_SHARE))


def nearest_rank(values: list[int], share: float) -> int | None:
    """The smallest value that at least `share` of `values` are at or below (None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * share) - 1)]


def losses_over(k: Kept, max_length: int, max_skipped_share: float, max_truncated_share: float,
                why: str) -> str | None:
    """What of a dataset is lost past the limits (the max_skipped_share and max_truncated_share keys; why: the
    skip reasons, encode.skip_reasons), with the max_length that keeps WHOLE_SHARE of its rows whole and the keys
    that go on; None within them."""
    over = []
    if k.skipped_share > max_skipped_share:
        over.append(f"{k.rows - k.kept} of {k.rows} rows ({k.skipped_share:.0%}) are skipped ({why}), over "
                    f"max_skipped_share={max_skipped_share:g}")
    if k.cut_share > max_truncated_share:
        over.append(f"{k.cut} of {k.completions} completions kept ({k.cut_share:.0%}) are cut at max_length="
                    f"{max_length}, over max_truncated_share={max_truncated_share:g}")
    if not over:
        return None
    advice = (f"max_length={k.whole} keeps {WHOLE_SHARE:.0%} of the rows whole (prompt and longest completion, as "
              "tokenized); raise it" if k.whole is not None and k.whole > max_length else
              "fix or remove those rows")
    return (" and ".join(over) + f": {advice}, or set max_skipped_share=1 max_truncated_share=1 to go on with "
            "what is left")
