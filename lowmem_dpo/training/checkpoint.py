"""Training checkpoints: everything a killed run needs to continue as if it had never stopped.

    lowmem-dpo train RECIPE.yaml      # rerun the same command: resumes from the newest checkpoint

Layout, one folder per checkpoint, under output_dir/checkpoints/:

    checkpoint-STEP/adapter_config.json, adapter_model.safetensors   the PEFT adapter at STEP (loadable as is)
    checkpoint-STEP/optimizer.pt, scheduler.pt                        their state_dicts (torch.save)
    checkpoint-STEP/scaler.pt                                         float16: the loss scaler's state_dict
    checkpoint-STEP/rng.pt                                            torch's CPU (and CUDA) RNG states, each
                                                                      process's (dropout masks differ by rank)
    checkpoint-STEP/metrics.jsonl, samples.jsonl                      output_dir's, as they were at STEP
    checkpoint-STEP/trainer_state.json                                step, position in the data order, batch
                                                                      split, the run's config, the digests
                                                                      of its inputs and the best checkpoint

A checkpoint is complete or absent: it is written into a hidden temporary folder beside the others, every file
fsynced, and renamed to checkpoint-STEP in one step. Older ones beyond save_total_limit are removed only after
the new one is in place. Before writing, the free disk space is checked against the checkpoint's size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo.model import adapters
from lowmem_dpo.runtime import files, folders
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training.step import Trainee

FOLDER = "checkpoints"
STATE = "trainer_state.json"
METRICS = "metrics.jsonl"  # output_dir's metrics lines (output.py), copied into each checkpoint as they were at STEP
SCALER = "scaler.pt"
SAMPLES = "samples.jsonl"  # output_dir's samples (evaluation.py), copied into each checkpoint as it was at STEP
_NAME = re.compile(r"checkpoint-(\d+)")


@dataclass
class TrainerState:
    step: int  # optimizer steps finished
    pairs_seen: int  # pairs consumed from the data stream (step * pairs per step)
    micro_batch: int  # the split in use (out-of-memory back-off may have halved it)
    grad_accum: int
    skipped_steps: int  # updates skipped for a non-finite loss or gradient
    window: dict  # the metric window since the last logged line (session.Progress.window), so the next line is what
    #               it would have been
    config: dict  # the run's Config as a dict
    # What the run trains on (inputs.run_inputs: data, model and adapter weights, tokenizer, tokenization,
    # reference cache), compared on resume; None in checkpoints written before it was recorded.
    inputs: dict | None = None
    # The best checkpoint so far by metric_for_best_model (evaluation.py), under transformers' TrainerState keys;
    # None until an evaluated checkpoint, and in checkpoints written before it was recorded.
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    world_size: int = 1  # processes of the run (torchrun / accelerate launch): a step's pairs depend on it
    scaler_skips: int = 0  # float16: updates the loss scaler skipped (its state: scaler.pt)
    nonfinite_in_a_row: int = 0  # the skips for a non-finite loss or gradient just before it (max_nonfinite_steps)
    # The formats of the training rows (data.TokenizedData.formats: "text", tokenized as written, and/or
    # "conversation", through the chat template): chat renders its prompts as the run's were. Not an input (a
    # resume does not compare it); None in checkpoints written before it was recorded.
    row_formats: list[str] | None = None


def root(output_dir: str | Path) -> Path:
    return Path(output_dir) / FOLDER


def folder(output_dir: str | Path, step: int) -> Path:
    """The folder of checkpoint-STEP under output_dir (where it is now: a moved run's paths follow it)."""
    return root(output_dir) / f"checkpoint-{step}"


def complete(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first. Temporary folders are not checkpoints."""
    folder = root(output_dir)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _NAME.fullmatch(p.name)
        if m and (p / STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def size_bytes(model, opt) -> int:
    """What a checkpoint of this run takes on disk: the adapter, the optimizer state, and 64 KiB for the rest
    (scheduler, RNG, metrics, JSON, file headers)."""
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return adapter + state + (64 << 10)


def resume_note(output_dir: str | Path) -> str:
    """What a rerun after a failed write continues from: the newest complete checkpoint, or nothing."""
    newest = complete(output_dir)
    return (f"The run resumes from {newest[-1][1].name} (step {newest[-1][0]}), which is intact."
            if newest else "No checkpoint was written yet.")


def intact_note(output_dir: str | Path) -> str:
    """What a stopped run leaves to resume from, for the message that stops it."""
    found = complete(output_dir)
    return (f"the last checkpoint, {found[-1][1]} (step {found[-1][0]}), is intact" if found
            else "no checkpoint was written yet (save_steps)")


def rng_state() -> dict:
    """This process's random state: torch's CPU generator, and CUDA's where there is a GPU."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def save(output_dir: str | Path, state: TrainerState, trainee: Trainee, metrics_lines: list[str], keep: int,
         replaces: list[Path] = (), rng_states: list[dict] | None = None) -> Path:
    """Write checkpoint-{state.step} atomically (the trainee's adapter, optimizer, schedule and loss scaler, and
    the random states), then remove `replaces` (an earlier run's checkpoints, when this one started over) and
    keep only the newest `keep` and the best (state.best_global_step's), which is never pruned. output_dir's
    samples.jsonl goes in too, as metrics_lines do. A full disk stops the run with exit 2 and leaves the previous
    checkpoints as they were. `rng_states`: every rank's rng_state(), in rank order
    (distributed.gather); default this process's."""
    folder = root(output_dir)
    final = folder / f"checkpoint-{state.step}"
    need = size_bytes(trainee.model, trainee.optimizer)
    then = resume_note(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".checkpoint-*"):  # a write a kill interrupted: never a checkpoint, only litter
        shutil.rmtree(stale, ignore_errors=True)
    files.ensure_free_space(folder, need, f"checkpoint-{state.step}", then)
    tmp = Path(tempfile.mkdtemp(prefix=f".checkpoint-{state.step}-", dir=folder))
    try:
        adapters.save(trainee.model, tmp)
        torch.save(trainee.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(trainee.scheduler.state_dict(), tmp / "scheduler.pt")
        if trainee.scaler is not None:
            torch.save(trainee.scaler.state_dict(), tmp / SCALER)
        ranks = rng_states or [rng_state()]
        torch.save({**ranks[0], "ranks": ranks} if len(ranks) > 1 else ranks[0], tmp / "rng.pt")
        (tmp / METRICS).write_text("".join(metrics_lines), encoding="utf-8")
        if (Path(output_dir) / SAMPLES).is_file():
            shutil.copyfile(Path(output_dir) / SAMPLES, tmp / SAMPLES)
        (tmp / STATE).write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n", encoding="utf-8")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        files.fsync_tree(tmp)
        if final.exists():  # a checkpoint of the same step from an earlier attempt: the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if files.is_disk_full(e):
            raise files.disk_full_error(folder, f"checkpoint-{state.step}", need, then) from None
        raise
    for old in replaces:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    for step, old in complete(output_dir)[:-keep] if keep > 0 else []:
        if step != state.best_global_step:
            shutil.rmtree(old, ignore_errors=True)
    return final


def new_run(output_dir: str | Path) -> str:
    """The advice when a run cannot continue: a new folder, which leaves this run as it is (never resume=never,
    which would replace its checkpoints)."""
    return (f"start a new run in a new folder, output_dir={folders.free_name(Path(output_dir))} ({output_dir} stays "
            "as it is)")


def read_state(path: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((path / STATE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {e}); pass resume=PATH of "
                        f"another checkpoint, or {new_run(Path(path).parent.parent)}") from None


def find(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: resume=auto the newest complete one under output_dir (None if there is
    none), never None, else resume is a checkpoint folder's path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete(output_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if (path / FOLDER).is_dir() or "global_step" in _json_or_empty(path / STATE):  # a run's output_dir and record
        raise UserError(f"resume={resume!r} is a run's output_dir, not a checkpoint: pass one of its "
                        f"{root(path)}/checkpoint-STEP folders, or resume=auto with output_dir={resume}")
    if not (path / STATE).is_file():
        raise UserError(f"resume={resume!r} is not a complete checkpoint folder (no {STATE}); checkpoints are "
                        f"{root(output_dir)}/checkpoint-STEP")
    return path


def _json_or_empty(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def input_changes(saved: dict, current: dict) -> list[str]:
    """The inputs (inputs.run_inputs' names) whose digests differ from the checkpoint's, in the record's order. A
    checkpoint written before the cache was keyed by row content recorded the whole cache's fingerprint (64 hex
    digits, where a model side's identity has 32): the data and the weights it covered are compared on their own."""
    legacy = len(saved.get("reference cache") or "") == 64
    return [k for k in [*saved, *(k for k in current if k not in saved)]
            if saved.get(k) != current.get(k) and not (legacy and k == "reference cache")]


def check_inputs(resume: tuple[Path | None, TrainerState | None], current: dict, output_dir: str | Path) -> None:
    """Refuse to continue checkpoint `resume` (resuming.find_resume's pair) on other inputs than it was trained on:
    `current` (inputs.run_inputs) against its record, exit 2 naming what changed. A checkpoint written before
    inputs were recorded is continued with a warning (its settings are still checked)."""
    resume_from, saved = resume
    if saved is None:
        return
    if saved.inputs is None:
        log(f"warning: {resume_from} does not record its inputs (written by an older lowmem_dpo): resuming "
            f"without checking that its {', '.join(current)} are the ones it trained on; if they changed, "
            f"{new_run(output_dir)} (this run's checkpoints record them)")
        return
    changed = input_changes(saved.inputs, current)
    if changed:
        raise UserError(f"{resume_from} was trained on other inputs: {', '.join(changed)} changed since; the run "
                        f"cannot continue on them. Restore them to resume, or {new_run(output_dir)}")


def load_adapter_weights(path: Path, model) -> None:
    """Put checkpoint `path`'s adapter weights into the run's model (same adapter shape)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(path / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    if getattr(result, "unexpected_keys", None):
        raise UserError(f"checkpoint {str(path)!r} holds an adapter that does not match this run's "
                        f"({len(result.unexpected_keys)} unexpected keys); {new_run(Path(path).parent.parent)}")


def load_adapter(path: Path, trainee: Trainee) -> None:
    """Checkpoint `path`'s adapter weights into the trainee's model, its compute copies after them (a 16-bit
    forward reads those)."""
    load_adapter_weights(path, trainee.model)
    if trainee.copies is not None:
        trainee.copies.refresh()


def restore(path: Path, trainee: Trainee, rank: int = 0) -> None:
    """Load the adapter weights, optimizer, scheduler and loss scaler (float16) of checkpoint `path` into the
    trainee, and its RNG state into this process: process `rank`'s (a checkpoint of one process, or one written
    before each rank's was kept: its one state)."""
    load_adapter(path, trainee)
    trainee.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    trainee.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if trainee.scaler is not None and (path / SCALER).is_file():
        trainee.scaler.load_state_dict(torch.load(path / SCALER, weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    if "ranks" in rng:
        rng = rng["ranks"][rank]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        for index, state in cuda_states(rng["cuda"], torch.cuda.device_count()):
            torch.cuda.set_rng_state(state, index)


def cuda_states(saved: list, visible: int) -> list[tuple[int, torch.Tensor]]:
    """(GPU index, state) of the saved CUDA RNG states to restore on `visible` GPUs: each GPU's own, by index. A run
    resumed on fewer GPUs than it saw (saved on a 2 x T4 notebook, resumed on 1 x T4) drops the states of the GPUs
    it no longer has, which it never drew from (a process trains on one GPU); one with more keeps its new GPUs'."""
    return list(enumerate(saved[:visible]))


def metrics_lines(path: Path) -> list[str]:
    """The metrics lines of a checkpoint or a run folder ([] without its file)."""
    try:
        return (path / METRICS).read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return []


def write_run_state(output_dir: str | Path, state: TrainerState, max_steps: int, metric: str, greater: bool,
                    metrics_lines: list[str]) -> None:
    """output_dir/trainer_state.json in transformers' TrainerState form: global_step, max_steps, the best
    checkpoint (best_metric, best_global_step, best_model_checkpoint, chosen by metric_for_best_model) and the
    log history (metrics.jsonl's lines); the digests of what the run trained on (inputs, for the export's check
    that the base has not changed since); and the formats of its rows (row_formats, for chat)."""
    record = {"global_step": state.step, "max_steps": max_steps, "best_metric": state.best_metric,
              "best_global_step": state.best_global_step, "best_model_checkpoint": state.best_model_checkpoint,
              "metric_for_best_model": metric, "greater_is_better": greater,
              "log_history": [json.loads(line) for line in metrics_lines], "inputs": state.inputs,
              "row_formats": state.row_formats}
    payload = (json.dumps(record, indent=2) + "\n").encode()
    try:
        files.atomic_write_bytes(Path(output_dir) / STATE, payload)
    except OSError as e:
        if files.is_disk_full(e):
            raise files.disk_full_error(Path(output_dir), STATE, len(payload), resume_note(output_dir)) from None
        raise
