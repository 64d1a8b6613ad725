"""Which checkpoint a training stage continues, and whether it may: settings that change the numbers are refused
(config.py declares which may change), and a raised max_steps or num_train_epochs continues the run on the new
schedule. The stages call find_resume, then check_before_load once their data is tokenized, before the model
loads; session.start calls follow_run_length once the checkpoint is restored.

    resume = find_resume(cfg)                            # (checkpoint folder, its TrainerState) or (None, None)
    check_before_load(cfg, resume, trains_on, len(items))  # other inputs, or a total below its step: refused
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lowmem_dpo.config.recipe import config_changes, declared
from lowmem_dpo.config.schema import RUN_LENGTH, Config
from lowmem_dpo.objectives.metrics import LOSS, NLL_LOSS
from lowmem_dpo.runtime import distributed
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, policy
from lowmem_dpo.training.step import Sums, Trainee


def find_resume(cfg: Config) -> tuple[Path | None, checkpoint.TrainerState | None]:
    """The checkpoint this run continues from (resume=auto: the newest in output_dir; resume=PATH) and its
    state, refused when it was written with settings that change the numbers; (None, None) to start over."""
    resume_from = checkpoint.find(cfg.output_dir, cfg.resume)
    if resume_from is None:
        return None, None
    saved = checkpoint.read_state(resume_from)
    check_older_semantics(cfg, resume_from, saved)
    changed = config_changes(saved.config, dataclasses.asdict(cfg))
    if changed:
        raise UserError(f"{resume_from} was written by a run with other settings ("
                        + ", ".join(f"{k}: {declared(k, saved.config.get(k))!r} -> {getattr(cfg, k, None)!r}"
                                    for k in changed)
                        + f"); restore them to resume, or {checkpoint.new_run(cfg.output_dir)}")
    processes = distributed.world().size
    if saved.world_size != processes:
        raise UserError(f"{resume_from} was written by a run on {saved.world_size} process(es), this one has "
                        f"{processes}: a step's pairs are per_device_train_batch_size x gradient_accumulation_steps "
                        f"x processes, so the run would change; resume with {saved.world_size} (torchrun "
                        f"--nproc-per-node), or {checkpoint.new_run(cfg.output_dir)}")
    return resume_from, saved


def check_older_semantics(cfg: Config, resume_from: Path, saved: checkpoint.TrainerState) -> None:
    """A checkpoint written before the schedules were transformers' and before sigmoid ignored label_smoothing (its
    config has neither lr_scheduler_kwargs nor warmup_ratio, the keys added with them): a run whose numbers those
    changed is refused, or told what changes."""
    if "lr_scheduler_kwargs" in saved.config or "warmup_ratio" in saved.config:
        return
    old_types = saved.config.get("loss_type")
    old_types = [old_types] if isinstance(old_types, str) else list(old_types or [])
    if saved.config.get("label_smoothing") and "sigmoid" in old_types:  # that run's sigmoid is today's cdpo
        saved.config["loss_type"] = ["cdpo" if t == "sigmoid" else t for t in old_types]
    if cfg.label_smoothing > 0 and "sigmoid" in cfg.loss_type:
        raise UserError(f"{resume_from} was written when loss_type=sigmoid with label_smoothing="
                        f"{cfg.label_smoothing} was conservative DPO; sigmoid now ignores label_smoothing, as TRL "
                        "1.16's does. To continue it as it was, set loss_type=cdpo (the same loss under its own "
                        f"name); or {checkpoint.new_run(cfg.output_dir)}")
    if cfg.warmup_steps or cfg.lr_scheduler_type == "constant":
        log(f"note: {resume_from} was written before the learning-rate schedule was transformers': from here on "
            "its warmup (and a constant schedule, which has none in transformers) follow transformers'")


def _length_changes(cfg: Config, saved: checkpoint.TrainerState) -> str:
    return ", ".join(f"{k} {saved.config.get(k)} -> {getattr(cfg, k)}" for k in sorted(RUN_LENGTH)
                     if saved.config.get(k) != getattr(cfg, k))


def _old_total(cfg: Config, saved: checkpoint.TrainerState, n_items: int) -> int:
    """The total steps of the run that wrote `saved`, over the same items."""
    old = dataclasses.replace(cfg, **{k: saved.config[k] for k in RUN_LENGTH if k in saved.config})
    return policy.total_steps(old, n_items, distributed.world().size)


def check_before_load(cfg: Config, resume: tuple[Path | None, checkpoint.TrainerState | None], trains_on: dict,
                      n_items: int) -> None:
    """Before the model loads, so that a refusal takes seconds: the checkpoint `resume` must have been trained on
    the same inputs (`trains_on`: inputs.run_inputs; checkpoint.check_inputs), and this run's total steps over
    its `n_items` must not end before the checkpoint's step (check_run_length)."""
    checkpoint.check_inputs(resume, trains_on, cfg.output_dir)
    check_run_length(cfg, resume, n_items)


def check_run_length(cfg: Config, resume: tuple[Path | None, checkpoint.TrainerState | None], n_items: int) -> None:
    """A raised max_steps or num_train_epochs continues a run, a total below the checkpoint's step is refused."""
    resume_from, saved = resume
    steps = policy.total_steps(cfg, n_items, distributed.world().size)
    if saved is not None and steps < saved.step:
        raise UserError(f"{_length_changes(cfg, saved)}: the run would end at step {steps}, before "
                        f"{resume_from}'s step {saved.step}; raise it to continue, or "
                        f"{checkpoint.new_run(cfg.output_dir)}")


def follow_run_length(cfg: Config, n_items: int, steps: int, trainee: Trainee,
                      saved: checkpoint.TrainerState) -> None:
    """A run of `n_items` data items and `steps` steps in all, its trainee restored from a checkpoint (`saved`)
    that was written with another max_steps or num_train_epochs (check_run_length: not past the new total),
    continues from its step to the new total, at the learning rate the new schedule gives there."""
    old_total = _old_total(cfg, saved, n_items)
    if old_total == steps:
        return
    # The restored learning rates are the old schedule's at this step; the scheduler's lambda is over `steps`.
    scheduler = trainee.scheduler
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(trainee.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reads: the learning rate the next step logs
    log(f"{_length_changes(cfg, saved)}: continuing from step {saved.step} of {steps} (was {old_total}), the "
        "schedule follows the new total")


def restored_window(fresh: Sums, saved: dict) -> Sums:
    """The metric window a checkpoint saved (dataclasses.asdict of its Sums), onto the run's `fresh` one: its totals
    and counts added to the fresh keys (an objective's own metrics start from 0). A window that an earlier version
    saved (earlier_window) resumes too."""
    if "totals" not in saved:
        saved = earlier_window(saved)
    names = {f.name for f in dataclasses.fields(fresh)} - {"totals", "counts", "nll_weight"}
    window = dataclasses.replace(fresh, **{k: v for k, v in saved.items() if k in names})
    window.totals = {**fresh.totals, **saved["totals"]}
    window.counts = {**fresh.counts, **saved["counts"]}
    return window


def earlier_window(saved: dict) -> dict:
    """A window an earlier version saved, as Sums' fields: DPO's StepStats (sums over `pairs`, the NLL's `nll` over
    `nll_tokens`; before those were counted, over the chosen tokens), SFT's SFTStats (the NLL over `targets`) or
    KTO's KtoStats (each metric's sum over `blocks`)."""
    if "targets" in saved:  # SFT: its one metric; its rows were not counted, its tokens stand in (only "empty" reads)
        return {"totals": {LOSS.name: saved["nll"]}, "counts": {LOSS.name: saved["targets"]},
                "items": saved["targets"], "tokens": saved["tokens"]}
    if "blocks" in saved:  # KTO
        return {"totals": saved["sums"], "counts": saved["blocks"], "items": saved["rows"], "tokens": saved["tokens"]}
    pairs, chosen = saved["pairs"], saved["chosen_tokens"]
    out = {"totals": dict(saved["sums"]), "counts": dict.fromkeys(saved["sums"], pairs), "items": pairs,
           "tokens": saved["tokens"], "chosen_tokens": chosen,
           "rejected_tokens": saved.get("rejected_tokens", chosen), "ref_drift": saved.get("ref_drift", 0.0),
           "ref_offset": saved.get("ref_offset", 0.0)}
    if saved.get("nll_weight", saved.get("sft_weight")) is not None:  # the NLL was over the chosen tokens, then
        out["totals"][NLL_LOSS.name] = saved["nll"]
        out["counts"][NLL_LOSS.name] = saved.get("nll_tokens", chosen)
    return out
