"""The policy a training stage trains (train's DPO, sft's SFT): the frozen base with one LoRA adapter, its
optimizer and schedule, and the memory plan's choices for them.

    setup_model      base (quantized, streamed as asked) + the SFT adapter continued, or a fresh adapter
    setup_optimizer  the device rule's AdamW over the LoRA weights, warmup + decay
    trainee          the model with its optimizer, schedule and float16 loss scaler: what a step updates
    apply_plan       the memory planner's knobs train can apply (memory/search.py): a smaller micro-batch,
                     gradient_checkpointing=auto, and on CUDA, last, decoder layers streamed from CPU RAM
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lowmem_dpo.config.schedule import make_schedule
from lowmem_dpo.config.schema import Config
from lowmem_dpo.memory import attention, cards, search
from lowmem_dpo.memory.host import check_host_ram, host_ram
from lowmem_dpo.memory.setup import default_budget, setup_from_config
from lowmem_dpo.model import activations, adapters, compute_copies, logps, models, streaming
from lowmem_dpo.runtime import devices, distributed, heap, sharding
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.units import fmt
from lowmem_dpo.training.step import Trainee


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
    # context_fn marks the recompute, where a tiled MLP skips its forward (activations.checkpoint_contexts).
    kwargs = {"use_reentrant": False, "context_fn": activations.checkpoint_contexts}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5; the old name warns there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # For models whose checkpointing ignores use_reentrant (remote code in the old format): the embedding output
    # requires grad, so every layer's input does. Costs one (B, T, H) gradient. Transformers 5 registers the same
    # hook itself for a model of input_ids: a second would only run twice.
    if getattr(base, "_require_grads_hook", None) is None:
        base.enable_input_require_grads()


def setup_model(cfg: Config, resolved: devices.Resolved, model_path: Path, stream: streaming.Plan | None = None,
                source: models.ModelSource | None = None, reference: bool = False):
    """The one bring-up of a stage's model, precompute's reference and train's (and sft's) policy alike: the base
    loaded on the device (frozen, dropout off, in the dtype and quantization of its role), the decoder layers
    `stream` names streamed from CPU RAM (apply_plan), the MLP in tiles where the planner knows it, the attention
    path of the card.

    reference (precompute): the base in ref_dtype and ref_quantization, with the SFT adapter of `source` when there
    is one (adapters.reference_model), no gradient. Else the policy: + one LoRA adapter whose every parameter gets a
    gradient, with or without a quantized base and gradient checkpointing: the SFT adapter of `source` continued, or
    a fresh one (on the base with the SFT adapter merged in, for adapter_mode=new_on_merged)."""
    dtype, quantization = (resolved.ref_dtype, resolved.ref_quantization) if reference else (resolved.dtype,
                                                                                            resolved.quantization)
    layers = stream.layers if stream else 0
    base = models.load_model(model_path, models.load_device(resolved.device, quantization, layers, resolved.sharded), dtype,
                             quantization)
    if reference:
        model = adapters.reference_model(base, source)  # base + the SFT adapter, when there is one
        streaming.stream_layers(model, stream, resolved.device)
        tile(model, model_path)
        attention_path(model, resolved.device, dtype, grad=False)
        shard_over_ranks(model, resolved)
        return model
    model = adapters.sft_policy(base, cfg, source) if source is not None else None
    if model is None:
        model = new_adapter(cfg, base)
    streaming.stream_layers(model, stream, resolved.device)  # the adapter's weights go to the device with the rest
    if resolved.gradient_checkpointing:
        enable_checkpointing(base)
    long_sequences(model, resolved, model_path)
    if resolved.dtype != torch.float32:
        # Saves a float32 copy of every adapted layer's input per forward (4-7% of a llama-25m CPU step): peft
        # casts the input to the LoRA weights' float32, but the stages run under the 16-bit autocast, which casts
        # it straight back for LoRA's matmuls. Without lora_dropout the numbers are the same bit for bit; with it,
        # the dropout's 1/(1-p) scaling rounds in the 16-bit dtype.
        for module in model.modules():
            if hasattr(module, "cast_input_dtype_enabled"):
                module.cast_input_dtype_enabled = False
    shard_over_ranks(model, resolved)
    model.train()
    return model


def shard_over_ranks(model, resolved: devices.Resolved) -> None:
    """With fsdp, the base sharded over the processes (runtime/sharding.py), last: every probe of the bring-up
    above ran on the whole model."""
    if not resolved.sharded:
        return
    lm = logps.lm_of(model)
    before = sharding.local_bytes(model)
    layers, embeddings = sharding.shard(model, lm.backbone, lm.lm_head, resolved.device, resolved.shard_offload)
    heap.release_freed_memory()  # the whole weights each shard was cut from: back to the system, not the heap's
    shards, held = sharding.local_bytes(model, shards_only=True), sharding.local_bytes(model)
    log(f"fsdp: {layers} decoder layers{' and the embeddings' if embeddings else ''} sharded over "
        f"{distributed.world().size} processes: this one holds {fmt(held)} of the model's {fmt(before)}: its "
        f"shards {fmt(shards)}{' (in CPU RAM: fsdp_offload_params)' if resolved.shard_offload else ''}, and "
        f"{fmt(held - shards)} whole (the trained LoRA weights and the LM head)")


def tile(model, model_path: Path, grad_tiles: bool = True, tokens: int | None = None) -> list[activations.TiledMLP]:
    """The MLP in tiles (activations.tile_mlps) of `tokens` (None: its default) where the planner knows the layers'
    MLP block: a long sequence's MLP peak is one tile's (with gradients, only when grad_tiles). Returns the tiled
    MLPs."""
    arch = search.quiet_arch(model_path)
    if arch is not None and arch.mlp_block:
        return activations.tile_mlps(model, arch.mlp_block, arch.layers_prefix, grad_tiles,
                                     tokens or activations.MLP_TILE_TOKENS)
    return []


def attention_path(model, device: torch.device, dtype: torch.dtype, grad: bool) -> None:
    """On CUDA, k and v repeated to every query head where the card would otherwise run SDPA's math kernel for a
    grouped-query model (memory.attention.expand_kv: a T4 in float16; the planner counts the same path)."""
    if device.type != "cuda":
        return
    heads, kv, head_dim = models.attention_heads(models.text_config(model.config))
    card, cudnn = models.sdpa_card(device)
    if attention.expand_kv(attention.Card(card, cudnn), devices.dtype_name(dtype), kv < heads, False, head_dim,
                           grad=grad):
        log(models.repeat_kv_heads())


def long_sequences(model, resolved: devices.Resolved, model_path: Path) -> None:
    """What a long sequence needs in train (activations.py): the MLP in tiles (with gradients only under
    checkpointing, where the plan tiles it: their recompute skipped in each layer's recompute where the
    architecture allows), and the saved tensors offloaded when resolved says so."""
    grad_tiles = resolved.gradient_checkpointing and resolved.mlp_tiles
    tiled = tile(model, model_path, grad_tiles, resolved.mlp_tile_tokens)
    attention_path(model, resolved.device, resolved.dtype, grad=True)
    if resolved.activation_offloading:
        activations.offload_activations(model, resolved.device)
    if grad_tiles and tiled and not activations.probe_recompute_stop(model, tiled,
                                                                     devices.autocast(resolved.device, resolved.dtype)):
        log("note: this architecture saves tensors after its MLP (a norm of its output): a checkpointed layer's "
            "recompute runs the tiled MLP, which runs 3 times per step, not 2")


def setup_optimizer(cfg: Config, model, total_steps: int, resolved: devices.Resolved):
    """The device rule's optimizer (paged 8-bit AdamW on CUDA, torch AdamW elsewhere) over the LoRA weights, with
    transformers' schedule of lr_scheduler_type (schedule.make_schedule): each step's rate is HF Trainer's."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = devices.make_optimizer(resolved.optimizer, params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return opt, make_schedule(cfg, opt, total_steps), params


def trainee(cfg: Config, model, total_steps: int, resolved: devices.Resolved) -> Trainee:
    """`model` with its optimizer and schedule over `total_steps` (setup_optimizer), the loss scaler float16
    needs, and in a 16-bit dtype the LoRA weights' compute copies (compute_copies: no cast in the forward)."""
    optimizer, scheduler, params = setup_optimizer(cfg, model, total_steps, resolved)
    copies = compute_copies.ComputeCopies(model, resolved.dtype) if resolved.dtype != torch.float32 else None
    return Trainee(model, optimizer, scheduler, params, devices.grad_scaler(resolved.device, resolved.dtype), copies)


def items_per_step(cfg: Config, world_size: int = 1) -> int:
    """Rows per optimizer step, over all ranks: pairs (SFT rows, KTO rows), per_device_train_batch_size per rank
    and micro-batch, as transformers counts it."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size


def total_steps(cfg: Config, num_items: int, world_size: int = 1) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * num_items / items_per_step(cfg, world_size)))


# A run of null logging_steps logs about this many lines, every 1 to 10 steps (transformers' Trainer logs every 500
# steps: a 16-step run would get one line, a three-point curve at 10).
LOG_LINES, LOG_EVERY_MOST = 20, 10
# eval_generations null: this many answers for every this many steps of the run, between these two. A user's
# 16-step SmolLM2 run at 32 answers (the old default) spent 242 of its 370 s in its 5 evals; 8 answers per 25 steps
# give a short run a quarter of those answers (fewer answers judge less surely: ROUGE-L's change ±0.091 with 8,
# ±0.046 with 32), and a run of 100 steps or more the 32 the signs were calibrated on (guards.py).
GEN_PER, GEN_STEPS, GEN_FEWEST, GEN_MOST = 8, 25, 8, 32


def logging_every(cfg: Config, steps: int) -> int:
    """Optimizer steps between metrics lines: logging_steps, or for null about LOG_LINES lines over the run."""
    return cfg.logging_steps or min(LOG_EVERY_MOST, max(1, math.ceil(steps / LOG_LINES)))


def generations(cfg: Config, steps: int) -> int:
    """Eval prompts answered into samples.jsonl: eval_generations, or for null GEN_PER per GEN_STEPS steps of the
    run, at least GEN_FEWEST and at most GEN_MOST (the answers' cost grows with the run, as its steps do)."""
    if cfg.eval_generations is not None:
        return cfg.eval_generations
    return min(GEN_MOST, max(GEN_FEWEST, GEN_PER * math.ceil(steps / GEN_STEPS)))


def apply_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> streaming.Plan | None:
    """A training stage's memory choices from the same planner as `lowmem-dpo plan`, in the order of
    their cost (memory/search.py): the micro-batch halved with accumulation doubled (the same pairs per step, the
    same numbers), gradient checkpointing on (when auto), on CUDA activation offloading (when auto), the prompt
    unshared (share_prompt auto), and on CUDA, last, the trailing decoder layers streamed from CPU RAM. A knob it
    cannot apply (quantization changes the numbers and the cache) is advised, with numbers. Sets resolved's
    micro_batch, gradient_checkpointing, activation_offloading, share_prompt and streamed_layers; returns what to
    stream, or None."""
    budget = planning_budget(resolved)
    arch = search.arch_of_run(model_path, cfg, "using the device rule's choices")
    applied = None if arch is None else cards.on_cards(arch, cfg, budget, distributed.world().size,
                                                        search.stage_knobs(cfg, "train", resolved.device.type),
                                                        ("train",))
    cards.sharded_as_planned(cfg, resolved, applied)  # no plan (a model the planner does not model): data parallel
    if applied is None:
        return None
    setup = setup_from_config(cfg, budget)
    s, stream = applied.setup, applied.streams.get("train")
    if s.micro_batch != setup.micro_batch:
        resolved.micro_batch = s.micro_batch
        resolved.reasons.append(f"per_device_train_batch_size={s.micro_batch} gradient_accumulation_steps="
                                f"{s.grad_accum} (the planner: {setup.micro_batch} pairs per micro-batch do not fit "
                                f"{fmt(budget)}; the same {s.micro_batch * s.grad_accum} pairs per step, the same "
                                "numbers)")
    if s.gradient_checkpointing and not resolved.gradient_checkpointing:
        resolved.gradient_checkpointing = True
        resolved.reasons.append("gradient_checkpointing=true (" + (
            f"auto; the planner: needed to fit {fmt(budget)}" if "gradient_checkpointing" in applied.overrides
            else "streamed layers: without it every layer's activations stay until backward") + ")")
    if resolved.share_prompt and not s.share_prompt:
        resolved.share_prompt = False
        resolved.reasons.append(f"share_prompt=false (auto; the planner: a shared row's (T, T) mask does not fit "
                                f"{fmt(budget)}, each prompt twice does)")
    resolved.mlp_tiles, resolved.mlp_tile_tokens = s.mlp_tiles, s.mlp_tile_tokens
    if s.gradient_checkpointing and arch.mlp_block:
        tiles = f"in tiles of {s.mlp_tile_tokens} tokens" if s.mlp_tiles else "whole"
        resolved.reasons.append(f"the MLP {tiles} (the planner: {'needed to fit' if s.mlp_tiles else 'fits'} "
                                f"{fmt(budget)})")
    if s.activation_offloading and not resolved.activation_offloading:
        resolved.activation_offloading = True
        resolved.reasons.append(f"activation_offloading=true (auto; the planner: needed to fit {fmt(budget)}, "
                                f"{fmt(applied.prediction.train.details['offload.host_bytes'])} of pinned CPU RAM)")
    cards.report_fit(cfg, resolved, arch, applied, budget)
    # Streaming that does not make the run fit would only make it slower: the out-of-memory back-off has the last word
    resolved.streamed_layers = stream.layers if stream and applied.fits else 0
    resolved.reasons.extend(check_host_ram(host_ram(arch, applied, "train", bool(resolved.streamed_layers)), "train"))
    return streaming.Plan(stream.layers, arch.layers_prefix) if resolved.streamed_layers else None


def planning_budget(resolved: devices.Resolved) -> int:
    """The budget a stage plans for (memory_budget, or the device's: devices.resolve read it), the smallest of every
    process's: each decides the micro-batch, the batch and fsdp from it, and they must decide alike (a sharded run's
    forwards are collectives, paired only when every process runs the same batches)."""
    budget = resolved.budget if resolved.budget is not None else default_budget(resolved.device.type)
    return distributed.smallest(budget)
