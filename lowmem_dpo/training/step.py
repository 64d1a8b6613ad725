"""One optimizer step, top to bottom (`optimizer_step`): the step's items from the data stream; this rank's share
in micro-batches, each forward'ed, its loss backward'ed and its metrics summed (`accumulate`, which hands the
objective a `Pass`), the micro-batch halved on out-of-memory (`backward_with_backoff`); every rank's gradients and
sums; unscaled and clipped; the update or a skip; the schedule. The objective (objective.py) is only a loss: what it
needs per batch, its loss and metrics, its units; the step calls the same methods of every kind. The loop (loop.py)
writes the lines, evals and checkpoints around each step.

    items = next_items(session.progress.stream, session.run.items_per_step)
    result = optimizer_step(session)   # StepResult: the sums, grad norm, learning rate, seconds

What a step's summed gradients become: an update; or a skip for a non-finite loss or gradient
(max_nonfinite_steps in a row stop the run as diverged: loop.train_step), or for float16 gradients that overflowed at the loss scale
(a scaler skip: the scale halves, the run goes on); then the end of every step, skipped or not: the scale, the
schedule, the gradients zeroed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from lowmem_dpo import data
from lowmem_dpo.model import compute_copies
from lowmem_dpo.model.logps import LM, lm_of
from lowmem_dpo.objectives import metrics
from lowmem_dpo.runtime import devices, distributed, oom, sharding
from lowmem_dpo.runtime.errors import log


# -- what a step updates, and what it sums -------------------------------------------------------------------------
@dataclass
class Trainee:
    """The model being trained and what updates it; a checkpoint saves it and a resume restores it as one thing
    (checkpoint.save, checkpoint.restore)."""

    model: object  # PeftModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: list  # the trainable LoRA parameters
    scaler: object = None  # float16: torch.amp.GradScaler (devices.grad_scaler); None otherwise
    copies: compute_copies.ComputeCopies | None = None  # 16-bit: the LoRA weights' copies the forward reads
    lm: LM = field(init=False)  # the model's parts its forwards run (logps.lm_of), read once, not at each forward

    def __post_init__(self):
        self.lm = lm_of(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), the loss scaled first in float16 (the scaler's scale; optimizer_step unscales)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.copies is not None:  # 16-bit: the copies' gradients into the weights' .grad
            self.copies.accumulate()

    def zero_grad(self) -> None:
        """No gradient anywhere: the weights' and, in a 16-bit dtype, their compute copies'."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.copies is not None:
            self.copies.zero_grad()


@dataclass
class Sums:
    """A step's sums over its micro-batches (and ranks: distributed.sum_stats), or a log line's over its steps, or
    an eval's: each summed metric's total and count (its mean is total / count), the forward's tokens, the items,
    and the completion tokens the per-token guards read. A checkpoint stores it (dataclasses.asdict)."""

    totals: dict = field(default_factory=dict)  # metric name -> summed value
    counts: dict = field(default_factory=dict)  # metric name -> what its total is over (pairs, tokens, blocks)
    items: int = 0  # data rows summed: pairs, SFT rows, KTO rows (0: nothing added)
    tokens: int = 0  # tokens in the forward passes (for tokens_per_s)
    computed: int = 0  # positions the forwards computed, padding included (= tokens when packed: padding_free)
    chosen_tokens: int = 0  # completion tokens of the chosen sides (the per-token guards)
    rejected_tokens: int = 0  # and of the rejected sides
    # The reference values against this forward, at step 1 only (objectives.start_drift; else 0): summed |policy -
    # reference| over the completions (nats), and summed loss minus its value at policy = reference. At step 1 the
    # two are one model, so these measure how far the cache is from the policy's forward (the drift line).
    ref_drift: float = 0.0
    ref_offset: float = 0.0
    # In a 16-bit dtype at step 1 (PairForward.alone): summed |this forward - the same pairs forwarded one at a
    # time| (nats), this device's own rounding between two batch layouts, beside which ref_drift is judged.
    layout_drift: float = 0.0
    # the NLL's weight in the loss (nll_loss: the sft term, ORPO's own; the loss total excludes it), or None; not a
    # sum (distributed.sum_stats)
    nll_weight: float | None = field(default=None, metadata={"sum": False})

    @classmethod
    def of(cls, metrics, nll_weight: float | None = None) -> "Sums":
        """Empty sums of `metrics` (rows, in the order the line shows them), the same keys on every rank."""
        return cls({m.name: 0.0 for m in metrics}, {m.name: 0 for m in metrics}, nll_weight=nll_weight)

    def note(self, metric: metrics.Metric, total: float, count: float) -> None:
        self.totals[metric.name] += total
        self.counts[metric.name] += count

    def add(self, other: "Sums") -> None:
        for k, v in other.totals.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + other.counts[k]
        self.items += other.items
        self.tokens += other.tokens
        self.computed += other.computed
        self.chosen_tokens += other.chosen_tokens
        self.rejected_tokens += other.rejected_tokens
        self.ref_drift += other.ref_drift
        self.ref_offset += other.ref_offset
        self.layout_drift += other.layout_drift

    def means(self, preference: bool = False) -> dict:
        """Each metric's mean (None where nothing counted it); the loss with the NLL at its weight, unless
        `preference` (the preference terms alone: what the warning signs judge)."""
        out = {k: v / self.counts[k] if self.counts[k] else None for k, v in self.totals.items()}
        nll = out.get(metrics.NLL_LOSS.name)
        if self.nll_weight is not None and not preference and nll is not None and out[metrics.LOSS.name] is not None:
            out[metrics.LOSS.name] += self.nll_weight * nll
        return out

    @property
    def empty(self) -> bool:
        return self.items == 0


@dataclass(frozen=True)
class StepSize:
    """What one step's loss is a mean over, every rank's items counted (so the split changes no gradient)."""

    items: int  # pairs (DPO), KTO blocks; SFT: rows
    tokens: int = 0  # DPO: the tokens its NLL averages over; SFT: the completion tokens predicted
    drift: bool = False  # DPO at a new run's step 1: measure the reference values against this forward


@dataclass(frozen=True)
class Pass:
    """What the step hands its objective for one pass over a step's items (or an eval's): the items' reference
    values, the step's size, the micro-batch, and the backward each micro-batch's loss goes through."""

    ref: object  # the objective's ref (training) or eval_ref (an eval); None: none
    size: StepSize
    micro_batch: int  # items per forward (halved on out of memory: backward_with_backoff)
    backward: Callable[[torch.Tensor], None] | None = None  # Trainee.backward; None: no gradients (an eval)


# -- the data stream ----------------------------------------------------------------------------------------------
def pair_stream(items: list, seed: int):
    """Endless stream of data items: each epoch a fresh seeded permutation. Each optimizer step takes its items
    from here, so a step's items do not depend on how they are split into micro-batches, and a resumed run skips
    exactly the items it consumed."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(items), generator=generator).tolist():
            yield items[i]


def next_items(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def item_tokens(item) -> int:
    """The token ids an item holds (all its lists: a pair's prompt, chosen and rejected; an SFT row's prompt and
    completion), by which a step's items are sorted longest first (data.by_length). The step's loss is the mean
    over the same items, whatever their order."""
    return sum(len(v) for v in vars(item).values() if isinstance(v, list))


def rows_of(items: list) -> int:
    """The rows of a stage's data items: a pair or SFT row is one, a KTO block (a list: training/kto.py) its rows."""
    return sum(len(item) if isinstance(item, list) else 1 for item in items)


def micro_batches(items: list, micro_batch: int) -> list[list]:
    """The micro-batches of one optimizer step, in order."""
    return [items[i:i + micro_batch] for i in range(0, len(items), micro_batch)]


# -- forward and backward -----------------------------------------------------------------------------------------
def accumulate(session, items: list, micro_batch: int, grad: bool = True) -> Sums:
    """This rank's share of a step's `items` (every rank's) by micro-batches of `micro_batch` items, through the
    objective (Objective.group: each micro-batch's forward, its loss backward'ed, scaled so that summed over the ranks
    the step's loss is its mean over all `items` whatever the split: the objective's size; its metrics summed);
    grad=False: the sums alone (the eval's, over the eval part's reference). No collective call: the caller sums."""
    run, lm = session.run, session.trainee.lm
    objective = run.objective
    first = grad and session.progress.step == 0 and session.progress.resumed_from is None
    within = Pass(objective.ref if grad else objective.eval_ref, objective.size(items, first), micro_batch,
                  session.trainee.backward if grad else None)
    sums = Sums.of(objective.metrics, objective.nll_weight)
    with torch.set_grad_enabled(grad):
        for group in objective.groups(items, run.world):  # one for pairs and rows; KTO's blocks
            sums.add(objective.group(lm, group, within))
        for _ in range(idle_forwards(run, items, micro_batch) if run.resolved.sharded else 0):  # fsdp: as every rank
            out = objective.loss(objective.forward(lm, [min(items, key=item_tokens)], within), within.size)
            if grad:
                session.trainee.backward(out.value * 0)  # its gradients are zeros; its collectives are the point
    return sums


def idle_forwards(run, items: list, micro_batch: int) -> int:
    """With the base sharded (fsdp), every forward gathers each layer from every rank: a rank with fewer
    micro-batches in a step than another runs this many idle ones (the step's shortest item, its loss times 0)
    so that the ranks' forwards and backwards pair up. Called only sharded; for pairs and rows (one group, every
    world-size-th item by length): KTO's blocks are never sharded (memory.cards.unshardable refuses them)."""
    ordered = data.by_length(items, item_tokens)
    counts = [len(micro_batches(distributed.shard(ordered, distributed.World(r, run.world.size)), micro_batch))
              for r in range(run.world.size)]
    return sharding.idle_forwards(counts[run.world.rank], counts)


def backward_with_backoff(session, items: list) -> tuple[Sums, int, int]:
    """accumulate at the progress's micro_batch. On out-of-memory (on any rank), halve the micro-batch (the
    accumulation doubles: the same items, the same update) and retry, down to 1 item. Returns the sums, and the
    micro-batch and accumulation that fit."""
    run, progress = session.run, session.progress
    rows, unit = rows_of(items), run.objective.unit
    mine, step = math.ceil(rows / run.world.size), progress.step + 1
    said = oom.Said(
        retrying=lambda n: f"out of memory at step {step}: retrying with per_device_train_batch_size={n} "
                           f"gradient_accumulation_steps={math.ceil(mine / n)} (the same {rows} {unit}s per step)",
        exhausted=f"out of memory at step {step} with 1 {unit} per micro-batch; lower max_length, or set "
                  "quantization=4bit / gradient_checkpointing=true (lowmem-dpo plan RECIPE.yaml shows what "
                  "fits)",
        collective=sharding.oom_message("per_device_train_batch_size or max_length", run.resolved.shard_offload)
        if run.resolved.sharded else None)
    return oom.halving_on_oom(
        lambda n: (accumulate(session, items, n), n, math.ceil(mine / n)), progress.micro_batch, run.resolved.device,
        said, cleanup=session.trainee.zero_grad,  # drop the partial step's gradients
        any_rank=distributed.any_rank if run.world.size > 1 else None)  # every rank retries when one ran out


# -- the update ---------------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """What one optimizer step measured."""

    stats: Sums  # its sums, every rank's
    grad_norm: float  # before clipping
    lr: float  # the learning rate it used
    seconds: float  # its wall time, the device synchronized before and after
    loss: float  # its mean loss (NaN when not finite)
    nonfinite: bool = False  # its update skipped for a non-finite loss or gradient (not a float16 scaler skip)


def optimizer_step(session) -> StepResult:
    """One optimizer step, top to bottom: its items; forward and backward by micro-batches (halved on out of
    memory); every rank's gradients and sums; unscaled (float16) and clipped to max_grad_norm; the update or a
    skip; the loss scale, the schedule, the gradients zeroed. A finite step's sums go into the progress's window."""
    run, trainee, progress = session.run, session.trainee, session.progress
    devices.synchronize(run.resolved.device)
    started = time.perf_counter()
    items = next_items(progress.stream, run.items_per_step)  # every rank's: the stream is the same on each
    lr = trainee.scheduler.get_last_lr()[0]  # the rate this update uses: the schedule advances at the step's end
    stats, progress.micro_batch, progress.grad_accum = backward_with_backoff(session, items)
    if run.world.size > 1:  # several ranks: the step's gradient, the same on every rank; its sums, which the
        distributed.sum_gradients(trainee.params)  # loss, the guards and the log read: every rank's
        stats = distributed.sum_stats(stats)
    loss = stats.means()[metrics.LOSS.name]
    loss = math.nan if loss is None else loss
    if trainee.scaler is not None:
        trainee.scaler.unscale_(trainee.optimizer)
    max_norm = run.cfg.max_grad_norm if run.cfg.max_grad_norm is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(trainee.params, max_norm).item()  # its norm before clipping
    progress.step += 1  # from here on the notes, the log and the checkpoint name this step
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    # In float16 an overflowing gradient with a finite loss is the loss scaler's business (the scale halves), not a
    # sign of divergence, unless the scale is already at 1 or below (the gradients overflow unscaled).
    scaler_skip = trainee.scaler is not None and math.isfinite(loss) and not finite and trainee.scaler.get_scale() > 1
    if scaler_skip:
        progress.scaler_skips += 1
        log(f"note: step {progress.step}: the float16 gradients overflowed at loss scale "
            f"{trainee.scaler.get_scale():g}; update skipped and the scale halved (scaler skip {progress.scaler_skips}; "
            "not divergence)")
    elif finite:
        progress.nonfinite_in_a_row = 0
        trainee.optimizer.step() if trainee.scaler is None else trainee.scaler.step(trainee.optimizer)  # AdamW
        if trainee.copies is not None:  # the LoRA weights' 16-bit compute copies follow them
            trainee.copies.refresh()
    else:
        nonfinite(session, loss, grad_norm)
    # Every step's end, updated or skipped: the loss scale (halved after an overflow, grown after 2000 clean
    # steps), the schedule (a skipped step's too: the rate is a function of the step number, as the log, a resume
    # and a changed run length read it), the gradients zeroed.
    if trainee.scaler is not None:
        trainee.scaler.update()
    trainee.scheduler.step()
    trainee.zero_grad()
    devices.synchronize(run.resolved.device)
    if math.isfinite(loss):
        progress.window.add(stats)
    return StepResult(stats, grad_norm, lr, time.perf_counter() - started, loss, not finite and not scaler_skip)


def nonfinite(session, loss: float, grad_norm: float) -> None:
    """A non-finite loss or gradient: no update, a warning, counted (max_nonfinite_steps in a row stop the run as
    diverged: the loop's decision, loop.train_step)."""
    progress = session.progress
    progress.skipped_steps += 1
    progress.nonfinite_in_a_row += 1
    log(f"warning: step {progress.step}: non-finite loss ({loss:.4g}) or gradient norm ({grad_norm:.4g}); update "
        f"skipped ({progress.nonfinite_in_a_row} in a row)")
