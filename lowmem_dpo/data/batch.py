"""Collate tokenized rows into one right-padded forward: a pair's chosen and rejected in one concatenated
batch (rows [0, B) chosen, [B, 2B) rejected), or SFT rows one sequence each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowmem_dpo.data.encode import TokenizedCompletion, TokenizedPair


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
