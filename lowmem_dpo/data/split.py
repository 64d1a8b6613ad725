"""The eval hold-out of a dataset (eval_fraction): chosen by each row's prompt alone, through a hash.

A row is held out iff sha256 of its prompt, read as a number in [0, 1), is below the fraction. So:
  - adding or removing rows never moves another row to the other side;
  - every pair of one prompt falls on one side: no prompt is trained on and evaluated on;
  - SFT and DPO on the same data hold out the same rows, in every process (no Python hash(), which is salted).
"""

from __future__ import annotations

import hashlib
import json


def prompt_key(value) -> str:
    """The text a prompt is hashed by: the text itself, or a conversation as sorted-key JSON. Message keys
    `datasets` fills with null (a key only some rows' messages have) are dropped, so a row's key does not depend
    on the other rows in the file."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = [{k: v for k, v in message.items() if v is not None} if isinstance(message, dict) else message
                 for message in value]
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def shown_prompt(value) -> str:
    """A prompt as the log and the report show it: the text itself, or a conversation's last user message (its
    text parts), not the chat template's rendering with the roles glued to the text."""
    if isinstance(value, str):
        return value.strip()
    messages = [message for message in value or [] if isinstance(message, dict)]
    users = [message for message in messages if message.get("role") == "user"] or messages
    content = users[-1].get("content") if users else ""
    if isinstance(content, list):  # content parts: {"type": "text", "text": ...}
        content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "").strip()


def holdout_score(key: str) -> float:
    """sha256 of the key as a number in [0, 1) (its first 8 bytes)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def prompt_keys(ds) -> list[str]:
    """prompt_key of every row of a datasets.Dataset, in row order (read by chunks of the prompt column)."""
    prompts = ds.select_columns(["prompt"])
    keys: list[str] = []
    for start in range(0, len(prompts), 4096):
        keys += [prompt_key(v) for v in prompts[start:start + 4096]["prompt"]]
    return keys


def held_out(keys: list[str], fraction: float) -> set[int]:
    """The indices of the prompt keys whose holdout_score is below `fraction`."""
    return {i for i, key in enumerate(keys) if holdout_score(key) < fraction} if fraction > 0 else set()


def holdout_rows(ds, fraction: float) -> set[int]:
    """The row indices of `ds` (a datasets.Dataset) held out for eval: those whose prompt's holdout_score is
    below `fraction`."""
    return held_out(prompt_keys(ds), fraction)
