"""The one training loop, for DPO (train.py), SFT (sft.py) and KTO (training/kto.py).

A stage builds its session (session.start: the run's setup, the trainee, the progress) and supplies only what
differs, as an `Objective`: what a data item is, and how a step's items become a loss, its gradients and its
metrics. This module runs it: `optimizer_step` is one step, top to bottom; `run` the steps, then the final save.

    resume = resuming.find_resume(cfg)    # before anything heavy: a changed setting fails fast
    resuming.check_before_load(cfg, resume, trains_on, len(items))  # changed inputs or a shorter run fail fast too
    session = start(RunSetup(cfg, resolved, objective, items, pad_id, inputs=trains_on), model, resume)  # session.py
    run(session)                          # optimizer_step until the run's steps; log, checkpoint, save

Under torchrun or `accelerate launch` (distributed.py) every rank runs this loop on the same data stream: a step
takes per_device_train_batch_size x gradient_accumulation_steps items per rank, each rank computes its share
(`rank_share`), and the LoRA gradients and the metric sums are summed across ranks before the update, so every rank
takes the same update and the same decisions (non-finite skip, warning signs, out-of-memory halving). Rank 0
alone writes: metrics, checkpoints, samples, the final adapter.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import data
from lowmem_dpo.config.schema import Config
from lowmem_dpo.runtime import devices, distributed, oom
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, evaluation, guards, output, policy, trackers, update
from lowmem_dpo.training.session import Session, Stats, checkpoint_state, next_items


# -- a step's items ----------------------------------------------------------------------------------------------
def item_tokens(item) -> int:
    """The token ids an item holds (all its lists: a pair's prompt, chosen and rejected; an SFT row's prompt and
    completion), by which a step's items are sorted longest first (data.by_length). The step's loss is the mean
    over the same items, whatever their order."""
    return sum(len(v) for v in vars(item).values() if isinstance(v, list))


def micro_batches(items: list, micro_batch: int) -> list[list]:
    """The micro-batches of one optimizer step, in order."""
    return [items[i:i + micro_batch] for i in range(0, len(items), micro_batch)]


def rank_share(session: Session, items: list) -> list:
    """This rank's items of a step (all of them in a single process), longest first: every world-size-th item of
    the step sorted by length, so each rank gets items of every length (distributed.shard)."""
    return distributed.shard(data.by_length(items, item_tokens), session.run.world)


# -- one optimizer step ------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """What one optimizer step measured."""

    stats: Stats  # its sums, every rank's
    grad_norm: float  # before clipping
    lr: float  # the learning rate it used
    seconds: float  # its wall time, the device synchronized before and after


@dataclass
class StepOutputs:
    """Where a step's metrics line, eval and checkpoint go (rank 0 writes; the others' metrics go to os.devnull)."""

    metrics: object  # metrics.jsonl, open
    folder: Path  # output_dir
    bar: object  # the progress bar
    last: dict  # the last train line written


def optimizer_step(session: Session, out: StepOutputs | None = None) -> StepResult:
    """One optimizer step, top to bottom: its items; forward and backward by micro-batches (halved on out of
    memory); every rank's gradients and sums; clip; the update or a skip; the schedule; then into `out` its
    metrics line, an eval and a checkpoint when due (None: a measurement, the update alone)."""
    run, trainee, progress = session.run, session.trainee, session.progress
    devices.synchronize(run.resolved.device)
    started = time.perf_counter()
    items = next_items(progress.stream, run.items_per_step)  # every rank's: the stream is the same on each
    lr = trainee.scheduler.get_last_lr()[0]  # the rate this update uses: the schedule advances at the step's end
    stats, progress.micro_batch, progress.grad_accum = backward_with_backoff(session, items)
    distributed.sum_gradients(trainee.params)  # the step's gradient, the same on every rank
    stats = distributed.sum_stats(stats)  # the step's sums: the loss, the guards and the log see all ranks
    loss = stats.means()["loss"]
    grad_norm = update.unscale_and_clip(trainee, run.cfg.max_grad_norm)
    progress.step += 1  # from here on the notes, the log and the checkpoint name this step
    outcome = update.outcome(loss, grad_norm, trainee.scaler)
    if outcome is update.Outcome.APPLY:
        progress.nonfinite_in_a_row = 0
        update.optimizer_update(trainee)
    elif outcome is update.Outcome.SCALER_SKIP:  # neither an update nor non-finite: the run of those stands
        progress.scaler_skips += 1
        log(update.scaler_skip_note(progress.step, trainee.scaler.get_scale(), progress.scaler_skips))
    else:
        progress.skipped_steps += 1
        progress.nonfinite_in_a_row += 1
        log(update.nonfinite_note(progress.step, loss, grad_norm, progress.nonfinite_in_a_row))
        if progress.nonfinite_in_a_row >= run.cfg.max_nonfinite_steps:
            raise update.diverged(progress.step, progress.nonfinite_in_a_row,
                                  checkpoint.intact_note(run.cfg.output_dir))
    update.finish_update(trainee)  # the loss scale, the schedule (a skipped step's too), the gradients zeroed
    devices.synchronize(run.resolved.device)
    result = StepResult(stats, grad_norm, lr, time.perf_counter() - started)
    if not guards.nonfinite(loss):
        progress.window.add(stats)
    if out is None:
        return result
    out.bar.update(1)
    if logging_due(run.cfg, progress.step, run.steps):
        out.last = log_step(session, out.metrics, result, out.bar)
        progress.window = run.objective.new_stats()  # the next line's window
    evaluated = eval_step(session, out.metrics, out.bar) if evaluation.due(run.cfg, progress.step, run.steps) else None
    if saving_due(run.cfg, progress.step, run.steps):  # the best first: a checkpoint records it, never prunes it
        progress.best = evaluation.best_after(progress.best, progress.step, run.cfg, evaluated)
        save_checkpoint(session, out.folder)
    return result


def logging_due(cfg: Config, step: int, steps: int) -> bool:
    """A metrics line at step 1, every logging_steps and at the last step."""
    return step == 1 or step % cfg.logging_steps == 0 or step == steps


def saving_due(cfg: Config, step: int, steps: int) -> bool:
    """A checkpoint every save_steps and at the last step (save_steps=0: none)."""
    return bool(cfg.save_steps) and (step % cfg.save_steps == 0 or step == steps)


def backward_with_backoff(session: Session, items: list) -> tuple[Stats, int, int]:
    """The objective's forward+backward of this rank's share of one optimizer step's items, in micro-batches of
    the progress's micro_batch. On out-of-memory (on any rank), halve the micro-batch (the accumulation doubles:
    the same items, the same update) and retry, down to 1 item. Returns the stats, and the micro-batch and
    accumulation that fit."""
    rows, objective = policy.rows_of(items), session.run.objective
    mine = math.ceil(rows / session.run.world.size)  # this rank's rows, at most
    step = session.progress.step + 1

    def attempt(micro_batch: int):
        return objective.accumulate_gradients(session, items, micro_batch), micro_batch, math.ceil(mine / micro_batch)

    return oom.halving_on_oom(
        attempt, session.progress.micro_batch, session.run.resolved.device,
        retrying=lambda n: f"out of memory at step {step}: retrying with per_device_train_batch_size={n} "
                           f"gradient_accumulation_steps={math.ceil(mine / n)} (the same {rows} {objective.unit}s per "
                           "step)",
        exhausted=f"out of memory at step {step} with 1 {objective.unit} per micro-batch; lower max_length, or set "
                  "quantization=4bit / gradient_checkpointing=true (python -m lowmem_dpo.plan RECIPE.yaml shows what "
                  "fits)",
        cleanup=session.trainee.zero_grad,  # drop the partial step's gradients
        any_rank=distributed.any_rank)


# -- output (output.py writes the files) -------------------------------------------------------------------------
def save_checkpoint(session: Session, out_dir: Path) -> None:
    """checkpoint-STEP and output_dir/trainer_state.json; with every rank's random state (each rank calls this:
    rank 0 writes)."""
    rng_states = distributed.gather(checkpoint.rng_state())
    if not session.run.world.main:
        return
    state = checkpoint_state(session)
    cfg, progress = session.run.cfg, session.progress
    checkpoint.save(out_dir, state, session.trainee, progress.metrics_lines, cfg.save_total_limit, progress.replaces,
                    rng_states)
    progress.replaces = []
    checkpoint.write_run_state(out_dir, state, session.run.steps, cfg.best_metric_name, cfg.best_is_greater,
                               progress.metrics_lines)


# -- the loop ----------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    metrics: dict  # the last logged line of metrics.jsonl
    model: object  # the PEFT model as trained (in memory)


def warn_or_stop(session: Session, signs: list[str], metrics_file) -> None:
    """Log the warning signs of this step, and write them to metrics.jsonl ({"step", "warnings"}: the report lists
    them); with early_stop_on_divergence, stop on the first (exit 2)."""
    for sign in signs:
        log(f"warning: step {session.progress.step}: {sign}")
    if signs:
        output.write_line(session, metrics_file, {"step": session.progress.step, "warnings": signs})
    if signs and session.run.cfg.early_stop_on_divergence:
        raise UserError(f"stopped at step {session.progress.step} (early_stop_on_divergence=true): {signs[0]}; "
                        + checkpoint.intact_note(session.run.cfg.output_dir))


def log_step(session: Session, metrics_file, result: StepResult, bar) -> dict:
    """Write the metrics line of the step just taken (its window's means), and warn (or stop, with
    early_stop_on_divergence) on the objective's warning signs in that window."""
    line = output.write_line(session, metrics_file, output.log_line(session, result.stats, result.grad_norm, result.lr,
                                                              result.seconds))
    signs = []
    if not session.progress.window.empty:  # else every step since the last line had a non-finite loss (warned)
        output.show(bar, session.run.objective.bar_numbers(line))
        signs = session.run.objective.warning_signs(session, session.progress.window)
    warn_or_stop(session, signs, metrics_file)
    return line


def eval_step(session: Session, metrics_file, bar) -> dict:
    """Evaluate at this step (evaluation.evaluate): the eval line, the bar's eval numbers, the objective's signs on
    the held-out sums (every rank's), the collapse sign (rank 0's samples: its line and sign go to every rank, which
    then decide alike)."""
    line, signs = evaluation.evaluate(session)
    sign = evaluation.collapse_sign(session.progress.metrics_lines, line) if session.run.world.main else None
    line, sign = distributed.broadcast((line, sign))
    if line["step"] > 0:  # step 0's answers are the baseline the later lines show beside their own
        log(evaluation.log_line(session.progress.metrics_lines, line))
    output.write_line(session, metrics_file, line)
    output.show(bar, evaluation.bar_numbers(line))
    warn_or_stop(session, ([sign] if sign else []) + signs, metrics_file)  # what the answers show first
    return line


def run(session: Session, progress: bool = True) -> TrainResult:
    """Optimizer steps until session.run.steps: a metrics line at step 1, every logging_steps and the last step; a
    checkpoint every save_steps and at the last step; then the adapter into output_dir."""
    from tqdm.auto import tqdm

    cfg, main = session.run.cfg, session.run.world.main  # rank 0 writes the files; the others only compute
    out_dir = output.start_output(session.run) if main else Path(cfg.output_dir)
    for line in session.run.objective.opening_lines(session):
        log(line)
    if cfg.memory_snapshot_on_oom:
        log(oom.record_snapshots(session.run.resolved.device, out_dir))
    devices.memory_window(session.run.resolved.device)  # the first line's window starts here
    train_lines = [line for line in map(json.loads, session.progress.metrics_lines) if "loss" in line]  # not eval lines
    last = train_lines[-1] if train_lines else {}
    bar = tqdm(total=session.run.steps, initial=session.progress.step, desc=session.run.objective.name, unit="step",
               disable=not progress or not main, dynamic_ncols=True)
    bar.postfix_dict = {}  # the numbers shown: the last train line's and the last eval's
    # A resumed run's events after its checkpoint, or an earlier run's, are purged: the events follow metrics.jsonl.
    if main:
        session.trackers = trackers.open_trackers(cfg.report_to, out_dir, cfg.run_name, output.tracker_config(session),
                                            session.progress.step + 1 if session.progress.step else 0,
                                            session.progress.resumed_from is not None)
    try:
        last = steps(session, out_dir, bar, last)
    except KeyboardInterrupt:  # Ctrl-C: where the rerun continues
        then = ("starts the run again" if not checkpoint.complete(cfg.output_dir) else "continues from it"
                if cfg.resume == "auto" else "with resume=auto continues from it")
        raise KeyboardInterrupt(f"{checkpoint.intact_note(cfg.output_dir)}; the same command {then}") from None
    finally:
        bar.close()  # before any message that ends the run, which then stands on its own line
        if session.trackers is not None:  # a run that stops early closes its tracker runs too
            session.trackers.close()
    if session.progress.skipped_steps:
        log(f"note: {session.progress.skipped_steps} updates were skipped for a non-finite loss or gradient")
    if main:
        finish(session, out_dir, last)
    distributed.barrier()  # the other ranks end when the adapter is saved
    return TrainResult(last, session.trainee.model)


def steps(session: Session, out_dir: Path, bar, last: dict) -> dict:
    """The loop itself: optimizer steps until session.run.steps, with their lines, evals and checkpoints; returns
    the last train line."""
    main = session.run.world.main
    with output.open_metrics(session, out_dir) if main else open(os.devnull, "w") as metrics_file:
        first = distributed.broadcast(evaluation.at_start(session) if main else None)  # step 0: the samples
        if first is not None:
            output.write_line(session, metrics_file, first)
        if evaluation.on_start(session):  # every rank: the eval is split across them
            eval_step(session, metrics_file, bar)
        out = StepOutputs(metrics_file, out_dir, bar, last)
        while session.progress.step < session.run.steps:
            optimizer_step(session, out)
    return out.last


def finish(session: Session, out_dir: Path, last: dict) -> None:
    """Rank 0 at the end: the best adapter loaded (load_best_model_at_end), saved into output_dir with the run's
    state."""
    cfg = session.run.cfg
    if cfg.load_best_model_at_end:
        evaluation.load_best(session)
    output.save_final(session, out_dir)
    checkpoint.write_run_state(out_dir, checkpoint_state(session), session.run.steps, cfg.best_metric_name,
                               cfg.best_is_greater, session.progress.metrics_lines)
    log(f"saved adapter to {out_dir} (step {session.run.steps}{session.run.objective.closing_note(last)})")
