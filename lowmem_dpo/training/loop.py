"""The one training loop, for DPO (train.py) and SFT (sft.py).

It owns what the two share: the session state (step, the data stream, the micro-batch split, the metric window),
micro-batching with the out-of-memory back-off, the update with its non-finite guard, the metric lines, the
checkpoints and resuming from them, and the final save. A stage supplies only what differs, as an `Objective`:
what a data item is (in `Session.pairs`), and how a step's items become a loss, its gradients and its metrics.

    resume = resuming.find_resume(cfg)    # before anything heavy: a changed setting fails fast
    resuming.check_before_load(cfg, resume, ins, len(items))  # changed inputs or a shorter run fail fast too
    s = start(cfg, resolved, model, items, pad_id, objective, resume, ins)  # optimizer, schedule, checkpoint state
    run(s)                                # optimizer_step until s.steps; log, checkpoint, save

Under torchrun or `accelerate launch` (distributed.py) every rank runs this loop on the same data stream: a step
takes per_device_train_batch_size x gradient_accumulation_steps items per rank, each rank computes its share
(`share`), and the LoRA gradients and the metric sums are summed across ranks before the update, so every rank
takes the same update and the same decisions (non-finite skip, warning signs, out-of-memory halving). Rank 0
alone writes: metrics, checkpoints, samples, the final adapter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from lowmem_dpo import data
from lowmem_dpo.config.schema import Config
from lowmem_dpo.runtime import devices, distributed, oom
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, evaluation, guards, output, policy, resuming, trackers, update


class Stats(Protocol):
    """Sums over the micro-batches of one step, or over the steps of a log line's window (a dataclass: a
    checkpoint stores it with dataclasses.asdict)."""

    tokens: int  # tokens in the forward passes (for tokens_per_s)

    def add(self, other) -> None: ...
    def means(self) -> dict[str, float]: ...  # the metric line's values; "loss" is the step's mean loss

    @property
    def empty(self) -> bool: ...  # nothing added (every step since the last line was skipped)


class Objective(Protocol):
    """What a training stage plugs into the loop."""

    name: str  # the stage: the progress bar's label

    def new_stats(self) -> Stats: ...

    def backward(self, s: "Session", items: list) -> Stats:
        """Forward + backward of this rank's share (share()) of one optimizer step's items, in micro-batches of
        s.micro_batch (split()); the gradients accumulate in s.params, scaled so that summed over the ranks the
        step's loss is its mean over all `items` whatever the split. No collective call: the loop sums."""

    def eval_stats(self, s: "Session", items: list, micro_batch: int) -> Stats:
        """The eval sums over this rank's share of `items`, with no gradients, by micro-batches of `micro_batch`."""

    def eval_metrics(self, stats: Stats) -> dict[str, float]:
        """The eval metrics ("eval_" names) of eval sums (all ranks' summed)."""

    def warning_signs(self, s: "Session") -> list[str]:
        """Signs the run is going wrong, from s.window at the logged step s.step (guards.py); [] for none."""

    def postfix(self, line: dict) -> dict[str, str]:
        """The progress bar's numbers from a metrics line."""

    def intro(self, s: "Session") -> list[str]:
        """The log lines that open the run: what is trained, on what."""

    def summary(self, line: dict) -> str:
        """The last metrics line as the closing log line shows it (': loss ...'), or '' when it has none."""


# -- the data stream ---------------------------------------------------------------------------------------------
def pair_stream(items: list, seed: int):
    """Endless stream of data items: each epoch a fresh seeded permutation. Each optimizer step takes its items
    from here, so a step's items do not depend on how they are split into micro-batches, and a resumed run skips
    exactly the items it consumed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(items), generator=g).tolist():
            yield items[i]


def take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def item_tokens(item) -> int:
    """The token ids an item holds (all its lists: a pair's prompt, chosen and rejected; an SFT row's prompt and
    completion), by which a step's items are sorted longest first (data.by_length). The step's loss is the mean
    over the same items, whatever their order."""
    return sum(len(v) for v in vars(item).values() if isinstance(v, list))


def split(items: list, micro_batch: int) -> list[list]:
    """The micro-batches of one optimizer step, in order."""
    return [items[i:i + micro_batch] for i in range(0, len(items), micro_batch)]


def share(s: "Session", items: list) -> list:
    """This rank's items of a step (all of them in a single process), longest first: every world-size-th item of
    the step sorted by length, so each rank gets items of every length (distributed.shard)."""
    return distributed.shard(data.by_length(items, item_tokens), s.world)


# -- the session -------------------------------------------------------------------------------------------------
# The best so far (evaluation.note_best), in transformers' TrainerState keys; its folder, best_model_checkpoint, is
# derived from the step where output_dir is now (best_folder).
BEST_KEYS = ("best_metric", "best_global_step")

@dataclass
class Session:
    """Everything one training run holds: built by a stage's setup, advanced by `optimizer_step`."""

    cfg: Config
    resolved: devices.Resolved
    model: object  # PeftModel
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list  # the trainable LoRA parameters
    pairs: list  # the data items: preference pairs (train) or SFT rows (sft)
    pad_id: int
    steps: int  # optimizer steps this run takes in all (a resumed run included)
    objective: Objective
    stream: object = None  # pair_stream() generator, positioned after the items already trained on
    micro_batch: int = 0  # items per forward; the out-of-memory back-off halves it
    grad_accum: int = 0  # micro-batches per optimizer step; doubled with each halving
    step: int = 0  # optimizer steps finished
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient, in all
    nonfinite_in_a_row: int = 0
    window: Stats = None  # stats since the last logged line
    metrics_lines: list[str] = field(default_factory=list)  # metrics.jsonl so far
    inputs: dict = field(default_factory=dict)  # what the run trains on (inputs.run_inputs), in each checkpoint
    resumed_from: Path | None = None
    replaces: list[Path] = field(default_factory=list)  # an earlier run's checkpoints, removed at the first save
    eval_items: list = field(default_factory=list)  # held-out items evaluated every eval_steps ([]: no eval)
    tokenizer: object = None  # decodes the samples
    prompts: dict = field(default_factory=dict)  # eval item's row -> its prompt as the samples show it
    best: dict = field(default_factory=lambda: dict.fromkeys(BEST_KEYS))  # evaluation.note_best
    trackers: object = None  # report_to's: trackers.open_trackers's
    world: distributed.World = field(default_factory=distributed.world)  # this process among the launched ones
    scaler: object = None  # float16: torch.amp.GradScaler (devices.grad_scaler); None otherwise
    scaler_skips: int = 0  # updates the scaler skipped (scaled gradients overflowed), in all
    # The model with its adapter disabled is the run's start, its reference (the samples' KL is measured): not
    # when train continues an SFT adapter (its start is base + that adapter), nor in SFT (which means to move)
    adapter_off_is_start: bool = True

    def __post_init__(self):  # a new run: the data from its start, the planner's split, an empty window
        if self.stream is None:
            self.stream = pair_stream(self.pairs, self.cfg.seed)
        self.micro_batch = self.micro_batch or self.resolved.micro_batch or self.cfg.per_device_train_batch_size
        per_rank = self.cfg.per_device_train_batch_size * self.cfg.gradient_accumulation_steps
        self.grad_accum = self.grad_accum or math.ceil(per_rank / self.micro_batch)
        if self.window is None:
            self.window = self.objective.new_stats()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), the loss scaled first in float16 (the scaler's scale; update.apply_gradients unscales)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    @property
    def pairs_per_step(self) -> int:  # data items, all ranks': pairs, SFT rows, or KTO's blocks (one a micro-batch)
        rows = policy.items_per_step(self.cfg, self.world.size)
        return rows // self.cfg.per_device_train_batch_size if getattr(self.objective, "blocks", False) else rows


# -- resume ------------------------------------------------------------------------------------------------------
def resume_or_start(s: Session, resume_from: Path | None, saved: checkpoint.TrainerState | None) -> Session:
    """Put a freshly set-up session where checkpoint `resume_from` left off (weights, optimizer, schedule, RNG,
    data position, batch split, the metrics so far); or, starting over, note the old checkpoints it replaces."""
    if saved is None:
        s.replaces = [p for _, p in checkpoint.complete(s.cfg.output_dir)]
        return s
    checkpoint.restore(resume_from, s.model, s.opt, s.sched, s.scaler, rank=s.world.rank)
    resuming.follow_run_length(s, resume_from, saved)
    take(s.stream, saved.pairs_seen)  # the data order is a function of the seed: replay it
    s.step, s.skipped_steps, s.scaler_skips = saved.step, saved.skipped_steps, saved.scaler_skips
    s.micro_batch, s.grad_accum = saved.micro_batch, saved.grad_accum
    s.window = resuming.restored_window(s.window, saved.window)
    s.metrics_lines = checkpoint.metrics_lines(resume_from)
    s.best = {k: getattr(saved, k) for k in BEST_KEYS}
    s.resumed_from = resume_from
    return s


def start(cfg: Config, resolved: devices.Resolved, model, items: list, pad_id: int, objective: Objective,
          resume: tuple[Path | None, checkpoint.TrainerState | None], inputs: dict | None = None,
          eval_items: list = (), tokenizer=None, prompts: dict | None = None) -> Session:
    """The session of a stage's set-up model: its optimizer and schedule over the run's steps, at checkpoint
    `resume` (find_resume's pair, its inputs already checked against `inputs`) or at the start. `eval_items` are
    evaluated (Objective.evaluate) every eval_steps, their prompts answered with `tokenizer`'s decoding and shown
    as `prompts` has them (inputs.Data.prompts)."""
    steps = policy.total_steps(cfg, policy.rows_of(items), distributed.world().size)
    opt, sched, params = policy.setup_optimizer(cfg, model, steps, resolved)
    s = Session(cfg, resolved, model, opt, sched, params, items, pad_id, steps, objective, inputs=inputs or {},
                eval_items=list(eval_items), tokenizer=tokenizer, prompts=prompts or {},
                scaler=devices.grad_scaler(resolved.device, resolved.dtype))
    return resume_or_start(s, *resume)


def checkpoint_state(s: Session) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(step=s.step, pairs_seen=s.step * s.pairs_per_step, micro_batch=s.micro_batch,
                                   grad_accum=s.grad_accum, skipped_steps=s.skipped_steps, scaler_skips=s.scaler_skips,
                                   window=dataclasses.asdict(s.window), config=dataclasses.asdict(s.cfg),
                                   inputs=s.inputs, **s.best, best_model_checkpoint=best_folder(s),
                                   world_size=s.world.size)


def best_folder(s: Session) -> str | None:
    """The best checkpoint's folder, by its step under output_dir (so a moved or renamed run still names it)."""
    step = s.best["best_global_step"]
    return None if step is None else str(checkpoint.folder(s.cfg.output_dir, step))


# -- one optimizer step ------------------------------------------------------------------------------------------
def backward_with_backoff(s: Session, items: list):
    """The objective's forward+backward of this rank's share of one optimizer step's items, split into
    micro-batches of s.micro_batch. On out-of-memory (on any rank), halve the micro-batch (the accumulation
    doubles: the same items, the same update) and retry, down to 1 item."""
    mine = math.ceil(policy.rows_of(items) / s.world.size)  # this rank's rows, at most

    def attempt(micro_batch: int):
        s.micro_batch, s.grad_accum = micro_batch, math.ceil(mine / micro_batch)
        return s.objective.backward(s, items)

    return oom.halving_on_oom(
        attempt, s.micro_batch, s.resolved.device,
        lambda n: f"out of memory at step {s.step + 1}: retrying with per_device_train_batch_size={n} "
                  f"gradient_accumulation_steps={math.ceil(mine / n)} (the same {len(items)} pairs per step)",
        f"out of memory at step {s.step + 1} with 1 pair per micro-batch; lower max_length, or set "
        "quantization=4bit / gradient_checkpointing=true (python -m lowmem_dpo.plan RECIPE.yaml shows what fits)",
        cleanup=lambda: s.opt.zero_grad(set_to_none=True),  # drop the partial step's gradients
        any_rank=distributed.any_rank)


def optimizer_step(s: Session) -> tuple[Stats, float, float]:
    """One optimizer step over the next pairs_per_step items: forward+backward by micro-batches, clip, AdamW,
    schedule. A non-finite loss or gradient skips the update (the schedule still advances);
    max_nonfinite_steps in a row stop the run. Returns (stats, grad_norm before clipping, learning rate)."""
    items = take(s.stream, s.pairs_per_step)  # every rank's: the stream is the same on each
    lr = s.sched.get_last_lr()[0]
    stats = backward_with_backoff(s, items)
    distributed.sum_gradients(s.params)  # the step's gradient, the same on every rank
    stats = distributed.sum_stats(stats)  # the step's sums: the loss, the guards and the log see all ranks
    return stats, update.apply_gradients(s, stats.means()["loss"]), lr


def timed(s: Session) -> tuple:
    """optimizer_step's (stats, grad_norm, lr) and its wall seconds, the device synchronized before and after."""
    devices.synchronize(s.resolved.device)
    t0 = time.perf_counter()
    stats, grad_norm, lr = optimizer_step(s)
    devices.synchronize(s.resolved.device)
    return stats, grad_norm, lr, time.perf_counter() - t0


# -- output (output.py writes the files) -------------------------------------------------------------------------
def save_checkpoint(s: Session, out_dir: Path, evaluated: dict | None) -> None:
    """checkpoint-STEP, the best so far updated first when this step was evaluated (the best is never pruned),
    and output_dir/trainer_state.json; with every rank's random state (each rank calls this: rank 0 writes)."""
    rng_states = distributed.gather(checkpoint.rng_state())
    if not s.world.main:
        return
    evaluation.note_best(s, evaluated)
    state = checkpoint_state(s)
    checkpoint.save(out_dir, state, s.model, s.opt, s.sched, s.metrics_lines, s.cfg.save_total_limit, s.replaces,
                    s.scaler, rng_states)
    s.replaces = []
    checkpoint.write_run_state(out_dir, state, s.steps, s.cfg.best_metric_name, s.cfg.best_is_greater,
                               s.metrics_lines)


# -- the loop ----------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    metrics: dict  # the last logged line of metrics.jsonl
    model: object  # the PEFT model as trained (in memory)


def warn(s: Session, signs: list[str], metrics_file) -> None:
    """Log the warning signs of this step, and write them to metrics.jsonl ({"step", "warnings"}: the report lists
    them); with early_stop_on_divergence, stop on the first (exit 2)."""
    for sign in signs:
        log(f"warning: step {s.step}: {sign}")
    if signs:
        output.write_line(s, metrics_file, {"step": s.step, "warnings": signs})
    if signs and s.cfg.early_stop_on_divergence:
        raise UserError(f"stopped at step {s.step} (early_stop_on_divergence=true): {signs[0]}; "
                        + output.last_checkpoint_note(s))


def log_step(s: Session, metrics_file, stats: Stats, grad_norm: float, lr: float, dt: float, bar) -> dict:
    """Write the metrics line of the step just taken, start a new window, and warn (or stop, with
    early_stop_on_divergence) on the objective's warning signs."""
    line = output.write_line(s, metrics_file, output.log_line(s, stats, grad_norm, lr, dt))
    signs = []
    if not s.window.empty:  # else every step since the last line was skipped (already warned)
        output.show(bar, s.objective.postfix(line))
        signs = s.objective.warning_signs(s)
    s.window = s.objective.new_stats()
    warn(s, signs, metrics_file)
    return line


def eval_step(s: Session, metrics_file, bar) -> dict:
    """Evaluate at this step (evaluation.evaluate): the eval line, the bar's eval numbers, the collapse sign (rank
    0's samples: its line and sign go to every rank, which then decide alike)."""
    line = evaluation.evaluate(s)
    line, sign = distributed.broadcast((line, evaluation.collapse_sign(s, line) if s.world.main else None))
    output.write_line(s, metrics_file, line)
    output.show(bar, evaluation.postfix(line))
    warn(s, [sign] if sign else [], metrics_file)
    return line


def run(s: Session, progress: bool = True) -> TrainResult:
    """Optimizer steps until s.steps: a metrics line at step 1, every logging_steps and the last step; a
    checkpoint every save_steps and at the last step; then the adapter into output_dir."""
    from tqdm.auto import tqdm

    cfg, main = s.cfg, s.world.main  # rank 0 writes the files; the others only compute (distributed.py)
    out_dir = output.start_output(s) if main else Path(cfg.output_dir)
    for line in s.objective.intro(s):
        log(line)
    if cfg.memory_snapshot_on_oom:
        log(oom.record_snapshots(s.resolved.device, out_dir))
    devices.memory_window(s.resolved.device)  # the first line's window starts here
    train_lines = [line for line in map(json.loads, s.metrics_lines) if "loss" in line]  # not eval lines
    last = train_lines[-1] if train_lines else {}
    bar = tqdm(total=s.steps, initial=s.step, desc=s.objective.name, unit="step", disable=not progress or not main,
               dynamic_ncols=True)
    bar.postfix_dict = {}  # the numbers shown: the last train line's and the last eval's
    # A resumed run's events after its checkpoint, or an earlier run's, are purged: the events follow metrics.jsonl.
    if main:
        s.trackers = trackers.open_trackers(cfg.report_to, out_dir, cfg.run_name, output.tracker_config(s),
                                            s.step + 1 if s.step else 0, s.resumed_from is not None)
    try:
        last = steps(s, out_dir, bar, last)
    except KeyboardInterrupt:  # Ctrl-C: where the rerun continues
        then = ("starts the run again" if not checkpoint.complete(cfg.output_dir) else "continues from it"
                if cfg.resume == "auto" else "with resume=auto continues from it")
        raise KeyboardInterrupt(f"{output.last_checkpoint_note(s)}; the same command {then}") from None
    finally:
        bar.close()  # before any message that ends the run, which then stands on its own line
        if s.trackers is not None:  # a run that stops early closes its tracker runs too
            s.trackers.close()
    if s.skipped_steps:
        log(f"note: {s.skipped_steps} updates were skipped for a non-finite loss or gradient")
    if main:
        finish(s, out_dir, last)
    distributed.barrier()  # the other ranks end when the adapter is saved
    return TrainResult(last, s.model)


def steps(s: Session, out_dir: Path, bar, last: dict) -> dict:
    """The loop itself: optimizer steps until s.steps, with their lines, evals and checkpoints; returns the last
    train line."""
    cfg, main = s.cfg, s.world.main
    with output.open_metrics(s, out_dir) if main else open(os.devnull, "w") as metrics_file:
        first = distributed.broadcast(evaluation.at_start(s) if main else None)  # step 0: the reference's samples
        if first is not None:
            output.write_line(s, metrics_file, first)
        if evaluation.on_start(s):  # every rank: the eval is split across them
            eval_step(s, metrics_file, bar)
        while s.step < s.steps:
            stats, grad_norm, lr, dt = timed(s)
            if not guards.nonfinite(stats.means()["loss"]):
                s.window.add(stats)
            bar.update(1)
            if s.step == 1 or s.step % cfg.logging_steps == 0 or s.step == s.steps:
                last = log_step(s, metrics_file, stats, grad_norm, lr, dt, bar)
            evaluated = eval_step(s, metrics_file, bar) if evaluation.due(cfg, s.step, s.steps) else None
            if cfg.save_steps and (s.step % cfg.save_steps == 0 or s.step == s.steps):
                save_checkpoint(s, out_dir, evaluated)
    return last


def finish(s: Session, out_dir: Path, last: dict) -> None:
    """Rank 0 at the end: the best adapter loaded (load_best_model_at_end), saved into output_dir with the run's
    state."""
    cfg = s.cfg
    if cfg.load_best_model_at_end:
        evaluation.load_best(s)
    output.save_final(s, out_dir)
    checkpoint.write_run_state(out_dir, checkpoint_state(s), s.steps, cfg.best_metric_name, cfg.best_is_greater,
                               s.metrics_lines)
    log(f"saved adapter to {out_dir} (step {s.steps}{s.objective.summary(last)})")
