"""Stage A: supervised fine-tuning of a LoRA adapter, the starting point (and the reference) of a DPO stage.

    lowmem-dpo sft lowmem_dpo:tiny-sft [key=value ...]

The loss is the mean negative log-likelihood of the completion tokens only (prompt and padding contribute
nothing), as TRL's SFTTrainer with completion_only_loss: rows with `prompt`/`completion` (TRL's prompt-completion
format, text or conversations), or preference rows, whose `prompt`/`chosen` are used. Text completions get the
EOS token appended. Model loading, quantization, device rules, gradient checkpointing, optimizer and schedule are
train's (same keys), so stage A fits where stage B fits.

Writes to output_dir: config.yaml (resolved), metrics.jsonl (step, loss, grad_norm, learning_rate, step_time_s,
tokens_per_s), and a standard PEFT adapter (adapter_config.json, adapter_model.safetensors) whose
base_model_name_or_path names the base, so `model_name_or_path=OUTPUT_DIR` points a DPO recipe at base + adapter.
"""

# Train's policy setup (policy.py), step and loop run stage A too, with SFT's entry (training/objective.py).

from __future__ import annotations

from pathlib import Path

from lowmem_dpo import data
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config, require
from lowmem_dpo.config.schedule import learning_rate_warning
from lowmem_dpo.config.schema import Config
from lowmem_dpo.model import adapters, headcheck, models
from lowmem_dpo.model.tiny import BUILTIN_PREFIX
from lowmem_dpo.objectives.metrics import GEN_REPETITION, GEN_ROUGE_L, LOSS
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import inputs, loop, output, policy, resuming
from lowmem_dpo.training.objective import Batching, Rows
from lowmem_dpo.training.session import RunSetup, Session
from lowmem_dpo.training.session import start as start_session

# the eval metrics an SFT run logs (metric_for_best_model)
SFT_METRICS = (LOSS.eval, GEN_REPETITION.eval, GEN_ROUGE_L.eval)


def base_name(spec: str) -> str:
    """How the saved adapter names its base: a built-in or hub name as given, a local folder as an absolute path
    (so the adapter folder works from any working directory)."""
    if spec.startswith(BUILTIN_PREFIX) or not Path(spec).is_dir():
        return spec
    return str(Path(spec).resolve())


def setup(cfg: Config, progress: bool = True) -> Session:
    """Tokenize the SFT rows, load the model with one adapter (fresh, or an SFT adapter continued), optimizer;
    with resume=auto and a checkpoint in output_dir (or resume=PATH), continue from it, as train does."""
    if cfg.has_eval and cfg.best_metric_name not in SFT_METRICS:
        raise UserError(f"metric_for_best_model={cfg.metric_for_best_model} is a DPO metric; sft evaluates "
                        f"{' and '.join(SFT_METRICS)}: set one of them")
    require(cfg, "sft")
    output.check_output_dir(cfg, "sft")  # a folder of other files is refused before anything loads
    resolved = devices.resolve(cfg)
    for note in [*cfg.no_effect(), *filter(None, [learning_rate_warning(cfg.learning_rate)])]:
        log(f"warning: {note}")
    source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)
    adapters.check_mode(cfg, source, resolved.quantization, reference=False)
    resume = resuming.find_resume(cfg)
    # The planner plans a DPO step: 2 x per_device_train_batch_size sequences, twice an SFT step's.
    stream = policy.apply_plan(adapters.planned_lora(cfg, source), resolved, source.base_path)
    devices.check_bitsandbytes(resolved)
    log(source.description)
    tokenizer = models.load_tokenizer(source.tokenizer_path, cfg.chat_template, source.base_path)
    dataset = inputs.load_data(cfg, tokenizer, progress, sft=True)  # logs the rows it skips and the eval split
    files = inputs.file_components(cfg, source.base_path, source.adapter_path, source.tokenizer_path, dataset.mixture)
    trains_on = inputs.run_inputs(files, dataset.train)  # no reference cache in SFT
    resuming.check_before_load(cfg, resume, trains_on, len(dataset.train))
    model = policy.setup_model(cfg, resolved, source.base_path, stream, source=source)
    if source.adapter_path is None:  # a fresh adapter on the base: name the base portably
        model.peft_config["default"].base_model_name_or_path = base_name(cfg.model_name_or_path)
    pad_id = data.pad_token_id(tokenizer)
    layout = headcheck.bring_up(model, cfg, resolved, pad_id, dataset.train[:2], train=True)  # never shared
    # SFT means to move away from its base: the KL from it is no warning sign there (nor measured)
    run = RunSetup(cfg, resolved, Rows(batching=Batching(resolved, pad_id, layout)), dataset.train, pad_id,
                   trains_on, dataset.eval, tokenizer, dataset.prompts, adapter_off_is_start=False,
                   row_formats=dataset.tok.formats)
    session = start_session(run, model, resume)
    progress = session.progress
    session.opening = [
        f"sft: training {sum(p.numel() for p in session.trainee.params):,} LoRA parameters for {run.steps} steps of "
        f"{progress.micro_batch} x {progress.grad_accum} rows ({len(run.items)} rows in the data), loss on "
        "completion tokens only"]
    return session


def run(cfg: Config, progress: bool = True) -> loop.TrainResult:
    """Fine-tune and save the adapter to cfg.output_dir; full-state checkpoints every save_steps under
    output_dir/checkpoints, resumed from as train does (resume=auto|never|PATH)."""
    with output.running(cfg, "sft"):
        return loop.run(setup(cfg, progress), progress)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "sft", __doc__))
