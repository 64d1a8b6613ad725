"""Collate tokenized rows into one right-padded forward: a pair's chosen and rejected in one concatenated
batch (rows [0, B) chosen, [B, 2B) rejected), or in one row each sharing the prompt ([prompt, chosen,
rejected], collate_shared), or SFT rows one sequence each. packed=True adds the same sequences without padding,
one after another in one row (Packed: padding_free), which the forward runs instead of the padded rows, where the
batch holds padding worth removing (packed_if_padded); the padded rows still say where each completion token is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lowmem_dpo.data.encode import TokenizedCompletion, TokenizedPair


@dataclass(frozen=True)
class Layout:
    """How a stage lays out a micro-batch's sequences (headcheck.bring_up decides, on the model's first rows)."""

    shared: bool = False  # share_prompt: a pair's prompt once, rows [prompt, chosen, rejected] (collate_shared)
    packed: bool = False  # padding_free: the sequences in one row, no padding (Packed)


@dataclass
class Packed:
    """A micro-batch's sequences in one row, without padding (padding_free): what the model runs. Each sequence
    keeps its own positions, from 0 (a shared row's rejected continues from its prompt, as padded), and the
    attention stays within each one (model/packing.py)."""

    input_ids: torch.Tensor  # (1, S) every real token, the padded rows' in row order
    position_ids: torch.Tensor  # (1, S)
    starts: torch.Tensor  # (N,) where each padded row's tokens begin in the packed row
    bounds: tuple[int, ...]  # (N + 1,) the sequences' boundaries, 0 .. S, as ints: read by the attention of every
    # layer, which would otherwise wait for the device to hand them over
    splits: tuple[tuple[int, int], ...] | None = None  # shared rows: where each one's prompt and chosen end

    def to(self, device) -> "Packed":
        return Packed(self.input_ids.to(device), self.position_ids.to(device), self.starts.to(device), self.bounds,
                      self.splits)

    def kwargs(self) -> dict:
        """The backbone's keyword arguments: the row's ids and positions; the bounds (and shared splits) the packed
        attention reads (model/packing.py); and an attention mask of ones, with which transformers builds no mask
        (a row without padding is causal: SDPA's own skip), where position_ids alone would make it build the row's
        (S, S) block-diagonal mask."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids,
                    attention_mask=torch.ones_like(self.input_ids), sequence_bounds=self.bounds,
                    shared_splits=self.splits)


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
    packed: Packed | None = None  # padding_free: the same sequences in one row, which the forward runs

    def to(self, device) -> "Batch":
        return Batch(self.rows, self.input_ids.to(device), self.attention_mask.to(device),
                     self.completion_mask.to(device), self.num_tokens,
                     None if self.position_ids is None else self.position_ids.to(device),
                     None if self.packed is None else self.packed.to(device))

    @property
    def shared(self) -> bool:
        return self.position_ids is not None

    @property
    def computed_tokens(self) -> int:
        """The positions the forward computes, padding included: the packed row's real tokens, or every padded
        row's T."""
        return self.packed.bounds[-1] if self.packed is not None else self.input_ids.numel()


def by_length(items: list, tokens: Callable[[object], int]) -> list:
    """Longest first by `tokens`, a stable sort (ties keep their order): batches cut from the result carry items of
    like length, so little padding, and an out-of-memory shows on the first batch. What an item is: a train step's
    pair or row (training/loop.py), or precompute's forward unit of one or two sequences."""
    return sorted(items, key=lambda item: -tokens(item))


def collate(pairs: list[TokenizedPair], pad_token_id: int, packed: bool = False) -> Batch:
    """Right-padded [chosen..., rejected...] batch. Right padding keeps every real token's position, so a row's
    log-probs do not depend on its batch-mates. packed: with the Packed row too (packed_if_padded)."""
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    comp = [len(p.chosen_ids) for p in pairs] + [len(p.rejected_ids) for p in pairs]
    return _padded([p.row for p in pairs], seqs, comp, pad_token_id, packed)


def collate_shared(pairs: list[TokenizedPair], pad_token_id: int, packed: bool = False) -> Batch:
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
    return packed_if_padded(b, packed)


def collate_completions(items: list[TokenizedCompletion], pad_token_id: int, packed: bool = False) -> Batch:
    """Right-padded batch of B prompt+completion sequences (SFT), completion_mask on the completions."""
    seqs = [c.prompt_ids + c.completion_ids for c in items]
    return _padded([c.row for c in items], seqs, [len(c.completion_ids) for c in items], pad_token_id, packed)


# packed=True packs a micro-batch whose padding is at least this share of its positions: a batch of (nearly) equal
# lengths has no work to shed, and its packed row would only add a few attention calls per layer (one per sequence).
PACK_MIN_PADDING = 1 / 16


def packed_if_padded(b: Batch, packed: bool) -> Batch:
    """`b` with its Packed row (pack) when `packed` and its padding is worth removing (PACK_MIN_PADDING)."""
    if packed and b.input_ids.numel() - b.num_tokens >= PACK_MIN_PADDING * b.input_ids.numel():
        b.packed = pack(b)
    return b


def pack(b: Batch) -> Packed:
    """The real tokens of the right-padded rows of `b` (N, T), one row after another in one row (1, S), each with
    its own positions (a shared row's, or 0, 1, ...), and a shared row's splits."""
    mask = b.attention_mask.bool()  # (N, T)
    lengths = mask.sum(1)  # (N,)
    positions = b.position_ids if b.shared else torch.arange(mask.shape[1]).expand(mask.shape)  # (N, T)
    ends = torch.cumsum(lengths, 0)  # (N,)
    splits = None
    if b.shared:  # completion_mask 0 on the prompt (and padding), 1 on chosen, 2 on rejected
        prompt, chosen = ((b.completion_mask == 0) & mask).sum(1), (b.completion_mask == 1).sum(1)  # (N,) each
        splits = tuple(zip(prompt.tolist(), (prompt + chosen).tolist()))
    return Packed(b.input_ids[mask][None], positions[mask][None], ends - lengths, (0, *ends.tolist()), splits)


def _padded(rows: list[int], seqs: list[list[int]], comp: list[int], pad_token_id: int,
            packed: bool = False) -> Batch:
    """N sequences right-padded to the longest; the last comp[i] tokens of sequence i are its completion;
    packed: with their Packed row (packed_if_padded)."""
    T = max(len(seq) for seq in seqs)
    n = len(seqs)
    input_ids = torch.full((n, T), pad_token_id, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((n, T), dtype=torch.long)  # (N, T)
    completion_mask = torch.zeros((n, T), dtype=torch.long)  # (N, T)
    for i, (seq, c) in enumerate(zip(seqs, comp)):
        input_ids[i, :len(seq)] = torch.tensor(seq)
        attention_mask[i, :len(seq)] = 1
        completion_mask[i, len(seq) - c:len(seq)] = 1
    b = Batch(torch.tensor(rows, dtype=torch.long), input_ids, attention_mask, completion_mask,
              sum(len(seq) for seq in seqs))
    return packed_if_padded(b, packed)


def pad_token_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id  # padding is masked out; any id works
