"""The one training loop, for DPO (train.py), SFT (sft.py) and KTO: the steps and the lines around each one.

A stage builds its session (session.start: the run's setup with its objective, the trainee, the progress); the
objective is a loss (objective.py). step.optimizer_step is the update, top to bottom: the micro-batches, the
out-of-memory back-off, the sums. This module runs the steps (`train_step`: the update, then its metrics line and
warning signs, an eval and a checkpoint when due), then the final save.

    resume = resuming.find_resume(cfg)    # before anything heavy: a changed setting fails fast
    resuming.check_before_load(cfg, resume, trains_on, len(items))  # changed inputs or a shorter run fail fast too
    session = start(RunSetup(cfg, resolved, objective, items, pad_id, inputs=trains_on), model, resume)  # session.py
    run(session)                          # train_step until the run's steps; log, checkpoint, save

Under torchrun or `accelerate launch` (distributed.py) every rank runs this loop on the same data stream: a step
takes per_device_train_batch_size x gradient_accumulation_steps items per rank, each rank computes its share
(step.accumulate), and the LoRA gradients and the metric sums are summed across ranks before the update, so every rank
takes the same update and the same decisions (non-finite skip, warning signs, out-of-memory halving). Rank 0
alone writes: metrics, checkpoints, samples, the final adapter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.config.schema import Config
from lowmem_dpo.objectives import metrics
from lowmem_dpo.runtime import devices, distributed, oom
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, evaluation, guards, output, policy, trackers
from lowmem_dpo.training.session import Session, checkpoint_state
from lowmem_dpo.training.step import StepResult, optimizer_step


# -- one step and its lines ------------------------------------------------------------------------------------
@dataclass
class StepOutputs:
    """Where a step's metrics line, eval and checkpoint go (rank 0 writes; the others' metrics go to os.devnull)."""

    metrics: object  # metrics.jsonl, open
    folder: Path  # output_dir
    bar: object  # the progress bar
    last: dict  # the last train line written


def train_step(session: Session, out: StepOutputs) -> StepResult:
    """The update (step.optimizer_step), then the loop's lines around it: the stop after max_nonfinite_steps skipped
    in a row; its metrics line when due (the window's means, the warning signs), an eval and a checkpoint when
    due."""
    run, progress = session.run, session.progress
    result = optimizer_step(session)
    if result.nonfinite:
        stop_if_diverged(session)
    out.bar.update(1)
    if logging_due(run.cfg, progress.step, run.steps):
        out.last = log_step(session, out.metrics, result, out.bar)
        progress.window = run.objective.new_sums()  # the next line's window
    evaluated = eval_step(session, out.metrics, out.bar) if evaluation.due(run.cfg, progress.step, run.steps) else None
    if saving_due(run.cfg, progress.step, run.steps):  # the best first: a checkpoint records it, never prunes it
        progress.best = evaluation.best_after(progress.best, progress.step, run.cfg, evaluated,
                                               progress.metrics_lines)
        save_checkpoint(session, out.folder)
    return result


def stop_if_diverged(session: Session) -> None:
    """max_nonfinite_steps updates skipped in a row for a non-finite loss or gradient: the run stops (exit 2) as
    diverged, saying what it leaves to resume from."""
    progress, cfg = session.progress, session.run.cfg
    if progress.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
        raise UserError(f"diverged: {progress.nonfinite_in_a_row} steps in a row with a non-finite loss or gradient "
                        f"(up to step {progress.step}); the weights were not updated by them and "
                        f"{checkpoint.intact_note(cfg.output_dir)}; lower learning_rate or check the data and the "
                        "cache")


def logging_due(cfg: Config, step: int, steps: int) -> bool:
    """A metrics line at step 1, every logging_steps (policy.logging_every) and at the last step."""
    return step == 1 or step % policy.logging_every(cfg, steps) == 0 or step == steps


def saving_due(cfg: Config, step: int, steps: int) -> bool:
    """A checkpoint every save_steps and at the last step (save_steps=0: none)."""
    return bool(cfg.save_steps) and (step % cfg.save_steps == 0 or step == steps)


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
        output.show(bar, metrics.bar_numbers(line))
        signs = evaluation.signs_of(session, session.progress.window)
    warn_or_stop(session, signs, metrics_file)
    return line


def eval_step(session: Session, metrics_file, bar) -> dict:
    """Evaluate at this step (evaluation.evaluate): the eval line, the bar's eval numbers, the objective's signs on
    the held-out sums (every rank's), the collapse sign (rank 0's samples: its line and sign go to every rank, which
    then decide alike)."""
    line, signs = evaluation.evaluate(session)
    sign = evaluation.collapse_sign(session.progress.metrics_lines, line) if session.run.world.main else None
    line, sign = distributed.broadcast((line, sign))
    log(evaluation.log_line(session.progress.metrics_lines, line, evaluation.cost_note(session, line)))
    output.write_line(session, metrics_file, line)
    output.show(bar, metrics.bar_numbers(line, "eval_"))
    warn_or_stop(session, ([sign] if sign else []) + signs, metrics_file)  # what the answers show first
    return line


def run(session: Session, progress: bool = True) -> TrainResult:
    """Optimizer steps until session.run.steps: a metrics line at step 1, every logging_steps and the last step; a
    checkpoint every save_steps and at the last step; then the adapter into output_dir."""
    from tqdm.auto import tqdm

    cfg, main = session.run.cfg, session.run.world.main  # rank 0 writes the files; the others only compute
    out_dir = output.start_output(session.run) if main else Path(cfg.output_dir)
    for line in session.opening:
        log(line)
    if cfg.memory_snapshot_on_oom:
        log(oom.record_snapshots(session.run.resolved.device, out_dir))
    devices.memory_window(session.run.resolved.device)  # the first line's window starts here
    train_lines = [line for line in map(json.loads, session.progress.metrics_lines) if metrics.LOSS.name in line]  # not eval lines
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
        first = distributed.broadcast(evaluation.at_start(session) if evaluation.samples_on_rank(session)
                                      else None)  # step 0: the samples
        if first is not None:
            output.write_line(session, metrics_file, first)
        if evaluation.on_start(session):  # every rank: the eval is split across them
            eval_step(session, metrics_file, bar)
        out = StepOutputs(metrics_file, out_dir, bar, last)
        while session.progress.step < session.run.steps:
            train_step(session, out)
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
    log(f"saved adapter to {out_dir} (step {session.run.steps}{metrics.closing_note(last)})")
    warned = guards.warnings_summary(list(map(json.loads, session.progress.metrics_lines)))
    best = session.progress.best["best_global_step"]
    kept = (f"; the adapter saved is step {best}'s, the best checkpoint, with no sign of damage since the eval before"
            if cfg.load_best_model_at_end and best not in (None, session.progress.step) else "")
    if warned:  # the last line: a run with warning signs is no plain success
        log(f"warning: this run ended with warning signs, so its adapter may be damaged: {warned}{kept}; "
            f"`lowmem-dpo report {out_dir}` has the curves, samples.jsonl the answers")
