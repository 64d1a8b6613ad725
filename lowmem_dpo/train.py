"""Train a LoRA DPO policy against cached reference log-probs: one model resident, no reference forward.

    lowmem-dpo precompute lowmem_dpo:tiny-cpu   # once
    lowmem-dpo train lowmem_dpo:tiny-cpu [key=value ...]

Writes to output_dir: config.yaml (resolved), metrics.jsonl (one JSON object per logged step, TRL key names),
and the final PEFT adapter (adapter_config.json, adapter_model.safetensors). When model_name_or_path (or
sft_adapter) names an SFT LoRA adapter, that adapter is the one trained (adapters.py).
"""

# This module sets a DPO (or KTO) run up: the cache checked, the data, the model, the objective's entry
# (training/objective.py). The step (training/step.py) and the loop (training/loop.py) are shared with sft.py.

from __future__ import annotations

from lowmem_dpo import data, objectives
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config, require
from lowmem_dpo.config.schedule import learning_rate_warning
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache, sides
from lowmem_dpo.model import adapters, headcheck
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.training import inputs, kto, loop, output, policy, resuming
from lowmem_dpo.training.objective import Batching, Pairs
from lowmem_dpo.training.session import RunSetup, Session
from lowmem_dpo.training.session import start as start_session
from lowmem_dpo.training.signs import judged_limits


def opening_lines(session: Session) -> list[str]:
    """The log lines that open a DPO or KTO run: its reference, how it lays out prompts, what is trained."""
    cfg, objective, progress = session.run.cfg, session.run.objective, session.progress
    params = sum(p.numel() for p in session.trainee.params)
    if objective.blocks:
        rows = [v.row for block in session.run.items for v in block]
        good = int(objective.ref.desirable[rows].sum())
        return [f"reference: cached in {cfg.ref_cache_dir}; {cfg.loss_type[0]} on unpaired rows ({good} desirable, "
                f"{len(rows) - good} not)",
                f"training {params:,} LoRA parameters for {session.run.steps} steps of "
                f"{cfg.gradient_accumulation_steps} blocks of {cfg.per_device_train_batch_size} rows "
                f"({len(rows)} rows in {len(session.run.items)} blocks)"]
    reference = (f"cached in {cfg.ref_cache_dir}" if objective.ref is not None
                 else "live (adapter disabled), costs a forward" if objectives.needs_reference(cfg.loss_type)
                 else f"none (loss_type={cfg.loss_type} reads no reference: no cache, no precompute)")
    limits, _, judged = judged_limits(objective.terms)
    still = ("likelihood displacement and the answers' signs still warn"
             if objectives.needs_reference(cfg.loss_type) else "the answers' signs still warn")
    unguarded = [] if limits is not None else [
        f"warning signs: loss_type={judged} declares no margin or early-loss limits, so that context is not shown "
        f"beside a warning ({still})"]
    return unguarded + [
        f"reference: {reference}; prompts: {'once per pair (share_prompt)' if objective.shared else 'twice'}",
        f"training {params:,} LoRA parameters for {session.run.steps} steps of {progress.micro_batch} x "
        f"{progress.grad_accum} pairs ({len(session.run.items)} pairs in the data)"]


def setup(cfg: Config, recipe: str | None = None, progress: bool = True) -> Session:
    """Check the cache, tokenize, load the model with its one adapter (fresh, or the SFT adapter continued), build
    the optimizer; with resume=auto and a checkpoint in output_dir (or resume=PATH), continue from it."""
    require(cfg, "train")
    output.check_output_dir(cfg, "train")  # a folder of other files is refused before anything loads
    notes = [*cfg.no_effect(), *filter(None, [learning_rate_warning(cfg.learning_rate)])]
    resolved = devices.resolve(cfg)
    # what the run's loss reads, decided once (the objectives' floor, beside the device's)
    reads_cache = cfg.ref_source == "cache" and objectives.needs_reference(cfg.loss_type)
    unpaired = objectives.unpaired(cfg.loss_type)
    for note in notes:
        log(f"warning: {note}")
    prepared = inputs.prepare(cfg, resolved)
    adapters.check_mode(cfg, prepared.source, resolved.quantization)
    resume = resuming.find_resume(cfg)  # before anything heavy: a bad path or changed settings fail fast
    stream = policy.apply_plan(adapters.planned_lora(cfg, prepared.source), resolved, prepared.model_path)
    devices.check_bitsandbytes(resolved)
    log(prepared.source.description)
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress)  # logs the rows it skips and the eval split
    files_in = inputs.run_inputs(prepared.fingerprint, dataset.train)
    side = inputs.run_side(cfg, resolved, prepared)
    # Before anything heavy loads: rows without a reference value are refused in seconds.
    ref, eval_ref = inputs.cached_reference(cfg, prepared, side, dataset, recipe) if reads_cache else (None, None)
    trains_on = {**files_in, "reference cache": None if ref is None else side.identity}
    resuming.check_before_load(cfg, resume, trains_on, len(dataset.train))
    model = policy.setup_model(cfg, resolved, prepared.model_path, stream, source=prepared.source)
    pad_id = data.pad_token_id(prepared.tokenizer)
    # sharing decided on the same rows as precompute's (every row of dataset): the two agree on the layout
    layout = headcheck.bring_up(model, cfg, resolved, pad_id, dataset.train[:1], dataset.tok.pairs, train=True)
    cache_layout = sides.CacheLayout.of_run(side, cfg)
    reads = cache_layout.of_forward(layout.shared)
    if ref is not None and reads is not None:  # 16-bit: the values of this run's layout first
        ref, eval_ref = inputs.cached_reference(cfg, prepared, side.preferring(reads), dataset, recipe)
        note = cache_layout.note(ref.shared, layout.shared, devices.dtype_name(resolved.dtype),
                                 cache.rebuild_command(cfg, recipe))
        if note:
            log(note)
    eval_ref = (eval_ref or ref) if dataset.eval else None  # a held-out part of dataset: its rows' values
    off_is_start = adapters.adapter_off_is_start(cfg, prepared.source)
    items, eval_items = dataset.train, dataset.eval
    batching = Batching(resolved, pad_id, layout)
    if unpaired:  # blocks of rows, with each part's labels
        ref = kto.Reference(ref, kto.labels(dataset.unpaired["train"]))
        eval_ref = (kto.Reference(eval_ref, kto.labels(dataset.unpaired[dataset.eval_part])) if dataset.eval_part
                    else None)
        items, eval_items = (kto.blocks(views, cfg.per_device_train_batch_size) for views in (items, eval_items))
        objective = kto.Blocks.of(cfg, batching, ref, eval_ref)
    else:
        # A new run's step 1 measures the cache against its own forward (the drift line): the policy is the
        # reference there, so the cache should hold its forward's values; not so for a continued SFT adapter with
        # lora_dropout, whose B is not 0: the dropout draws noise into it.
        objective = Pairs.of(cfg, batching, ref, eval_ref, drift_at_start=off_is_start or not cfg.lora_dropout)
    run = RunSetup(cfg, resolved, objective, items, pad_id, trains_on, eval_items, prepared.tokenizer,
                   dataset.prompts, adapter_off_is_start=off_is_start, row_formats=dataset.tok.formats)
    session = start_session(run, model, resume)
    session.opening = opening_lines(session)
    return session


def run(cfg: Config, recipe: str | None = None, progress: bool = True) -> loop.TrainResult:
    """Train and save the adapter to cfg.output_dir; checkpoints every save_steps; resumes per cfg.resume."""
    with output.running(cfg, "train"):
        return loop.run(setup(cfg, recipe, progress), progress)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]), recipe=argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "train", __doc__))
