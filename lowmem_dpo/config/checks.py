"""The checks across a Config's keys (schema.py declares the keys; each key's own type and bounds are checked at
coercion, coerce.py): the problems that refuse a recipe (Config.validate) and the keys set to values that change
nothing in the run (Config.no_effect, the warnings train logs). Each reads the keys of the Config `cfg`."""

from __future__ import annotations

import difflib
import re

from lowmem_dpo.config.schedule import schedule_problems
from lowmem_dpo.config.sources import repeated
from lowmem_dpo.objectives import logs
from lowmem_dpo.objectives import no_effect as objective_no_effect
from lowmem_dpo.objectives import problems as objective_problems
from lowmem_dpo.objectives.metrics import EVAL_METRICS, row_of
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import parse_size

# A lora_target_modules entry with one of these is a regex ('.' alone is not: self_attn.q_proj is a name).
REGEX_CHARS = frozenset("*+?[](){}|^$\\")


def validate(cfg) -> list[str]:
    """Cross-field checks; per-field types and ranges are checked at coercion time."""
    problems = [p for p in [cfg.dataset and repeated(cfg.dataset, cfg.dataset_split)] if p]
    if cfg.max_prompt_length is not None and cfg.max_prompt_length >= cfg.max_length:
        problems.append(f"max_prompt_length={cfg.max_prompt_length} must be below max_length="
                        f"{cfg.max_length}: a prompt that long leaves no room for the completion")
    if cfg.ref_source == "live":
        for name, policy_key in (("ref_quantization", "quantization"), ("ref_dtype", "dtype")):
            value = getattr(cfg, name)
            if value is not None and value != getattr(cfg, policy_key):
                problems.append(f"{name}={value}: ref_source=live computes the reference with the policy's own "
                                f"base ({policy_key}={getattr(cfg, policy_key)}); set {name}=null or use "
                                "ref_source=cache")
    problems += objective_problems(cfg.loss_type, cfg.loss_weights, cfg.loss_settings)
    problems += eval_problems(cfg)
    problems += schedule_problems(cfg)
    if cfg.memory_budget is not None:
        try:
            parse_size(cfg.memory_budget, "memory_budget")
        except UserError as e:
            problems.append(str(e))
    if not cfg.lora_target_modules:
        problems.append("lora_target_modules is empty: name at least one module or use all-linear")
    regexes = [t for t in cfg.lora_target_modules if REGEX_CHARS.intersection(t)]
    if len(cfg.lora_target_modules) > 1 and regexes:  # peft would take it as a name and match nothing
        problems.append(f"lora_target_modules={cfg.lora_target_modules}: {regexes[0]!r} is a regex, which "
                        "must be the only entry (peft matches one regex against full module names); write "
                        "one regex for all of them, e.g. '.*\\.(q|v)_proj', or list plain names")
    elif regexes:
        try:
            re.compile(regexes[0])
        except re.error as e:
            problems.append(f"lora_target_modules={regexes[0]!r} is not a valid regex ({e})")
    return problems


def no_effect(cfg) -> list[str]:
    """Keys set to values that change nothing in this run (as in TRL and transformers, which ignore them too):
    the warnings train logs."""
    notes = objective_no_effect(cfg.loss_type, cfg.loss_settings)
    if cfg.lr_scheduler_type == "constant" and cfg.warmup_steps:
        notes.append("lr_scheduler_type=constant has no warmup (as transformers'); use constant_with_warmup")
    return notes


def eval_problems(cfg) -> list[str]:
    """The evaluation keys' problems (validate's part)."""
    problems = []
    if cfg.eval_dataset is not None and cfg.eval_fraction > 0:
        problems.append(f"eval_dataset={cfg.eval_dataset} and eval_fraction={cfg.eval_fraction}: set one "
                        "(eval_fraction holds rows of dataset out; eval_dataset names other rows)")
    if cfg.metric_for_best_model not in EVAL_METRICS and f"eval_{cfg.metric_for_best_model}" not in EVAL_METRICS:
        close = difflib.get_close_matches(cfg.metric_for_best_model, EVAL_METRICS, n=2)
        problems.append(f"metric_for_best_model={cfg.metric_for_best_model}: not an eval metric; one of "
                        f"{', '.join(close or EVAL_METRICS)}")
    elif not logs(cfg.best_metric_name.removeprefix("eval_"), cfg.loss_type):
        problems.append(f"metric_for_best_model={cfg.metric_for_best_model}: loss_type={cfg.loss_type} does not log it")
    row = row_of(cfg.best_metric_name)
    if row is not None and row.kind == "sample" and cfg.eval_generations == 0:
        problems.append(f"metric_for_best_model={cfg.best_metric_name} measures the samples: set "
                        "eval_generations above 0")
    if cfg.load_best_model_at_end:
        if not cfg.has_eval:
            problems.append("load_best_model_at_end=true needs eval data: set eval_dataset or eval_fraction")
        if not cfg.save_steps:
            problems.append("load_best_model_at_end=true needs checkpoints to choose from: set save_steps")
        elif cfg.eval_steps is not None and cfg.save_steps % cfg.eval_steps:
            problems.append(f"load_best_model_at_end=true: save_steps={cfg.save_steps} must be a multiple of "
                            f"eval_steps={cfg.eval_steps}, so that every checkpoint is evaluated (or set "
                            "eval_steps=null: at every checkpoint)")
    return problems
