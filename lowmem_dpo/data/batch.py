"""Collate tokenized rows into one right-padded forward: a pair's chosen and rejected in one concatenated
batch (rows [0, B) chosen, [B, 2B) rejected), or in one row each sharing the prompt ([prompt, chosen,
rejected], collate_shared), or SFT rows one sequence each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowmem_dpo.data.encode import TokenizedCompletion, TokenizedPair


@dataclass
class Batch:
    """A micro-batch of B pairs as one forward: rows [0, B) are chosen, rows [B, 2B) rejected. From
    collate_completions (SFT): B sequences, one per row."""

    rows: torch.Tensor  # (B,) dataset row indices
    input_ids: torch.Tensor  # (2B, T); (B, T) shared
    attention_mask: torch.Tensor  # (2B, T) 1 on real tokens; (B, T) shared
    completion_mask: torch.Tensor  # (2B, T) 1 on completion tokens; shared (B, T): 1 chosen, 2 rejected
    # the real tokens (attention_mask's sum), counted at collate on the host: read off a GPU batch, the count would
    # wait for the device (a synchronization in every micro-batch)
    num_tokens: int
    position_ids: torch.Tensor | None = None  # shared (B, T): rejected continues from the prompt, as chosen does

    def to(self, device) -> "Batch":
        return Batch(self.rows, self.input_ids.to(device), self.attention_mask.to(device),
                     self.completion_mask.to(device), self.num_tokens,
                     None if self.position_ids is None else self.position_ids.to(device))

    @property
    def shared(self) -> bool:
        return self.position_ids is not None


def by_length(items: list, tokens: Callable[[object], int]) -> list:
    """Longest first by `tokens`, a stable sort (ties keep their order): batches cut from the result carry items of
    like length, so little padding, and an out-of-memory shows on the first batch. What an item is: a train step's
    pair or row (training/loop.py), or precompute's forward unit of one or two sequences."""
    return sorted(items, key=lambda item: -tokens(item))


def collate(pairs: list[TokenizedPair], pad_token_id: int) -> Batch:
    """Right-padded [chosen..., rejected...] batch. Right padding keeps every real token's position, so a row's
    log-probs do not depend on its batch-mates."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    comp = [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    return _padded([p.row for p in pairs], seqs, comp, pad_token_id)


def collate_shared(pairs: list[TokenizedPair], pad_token_id: int) -> Batch:
    """Right-padded batch of B rows [prompt, chosen, rejected]: the prompt goes through the model once per pair.
    position_ids restart rejected at the prompt's length, as if it followed the prompt directly; logps builds
    the attention mask that hides chosen from rejected (logps.shared_prefix_mask)."""
    seqs = [p.prompt_ids + p.chosen_ids + p.rejected_ids for p in pairs]
    b = _padded([p.row for p in pairs], seqs, [len(p.chosen_ids) + len(p.rejected_ids) for p in pairs],
                pad_token_id)
    positions = torch.zeros_like(b.input_ids)  # (B, T); padding at 0
    for i, p in enumerate(pairs):
        n, c, r = len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)
        positions[i, :n + c] = torch.arange(n + c)
        positions[i, n + c:n + c + r] = torch.arange(n, n + r)
        b.completion_mask[i, n + c:n + c + r] = 2  # rejected
    b.position_ids = positions
    return b


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
    return Batch(torch.tensor(rows, dtype=torch.long), input_ids, attention_mask, completion_mask,
                 sum(len(s) for s in seqs))


def pad_token_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id  # padding is masked out; any id works
