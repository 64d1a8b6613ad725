"""Implicit prompts: preference rows with only chosen and rejected, each holding the whole conversation (or text),
as TRL's implicit-prompt format (trl.extract_prompt) has them. The prompt is the part the two share from the start:

  conversations  the leading messages equal in both; chosen and rejected keep the messages after them
  text           the leading characters equal in both, a space at the cut going to the completions, as TRL 1.16
                 cuts it ("The sky is blue." / "The sky is green." -> "The sky is", " blue.", " green.")

Tokenization then finds where the token ids of prompt and prompt + completion part (encode.py), so a cut inside a
word ("... bl" + "ue") still scores the same completion tokens as TRL does.
"""

from __future__ import annotations

IMPLICIT = ("chosen", "rejected")  # the columns of an implicit-prompt row


def shared_prefix(chosen, rejected) -> int:
    """Where TRL 1.16 (trl.extract_prompt) ends the prompt: at the first message (conversations) or character
    (text) where chosen and rejected differ, one earlier when the character before it is a space (the space starts
    the completions); when one is a prefix of the other, one before the shorter one's end, so that both
    completions keep at least one message or character. One difference: text whose first characters differ
    has no prompt here (the row is then skipped as empty), where TRL reads chosen[-1] and, when chosen ends with a
    space, takes all of chosen but that space as the prompt."""
    for n, (a, b) in enumerate(zip(chosen, rejected)):
        if a != b:
            return n - 1 if n > 0 and isinstance(chosen, str) and chosen[n - 1] == " " else n
    return max(0, min(len(chosen), len(rejected)) - 1)


def with_prompt(row: dict) -> dict:
    """{prompt, chosen, rejected} of an implicit-prompt row: its shared prefix, and what follows it in each
    (null values stay null: the data checks skip such a row as empty)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen is None or rejected is None:
        return {"prompt": None, "chosen": chosen, "rejected": rejected}
    n = shared_prefix(chosen, rejected)
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def is_implicit(row: dict, required: tuple[str, ...]) -> bool:
    """Whether a row that `required` asks a prompt of is in the implicit-prompt format: no prompt, chosen and
    rejected present."""
    return "prompt" in required and "prompt" not in row and all(k in row for k in IMPLICIT)


def implicit_required(required: tuple[str, ...]) -> tuple[str, ...]:
    """The columns an implicit-prompt row needs in place of `required`: chosen and rejected for the prompt."""
    return tuple(k for k in required if k != "prompt") + tuple(k for k in IMPLICIT if k not in required)
