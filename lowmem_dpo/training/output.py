"""What a training run writes into output_dir besides checkpoints: config.yaml, metrics.jsonl (and the progress
bar's numbers), the final adapter.

Used by the loop (loop.py) with its session (session.Session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lowmem_dpo.config.recipe import place, require
from lowmem_dpo.config.schema import FIELDS
from lowmem_dpo.config.sources import yaml_form
from lowmem_dpo.model import adapters
from lowmem_dpo.model.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TOKENIZER_FILES
from lowmem_dpo.objectives.metrics import GRAD_NORM, LEARNING_RATE, REWARDS_CHOSEN
from lowmem_dpo.runtime import devices, distributed, files, folders, oom
from lowmem_dpo.runtime.builtins import PREFIX as BUILTIN_PREFIX
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint
from lowmem_dpo.training.provenance import RUN_CONFIG
from lowmem_dpo.training.session import RunSetup, Session
from lowmem_dpo.training.step import rows_of
from lowmem_dpo.training.trackers import EVENTS_DIR

PICTURE = "curves.png"  # the report's picture of a run (report.py), into its output_dir
# What a run (and its report) writes into output_dir: overwrite_output_dir accepts a folder of other files when none
# has one of these names; a tokenizer saving a file of a name of its own is caught when the adapter is saved
# (folders.check_replacing). README.md: peft's model card, saved with the adapter.
RUN_FILES = frozenset({checkpoint.FOLDER, RUN_CONFIG, checkpoint.METRICS, checkpoint.SAMPLES, checkpoint.STATE,
                       EVENTS_DIR, PICTURE, oom.SNAPSHOT, ADAPTER_CONFIG, *ADAPTER_WEIGHTS, "README.md",
                       folders.MARKER, *TOKENIZER_FILES})
KIND = {"train": "dpo run", "sft": "sft run"}  # the folder kind (folders.KINDS) of each stage's output_dir
# A run written before folders had a marker: its config.yaml holds every one of these keys (earlier_run).
RUN_KEYS = ("model_name_or_path", "ref_cache_dir", "output_dir", "loss_type", "learning_rate", "lora_r", "seed")


def earlier_run(folder: Path, kind: str) -> bool:
    """Whether `folder` is a run of `kind` this tool wrote before it marked its folders, or checkpoints copied from
    one: nothing but what a run writes, a config.yaml (or the checkpoints' trainer_state.json) holding one of our
    configs, and metrics of that kind (DPO's lines have rewards, SFT's none)."""
    import yaml

    held = folders.visible(folder)
    if not set(held) <= RUN_FILES:
        return False
    try:
        config = yaml.safe_load((folder / RUN_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        config = None
    found = checkpoint.complete(folder) if held == [checkpoint.FOLDER] else []
    try:
        config = checkpoint.read_state(found[-1][1]).config if found else config
        lines = checkpoint.metrics_lines(found[-1][1] if found else folder)
    except (UserError, OSError):
        return False
    dpo = any(f'"{REWARDS_CHOSEN.name}"' in line for line in lines)  # DPO's and KTO's lines have it, SFT's not
    if lines and dpo != (kind == KIND["train"]):
        return False
    # ours: every one of RUN_KEYS, and most of the keys a Config has (an older version's lacks the newest)
    return (isinstance(config, dict) and all(k in config for k in RUN_KEYS)
            and len(set(config) & set(FIELDS)) >= len(FIELDS) // 2)


def check_output_dir(cfg, stage: str) -> None:
    """Before anything heavy: output_dir must be new, empty, or `stage`'s own run (its marker; or an earlier run of
    this tool, which is then marked); with overwrite_output_dir, a folder whose files have none of RUN_FILES'
    names. Anything else is refused, naming its files: nothing a user had is replaced."""
    kind = KIND[stage]
    beside = folders.Beside(RUN_FILES, cfg.overwrite_output_dir, "or set overwrite_output_dir=true to write beside "
                            "files whose names it does not use")
    folders.check(Path(cfg.output_dir), kind, "output_dir", lambda folder: earlier_run(folder, kind), beside)


def running(cfg, stage: str):
    """output_dir checked (check_output_dir: nothing of a user's is touched), then its lock for the run
    (folders.locked; rank 0 holds it for every process of a torchrun): a second run into the folder meanwhile exits
    2 naming this one."""
    require(cfg, stage)  # a recipe without its model or data says so first
    check_output_dir(cfg, stage)
    if distributed.is_main():
        return folders.locked(Path(cfg.output_dir), "output_dir")
    return contextlib.nullcontext()


def start_output(run: RunSetup) -> Path:
    """output_dir with the resolved config.yaml (the recipe's keys, then each resolved choice with its reason as a
    "# resolved" line); one line of them in the log (resolved_line)."""
    out_dir = Path(run.cfg.output_dir)
    folders.mark(out_dir, KIND[run.objective.name])  # before the first file: the folder is this run's
    log(f"writing to {place(run.cfg, 'output_dir')}")
    resolved_note = "".join(f"# resolved {reason}\n" for reason in run.resolved.reasons)
    files.atomic_write_bytes(out_dir / RUN_CONFIG, (run.cfg.to_yaml() + resolved_note).encode())
    log(resolved_line(run.resolved, run.cfg.per_device_train_batch_size, out_dir / RUN_CONFIG, run.world))
    return out_dir


def resolved_line(resolved: devices.Resolved, batch: int, config: Path, world: distributed.World) -> str:
    """What the device rules and the planner chose, in one line, and where their reasons are."""
    micro = resolved.micro_batch or batch
    processes = f", process {world.rank} of {world.size}" if world.size > 1 else ""
    parts = [f"{resolved.device.type} in {devices.dtype_name(resolved.dtype)}{processes}"
             + ("" if resolved.quantization == "none" else f" on a {resolved.quantization} base"),
             f"micro-batch {micro}" + ("" if micro == batch else f" (the recipe's {batch} split by the planner)"),
             f"gradient checkpointing {'on' if resolved.gradient_checkpointing else 'off'}",
             f"optimizer {resolved.optimizer}"]
    parts += [f"{resolved.streamed_layers} layers streamed from CPU RAM"] * bool(resolved.streamed_layers)
    parts += ["activations offloaded"] * resolved.activation_offloading + ["the base sharded (fsdp)"] * resolved.sharded
    return f"resolved: {', '.join(parts)}; the {len(resolved.reasons)} reasons are in {config} (# resolved)"


def open_metrics(session: Session, out_dir: Path):
    """metrics.jsonl as of the checkpoint the run resumes from (empty for a new run), open for appending: a
    resumed run continues it without repeating a step. Logs where the run starts."""
    if session.progress.resumed_from is not None:
        log(f"resuming from {session.progress.resumed_from} (step {session.progress.step} of {session.run.steps})")
    elif session.progress.replaces:
        log(f"starting over (resume={session.run.cfg.resume}): the {len(session.progress.replaces)} checkpoints in "
            f"{checkpoint.root(out_dir)} are replaced by this run's first one")
    files.atomic_write_bytes(out_dir / checkpoint.METRICS, "".join(session.progress.metrics_lines).encode())
    return open(out_dir / checkpoint.METRICS, "a", encoding="utf-8")


def save_adapter(model, out_dir: Path, tokenizer=None) -> None:
    """PEFT adapter files (and the tokenizer's, with the chat template the run used, as transformers' Trainer
    saves them) into out_dir, each replaced atomically (a crash leaves the old file or the new one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=out_dir))
    try:
        adapters.save(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        names = sorted(f.name for f in tmp.iterdir())
        marker = folders.read_marker(out_dir)
        if marker is not None:  # a run's folder (a checkpoint's is inside one): record what it holds
            folders.check_replacing(out_dir, names, RUN_FILES, "the adapter")
            folders.mark(out_dir, marker["kind"], names)
        for f in sorted(tmp.iterdir()):
            os.chmod(f, 0o644)
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_final(session: Session, out_dir: Path) -> None:
    """The adapter into output_dir, refusing non-finite weights and a disk without room for it."""
    bad = [n for n, p in session.trainee.model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise UserError(f"not saving: {len(bad)} LoRA weights are not finite (first: {bad[0]}); "
                        + checkpoint.intact_note(session.run.cfg.output_dir))
    need = sum(p.numel() * p.element_size() for p in session.trainee.params) + (1 << 20)
    then = checkpoint.resume_note(session.run.cfg.output_dir)
    files.ensure_free_space(out_dir, need, "the adapter", then)
    try:
        save_adapter(session.trainee.model, out_dir, session.run.tokenizer)
        write_model_card(session, out_dir)
    except OSError as e:
        if files.is_disk_full(e):
            raise files.disk_full_error(out_dir, "the adapter", need, then) from None
        raise


def tracker_config(session: Session) -> dict:
    """What trackio and wandb record of a run at its start: its config, and the setup the device rules and the
    planner resolved (TRL's trackers get its args the same way)."""
    resolved, cfg = session.run.resolved, session.run.cfg
    return {f.name: yaml_form(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)} | {"resolved": {
        "device": str(resolved.device), "dtype": devices.dtype_name(resolved.dtype),
        "micro_batch": session.progress.micro_batch, "gradient_accumulation": session.progress.grad_accum,
        "gradient_checkpointing": resolved.gradient_checkpointing, "share_prompt": resolved.share_prompt,
        "budget_bytes": resolved.budget, "steps": session.run.steps}}


def write_model_card(session: Session, out_dir: Path) -> None:
    """README.md in place of peft's template; a card that cannot be written is a warning, the adapter is saved."""
    try:
        card = model_card(session, out_dir)
    except Exception as e:  # the card describes the run; the run's result is the adapter, already saved
        log(f"warning: the model card (README.md) was not written ({type(e).__name__}: {e}); the adapter is saved")
        return
    files.atomic_write_bytes(out_dir / "README.md", card.encode())


def model_card(session: Session, out_dir: Path) -> str:
    """The run folder's README.md, the Hub's model card: base model, data, objective, the settings that shape the
    result, the last eval and the best checkpoint, the tool's version, and how to load the adapter."""
    cfg = session.run.cfg
    config = json.loads((out_dir / ADAPTER_CONFIG).read_text())
    named = cfg.model_name_or_path.startswith(BUILTIN_PREFIX)  # a built-in by its name, not its cache folder
    base = cfg.model_name_or_path if named else config.get("base_model_name_or_path") or cfg.model_name_or_path
    objective = "SFT on the completions" if session.run.objective.name == "sft" else (
        f"loss_type {cfg.loss_type}" + (f" weighted {cfg.loss_weights}" if cfg.loss_weights else "")
        + f", beta {cfg.beta}")
    evals = [json.loads(x) for x in session.progress.metrics_lines if '"eval_loss"' in x]
    last = ", ".join(f"{k} {v:.4g}" for k, v in evals[-1].items() if k.startswith("eval_") and k not in (
        "eval_runtime", "eval_pairs") and isinstance(v, (int, float))) if evals else "none (no eval data)"
    best = "not tracked"
    noted = session.progress.best
    if noted.get("best_global_step") is not None:
        best = f"{cfg.best_metric_name} {noted['best_metric']:.4g} at step {noted['best_global_step']}" + (
            " (the adapter here: load_best_model_at_end)" if cfg.load_best_model_at_end else "")
    lines = [
        "---", f"base_model: {base}", "library_name: peft", "tags:", "- lowmem_dpo", "- lora",
        f"- {session.run.objective.name}", "---", "", f"# {out_dir.resolve().name}", "",
        f"A LoRA adapter on {base}, trained by lowmem_dpo {folders.tool_version()}.", "",
        f"- **Base model**: {base}",
        f"- **Data**: {', '.join(src.path for src in cfg.dataset)} ({rows_of(session.run.items)} training rows)",
        f"- **Objective**: {objective}",
        f"- **Settings**: {session.run.steps} steps of {cfg.per_device_train_batch_size} x "
        f"{cfg.gradient_accumulation_steps} per device, learning_rate {cfg.learning_rate} ({cfg.lr_scheduler_type}), "
        f"max_length {cfg.max_length}, LoRA r {config.get('r')} alpha {config.get('lora_alpha')}, dtype {cfg.dtype}, quantization "
        f"{cfg.quantization}, seed {cfg.seed}",
        f"- **Last eval** (step {evals[-1]['step'] if evals else '-'}): {last}",
        f"- **Best**: {best}", "", "## Use", "", "```python", "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM", "",
        f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "PATH/TO/THIS/FOLDER")',
        "```", "", "The run's config.yaml and metrics.jsonl are beside it; `lowmem-dpo export THIS_FOLDER "
        "MERGED_DIR` merges it into its base (`--gguf q8_0`: for llama.cpp and Ollama)."]
    return "\n".join(lines) + "\n"


# -- metrics.jsonl and the progress bar -----------------------------------------------------------------------
def log_line(session: Session, stats, grad_norm: float, lr: float, dt: float) -> dict:
    """The metrics.jsonl line for this step: the window's means (null when every step since the last line had a
    non-finite loss: such a step's numbers stay out of the window), the step's gradient norm, learning rate and
    timing; on CUDA the window's memory
    (devices.memory_window: peak allocated and reserved since the last line, the card's used bytes); in float16
    the loss scale and the scaler's skips so far."""
    window = session.progress.window
    means = dict.fromkeys(window.means()) if window.empty else window.means()
    line = {"step": session.progress.step, **{k: None if v is None else round(v, 6) for k, v in means.items()},
            GRAD_NORM.name: round(grad_norm, 6) if math.isfinite(grad_norm) else None, LEARNING_RATE.name: lr, "step_time_s": round(dt, 6), "tokens_per_s": round(stats.tokens / dt, 3),
            **devices.memory_window(session.run.resolved.device)}
    if session.trainee.scaler is not None:
        line.update(loss_scale=session.trainee.scaler.get_scale(), scaler_skips=session.progress.scaler_skips)
    return line


def write_line(session: Session, metrics_file, line: dict) -> dict:
    """Append a line to metrics.jsonl (and the session's copy, which checkpoints keep), and to TensorBoard."""
    session.progress.metrics_lines.append(json.dumps(line) + "\n")
    metrics_file.write(session.progress.metrics_lines[-1])
    metrics_file.flush()
    if session.trackers is not None:
        session.trackers.add(line)
    return line


def show(bar, numbers: dict[str, str]) -> None:
    """Update the progress bar's numbers, keeping the others (the last train line's beside the last eval's)."""
    bar.postfix_dict = {**bar.postfix_dict, **numbers}
    bar.set_postfix(bar.postfix_dict)
