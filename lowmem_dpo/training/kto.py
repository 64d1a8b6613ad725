"""KTO's part of a training run (`Blocks`, an objective.Objective): unpaired rows against the cached reference, as
TRL 1.16's KTOTrainer trains them.

A data item of the loop is a block: per_device_train_batch_size rows whose KL sequences pair within it
(data.unpaired.with_kl). The loop shuffles whole blocks each epoch (TRL keeps them in data order); a block is never
split across steps or ranks. Per block:
  1. the reference point z0 (kto only, `Blocks.reference_point`): the policy's log-probs of the block's KL sequences, no
     gradient, minus the reference's from the cache, averaged over the block, clamped at 0 (TRL also averages the
     processes' blocks);
  2. the policy's log-probs of the block's own completions (`forward`), the loss of each row against z0 (`Blocks.loss`);
     the step's loss is the mean over its blocks of each block's mean.
Both forwards go by the loop's micro-batches (the out-of-memory back-off halves them), which changes no number: z0 is
over the whole block. Metrics are TRL's (metrics.BLOCK_METRICS): each block's mean of rewards/chosen (its desirable
rows), rewards/rejected, logps/*, the margin of the two where the block has both, kl and the loss (`block_means`),
averaged over the blocks of a logged line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache
from lowmem_dpo.model.logps import LM
from lowmem_dpo.objectives import kto
from lowmem_dpo.objectives import metrics as metric_rows
from lowmem_dpo.objectives.metrics import Metric
from lowmem_dpo.runtime import distributed
from lowmem_dpo.training.objective import Batching, Loss, Objective, row_forward
from lowmem_dpo.training.step import Pass, StepSize, Sums, micro_batches


@dataclass(frozen=True)
class Reference:
    """The reference values of a part's rows (chosen: each row's completion, rejected: its KL sequence) and whether
    each row is desirable, (rows,) bool by the views' row."""

    cache: cache.RefCache
    desirable: torch.Tensor


@dataclass(frozen=True)
class Point:
    """What a block's forwards read, computed before them: z0 (a () tensor), and the KL forward's tokens and the
    positions it computed (padding included), the block's rows."""

    z0: torch.Tensor
    tokens: int
    rows: int
    computed: int = 0


@dataclass(frozen=True)
class BlockPass(Pass):
    """The step's Pass within one block: its reference point besides."""

    point: Point | None = None


@dataclass
class BlockForward:
    """A micro-batch of a block's rows as its loss reads it: the rows' log-probs against the block's z0
    (kto.UnpairedLogps), the reference's float64 values and the labels (on the CPU), the forward's tokens and
    positions, and the block's rows."""

    x: kto.UnpairedLogps
    ref_logps: torch.Tensor  # (n,) float64
    label: torch.Tensor  # (n,) bool
    tokens: int
    computed: int
    block_rows: int


@dataclass
class BlockLoss(Loss):
    """A micro-batch's Loss, and what its block's metrics read of it (block_means): its rows' losses, policy and
    reference log-probs, labels, (n,) each on the CPU."""

    seen: tuple = ()


def sequences(views: list[data.TokenizedPair], kl: bool) -> list[data.TokenizedCompletion]:
    """The block's own completions, or (kl) its KL sequences, as SFT-style rows (rows: the views' rows)."""
    return [data.TokenizedCompletion(v.row, v.prompt_ids, v.rejected_ids if kl else v.chosen_ids) for v in views]


@dataclass(frozen=True, kw_only=True)
class Blocks(Objective):
    """KTO's objective (and apo_zero_unpaired's): its items are blocks of unpaired rows, its metrics each block's
    means (module doc). ref and eval_ref: Reference (a cache and the part's labels)."""

    unit: ClassVar[str] = "row"
    blocks: ClassVar[bool] = True
    formula: Callable  # the unpaired objective's (objectives/kto.py): (UnpairedLogps, Settings) -> (n,) losses
    settings: objectives.Settings
    kl: bool = True  # the reference point is the KL estimate (kto); apo_zero_unpaired: z0 = 0
    metrics: tuple[Metric, ...] = field(default=metric_rows.BLOCK_METRICS, init=False)  # each block's means

    @classmethod
    def of(cls, cfg: Config, batching: Batching, ref: Reference, eval_ref: Reference | None = None) -> "Blocks":
        return cls(batching=batching, ref=ref, eval_ref=eval_ref, formula=objectives.OBJECTIVES[cfg.loss_type[0]].formula,
                   settings=cfg.loss_settings, kl=objectives.needs_kl(cfg.loss_type))

    def groups(self, items: list, world: distributed.World) -> list[list]:
        """This rank's whole blocks, every world-size-th."""
        return distributed.shard(items, world) if world.size > 1 else items

    def group(self, lm: LM, views: list, within: Pass) -> Sums:
        """One block: its reference point, then its rows by micro-batches (each loss backward'ed), then its
        means (block_means)."""
        point = self.reference_point(lm, views, within)
        inner = BlockPass(**vars(within), point=point)
        part, seen = Sums.of(self.metrics, self.nll_weight), []
        for batch in micro_batches(views, within.micro_batch):
            out = self.loss(self.forward(lm, batch, inner), within.size)
            if within.backward is not None:
                within.backward(out.value)
            part.add(out.sums)
            seen.append(out.seen)
        return self.block_means(part, point, seen)

    def reference_point(self, lm: LM, views: list, within: Pass) -> Point:
        """z0 of a block (module doc), by micro-batches, and the KL forward's tokens; 0 for apo_zero_unpaired.
        Over this process's block only: TRL averages the processes' block means at each micro-step, a collective
        call that would pair wrongly here when one process retries after running out of memory or holds one eval
        block more."""
        if not self.kl:
            return Point(torch.zeros(()), 0, len(views))
        logps, tokens, computed = [], 0, 0
        with torch.no_grad():
            for i in range(0, len(views), within.micro_batch):
                got = row_forward(lm, sequences(views[i:i + within.micro_batch], kl=True), self.batching)
                logps.append(got.logps.logps)
                tokens, computed = tokens + got.tokens, computed + got.computed
        share = kto.kl_share(torch.cat(logps).cpu(), within.ref.cache.rejected[[v.row for v in views]])
        return Point(kto.reference_point(share), tokens, len(views), computed)

    def forward(self, lm: LM, items: list, within: BlockPass) -> BlockForward:
        """A micro-batch of a block's rows as its loss reads them (kto.UnpairedLogps) and the forward's tokens."""
        own = row_forward(lm, sequences(items, kl=False), self.batching)
        got, tokens, computed = own.logps.logps, own.tokens, own.computed
        rows = torch.tensor([v.row for v in items])
        ref_logps, label = within.ref.cache.chosen[rows], within.ref.desirable[rows]  # (n,) float64, bool; CPU
        x = kto.UnpairedLogps(got, ref_logps.to(got.device, got.dtype), label.to(got.device),
                              within.point.z0.to(got.device))
        return BlockForward(x, ref_logps, label, tokens, computed, within.point.rows)

    def loss(self, output: BlockForward, size: StepSize) -> BlockLoss:
        """The micro-batch's share of the step's loss (the mean over the step's blocks of each block's mean), and
        what its block's metrics read of it (block_means takes them of the whole block, as TRL's means of a
        batch)."""
        x = output.x
        losses = self.formula(x, self.settings)  # (n,)
        sums = Sums.of(metric_rows.BLOCK_METRICS)
        sums.items, sums.tokens, sums.computed = len(x.logps), output.tokens, output.computed
        seen = (losses.detach().float().cpu(), x.logps.detach().float().cpu(), output.ref_logps, output.label)
        return BlockLoss(losses.sum() * (1.0 / (output.block_rows * size.items)), sums, seen)

    def size(self, items: list, first: bool) -> StepSize:
        return StepSize(len(items))

    def block_means(self, part: Sums, point: Point, seen: list[tuple]) -> Sums:
        """A block's metrics, each counted once (TRL averages its micro-batches' means): the mean of its rows'
        losses, z0 (kl), each side's rewards and logps where it has rows, and their margin where it has both."""
        lossed, logps, ref_logps, label = (torch.cat(t) for t in zip(*seen))  # (N,) each
        rewards = kto.rewards(kto.UnpairedLogps(logps, ref_logps, label), self.settings)  # (N,), against float64
        out = Sums.of(metric_rows.BLOCK_METRICS)
        out.items, out.tokens, out.computed = part.items, part.tokens + point.tokens, part.computed + point.computed
        out.note(metric_rows.LOSS, lossed.mean().item(), 1)
        out.note(metric_rows.KL, point.z0.item(), 1)
        for (reward, logp), mask in (((metric_rows.REWARDS_CHOSEN, metric_rows.LOGPS_CHOSEN), label),
                                     ((metric_rows.REWARDS_REJECTED, metric_rows.LOGPS_REJECTED), ~label)):
            if mask.any():
                out.note(reward, rewards[mask].mean().item(), 1)
                out.note(logp, logps[mask].mean().item(), 1)
        if label.any() and (~label).any():
            out.note(metric_rows.MARGIN, rewards[label].mean().item() - rewards[~label].mean().item(), 1)
        return out

    def samples_from(self, items: list) -> list:
        """The eval rows whose completion is desirable (the eval part's labels), as prompt + completion (no pair:
        its KL sequence is no rejected answer): what the samples are scored against."""
        if self.eval_ref is None:
            return items
        desirable = self.eval_ref.desirable
        return [data.TokenizedCompletion(v.row, v.prompt_ids, v.chosen_ids) for block in items for v in block
                if bool(desirable[v.row])]


def blocks(views: list, size: int) -> list[list]:
    """The views in blocks of `size` (the KL sequences' blocks, data.unpaired.with_kl): the loop's data items."""
    return [views[i:i + size] for i in range(0, len(views), size)]


def labels(items: list) -> torch.Tensor:
    """(rows,) bool: whether each of a part's data.unpaired rows is desirable, by its place (the views' row)."""
    return torch.tensor([item.desirable for item in items], dtype=torch.bool)
