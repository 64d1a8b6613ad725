"""Train a LoRA DPO policy against cached reference log-probs: one model resident, no reference forward.

    python -m lowmem_dpo.precompute recipes/tiny-cpu.yaml   # once
    python -m lowmem_dpo.train recipes/tiny-cpu.yaml [key=value ...]

Writes to output_dir: config.yaml (resolved), metrics.jsonl (one JSON object per logged step, TRL key names),
and the final PEFT adapter (adapter_config.json, adapter_model.safetensors).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowmem_dpo import cache, data, devices, inputs
from lowmem_dpo.cli import UserError, log, run_cli
from lowmem_dpo.config import Config, load_config
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.loss import dpo_loss
from lowmem_dpo.precompute import rebuild_command

METRIC_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


# -- setup steps -------------------------------------------------------------------------------------------------
def setup_model(cfg: Config, resolved: devices.Resolved, model_path: Path):
    """Base model (frozen, dropout off, quantized if asked) + a fresh LoRA adapter whose every parameter gets a
    gradient, with or without a quantized base and gradient checkpointing."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.models import load_model

    base = load_model(model_path, resolved.device, resolved.dtype, resolved.quantization)
    targets = cfg.lora_target_modules
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      task_type="CAUSAL_LM")
    torch.manual_seed(cfg.seed)  # LoRA A init
    try:
        model = get_peft_model(base, lora)
    except ValueError as e:
        raise UserError(f"lora_target_modules={targets}: {e}") from None
    if resolved.gradient_checkpointing:
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


def total_steps(cfg: Config, num_pairs: int) -> int:
    if cfg.max_steps > 0:
        return cfg.max_steps
    per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return max(1, math.ceil(cfg.num_train_epochs * num_pairs / per_step))


def micro_batches(pairs: list[data.TokenizedPair], batch_size: int, seed: int):
    """Endless stream of micro-batches: each epoch a fresh seeded permutation, chunks cross epoch borders so
    every micro-batch is full."""
    g = torch.Generator().manual_seed(seed)
    buf: list[data.TokenizedPair] = []
    while True:
        for i in torch.randperm(len(pairs), generator=g).tolist():
            buf.append(pairs[i])
            if len(buf) == batch_size:
                yield buf
                buf = []


# -- one step ----------------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    sums: dict = field(default_factory=lambda: dict.fromkeys(METRIC_KEYS, 0.0))
    pairs: int = 0
    tokens: int = 0

    def add(self, other: "StepStats") -> None:
        for k in METRIC_KEYS:
            self.sums[k] += other.sums[k]
        self.pairs += other.pairs
        self.tokens += other.tokens

    def means(self) -> dict:
        return {k: v / max(1, self.pairs) for k, v in self.sums.items()}


def reference_logps(model, batch: data.Batch, ref: cache.RefCache | None):
    """(chosen, rejected) reference log-prob sums for this batch, (B,) each, on the CPU."""
    if ref is not None:
        return ref.chosen[batch.rows], ref.rejected[batch.rows]
    # ref_source=live: the same model with the adapter off. Costs a forward pass; for verification.
    with torch.no_grad(), model.disable_adapter():
        chosen, rejected = completion_logps(model, batch.input_ids, batch.attention_mask,
                                            batch.completion_mask).split()
    return chosen.logps.cpu(), rejected.logps.cpu()


def train_step(model, cfg: Config, group: list[list[data.TokenizedPair]], ref, pad_id: int,
               resolved: devices.Resolved) -> StepStats:
    """Forward+backward over the micro-batches of one optimizer step; gradients accumulate in the params."""
    stats = StepStats()
    device = resolved.device
    for pairs in group:
        batch = data.collate(pairs, pad_id).to(device)
        with devices.autocast(resolved.device, resolved.dtype):
            ref_chosen, ref_rejected = reference_logps(model, batch, ref)
            policy = completion_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        chosen, rejected = policy.split()  # (B,) each
        losses, r_chosen, r_rejected = dpo_loss(
            chosen.logps, rejected.logps, ref_chosen.to(device), ref_rejected.to(device),
            beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
            chosen_lengths=chosen.n_tokens, rejected_lengths=rejected.n_tokens)
        (losses.mean() / len(group)).backward()
        b = len(pairs)
        s = stats.sums
        s["loss"] += losses.detach().sum().item()
        s["rewards/chosen"] += r_chosen.sum().item()
        s["rewards/rejected"] += r_rejected.sum().item()
        s["rewards/accuracies"] += (r_chosen > r_rejected).float().sum().item()
        s["rewards/margins"] += (r_chosen - r_rejected).sum().item()
        s["logps/chosen"] += chosen.logps.detach().sum().item()
        s["logps/rejected"] += rejected.logps.detach().sum().item()
        stats.pairs += b
        stats.tokens += batch.num_tokens
    return stats


# -- output ------------------------------------------------------------------------------------------------------
def save_adapter(model, out_dir: Path) -> None:
    """PEFT adapter files into out_dir, each replaced atomically (a crash leaves the old file or the new one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=out_dir))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in sorted(tmp.iterdir()):
            os.chmod(f, 0o644)
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_cache_rows(ref: cache.RefCache, pairs: list[data.TokenizedPair], cache_dir: Path) -> None:
    rows = torch.tensor([p.row for p in pairs])
    if len(ref.chosen) <= int(rows.max()) or not torch.isfinite(ref.chosen[rows]).all():
        raise UserError(f"the reference cache in {str(cache_dir)!r} lacks rows this run trains on; rebuild it "
                        "with python -m lowmem_dpo.precompute")


def check_cache(cache_dir: Path, fingerprint: dict, rebuild_cmd: str) -> None:
    """cache.check_fingerprint; when only the reference's precision differs, the message also says which
    settings train against the cache as built (it may hold a higher-precision reference on purpose)."""
    try:
        cache.check_fingerprint(cache_dir, fingerprint, rebuild_cmd)
    except UserError as e:
        old = (cache.read_manifest(cache_dir) or {}).get("components", {})
        changed = {k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k)}
        if not changed or not changed <= {"dtype", "quantization"}:
            raise
        raise UserError(f"{e} ; or train against it as built: ref_quantization={old['quantization']} "
                        f"ref_dtype={old['dtype']} (the dtype and quantization above are the reference's)") from None


@dataclass
class Session:
    """Everything one training run holds: built by `setup`, advanced by `optimizer_step`."""

    cfg: Config
    resolved: devices.Resolved
    model: object  # PeftModel
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list  # the trainable LoRA parameters
    ref: cache.RefCache | None  # None: ref_source=live
    pairs: list[data.TokenizedPair]
    pad_id: int
    steps: int  # optimizer steps this run will take
    stream: object  # micro_batches() generator


def apply_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> None:
    """Train's `auto` memory choice from the same planner as `python -m lowmem_dpo.plan`: with
    gradient_checkpointing=auto, checkpointing goes on when the planner says the run needs it to fit
    memory_budget (default: the device's memory). Knobs that are not auto are only advised, with numbers."""
    from lowmem_dpo import plan

    budget = plan.run_budget(cfg, resolved.device.type)
    arch = plan.arch_of_run(model_path, "using the device rule's choices")
    if arch is None:
        return
    chosen = plan.choose(arch, cfg, budget)
    peak = chosen.prediction.train.peak_bytes
    overrides = dict(chosen.overrides)
    if cfg.gradient_checkpointing == "auto" and overrides.pop("gradient_checkpointing", None) == "true":
        resolved.gradient_checkpointing = True
        resolved.reasons.append(f"gradient_checkpointing=true (auto; the planner: needed to fit "
                                f"{plan.fmt(budget)}, train peak {plan.fmt(peak)} with it)")
    overrides.pop("precompute_batch_size", None)  # precompute's business, not train's
    if overrides:
        log(f"warning: the planner predicts this run does not fit {plan.fmt(budget)}; it would with: "
            + " ".join(f"{k}={v}" for k, v in overrides.items()) + " (python -m lowmem_dpo.plan shows the terms)")
    else:
        resolved.reasons.append(f"planner: train peak {plan.fmt(peak)} of a {plan.fmt(budget)} budget")
    if chosen.offload_layers and resolved.device.type == "cuda":
        setup = dataclasses.replace(plan.setup_from_config(cfg, budget),
                                    gradient_checkpointing=resolved.gradient_checkpointing)
        device_map = plan.offload_map(arch, setup, budget, "train")
        if device_map:
            off = devices.offloaded_layers(device_map)
            # peft puts the LoRA weights of a layer accelerate keeps off the device on the meta device, and
            # backward then fails there; LoRA on the resident layers only would be a different adapter.
            log(f"warning: train would need {len(off)} of {arch.layers} decoder layers in CPU RAM to fit "
                f"{plan.fmt(budget)}; train does not offload yet (LoRA on offloaded layers cannot get gradients): "
                "expect an out-of-memory error, or apply the planner's other advice")


def setup(cfg: Config, recipe: str | None = None, progress: bool = True) -> Session:
    """Check the cache, tokenize, load the model with a fresh adapter, build the optimizer."""
    resolved = devices.resolve(cfg)
    ins = inputs.prepare(cfg, resolved)
    apply_plan(cfg, resolved, ins.model_path)
    cache_dir = Path(cfg.ref_cache_dir)
    ref = None
    if cfg.ref_source == "cache":
        # Before anything heavy loads: a stale cache is refused in seconds.
        check_cache(cache_dir, ins.fingerprint, rebuild_command(cfg, recipe))
        ref = cache.load_ref_cache(cache_dir)
    needs_bnb = ([f"quantization={resolved.quantization}"] if resolved.quantization != "none" else []) + (
        [f"optimizer={resolved.optimizer} (the {resolved.kind} rule)"]
        if resolved.optimizer == devices.PAGED_ADAMW_8BIT else [])
    if needs_bnb:  # fail before tokenizing and loading, not after
        devices.import_bitsandbytes(" and ".join(needs_bnb))
    tok = inputs.tokenized(cfg, ins.tokenizer, progress)  # logs the rows it skips
    if ref is not None:
        check_cache_rows(ref, tok.pairs, cache_dir)
    model = setup_model(cfg, resolved, ins.model_path)
    steps = total_steps(cfg, len(tok.pairs))
    opt, sched, params = setup_optimizer(cfg, model, steps, resolved)
    stream = micro_batches(tok.pairs, cfg.per_device_train_batch_size, cfg.seed)
    return Session(cfg, resolved, model, opt, sched, params, ref, tok.pairs, data.pad_token_id(ins.tokenizer),
                   steps, stream)


def optimizer_step(s: Session) -> tuple[StepStats, float, float]:
    """One optimizer step: gradient_accumulation_steps micro-batches, clip, AdamW, schedule.
    Returns (stats, grad_norm before clipping, learning rate used)."""
    group = [next(s.stream) for _ in range(s.cfg.gradient_accumulation_steps)]
    lr = s.sched.get_last_lr()[0]
    stats = train_step(s.model, s.cfg, group, s.ref, s.pad_id, s.resolved)
    max_norm = s.cfg.max_grad_norm if s.cfg.max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(s.params, max_norm).item()
    s.opt.step()
    s.sched.step()
    s.opt.zero_grad(set_to_none=True)
    return stats, grad_norm, lr


@dataclass
class TrainResult:
    metrics: dict  # the last logged line of metrics.jsonl
    model: object  # the PEFT model as trained (in memory)


def run(cfg: Config, recipe: str | None = None, progress: bool = True) -> TrainResult:
    """Train and save the adapter to cfg.output_dir."""
    from tqdm.auto import tqdm

    s = setup(cfg, recipe, progress)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved_note = "".join(f"# resolved {r}\n" for r in s.resolved.reasons)
    cache.atomic_write_bytes(out_dir / "config.yaml", (cfg.to_yaml() + resolved_note).encode())
    for reason in s.resolved.reasons:
        log(f"resolved {reason}")
    log(f"reference: {'cached in ' + cfg.ref_cache_dir if s.ref is not None else 'live (adapter disabled), costs a forward'}")
    log(f"training {sum(p.numel() for p in s.params):,} LoRA parameters for {s.steps} steps of "
        f"{cfg.per_device_train_batch_size} x {cfg.gradient_accumulation_steps} pairs ({len(s.pairs)} pairs in the data)")

    window = StepStats()
    last: dict = {}
    bar = tqdm(total=s.steps, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    with open(out_dir / "metrics.jsonl", "w", encoding="utf-8") as metrics_file:
        for step in range(1, s.steps + 1):
            devices.synchronize(s.resolved.device)
            t0 = time.perf_counter()
            stats, grad_norm, lr = optimizer_step(s)
            devices.synchronize(s.resolved.device)
            dt = time.perf_counter() - t0
            window.add(stats)
            bar.update(1)
            if step == 1 or step % cfg.logging_steps == 0 or step == s.steps:
                last = {"step": step, **{k: round(v, 6) for k, v in window.means().items()},
                        "grad_norm": round(grad_norm, 6), "learning_rate": lr, "step_time_s": round(dt, 6),
                        "tokens_per_s": round(stats.tokens / dt, 3)}
                peak = devices.peak_memory_bytes(s.resolved.device)
                if peak is not None:
                    last["peak_mem_bytes"] = peak
                metrics_file.write(json.dumps(last) + "\n")
                metrics_file.flush()
                bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['rewards/accuracies']:.2f}",
                                margin=f"{last['rewards/margins']:.3f}")
                window = StepStats()
            if cfg.save_steps and step % cfg.save_steps == 0 and step != s.steps:
                save_adapter(s.model, out_dir / f"checkpoint-{step}")
    bar.close()
    save_adapter(s.model, out_dir)
    log(f"saved adapter to {out_dir} (step {s.steps}: loss {last['loss']:.4f}, rewards/accuracies "
        f"{last['rewards/accuracies']:.2f})")
    return TrainResult(last, s.model)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]), recipe=argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "train", __doc__))
