"""KTO's part of a training run (session.Objective): unpaired rows against the cached reference, as TRL 1.16's
KTOTrainer trains them.

A data item of the loop is a block: per_device_train_batch_size rows whose KL sequences pair within it
(data.unpaired.with_kl), one micro-batch. The loop shuffles whole blocks each epoch (TRL keeps them in data
order); a block is never split across micro-batches or steps. Per block:
  1. the reference point z0 (kto only): the policy's log-probs of the block's KL sequences, no gradient, minus the
     reference's from the cache, averaged over the block, clamped at 0 (TRL also averages the processes' blocks);
  2. the policy's log-probs of the block's own completions, the loss of each row against z0, their mean over the
     block; the step's gradient is the mean over its blocks.
Both forwards go by sub-batches of the loop's micro-batch rows (the out-of-memory back-off halves it), which
changes no number: z0 is over the whole block. Metrics are TRL's: each block's mean of rewards/chosen (its desirable rows),
rewards/rejected, logps/*, the margin of the two where the block has both, kl and the loss, averaged over the
blocks of a logged line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache
from lowmem_dpo.model.logps import batch_logps
from lowmem_dpo.objectives import kto
from lowmem_dpo.runtime import devices, distributed
from lowmem_dpo.training.session import Session

METRICS = ("loss", "kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")


@dataclass
class KtoStats:
    """Sums over blocks of each block's metric, and how many blocks gave each (TRL averages its micro-batches')."""

    sums: dict = field(default_factory=lambda: dict.fromkeys(METRICS, 0.0))
    blocks: dict = field(default_factory=lambda: dict.fromkeys(METRICS, 0))
    rows: int = 0
    tokens: int = 0

    def add(self, other: "KtoStats") -> None:
        for k in METRICS:
            self.sums[k] += other.sums[k]
            self.blocks[k] += other.blocks[k]
        self.rows += other.rows
        self.tokens += other.tokens

    def note(self, name: str, value: float) -> None:
        self.sums[name] += value
        self.blocks[name] += 1

    def means(self) -> dict:
        return {k: self.sums[k] / self.blocks[k] if self.blocks[k] else None for k in METRICS}

    @property
    def empty(self) -> bool:
        return self.rows == 0


def sequences(views: list[data.TokenizedPair], kl: bool) -> list[data.TokenizedCompletion]:
    """The block's own completions, or (kl) its KL sequences, as SFT-style rows (rows: the views' rows)."""
    return [data.TokenizedCompletion(v.row, v.prompt_ids, v.rejected_ids if kl else v.chosen_ids) for v in views]


def policy_logps(model, items: list[data.TokenizedCompletion], pad_id: int, resolved: devices.Resolved, micro: int):
    """The policy's completion log-prob sums of `items` (N,) and their tokens, by sub-batches of `micro` rows."""
    out, tokens = [], 0
    for i in range(0, len(items), micro):
        batch = data.collate_completions(items[i:i + micro], pad_id).to(resolved.device)
        with devices.autocast(resolved.device, resolved.dtype):
            out.append(batch_logps(model, batch).logps)
        tokens += batch.num_tokens
    return torch.cat(out), tokens


def reference_point(session: Session, views: list, ref: cache.RefCache, micro: int) -> tuple[torch.Tensor, int]:
    """z0 of a block (module doc) and the KL forward's tokens; 0 for apo_zero_unpaired. Over this process's block
    only: TRL averages the processes' block means at each micro-step, a collective call that would pair wrongly
    here when one process retries after running out of memory or holds one eval block more."""
    if not objectives.needs_kl(session.run.cfg.loss_type):
        return torch.zeros(()), 0
    with torch.no_grad():
        logps, tokens = policy_logps(session.trainee.model, sequences(views, kl=True), session.run.pad_id,
                                     session.run.resolved, micro)
    return kto.reference_point(kto.kl_share(logps.cpu(), ref.rejected[[v.row for v in views]])), tokens


def block_step(session: Session, views: list, ref: cache.RefCache, desirable: torch.Tensor, micro: int,
               scale: float | None) -> KtoStats:
    """One block: z0, then the loss of its rows by sub-batches of `micro`, each backward'd at `scale` times its
    rows' loss sum (None: no gradient, eval); its metrics."""
    cfg = session.run.cfg
    stats = KtoStats(rows=len(views))
    z0, stats.tokens = reference_point(session, views, ref, micro)
    rows = torch.tensor([v.row for v in views])
    label = desirable[rows]  # (N,) bool
    logps, lossed = [], []
    for i in range(0, len(views), micro):
        part = rows[i:i + micro]
        with torch.set_grad_enabled(scale is not None):
            got, tokens = policy_logps(session.trainee.model, sequences(views[i:i + micro], kl=False),
                                       session.run.pad_id, session.run.resolved, micro)
            loss_inputs = kto.UnpairedLogps(got, ref.chosen[part].to(got.device, got.dtype),
                                            label[i:i + micro].to(got.device), z0.to(got.device))
            losses = objectives.OBJECTIVES[cfg.loss_type[0]].formula(loss_inputs, cfg.loss_settings)  # (n,)
            if scale is not None:
                session.trainee.backward(losses.sum() * scale)
        stats.tokens += tokens
        logps.append(got.detach().float().cpu())
        lossed.append(losses.detach().float().cpu())
    logps = torch.cat(logps)  # (N,)
    rewards = kto.rewards(kto.UnpairedLogps(logps, ref.chosen[rows], label), cfg.loss_settings)  # (N,)
    stats.note("loss", torch.cat(lossed).mean().item())
    stats.note("kl", z0.item())
    for side, mask in (("chosen", label), ("rejected", ~label)):
        if mask.any():
            stats.note(f"rewards/{side}", rewards[mask].mean().item())
            stats.note(f"logps/{side}", logps[mask].mean().item())
    if label.any() and (~label).any():
        stats.note("rewards/margins", rewards[label].mean().item() - rewards[~label].mean().item())
    return stats


@dataclass
class KTO:
    """KTO's part of the loop (session.Objective); its data items are blocks (blocks())."""

    cfg: Config
    ref: cache.RefCache  # the dataset's rows: chosen = each row's completion, rejected = its KL sequence
    desirable: torch.Tensor  # (rows,) bool, by the views' row
    eval_ref: cache.RefCache | None = None
    eval_desirable: torch.Tensor | None = None
    name: str = "train"
    unit: str = "row"
    blocks: bool = True  # its data items are blocks of rows (session.RunSetup.items_per_step counts them)

    def new_stats(self) -> KtoStats:
        return KtoStats()

    def accumulate_gradients(self, session: Session, blocks: list[list], micro_batch: int) -> KtoStats:
        stats = KtoStats()
        for block in distributed.shard(blocks, session.run.world):  # whole blocks: each rank every world-size-th
            scale = 1.0 / (len(block) * len(blocks))  # the step's loss: the mean over its blocks of each block's mean
            stats.add(block_step(session, block, self.ref, self.desirable, micro_batch, scale))
        return stats

    def eval_stats(self, session: Session, views: list, micro_batch: int) -> KtoStats:
        stats = KtoStats()
        with torch.no_grad():
            for block in distributed.shard(blocks(views, self.cfg.per_device_train_batch_size), session.run.world):
                stats.add(block_step(session, block, self.eval_ref, self.eval_desirable, micro_batch, None))
        return stats

    def eval_metrics(self, stats: KtoStats) -> dict[str, float]:
        return {f"eval_{k}": v for k, v in stats.means().items()}

    def samples_from(self, views: list) -> list:
        """The eval rows whose completion is desirable, as prompt + completion (no pair: its KL sequence is no
        rejected answer): what the samples are scored against."""
        return [data.TokenizedCompletion(v.row, v.prompt_ids, v.chosen_ids) for v in views
                if bool(self.eval_desirable[v.row])]

    def warning_signs(self, session: Session, stats: KtoStats, held_out: bool = False) -> list[str]:
        return []  # likelihood displacement reads pairs; the answers' signs (guards.collapse_sign) still judge KTO

    def bar_numbers(self, line: dict) -> dict[str, str]:
        return {k: f"{line[name]:.4f}" for k, name in (("loss", "loss"), ("kl", "kl")) if line.get(name) is not None}

    def opening_lines(self, session: Session) -> list[str]:
        rows = [v.row for block in session.run.items for v in block]
        good = int(self.desirable[rows].sum())
        cfg, params = session.run.cfg, sum(p.numel() for p in session.trainee.params)
        return [f"reference: cached in {cfg.ref_cache_dir}; {cfg.loss_type[0]} on unpaired rows ({good} desirable, "
                f"{len(rows) - good} not)",
                f"training {params:,} LoRA parameters for {session.run.steps} steps of "
                f"{cfg.gradient_accumulation_steps} blocks of {cfg.per_device_train_batch_size} rows "
                f"({len(rows)} rows in {len(session.run.items)} blocks)"]

    def closing_note(self, line: dict) -> str:
        return f": loss {line['loss']:.4f}, kl {line['kl']:.4f}" if line.get("loss") is not None else ""


def blocks(views: list, size: int) -> list[list]:
    """The views in blocks of `size` (the KL sequences' blocks, data.unpaired.with_kl): the loop's data items."""
    return [views[i:i + size] for i in range(0, len(views), size)]


def labels(items: list) -> torch.Tensor:
    """(rows,) bool: whether each of a part's data.unpaired rows is desirable, by its place (the views' row)."""
    return torch.tensor([item.desirable for item in items], dtype=torch.bool)

