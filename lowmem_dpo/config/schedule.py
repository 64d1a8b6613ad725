"""The learning-rate schedule of a run: transformers' own (get_scheduler), with its warmup read as transformers reads
it. `cfg` is a config.Config (lr_scheduler_type, lr_scheduler_kwargs, warmup_steps); the config
checks a schedule's arguments with make_schedule at load, policy.setup_optimizer builds the run's."""

from __future__ import annotations

import math

# transformers.get_scheduler's names that an optimizer-step schedule can use (reduce_lr_on_plateau needs an eval
# metric every step, greedy a loss signal: not these).
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
# Those of them that transformers builds with no lr_scheduler_kwargs (tests/test_train.py builds each, and the others
# not): named so without kwargs, the config's check of the schedule builds nothing. Building one imports transformers'
# optimization module, which brings peft, bitsandbytes and torch's compiler, and a throwaway optimizer, which brings
# torch._dynamo: ~10 s of a fresh process's start, most of `lowmem-dpo plan`'s 15 s.
NO_ARGUMENTS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                "inverse_sqrt")
# The learning rates LoRA recipes use (the README's range); a rate ten times outside it either way is warned about
# before step 1 (learning_rate_warning).
LORA_LEARNING_RATES = (5e-5, 5e-4)
FAR = 10


def learning_rate_warning(lr: float) -> str | None:
    """The warning for a learning rate far outside LORA_LEARNING_RATES (FAR times beyond either end), or None."""
    low, high = LORA_LEARNING_RATES
    span = f"{low:.0e} to {high:.0e}".replace("e-0", "e-")  # 5e-5 to 5e-4
    if lr > FAR * high:
        return (f"learning_rate={lr:g} is far above what LoRA recipes use ({span}): expect the warning signs "
                "within steps (answers collapsing into repetition), and a damaged adapter")
    if lr < low / FAR:
        return (f"learning_rate={lr:g} is far below what LoRA recipes use ({span}): the adapter will barely move "
                "from the reference (such rates suit a full fine-tune, not LoRA)")
    return None


def warmup(cfg, total_steps: int) -> int:
    """Warmup steps of a run of `total_steps`, as transformers' TrainingArguments.get_warmup_steps: warmup_steps,
    or ceil(warmup_steps x total) below 1 (a ratio)."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    return math.ceil(total_steps * cfg.warmup_steps)


def make_schedule(cfg, optimizer, total_steps: int):
    """transformers' scheduler of `lr_scheduler_type` over `total_steps` optimizer steps (get_scheduler, HF
    Trainer's call): a LambdaLR whose last_epoch is the steps taken."""
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup(cfg, total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)


def throwaway_optimizer():
    """A throwaway optimizer over one scalar, for checking a schedule's arguments."""
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def schedule_problems(cfg) -> list[str]:
    """The run length's and the schedule keys' problems (Config.validate): max_steps 0, warmup as steps or a ratio,
    and the schedule's own arguments, checked by transformers."""
    problems = []
    if cfg.max_steps == 0:
        problems.append("max_steps=0 trains nothing: -1 (the default) runs num_train_epochs, a positive number runs "
                        "that many optimizer steps")
    if cfg.warmup_steps >= 1 and cfg.warmup_steps != int(cfg.warmup_steps):
        problems.append(f"warmup_steps={cfg.warmup_steps}: a number of steps is whole; below 1 it is a ratio "
                        "of the run's steps")
    if not cfg.lr_scheduler_kwargs and cfg.lr_scheduler_type in NO_ARGUMENTS:
        return problems
    try:
        make_schedule(cfg, throwaway_optimizer(), 10)  # the schedule's own arguments, checked by transformers
    except (TypeError, ValueError) as e:
        problems.append(f"lr_scheduler_type={cfg.lr_scheduler_type} with lr_scheduler_kwargs="
                        f"{cfg.lr_scheduler_kwargs}: {str(e).splitlines()[0]}")
    return problems

