"""Train a LoRA DPO policy against cached reference log-probs: one model resident, no reference forward.

    python -m lowmem_dpo.precompute recipes/tiny-cpu.yaml   # once
    python -m lowmem_dpo.train recipes/tiny-cpu.yaml [key=value ...]

Writes to output_dir: config.yaml (resolved), metrics.jsonl (one JSON object per logged step, TRL key names),
and the final PEFT adapter (adapter_config.json, adapter_model.safetensors). When model_name_or_path (or
sft_adapter) names an SFT LoRA adapter, that adapter is the one trained (adapters.py).
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

from lowmem_dpo import adapters, cache, checkpoint, data, devices, guards, inputs
from lowmem_dpo.cli import UserError, log, run_cli
from lowmem_dpo.config import Config, load_config
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.loss import dpo_loss
from lowmem_dpo.models import ModelSource
from lowmem_dpo.precompute import rebuild_command

METRIC_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


# -- setup steps -------------------------------------------------------------------------------------------------
def new_adapter(cfg: Config, base):
    """A fresh LoRA adapter from the recipe's lora_* keys on `base` (B = 0: the policy starts equal to base)."""
    from peft import LoraConfig, get_peft_model

    adapters.check_no_adapter(base, "a fresh LoRA adapter")
    targets = cfg.lora_target_modules
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      task_type="CAUSAL_LM")
    torch.manual_seed(cfg.seed)  # LoRA A init
    try:
        return get_peft_model(base, lora)
    except ValueError as e:
        raise UserError(f"lora_target_modules={targets}: {e}") from None


def setup_model(cfg: Config, resolved: devices.Resolved, model_path: Path, device_map: dict | None = None,
                offload_folder: Path | None = None, source: ModelSource | None = None):
    """Base model (frozen, dropout off, quantized if asked) + one LoRA adapter whose every parameter gets a
    gradient, with or without a quantized base, gradient checkpointing and layers offloaded by `device_map`: the
    SFT adapter of `source` continued, or a fresh one (on the base with the SFT adapter merged in, for
    adapter_mode=new_on_merged)."""
    from lowmem_dpo.models import load_model, place_offloaded_adapters

    base = load_model(model_path, resolved.device, resolved.dtype, resolved.quantization, device_map=device_map,
                      offload_folder=offload_folder)
    model = adapters.sft_policy(base, cfg, source) if source is not None else None
    if model is None:
        model = new_adapter(cfg, base)
    placed = place_offloaded_adapters(model, resolved.device)
    if placed:
        log(f"offload: the LoRA weights of {len(placed)} adapted modules on offloaded layers stay on "
            f"{resolved.device.type}; only the frozen base weights stream")
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


def pair_stream(pairs: list[data.TokenizedPair], seed: int):
    """Endless stream of pairs: each epoch a fresh seeded permutation. Each optimizer step takes its pairs from
    here, so a step's pairs do not depend on how they are split into micro-batches, and a resumed run skips
    exactly the pairs it consumed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(len(pairs), generator=g).tolist():
            yield pairs[i]


def take(stream, n: int) -> list:
    return [next(stream) for _ in range(n)]


def split(pairs: list, micro_batch: int) -> list[list]:
    """The micro-batches of one optimizer step, in order."""
    return [pairs[i:i + micro_batch] for i in range(0, len(pairs), micro_batch)]


# -- one step ----------------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    sums: dict = field(default_factory=lambda: dict.fromkeys(METRIC_KEYS, 0.0))
    pairs: int = 0
    tokens: int = 0
    chosen_tokens: int = 0  # completion tokens of the chosen sides (per-token guard)

    def add(self, other: "StepStats") -> None:
        for k in METRIC_KEYS:
            self.sums[k] += other.sums[k]
        self.pairs += other.pairs
        self.tokens += other.tokens
        self.chosen_tokens += other.chosen_tokens

    def means(self) -> dict:
        return {k: v / max(1, self.pairs) for k, v in self.sums.items()}

    @property
    def empty(self) -> bool:
        return self.pairs == 0


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
    """Forward+backward over the micro-batches of one optimizer step; gradients accumulate in the params. The
    loss is the mean over all the step's pairs whatever the split (the out-of-memory back-off changes it)."""
    stats = StepStats()
    device = resolved.device
    n_pairs = sum(len(pairs) for pairs in group)
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
        (losses.sum() / n_pairs).backward()
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
        stats.chosen_tokens += int(chosen.n_tokens.sum())
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
    steps: int  # optimizer steps this run takes in all (a resumed run included)
    stream: object  # pair_stream() generator, positioned after the pairs already trained on
    micro_batch: int  # pairs per forward; the out-of-memory back-off halves it
    grad_accum: int  # micro-batches per optimizer step; doubled with each halving
    step: int = 0  # optimizer steps finished
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient, in all
    nonfinite_in_a_row: int = 0
    window: StepStats = field(default_factory=StepStats)  # stats since the last logged line
    metrics_lines: list[str] = field(default_factory=list)  # metrics.jsonl so far
    resumed_from: Path | None = None
    replaces: list[Path] = field(default_factory=list)  # an earlier run's checkpoints, removed at the first save

    @property
    def pairs_per_step(self) -> int:
        return self.cfg.per_device_train_batch_size * self.cfg.gradient_accumulation_steps


def apply_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> dict | None:
    """Train's `auto` memory choices from the same planner as `python -m lowmem_dpo.plan`: with
    gradient_checkpointing=auto, checkpointing goes on when the planner says the run needs it to fit
    memory_budget (default: the device's memory). Knobs that are not auto are only advised, with numbers.

    Returns the device_map for CPU offload (on CUDA, when even the planner's other knobs leave train over the
    budget: the trailing decoder layers stay in CPU RAM and stream through the GPU; checkpointing goes on), or
    None."""
    from lowmem_dpo import plan

    budget = plan.run_budget(cfg, resolved.device.type)
    arch = plan.arch_of_run(model_path, "using the device rule's choices")
    if arch is None:
        return None
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
    if resolved.device.type != "cuda":
        return None
    # The run as configured (the advice above is not applied), with checkpointing: offload needs it.
    setup = dataclasses.replace(plan.setup_from_config(cfg, budget), gradient_checkpointing=True)
    device_map = plan.offload_map(arch, setup, budget, "train", resolved.device.index or 0)
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


def setup(cfg: Config, recipe: str | None = None, progress: bool = True) -> Session:
    """Check the cache, tokenize, load the model with its one adapter (fresh, or the SFT adapter continued), build
    the optimizer; with resume=auto and a checkpoint in output_dir (or resume=PATH), continue from it."""
    resolved = devices.resolve(cfg)
    ins = inputs.prepare(cfg, resolved)
    adapters.check_mode(cfg, ins.source, resolved.quantization)
    resume_from, saved = find_resume(cfg)  # before anything heavy: a bad path or changed settings fail fast
    device_map = apply_plan(adapters.planned_lora(cfg, ins.source), resolved, ins.model_path)
    cache_dir = Path(cfg.ref_cache_dir)
    ref = None
    if cfg.ref_source == "cache":
        # Before anything heavy loads: a stale cache is refused in seconds.
        check_cache(cache_dir, ins.fingerprint, rebuild_command(cfg, recipe))
        ref = cache.load_ref_cache(cache_dir)
    check_bitsandbytes(resolved)
    log(ins.source.description)
    tok = inputs.tokenized(cfg, ins.tokenizer, progress)  # logs the rows it skips
    if ref is not None:
        check_cache_rows(ref, tok.pairs, cache_dir)
    model = setup_model(cfg, resolved, ins.model_path, device_map, source=ins.source)
    steps = total_steps(cfg, len(tok.pairs))
    opt, sched, params = setup_optimizer(cfg, model, steps, resolved)
    s = Session(cfg, resolved, model, opt, sched, params, ref, tok.pairs, data.pad_token_id(ins.tokenizer),
                steps, pair_stream(tok.pairs, cfg.seed), cfg.per_device_train_batch_size,
                cfg.gradient_accumulation_steps)
    return resume_or_start(s, resume_from, saved)


def find_resume(cfg: Config) -> tuple[Path | None, checkpoint.TrainerState | None]:
    """The checkpoint this run continues from (resume=auto: the newest in output_dir; resume=PATH) and its
    state, refused when it was written with settings that change the numbers; (None, None) to start over."""
    resume_from = checkpoint.find(cfg.output_dir, cfg.resume)
    if resume_from is None:
        return None, None
    saved = checkpoint.read_state(resume_from)
    changed = checkpoint.config_changes(saved.config, dataclasses.asdict(cfg))
    if changed:
        raise UserError(f"{resume_from} was written by a run with other settings ("
                        + ", ".join(f"{k}: {saved.config.get(k)!r} -> {getattr(cfg, k, None)!r}" for k in changed)
                        + "); restore them to resume, or pass resume=never to start over (the old checkpoints"
                        " are replaced as the new run saves)")
    return resume_from, saved


def resume_or_start(s: Session, resume_from: Path | None, saved: checkpoint.TrainerState | None) -> Session:
    """Put a freshly set-up session where checkpoint `resume_from` left off (weights, optimizer, schedule, RNG,
    data position, batch split, the metrics so far); or, starting over, note the old checkpoints it replaces."""
    if saved is None:
        s.replaces = [p for _, p in checkpoint.complete(s.cfg.output_dir)]
        return s
    checkpoint.restore(resume_from, s.model, s.opt, s.sched)
    take(s.stream, saved.pairs_seen)  # the data order is a function of the seed: replay it
    s.step, s.skipped_steps = saved.step, saved.skipped_steps
    s.micro_batch, s.grad_accum = saved.micro_batch, saved.grad_accum
    s.window = type(s.window)(**saved.window)
    s.metrics_lines = checkpoint.metrics_lines(resume_from)
    s.resumed_from = resume_from
    return s


def open_metrics(s: Session, out_dir: Path):
    """metrics.jsonl as of the checkpoint the run resumes from (empty for a new run), open for appending: a
    resumed run continues it without repeating a step. Logs where the run starts."""
    if s.resumed_from is not None:
        log(f"resuming from {s.resumed_from} (step {s.step} of {s.steps})")
    elif s.replaces:
        log(f"starting over (resume={s.cfg.resume}): the {len(s.replaces)} checkpoints in "
            f"{checkpoint.root(out_dir)} are replaced by this run's first one")
    cache.atomic_write_bytes(out_dir / "metrics.jsonl", "".join(s.metrics_lines).encode())
    return open(out_dir / "metrics.jsonl", "a", encoding="utf-8")


def checkpoint_state(s: Session) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(step=s.step, pairs_seen=s.step * s.pairs_per_step, micro_batch=s.micro_batch,
                                   grad_accum=s.grad_accum, skipped_steps=s.skipped_steps,
                                   window=dataclasses.asdict(s.window), config=dataclasses.asdict(s.cfg))


def dpo_backward(s: Session, pairs: list[data.TokenizedPair]) -> StepStats:
    return train_step(s.model, s.cfg, split(pairs, s.micro_batch), s.ref, s.pad_id, s.resolved)


def backward_with_backoff(s: Session, pairs: list, backward=dpo_backward):
    """backward(s, pairs): forward+backward of one optimizer step's pairs (or SFT rows) split into micro-batches of
    s.micro_batch. On out-of-memory, halve the micro-batch (the accumulation doubles: the same pairs, the same
    update) and retry, down to 1 pair."""
    while True:
        try:
            return backward(s, pairs)
        except Exception as e:
            if not devices.is_out_of_memory(e):
                raise
            s.opt.zero_grad(set_to_none=True)  # drop the partial step's gradients
            del e  # its traceback holds the failed step's tensors
            devices.release_memory(s.resolved.device)
            if s.micro_batch == 1:
                raise UserError(f"out of memory at step {s.step + 1} with 1 pair per micro-batch; lower max_length, "
                                "or set quantization=4bit / gradient_checkpointing=true (python -m "
                                "lowmem_dpo.plan RECIPE.yaml shows what fits)") from None
            s.micro_batch = max(1, s.micro_batch // 2)
            s.grad_accum = math.ceil(len(pairs) / s.micro_batch)
            log(f"out of memory at step {s.step + 1}: retrying with per_device_train_batch_size={s.micro_batch} "
                f"gradient_accumulation_steps={s.grad_accum} (the same {len(pairs)} pairs per step)")


def optimizer_step(s: Session) -> tuple[StepStats, float, float]:
    """One optimizer step over the next pairs_per_step pairs: forward+backward by micro-batches, clip, AdamW,
    schedule. A non-finite loss or gradient skips the update (the schedule still advances);
    max_nonfinite_steps in a row stop the run. Returns (stats, grad_norm before clipping, learning rate)."""
    pairs = take(s.stream, s.pairs_per_step)
    lr = s.sched.get_last_lr()[0]
    stats = backward_with_backoff(s, pairs)
    return stats, apply_gradients(s, stats.sums["loss"] / max(1, stats.pairs)), lr


def apply_gradients(s: Session, loss: float) -> float:
    """The update after a step's backward (train's and sft's): clip; AdamW unless `loss` (the step's mean) or the
    gradient norm is non-finite; schedule; zero the gradients. Returns the gradient norm before clipping."""
    max_norm = s.cfg.max_grad_norm if s.cfg.max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(s.params, max_norm).item()
    s.step += 1
    if guards.nonfinite(loss, grad_norm):
        s.skipped_steps += 1
        s.nonfinite_in_a_row += 1
        log(f"warning: step {s.step}: non-finite loss ({loss:.4g}) or gradient "
            f"norm ({grad_norm:.4g}); update skipped ({s.nonfinite_in_a_row} in a row)")
        if s.nonfinite_in_a_row >= s.cfg.max_nonfinite_steps:
            raise UserError(f"diverged: {s.nonfinite_in_a_row} steps in a row with a non-finite loss or gradient "
                            f"(up to step {s.step}); the weights were not updated by them and "
                            + last_checkpoint_note(s) + "; lower learning_rate or check the data and the cache")
    else:
        s.nonfinite_in_a_row = 0
        s.opt.step()
    s.sched.step()
    s.opt.zero_grad(set_to_none=True)
    return grad_norm


def last_checkpoint_note(s: Session) -> str:
    found = checkpoint.complete(s.cfg.output_dir)
    return (f"the last checkpoint, {found[-1][1]} (step {found[-1][0]}), is intact" if found
            else "no checkpoint was written (save_steps)")


@dataclass
class TrainResult:
    metrics: dict  # the last logged line of metrics.jsonl
    model: object  # the PEFT model as trained (in memory)


def save_final(s: Session, out_dir: Path) -> None:
    """The adapter into output_dir, refusing non-finite weights and a disk without room for it."""
    bad = [n for n, p in s.model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if bad:
        raise UserError(f"not saving: {len(bad)} LoRA weights are not finite (first: {bad[0]}); "
                        + last_checkpoint_note(s))
    need = sum(p.numel() * p.element_size() for p in s.params) + (1 << 20)
    then = checkpoint.resume_note(s.cfg.output_dir)
    cache.ensure_free_space(out_dir, need, "the adapter", then)
    try:
        save_adapter(s.model, out_dir)
    except OSError as e:
        if cache.is_disk_full(e):
            raise cache.disk_full_error(out_dir, "the adapter", need, then) from None
        raise


def log_line(s: Session, stats: StepStats, grad_norm: float, lr: float, dt: float) -> dict:
    """The metrics.jsonl line for this step: the window's means (null when every step since the last line was
    skipped as non-finite), the step's gradient norm, learning rate and timing."""
    means = dict.fromkeys(s.window.means()) if s.window.empty else s.window.means()
    line = {"step": s.step, **{k: None if v is None else round(v, 6) for k, v in means.items()},
            "grad_norm": round(grad_norm, 6) if math.isfinite(grad_norm) else None,
            "learning_rate": lr, "step_time_s": round(dt, 6), "tokens_per_s": round(stats.tokens / dt, 3)}
    peak = devices.peak_memory_bytes(s.resolved.device)
    if peak is not None:
        line["peak_mem_bytes"] = peak
    return line


def start_output(s: Session) -> Path:
    """output_dir with the resolved config.yaml; the resolved choices in the log."""
    out_dir = Path(s.cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved_note = "".join(f"# resolved {r}\n" for r in s.resolved.reasons)
    cache.atomic_write_bytes(out_dir / "config.yaml", (s.cfg.to_yaml() + resolved_note).encode())
    for reason in s.resolved.reasons:
        log(f"resolved {reason}")
    return out_dir


def timed(s: Session, step) -> tuple:
    """`step(s)`'s (stats, grad_norm, lr) and its wall seconds, the device synchronized before and after."""
    devices.synchronize(s.resolved.device)
    t0 = time.perf_counter()
    stats, grad_norm, lr = step(s)
    devices.synchronize(s.resolved.device)
    return stats, grad_norm, lr, time.perf_counter() - t0


def run(cfg: Config, recipe: str | None = None, progress: bool = True) -> TrainResult:
    """Train and save the adapter to cfg.output_dir; checkpoints every save_steps; resumes per cfg.resume."""
    from tqdm.auto import tqdm

    s = setup(cfg, recipe, progress)
    out_dir = start_output(s)
    log(f"reference: {'cached in ' + cfg.ref_cache_dir if s.ref is not None else 'live (adapter disabled), costs a forward'}")
    log(f"training {sum(p.numel() for p in s.params):,} LoRA parameters for {s.steps} steps of "
        f"{s.micro_batch} x {s.grad_accum} pairs ({len(s.pairs)} pairs in the data)")
    last = json.loads(s.metrics_lines[-1]) if s.metrics_lines else {}
    bar = tqdm(total=s.steps, initial=s.step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
    with open_metrics(s, out_dir) as metrics_file:
        while s.step < s.steps:
            stats, grad_norm, lr, dt = timed(s, optimizer_step)
            if not guards.nonfinite(stats.sums["loss"]):
                s.window.add(stats)
            bar.update(1)
            step = s.step
            if step == 1 or step % cfg.logging_steps == 0 or step == s.steps:
                last = log_line(s, stats, grad_norm, lr, dt)
                line = json.dumps(last) + "\n"
                metrics_file.write(line)
                metrics_file.flush()
                s.metrics_lines.append(line)
                signs = []
                if not s.window.empty:  # else every step since the last line was skipped (already warned)
                    bar.set_postfix(loss=f"{last['loss']:.4f}", acc=f"{last['rewards/accuracies']:.2f}",
                                    margin=f"{last['rewards/margins']:.3f}")
                    signs = guards.warning_signs(s.window.means(), step, s.steps, cfg.beta,
                                                 s.window.chosen_tokens / s.window.pairs)
                s.window = StepStats()
                for sign in signs:
                    log(f"warning: step {step}: {sign}")
                if signs and cfg.early_stop_on_divergence:
                    raise UserError(f"stopped at step {step} (early_stop_on_divergence=true): {signs[0]}; "
                                    + last_checkpoint_note(s))
            if cfg.save_steps and (step % cfg.save_steps == 0 or step == s.steps):
                checkpoint.save(out_dir, checkpoint_state(s), s.model, s.opt, s.sched, s.metrics_lines,
                                cfg.save_total_limit, s.replaces)
                s.replaces = []
    bar.close()
    if s.skipped_steps:
        log(f"note: {s.skipped_steps} updates were skipped for a non-finite loss or gradient")
    save_final(s, out_dir)
    if last and last.get("loss") is not None:
        log(f"saved adapter to {out_dir} (step {s.steps}: loss {last['loss']:.4f}, rewards/accuracies "
            f"{last['rewards/accuracies']:.2f})")
    else:
        log(f"saved adapter to {out_dir} (step {s.steps})")
    return TrainResult(last, s.model)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]), recipe=argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "train", __doc__))
