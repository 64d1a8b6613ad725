"""TRL's side of bench/step_time.py: DPOTrainer on the same model folder, rows, batch, max_length and LoRA, with
DPOConfig's defaults (or --trl-set changes), each optimizer step timed by a callback."""

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
    """DPOTrainer that notes each micro-batch's non-padding token count (a lazy tensor sum, no sync)."""
    from trl import DPOTrainer

    class CountingDPOTrainer(DPOTrainer):
        bench_tokens: list = []

        def training_step(self, model, inputs, *args, **kwargs):
            self.bench_tokens.append(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    return CountingDPOTrainer


def required_settings(cfg, device: str, steps: int) -> dict:
    """Only what must match ours (or keep the run short and quiet); everything else is DPOConfig's default."""
    return {
        "output_dir": str(Path(cfg.output_dir) / "trl"),
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_length": cfg.max_length,
        "max_steps": steps,
        "report_to": "none",
        "save_strategy": "no",  # no checkpoint at the end (after the last on_step_end: not in any step time)
        "disable_tqdm": True,
        "use_cpu": device == "cpu",
    }


def bench_trl(cfg, device: str, steps: int, warmup: int, trl_sets: dict) -> dict:
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback
    from trl import DPOConfig

    from lowmem_dpo import data, models

    model_path = models.resolve_model_path(cfg.model_name_or_path)
    required = required_settings(cfg, device, warmup + steps)
    timer, trainer_class = step_timer(device), counting_trainer()  # trl's modules load here, before the phase
    with PeakMemory(device) as pm:
        t_setup = time.perf_counter()
        rows = data.load_rows(cfg.dataset, cfg.dataset_split)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        defaults = DPOConfig(output_dir=required["output_dir"], use_cpu=required["use_cpu"], report_to="none")
        args = DPOConfig(**{**required, **trl_sets})
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.peft_target_modules, task_type="CAUSAL_LM")
        trainer = trainer_class(model=str(model_path), args=args, train_dataset=rows, processing_class=tokenizer,
                                peft_config=lora, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # keep stdout for the table (logging itself still happens)
        setup_s = time.perf_counter() - t_setup
        result = trainer.train()
    tokens = [int(t) for t in trainer_class.bench_tokens]
    per_step = [sum(tokens[i:i + cfg.gradient_accumulation_steps])
                for i in range(0, len(tokens), cfg.gradient_accumulation_steps)]
    effective = {k: getattr(args, k) for k in (*REPORTED, *required) if hasattr(args, k)}
    changed = {k: {"default": jsonable(getattr(defaults, k, None)), "used": jsonable(v)}
               for k, v in trl_sets.items()}
    out = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "settings": {k: jsonable(v) for k, v in effective.items()},
        "set_beyond_required": changed,
        "lora": {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                 "target_modules": cfg.peft_target_modules},
        "reference": "live forward with the adapter disabled (TRL default for a PEFT model, no precompute)",
        "weights_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "setup_s": round(setup_s, 3),
        "warmup_s": [round(t, 4) for t in timer.times[:warmup]],
        **summarize(timer.times[warmup:], per_step[warmup:len(timer.times)], timer.cpu_times[warmup:]),
        "train_loss": round(float(result.training_loss), 6),
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }
    del trainer
    return out
