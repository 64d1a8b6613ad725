"""The policy a training stage trains (train's DPO, sft's SFT): the frozen base with one LoRA adapter, its
optimizer and schedule, and the memory plan's choices for them.

    setup_model      base (quantized, offloaded as asked) + the SFT adapter continued, or a fresh adapter
    setup_optimizer  the device rule's AdamW over the LoRA weights, warmup + decay
    apply_plan       gradient_checkpointing=auto and CPU offload from the memory planner (memory/search.py)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from lowmem_dpo import adapters, devices, models
from lowmem_dpo.config import Config
from lowmem_dpo.errors import UserError, log
from lowmem_dpo.memory import search
from lowmem_dpo.memory.setup import run_budget, setup_from_config
from lowmem_dpo.units import fmt


def new_adapter(cfg: Config, base):
    """A fresh LoRA adapter from the recipe's lora_* keys on `base` (B = 0: the policy starts equal to base)."""
    from peft import LoraConfig, get_peft_model

    adapters.check_no_adapter(base, "a fresh LoRA adapter")
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.peft_target_modules, task_type="CAUSAL_LM")
    torch.manual_seed(cfg.seed)  # LoRA A init
    try:
        return get_peft_model(base, lora)
    except ValueError as e:
        raise UserError(f"lora_target_modules={cfg.lora_target_modules}: {e}") from None


def enable_checkpointing(base) -> None:
    """Gradient checkpointing that lets every LoRA weight get its gradient, over a frozen (even 8-bit) base."""
    # Saves memory: activations are recomputed in backward instead of kept for every layer.
    # Non-reentrant checkpointing: reentrant checkpointing gives a layer's output a grad_fn only when one of
    # its *inputs* requires grad, and with a frozen (e.g. 8-bit) base and frozen embeddings none does, so
    # backward fails with "element 0 of tensors does not require grad" or the LoRA weights inside get no
    # gradient. The non-reentrant version tracks the parameters used inside the layer.
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5; the old name warns there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Belt and braces for models whose checkpointing ignores use_reentrant (remote code in the old format):
    # the embedding output requires grad, so every layer's input does. Costs one (B, T, H) gradient.
    base.enable_input_require_grads()


def setup_model(cfg: Config, resolved: devices.Resolved, model_path: Path, device_map: dict | None = None,
                offload_folder: Path | None = None, source: models.ModelSource | None = None):
    """Base model (frozen, dropout off, quantized if asked) + one LoRA adapter whose every parameter gets a
    gradient, with or without a quantized base, gradient checkpointing and layers offloaded by `device_map`: the
    SFT adapter of `source` continued, or a fresh one (on the base with the SFT adapter merged in, for
    adapter_mode=new_on_merged)."""
    base = models.load_model(model_path, resolved.device, resolved.dtype, resolved.quantization,
                             device_map=device_map, offload_folder=offload_folder)
    model = adapters.sft_policy(base, cfg, source) if source is not None else None
    if model is None:
        model = new_adapter(cfg, base)
    placed = models.place_offloaded_adapters(model, resolved.device)
    if placed:
        log(f"offload: the LoRA weights of {len(placed)} adapted modules on offloaded layers stay on "
            f"{resolved.device.type}; only the frozen base weights stream")
    if resolved.gradient_checkpointing:
        enable_checkpointing(base)
    if resolved.dtype != torch.float32:
        # Saves a float32 copy of every adapted layer's input per forward (4-7% of a llama-25m CPU step): peft
        # casts the input to the LoRA weights' float32, but the stages run under the 16-bit autocast, which casts
        # it straight back for LoRA's matmuls. Without lora_dropout the numbers are the same bit for bit; with it,
        # the dropout's 1/(1-p) scaling rounds in the 16-bit dtype.
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    model.train()
    return model


def get_lr(step: int, cfg: Config, total_steps: int) -> float:
    """Learning rate multiplier for optimizer step `step` (0-based): linear warmup, then the decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    if cfg.lr_scheduler_type == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, 1.0 - progress)


def setup_optimizer(cfg: Config, model, total_steps: int, resolved: devices.Resolved):
    """The device rule's optimizer (paged 8-bit AdamW on CUDA, torch AdamW elsewhere) over the LoRA weights,
    with the warmup + decay schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = devices.make_optimizer(resolved.optimizer, params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: get_lr(s, cfg, total_steps))
    return opt, sched, params


def items_per_step(cfg: Config, world_size: int = 1) -> int:
    """Pairs (or SFT rows) per optimizer step, over all ranks: per_device_train_batch_size per rank and micro-batch,
    as transformers counts it."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size


def total_steps(cfg: Config, num_items: int, world_size: int = 1) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * num_items / items_per_step(cfg, world_size)))


def apply_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> dict | None:
    """A training stage's `auto` memory choices from the same planner as `python -m lowmem_dpo.plan`: with
    gradient_checkpointing=auto, checkpointing goes on when the planner says the run needs it to fit
    memory_budget (default: the device's memory). Knobs that are not auto are only advised, with numbers.

    Returns the device_map for CPU offload (on CUDA, when even the planner's other knobs leave train over the
    budget: the trailing decoder layers stay in CPU RAM and stream through the GPU; checkpointing goes on), or
    None."""
    budget = run_budget(cfg, resolved.device.type)
    arch = search.arch_of_run(model_path, cfg, "using the device rule's choices")
    if arch is None:
        return None
    chosen = search.choose(arch, cfg, budget)
    peak = chosen.prediction.train.peak_bytes
    overrides = dict(chosen.overrides)
    if cfg.gradient_checkpointing == "auto" and overrides.pop("gradient_checkpointing", None) == "true":
        resolved.gradient_checkpointing = True
        resolved.reasons.append(f"gradient_checkpointing=true (auto; the planner: needed to fit "
                                f"{fmt(budget)}, train peak {fmt(peak)} with it)")
    overrides.pop("precompute_batch_size", None)  # precompute's business, not train's
    if overrides:
        log(f"warning: the planner predicts this run does not fit {fmt(budget)}; it would with: "
            + " ".join(f"{k}={v}" for k, v in overrides.items()) + " (python -m lowmem_dpo.plan shows the terms)")
    else:
        resolved.reasons.append(f"planner: train peak {fmt(peak)} of a {fmt(budget)} budget")
    if resolved.device.type != "cuda":
        return None
    # The run as configured (the advice above is not applied), with checkpointing: offload needs it.
    setup = dataclasses.replace(setup_from_config(cfg, budget), gradient_checkpointing=True)
    device_map = search.offload_map(arch, setup, budget, "train", resolved.device.index or 0)
    if device_map is not None and not resolved.gradient_checkpointing:
        # Without it autograd keeps every streamed layer's device copy until backward: nothing saved.
        resolved.gradient_checkpointing = True
        resolved.reasons.append("gradient_checkpointing=true (CPU offload: an offloaded layer's weights are "
                                "streamed in again for its backward instead of staying on the device)")
    return device_map


def check_bitsandbytes(resolved: devices.Resolved) -> None:
    """Fail before tokenizing and loading, not after, when the run needs bitsandbytes and it cannot load."""
    needs_bnb = ([f"quantization={resolved.quantization}"] if resolved.quantization != "none" else []) + (
        [f"optimizer={resolved.optimizer} (the {resolved.kind} rule)"]
        if resolved.optimizer == devices.PAGED_ADAMW_8BIT else [])
    if needs_bnb:
        devices.import_bitsandbytes(" and ".join(needs_bnb))
