"""Stage A: supervised fine-tuning of a LoRA adapter, the starting point (and the reference) of a DPO stage.

    python -m lowmem_dpo.sft recipes/tiny-sft.yaml [key=value ...]

The loss is the mean negative log-likelihood of the completion tokens only (prompt and padding contribute
nothing), as TRL's SFTTrainer with completion_only_loss: rows with `prompt`/`completion` (TRL's prompt-completion
format, text or conversations), or preference rows, whose `prompt`/`chosen` are used. Text completions get the
EOS token appended. Model loading, quantization, device rules, gradient checkpointing, optimizer and schedule are
train's (same keys), so stage A fits where stage B fits.

Writes to output_dir: config.yaml (resolved), metrics.jsonl (step, loss, grad_norm, learning_rate, step_time_s,
tokens_per_s), and a standard PEFT adapter (adapter_config.json, adapter_model.safetensors) whose
base_model_name_or_path names the base, so `model_name_or_path=OUTPUT_DIR` points a DPO recipe at base + adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import adapters, checkpoint, data, devices, guards, models, train
from lowmem_dpo.cli import log, run_cli
from lowmem_dpo.config import Config, load_config
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.tiny import BUILTIN_PREFIX


@dataclass
class SFTStats:
    """Sums over the steps since the last log line; the loss is their mean over completion tokens."""

    nll: float = 0.0  # summed -log p of the completion tokens
    targets: int = 0  # completion tokens
    tokens: int = 0  # all tokens in the forward (for tokens_per_s)

    def add(self, other: "SFTStats") -> None:
        self.nll += other.nll
        self.targets += other.targets
        self.tokens += other.tokens

    def means(self) -> dict:
        return {"loss": self.nll / max(1, self.targets)}

    @property
    def empty(self) -> bool:
        return self.targets == 0


def base_name(spec: str) -> str:
    """How the saved adapter names its base: a built-in or hub name as given, a local folder as an absolute path
    (so the adapter folder works from any working directory)."""
    if spec.startswith(BUILTIN_PREFIX) or not Path(spec).is_dir():
        return spec
    return str(Path(spec).resolve())


def setup(cfg: Config, progress: bool = True) -> train.Session:
    """Tokenize the SFT rows, load the model with one adapter (fresh, or an SFT adapter continued), optimizer;
    with resume=auto and a checkpoint in output_dir (or resume=PATH), continue from it, as train does."""
    resolved = devices.resolve(cfg)
    source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)
    adapters.check_mode(cfg, source, resolved.quantization, reference=False)
    resume_from, saved = train.find_resume(cfg)
    # The planner plans a DPO step: 2 x per_device_train_batch_size sequences, twice an SFT step's.
    device_map = train.apply_plan(adapters.planned_lora(cfg, source), resolved, source.base_path)
    train.check_bitsandbytes(resolved)
    log(source.description)
    tokenizer = models.load_tokenizer(source.tokenizer_path)
    rows = data.load_rows(cfg.dataset, cfg.dataset_split, required=("prompt",))
    tok = data.tokenize_completions(rows, tokenizer, cfg.max_length, cfg.max_prompt_length, spec=cfg.dataset,
                                    progress=progress, strict=cfg.strict)  # logs the rows it skips
    model = train.setup_model(cfg, resolved, source.base_path, device_map, source=source)
    if source.adapter_path is None:  # a fresh adapter on the base: name the base portably
        model.peft_config["default"].base_model_name_or_path = base_name(cfg.model_name_or_path)
    steps = train.total_steps(cfg, len(tok.pairs))
    opt, sched, params = train.setup_optimizer(cfg, model, steps, resolved)
    s = train.Session(cfg, resolved, model, opt, sched, params, None, tok.pairs, data.pad_token_id(tokenizer),
                      steps, train.pair_stream(tok.pairs, cfg.seed), cfg.per_device_train_batch_size,
                      cfg.gradient_accumulation_steps, window=SFTStats())
    return train.resume_or_start(s, resume_from, saved)


def sft_backward(s: train.Session, items: list) -> SFTStats:
    """Forward+backward of one optimizer step's rows, by micro-batches of s.micro_batch; gradients accumulate."""
    batches = [data.collate_completions(chunk, s.pad_id) for chunk in train.split(items, s.micro_batch)]
    # The step's loss is the mean over all its completion tokens (as TRL), so each micro-batch's sum is divided by
    # the step's total, known before the first backward. Position t-1 predicts token t: mask[:, 1:] counts.
    n_targets = sum(int(b.completion_mask[:, 1:].sum()) for b in batches)
    stats = SFTStats()
    for batch in batches:
        batch = batch.to(s.resolved.device)
        with devices.autocast(s.resolved.device, s.resolved.dtype):
            out = completion_logps(s.model, batch.input_ids, batch.attention_mask, batch.completion_mask)  # (B,)
        (-out.logps.sum() / max(1, n_targets)).backward()
        stats.nll -= out.logps.detach().sum().item()
        stats.targets += int(out.n_tokens.sum())
        stats.tokens += batch.num_tokens
    return stats


def sft_step(s: train.Session) -> tuple[SFTStats, float, float]:
    """One optimizer step over the next pairs_per_step rows (out-of-memory halves the micro-batch, as in train).
    Returns (stats, grad_norm before clipping, learning rate used)."""
    lr = s.sched.get_last_lr()[0]
    stats = train.backward_with_backoff(s, train.take(s.stream, s.pairs_per_step), sft_backward)
    return stats, train.apply_gradients(s, stats.means()["loss"]), lr


def run(cfg: Config, progress: bool = True) -> train.TrainResult:
    """Fine-tune and save the adapter to cfg.output_dir; full-state checkpoints every save_steps under
    output_dir/checkpoints, resumed from as train does (resume=auto|never|PATH)."""
    from tqdm.auto import tqdm

    s = setup(cfg, progress)
    out_dir = train.start_output(s)
    log(f"sft: training {sum(p.numel() for p in s.params):,} LoRA parameters for {s.steps} steps of "
        f"{s.micro_batch} x {s.grad_accum} rows ({len(s.pairs)} rows in the data), loss on completion tokens only")
    last = json.loads(s.metrics_lines[-1]) if s.metrics_lines else {}
    bar = tqdm(total=s.steps, initial=s.step, desc="sft", unit="step", disable=not progress, dynamic_ncols=True)
    with train.open_metrics(s, out_dir) as metrics_file:
        while s.step < s.steps:
            stats, grad_norm, lr, dt = train.timed(s, sft_step)
            if not guards.nonfinite(stats.nll):
                s.window.add(stats)
            bar.update(1)
            if s.step == 1 or s.step % cfg.logging_steps == 0 or s.step == s.steps:
                last = train.log_line(s, stats, grad_norm, lr, dt)
                s.metrics_lines.append(json.dumps(last) + "\n")
                metrics_file.write(s.metrics_lines[-1])
                metrics_file.flush()
                if not s.window.empty:
                    bar.set_postfix(loss=f"{last['loss']:.4f}")
                s.window = SFTStats()
            if cfg.save_steps and (s.step % cfg.save_steps == 0 or s.step == s.steps):
                checkpoint.save(out_dir, train.checkpoint_state(s), s.model, s.opt, s.sched, s.metrics_lines,
                                cfg.save_total_limit, s.replaces)
                s.replaces = []
    bar.close()
    train.save_final(s, out_dir)
    loss = f": loss {last['loss']:.4f}" if last.get("loss") is not None else ""
    log(f"saved adapter to {out_dir} (step {s.steps}{loss})")
    return train.TrainResult(last, s.model)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "sft", __doc__))
