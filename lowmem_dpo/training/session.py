"""A training run's state, in three typed parts by what changes when:

    RunSetup  what the run is, fixed from its setup to its end: the config, the device, the objective, the data
    Trainee   the model and its optimizer, schedule and (float16) loss scaler: what a step updates (step.py)
    Progress  the step counters, the data stream's position, the micro-batch split and the metric window: what
              a checkpoint saves (checkpoint.TrainerState) and a resume restores as one thing

A stage describes its run and `start`s it (train.py, sft.py); loop.py runs the steps.

    run = RunSetup(cfg, resolved, objective, items, pad_id, inputs=trains_on, eval_items=dataset.eval)
    session = start(run, model, resume)  # the trainee over run.steps; the progress at the start or the checkpoint
    session.run.cfg, session.trainee.optimizer, session.progress.step
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from lowmem_dpo.config.schema import Config
from lowmem_dpo.runtime import devices, distributed
from lowmem_dpo.training import checkpoint, policy, resuming
from lowmem_dpo.training.objective import Objective
from lowmem_dpo.training.step import Sums, Trainee, next_items, pair_stream, rows_of
from lowmem_dpo.training.trackers import Trackers

# -- the three parts ---------------------------------------------------------------------------------------------
# The best so far (evaluation.best_after), in transformers' TrainerState keys; its folder, best_model_checkpoint, is
# derived from the step where output_dir is now (best_folder).
BEST_KEYS = ("best_metric", "best_global_step")


@dataclass(frozen=True)
class RunSetup:
    """What the run is: fixed from the stage's setup (train.setup, sft.setup) to the run's end."""

    cfg: Config
    resolved: devices.Resolved
    objective: Objective
    items: list  # the data items: preference pairs (train), SFT rows (sft), or KTO's blocks of rows
    pad_id: int
    inputs: dict = field(default_factory=dict)  # what the run trains on (inputs.run_inputs), in each checkpoint
    eval_items: list = field(default_factory=list)  # held-out items evaluated every eval_steps ([]: no eval)
    tokenizer: object = None  # decodes the samples
    prompts: dict = field(default_factory=dict)  # eval item's row -> its prompt as the samples show it
    world: distributed.World = field(default_factory=distributed.world)  # this process among the launched ones
    # The model with its adapter disabled is the run's start, its reference (the samples' KL is measured): not
    # when train continues an SFT adapter (its start is base + that adapter), nor in SFT (which means to move)
    adapter_off_is_start: bool = True
    row_formats: list[str] | None = None  # the training rows' formats (data.TokenizedData.formats), for chat

    @functools.cached_property
    def steps(self) -> int:
        """Optimizer steps this run takes in all, a resumed run included (max_steps, or its epochs)."""
        return policy.total_steps(self.cfg, rows_of(self.items), self.world.size)

    @functools.cached_property
    def items_per_step(self) -> int:  # data items, all ranks': pairs, SFT rows, or KTO's blocks (one a micro-batch)
        rows = policy.items_per_step(self.cfg, self.world.size)
        return rows // self.cfg.per_device_train_batch_size if self.objective.blocks else rows


@dataclass
class Progress:
    """Where the run is: what each step changes, a checkpoint saves and a resume restores (all but
    resumed_from and replaces, which say where this process started)."""

    stream: object  # pair_stream() generator, positioned after the items already trained on
    micro_batch: int  # items per forward; the out-of-memory back-off halves it
    grad_accum: int  # micro-batches per optimizer step; doubled with each halving
    window: Sums  # sums since the last logged line
    step: int = 0  # optimizer steps finished
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient, in all
    nonfinite_in_a_row: int = 0  # skips for a non-finite loss or gradient since the last update
    scaler_skips: int = 0  # updates the float16 scaler skipped (scaled gradients overflowed), in all
    metrics_lines: list[str] = field(default_factory=list)  # metrics.jsonl so far
    best: dict = field(default_factory=lambda: dict.fromkeys(BEST_KEYS))  # evaluation.best_after
    resumed_from: Path | None = None
    replaces: list[Path] = field(default_factory=list)  # an earlier run's checkpoints, removed at the first save


@dataclass
class Session:
    """One training run: its three parts, and the trackers it reports to (report_to; open while it runs)."""

    run: RunSetup
    trainee: Trainee
    progress: Progress
    trackers: Trackers | None = None  # trackers.open_trackers's: None until run() opens them, or none asked
    opening: list[str] = field(default_factory=list)  # the log lines that open the run: what is trained, on what


# -- start or resume ---------------------------------------------------------------------------------------------
def start(run: RunSetup, model, resume: tuple[Path | None, checkpoint.TrainerState | None]) -> Session:
    """The session of `run` on a stage's set-up model: its optimizer and schedule over the run's steps, at
    checkpoint `resume` (resuming.find_resume's pair, its inputs already checked against run.inputs) or at the
    start."""
    cfg = run.cfg
    trainee = policy.trainee(cfg, model, run.steps, run.resolved)
    micro_batch = run.resolved.micro_batch or cfg.per_device_train_batch_size  # the planner's split, or the recipe's
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    progress = Progress(pair_stream(run.items, cfg.seed), micro_batch, math.ceil(per_rank / micro_batch),
                        run.objective.new_sums())
    resume_from, saved = resume
    if saved is None:  # a new run: the data from its start; an earlier run's checkpoints go at the first save
        progress.replaces = [p for _, p in checkpoint.complete(cfg.output_dir)]
    else:  # the trainee, then the progress, as the checkpoint left them
        checkpoint.restore(resume_from, trainee, rank=run.world.rank)
        resuming.follow_run_length(cfg, rows_of(run.items), run.steps, trainee, saved)
        progress = restored_progress(progress, resume_from, saved)
    return Session(run, trainee, progress)


def restored_progress(fresh: Progress, resume_from: Path, saved: checkpoint.TrainerState) -> Progress:
    """Where checkpoint `resume_from` left off: the data stream replayed to its position (a function of the seed),
    its counters, batch split, metric window, the metrics so far and the best."""
    next_items(fresh.stream, saved.pairs_seen)
    return dataclasses.replace(
        fresh, step=saved.step, skipped_steps=saved.skipped_steps, scaler_skips=saved.scaler_skips,
        nonfinite_in_a_row=saved.nonfinite_in_a_row,
        micro_batch=saved.micro_batch, grad_accum=saved.grad_accum,
        window=resuming.restored_window(fresh.window, saved.window),
        metrics_lines=checkpoint.metrics_lines(resume_from), best={k: getattr(saved, k) for k in BEST_KEYS},
        resumed_from=resume_from)


def checkpoint_state(session: Session) -> checkpoint.TrainerState:
    run, progress = session.run, session.progress
    return checkpoint.TrainerState(step=progress.step, pairs_seen=progress.step * run.items_per_step,
                                   micro_batch=progress.micro_batch, grad_accum=progress.grad_accum,
                                   skipped_steps=progress.skipped_steps, scaler_skips=progress.scaler_skips,
                                   nonfinite_in_a_row=progress.nonfinite_in_a_row,
                                   window=dataclasses.asdict(progress.window), config=dataclasses.asdict(run.cfg),
                                   inputs=run.inputs, **progress.best, best_model_checkpoint=best_folder(session),
                                   world_size=run.world.size, row_formats=run.row_formats)


def best_folder(session: Session) -> str | None:
    """The best checkpoint's folder, by its step under output_dir (so a moved or renamed run still names it)."""
    step = session.progress.best["best_global_step"]
    return None if step is None else str(checkpoint.folder(session.run.cfg.output_dir, step))
