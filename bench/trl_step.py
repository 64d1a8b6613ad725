"""TRL's side of bench/step_time.py: DPOTrainer on the same model folder, rows, batch, max_length and LoRA, each
optimizer step timed by a callback. Two setups of the same work: "default" (DPOConfig's defaults, or --trl-set
changes) and "best" (BEST: TRL set up as fast as it goes for this work; --trl-best-set changes)."""

from __future__ import annotations

import time
from pathlib import Path

from timing import PeakMemory, jsonable, summarize, synchronize

# DPOConfig settings reported in the JSON as the run used them (its defaults unless --trl-set changed them).
REPORTED = ("bf16", "fp16", "gradient_checkpointing", "gradient_checkpointing_kwargs", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "optim", "weight_decay", "max_grad_norm", "beta", "loss_type",
            "precompute_ref_log_probs", "disable_dropout", "padding_free", "pad_to_multiple_of", "truncation_mode",
            "dataloader_num_workers", "torch_compile", "seed", "logging_steps", "activation_offloading",
            "use_liger_kernel")


# The two TRL setups --vs-trl times: what each is, in the JSON and the report.
SETUPS = {
    "default": "DPOConfig's defaults: bf16 autocast over float32 weights, gradient checkpointing, live reference "
               "forward (the adapter disabled) in every step",
    "best": "TRL at its best on the same work: reference log-probs precomputed before training, no gradient "
            "checkpointing, bf16 autocast over bfloat16 weights where the device has native bf16 (else float32)",
}

# DPOConfig options looked at for "best" (TRL 1.16) and left at their defaults, with why: the JSON records this.
NOT_CHANGED = {
    "padding_free": "disabled in TRL 1.16: DPOTrainer warns and falls back to padding",
    "use_logits_to_keep": "not a DPOConfig option in TRL 1.16; its fused LM head already computes the log-probs "
                          "in chunks without the full logits",
    "pad_to_multiple_of": "already None off Neuron ('auto'): no padding beyond the batch's longest row",
    "torch_compile": "the batches' lengths differ, so a compiled model recompiles in the timed steps",
    "use_liger_kernel": "deprecated in TRL 1.16, Triton kernels (CUDA only)",
    "optim": "already adamw_torch_fused; ours runs torch's AdamW over the same LoRA parameters",
    "dataloader_num_workers": "collation happens before on_step_begin, outside the timed step",
    "max_length / truncation_mode": "kept equal to ours: nothing in the bench rows is cut",
}


def native_bf16(device: str) -> bool:
    """Whether the device runs bfloat16 natively: the rule lowmem_dpo's dtype=auto follows (lowmem_dpo.runtime.devices)."""
    import torch

    from lowmem_dpo.runtime import devices

    if device == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return devices.cpu_has_native_bf16()


BEST_KEYS = {"precompute_ref_log_probs", "gradient_checkpointing", "bf16"}  # what every "best" setup changes


def best_settings(cfg, device: str) -> dict:
    """DPOConfig changes that make TRL fastest on the same pairs, lengths and loss (see SETUPS["best"])."""
    bf16 = native_bf16(device)
    out = {
        "precompute_ref_log_probs": True,  # the reference forward leaves the step, as with our cache
        "precompute_ref_batch_size": cfg.precompute_batch_size,  # precompute's batch, as ours (not in a step)
        "gradient_checkpointing": False,  # no recomputation: memory is not the limit for this model
        "bf16": bf16,  # autocast to bf16 only where it is native (emulated bf16 is slower than float32)
    }
    if bf16:
        # the frozen base in bfloat16, as ours (dtype=auto): no float32 -> bf16 weight cast in every matmul;
        # peft keeps the LoRA weights in float32 (autocast_adapter_dtype), as ours
        out["model_init_kwargs"] = {"dtype": "bfloat16"}
    return out


def step_timer(device: str):
    """A TrainerCallback timing each optimizer step: on_step_begin .. on_step_end (forward, backward, clip,
    step), wall and CPU seconds."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.c0 = time.process_time()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self.t0)
            self.cpu_times.append(time.process_time() - self.c0)

    return StepTimer()


def counting_trainer():
    """DPOTrainer that notes each micro-batch's non-padding token count (a lazy tensor sum, no sync) and the
    positions it computes (its padded input's size), and times its reference precompute (precompute_ref_log_probs:
    in __init__, before any step)."""
    from trl import DPOTrainer

    class CountingDPOTrainer(DPOTrainer):
        bench_tokens: list = []
        bench_computed: list = []
        bench_precompute: list = []  # (name, rows, seconds) per precomputed dataset

        def training_step(self, model, inputs, *args, **kwargs):
            self.bench_tokens.append(inputs["attention_mask"].sum())
            self.bench_computed.append(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *args, **kwargs)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            self.bench_precompute.append((name, len(dataset), time.perf_counter() - t0))
            return out

    return CountingDPOTrainer


def required_settings(cfg, device: str, steps: int, setup: str = "default") -> dict:
    """Only what must match ours (or keep the run short and quiet); everything else is DPOConfig's default."""
    return {
        "output_dir": str(Path(cfg.output_dir) / ("trl" if setup == "default" else f"trl-{setup}")),
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_length": cfg.max_length,
        "max_steps": steps,
        "report_to": "none",
        "save_strategy": "no",  # no checkpoint at the end (after the last on_step_end: not in any step time)
        "disable_tqdm": True,
        "use_cpu": device == "cpu",
    }


def setup_changes(cfg, device: str, setup: str, trl_sets: dict) -> dict:
    """The DPOConfig changes of one setup: best_settings for "best", then the command line's --trl(-best)-set."""
    if setup not in SETUPS:
        raise ValueError(f"unknown TRL setup {setup!r} (known: {', '.join(SETUPS)})")
    return {**(best_settings(cfg, device) if setup == "best" else {}), **trl_sets}


def bench_trl(cfg, device: str, steps: int, warmup: int, trl_sets: dict, setup: str = "default") -> dict:
    """W + N optimizer steps of TRL's DPOTrainer in one setup (SETUPS), each timed; trl_sets change DPOConfig."""
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback
    from trl import DPOConfig

    from lowmem_dpo import data
    from lowmem_dpo.model import models
    from lowmem_dpo.training import inputs

    model_path = models.resolve_model_path(cfg.model_name_or_path)
    required = required_settings(cfg, device, warmup + steps, setup)
    changes = setup_changes(cfg, device, setup, trl_sets)
    timer, trainer_class = step_timer(device), counting_trainer()  # trl's modules load here, before the phase
    with PeakMemory(device) as pm:
        t_setup = time.perf_counter()
        rows = inputs.mixture(cfg).dataset(data.REQUIRED)  # the recipe's rows (of its mixture), as ours reads them
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        defaults = DPOConfig(output_dir=required["output_dir"], use_cpu=required["use_cpu"], report_to="none")
        args = DPOConfig(**{**required, **changes})
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.peft_target_modules, task_type="CAUSAL_LM")
        trainer = trainer_class(model=str(model_path), args=args, train_dataset=rows, processing_class=tokenizer,
                                peft_config=lora, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # keep stdout for the table (logging itself still happens)
        setup_s = time.perf_counter() - t_setup
        result = trainer.train()
    tokens = [int(t) for t in trainer_class.bench_tokens]
    per_step, computed = ([sum(counts[i:i + cfg.gradient_accumulation_steps])
                           for i in range(0, len(counts), cfg.gradient_accumulation_steps)]
                          for counts in (tokens, trainer_class.bench_computed))
    out = {
        "setup": setup,
        "description": SETUPS[setup],
        **describe(cfg, trainer, args, defaults, required, changes, trl_sets),
        "setup_s": round(setup_s, 3),
        "reference_precompute": [{"dataset": name, "rows": n, "seconds": round(sec, 3),
                                  "rows_per_s": round(n / sec, 3) if sec > 0 else None}
                                 for name, n, sec in trainer_class.bench_precompute],
        "warmup_s": [round(t, 4) for t in timer.times[:warmup]],
        **summarize(timer.times[warmup:], per_step[warmup:len(timer.times)], timer.cpu_times[warmup:]),
        # every timed step's seconds, real tokens and computed positions (padding included), in order
        "step_times_s": timer.times[warmup:], "tokens_per_step": per_step[warmup:len(timer.times)],
        "computed_per_step": computed[warmup:len(timer.times)],
        "train_loss": round(float(result.training_loss), 6),
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }
    del trainer
    return out


def describe(cfg, trainer, args, defaults, required: dict, changes: dict, trl_sets: dict) -> dict:
    """What the run used: versions, the effective DPOConfig settings, what differs from DPOConfig's defaults."""
    import transformers
    import trl

    effective = {k: getattr(args, k) for k in (*REPORTED, *required, *changes) if hasattr(args, k)}
    changed = {k: {"default": jsonable(getattr(defaults, k, None)), "used": jsonable(getattr(args, k, v))}
               for k, v in changes.items()}
    precomputed = bool(args.precompute_ref_log_probs)
    return {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "settings": {k: jsonable(v) for k, v in effective.items()},
        # every DPOConfig change beyond required_settings (the setup's own and --trl-set / --trl-best-set)
        "set_beyond_required": changed,
        "set_on_command_line": sorted(trl_sets),
        "left_at_default_why": NOT_CHANGED if changes.keys() >= BEST_KEYS else None,
        "lora": {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                 "target_modules": cfg.peft_target_modules},
        "reference": ("precomputed before training (precompute_ref_log_probs, in DPOTrainer's __init__: in "
                      "setup_s, not in any step)" if precomputed else
                      "live forward with the adapter disabled (TRL default for a PEFT model, no precompute)"),
        "weights_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
