"""KTO's part of a training run (objective.unpaired builds its entry): unpaired rows against the cached reference, as
TRL 1.16's KTOTrainer trains them.

A data item of the loop is a block: per_device_train_batch_size rows whose KL sequences pair within it
(data.unpaired.with_kl). The loop shuffles whole blocks each epoch (TRL keeps them in data order); a block is never
split across steps or ranks. Per block:
  1. the reference point z0 (kto only, `reference_point`): the policy's log-probs of the block's KL sequences, no
     gradient, minus the reference's from the cache, averaged over the block, clamped at 0 (TRL also averages the
     processes' blocks);
  2. the policy's log-probs of the block's own completions (`forward`), the loss of each row against z0 (`loss`);
     the step's loss is the mean over its blocks of each block's mean.
Both forwards go by the loop's micro-batches (the out-of-memory back-off halves them), which changes no number: z0 is
over the whole block. Metrics are TRL's (metrics.BLOCK_METRICS): each block's mean of rewards/chosen (its desirable
rows), rewards/rejected, logps/*, the margin of the two where the block has both, kl and the loss (`block_means`),
averaged over the blocks of a logged line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.objectives import kto
from lowmem_dpo.objectives import metrics as m
from lowmem_dpo.runtime import devices
from lowmem_dpo.training.step import Sums


@dataclass(frozen=True)
class Reference:
    """The reference values of a part's rows (chosen: each row's completion, rejected: its KL sequence) and whether
    each row is desirable, (rows,) bool by the views' row."""

    cache: cache.RefCache
    desirable: torch.Tensor


@dataclass(frozen=True)
class Block:
    """What a block's forwards read, computed before them: z0, the KL forward's tokens, the block's rows; and what
    its micro-batches' losses saw, in order (loss appends; block_means takes each block's means of the whole)."""

    z0: torch.Tensor
    tokens: int
    rows: int
    computed: int = 0  # the KL forward's positions, padding included
    seen: list = field(default_factory=list)  # (losses, logps, reference log-probs, labels) of each micro-batch


def sequences(views: list[data.TokenizedPair], kl: bool) -> list[data.TokenizedCompletion]:
    """The block's own completions, or (kl) its KL sequences, as SFT-style rows (rows: the views' rows)."""
    return [data.TokenizedCompletion(v.row, v.prompt_ids, v.rejected_ids if kl else v.chosen_ids) for v in views]


def policy_logps(lm, items: list[data.TokenizedCompletion], pad_id: int, resolved: devices.Resolved,
                 packed: bool = False):
    """The policy's completion log-prob sums of `items` (N,), the forward's tokens and the positions it computed
    (padding included); lm: its parts (logps.lm_of); packed: as one packed row (padding_free)."""
    batch = data.collate_completions(items, pad_id, packed).to(resolved.device)
    with devices.autocast(resolved.device, resolved.dtype):
        return completion_logps(lm, batch).logps, batch.num_tokens, batch.computed_tokens


def reference_point(lm, views: list, ref: Reference, micro_batch: int, *, cfg: Config, pad_id: int,
                    resolved: devices.Resolved, packed: bool = False) -> Block:
    """z0 of a block (module doc), by micro-batches, and the KL forward's tokens; 0 for apo_zero_unpaired. Over
    this process's block only: TRL averages the processes' block means at each micro-step, a collective call that
    would pair wrongly here when one process retries after running out of memory or holds one eval block more."""
    if not objectives.needs_kl(cfg.loss_type):
        return Block(torch.zeros(()), 0, len(views))
    logps, tokens, computed = [], 0, 0
    with torch.no_grad():
        for i in range(0, len(views), micro_batch):
            got, n, c = policy_logps(lm, sequences(views[i:i + micro_batch], kl=True), pad_id, resolved, packed)
            logps.append(got)
            tokens, computed = tokens + n, computed + c
    share = kto.kl_share(torch.cat(logps).cpu(), ref.cache.rejected[[v.row for v in views]])
    return Block(kto.reference_point(share), tokens, len(views), computed)


def forward(lm, views: list, ref: Reference, block: Block, *, pad_id: int, resolved: devices.Resolved,
            packed: bool = False):
    """A micro-batch of a block's rows as its loss reads them (kto.UnpairedLogps) and the forward's tokens."""
    got, tokens, computed = policy_logps(lm, sequences(views, kl=False), pad_id, resolved, packed)
    rows = torch.tensor([v.row for v in views])
    ref_logps, label = ref.cache.chosen[rows], ref.desirable[rows]  # (n,) float64 and bool, on the CPU
    x = kto.UnpairedLogps(got, ref_logps.to(got.device, got.dtype), label.to(got.device), block.z0.to(got.device))
    return x, ref_logps, label, (tokens, computed), block


def loss(f, size, *, formula, s: objectives.Settings) -> tuple[torch.Tensor, Sums]:
    """The micro-batch's share of the step's loss (the mean over the step's blocks of each block's mean); what it
    saw goes into its block (block_means takes the block's metrics of the whole, as TRL's means of a batch).
    formula: the unpaired objective's, s: the run's loss settings."""
    x, ref_logps, label, (tokens, computed), block = f
    losses = formula(x, s)  # (n,)
    block.seen.append((losses.detach().float().cpu(), x.logps.detach().float().cpu(), ref_logps, label))
    sums = Sums.of(m.BLOCK_METRICS)
    sums.items, sums.tokens, sums.computed = len(x.logps), tokens, computed
    return losses.sum() * (1.0 / (block.rows * size.items)), sums


def block_means(part: Sums, block: Block, *, s: objectives.Settings) -> Sums:
    """A block's metrics, each counted once (TRL averages its micro-batches' means): the mean of its rows' losses,
    z0 (kl), each side's rewards and logps where it has rows, and their margin where it has both (s: the run's
    loss settings)."""
    lossed, logps, ref_logps, label = (torch.cat(t) for t in zip(*block.seen))  # (N,) each
    rewards = kto.rewards(kto.UnpairedLogps(logps, ref_logps, label), s)  # (N,), against float64
    out = Sums.of(m.BLOCK_METRICS)
    out.items, out.tokens, out.computed = part.items, part.tokens + block.tokens, part.computed + block.computed
    out.note(m.LOSS, lossed.mean().item(), 1)
    out.note(m.KL, block.z0.item(), 1)
    for (reward, logp), mask in (((m.REWARDS_CHOSEN, m.LOGPS_CHOSEN), label), ((m.REWARDS_REJECTED, m.LOGPS_REJECTED),
                                                                               ~label)):
        if mask.any():
            out.note(reward, rewards[mask].mean().item(), 1)
            out.note(logp, logps[mask].mean().item(), 1)
    if label.any() and (~label).any():
        out.note(m.MARGIN, rewards[label].mean().item() - rewards[~label].mean().item(), 1)
    return out


def samples_from(blocks_: list, desirable: torch.Tensor) -> list:
    """The eval rows whose completion is desirable (`desirable`: the eval part's labels), as prompt + completion
    (no pair: its KL sequence is no rejected answer): what the samples are scored against."""
    return [data.TokenizedCompletion(v.row, v.prompt_ids, v.chosen_ids) for block in blocks_ for v in block
            if bool(desirable[v.row])]


def blocks(views: list, size: int) -> list[list]:
    """The views in blocks of `size` (the KL sequences' blocks, data.unpaired.with_kl): the loop's data items."""
    return [views[i:i + size] for i in range(0, len(views), size)]


def labels(items: list) -> torch.Tensor:
    """(rows,) bool: whether each of a part's data.unpaired rows is desirable, by its place (the views' row)."""
    return torch.tensor([item.desirable for item in items], dtype=torch.bool)
