"""Which base and which adapters a trained adapter folder belongs on: its run's record (a checkpoint's
trainer_state.json, or the config.yaml and trainer_state.json of the output_dir holding the final adapter),
checked against the files as they are now, for the export (export.py).

The record names the base and the SFT adapter by path; the checkpoints also hold the digests of their content
(inputs.run_inputs). A path whose content changed since training (an SFT stage rerun into the same folder, a hub
name whose newest snapshot moved) would put the adapter on weights it was never trained on: refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.model import models
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.files import files_digest
from lowmem_dpo.training import checkpoint, guards

RUN_CONFIG = "config.yaml"  # output.start_output's, beside the final adapter


@dataclass(frozen=True)
class Chain:
    """What a merge puts together: the base folder and the adapters merged into it, in order."""

    base: Path
    adapters: list[Path]  # [ADAPTER_DIR], or [SFT adapter, ADAPTER_DIR] for adapter_mode=new_on_merged
    tokenizer: Path  # the folder whose tokenizer files MERGED_DIR gets
    base_name: str  # how the run named the base (the model card's base_model)
    chat_template: str | None = None  # the run's chat_template key, when `tokenizer` is not the run's own saved one


def run_record(adapter_dir: Path) -> tuple[dict | None, str, dict]:
    """The config of the lowmem_dpo run that wrote ADAPTER_DIR, where it was read, and the digests of what the run
    trained on (inputs.run_inputs' names; {} when not recorded): a checkpoint's trainer_state.json, or the
    config.yaml and trainer_state.json of the output_dir holding the final adapter; (None, "", {}) for an adapter
    from elsewhere."""
    import yaml

    state = adapter_dir / checkpoint.STATE
    try:
        found = json.loads(state.read_text(encoding="utf-8")) if state.is_file() else {}
        found = found if isinstance(found, dict) else {}
        inputs = found.get("inputs") if isinstance(found.get("inputs"), dict) else {}
        if isinstance(found.get("config"), dict):
            return found["config"], f"the checkpoint's {state}", inputs
        if (adapter_dir / RUN_CONFIG).is_file():
            config = yaml.safe_load((adapter_dir / RUN_CONFIG).read_text(encoding="utf-8"))
            if isinstance(config, dict):
                return config, f"the run's {adapter_dir / RUN_CONFIG}", inputs
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"{adapter_dir}: its run record is unreadable ({type(e).__name__}); without it the base "
                        "the adapter was trained on is not known for sure") from None
    return None, "", {}


def run_warnings(adapter_dir: Path, stage: str) -> str | None:
    """The warning line `stage` (chat, export) repeats for an adapter whose run logged warning signs (the
    metrics.jsonl beside it: a run's output_dir, or a checkpoint's lines up to its step); None without any."""
    lines = []
    for text in checkpoint.metrics_lines(adapter_dir):
        try:
            lines.append(json.loads(text))
        except ValueError:  # a damaged line is the report's to name; the warnings are in the others
            continue
    summary = guards.warnings_summary([x for x in lines if isinstance(x, dict) and isinstance(x.get("step"), int)])
    if summary is None:
        return None
    return (f"warning: {stage}: the run that trained {adapter_dir} logged warning signs, so the adapter may be "
            f"damaged: {summary}{best_note(adapter_dir)} (`lowmem-dpo report` on its run folder has the numbers)")


def best_note(adapter_dir: Path) -> str:
    """'; the adapter here is step K's, ...' for a run's output_dir whose final adapter is its best checkpoint
    (load_best_model_at_end: chosen among those without a sign of damage), '' otherwise."""
    try:
        state = json.loads((adapter_dir / checkpoint.STATE).read_text(encoding="utf-8"))
        record, _, _ = run_record(adapter_dir)
    except (OSError, ValueError, UserError):
        return ""
    best = state.get("best_global_step") if isinstance(state, dict) else None
    if best is None or not (record or {}).get("load_best_model_at_end") or best == state.get("global_step"):
        return ""
    return f"; the adapter here is step {best}'s, the best checkpoint, with no sign of damage since the eval before"


def check_unchanged(inputs: dict, where: str, base: Path, sft_adapter: Path | None) -> None:
    """Refuse a base (or an SFT adapter merged under the adapter) whose content differs from what the run
    recorded it trained on (`inputs`, run_record's digests; a record without them is not checked)."""
    found = {"model weights": (base, lambda: files_digest(models.weight_files(base)))}
    if sft_adapter is not None:
        found["adapter weights"] = (sft_adapter, lambda: files_digest(models.adapter_files(sft_adapter)))
    for name, (path, digest) in found.items():
        if inputs.get(name) is not None and inputs[name] != digest():
            raise UserError(f"{path}: its files changed since the run trained on them (the {name}' digest in {where} "
                            "differs): merged there, the adapter would sit on weights it was never trained on. "
                            "Restore the files the run used, or export from a run trained on these")


def _same_folder(named: str, base: Path) -> bool | None:
    """Whether adapter_config.json's base_model_name_or_path is the folder `base`; None when it names no local
    folder or built-in (a hub name: not fetched just to compare)."""
    if not (Path(named).is_dir() or named.startswith("lowmem_dpo:")):
        return None
    try:
        return models.resolve_model_path(named).resolve() == base.resolve()
    except UserError:
        return None


def merge_chain(adapter_dir: Path) -> Chain:
    """The base and the adapters to merge for ADAPTER_DIR, from its run's record when it has one."""
    named = models.read_adapter_config(adapter_dir, "ADAPTER_DIR").get("base_model_name_or_path") or ""
    record, where, inputs = run_record(adapter_dir)
    if record is None:
        base = models.adapter_base(adapter_dir, "ADAPTER_DIR")
        log(f"export: {adapter_dir} holds no lowmem_dpo run record ({RUN_CONFIG}, or a checkpoint's "
            f"{checkpoint.STATE}): merging it as a plain PEFT adapter into the base it names, {base}")
        return Chain(base, [adapter_dir], _tokenizer(adapter_dir, base), named)
    spec, sft, mode = record.get("model_name_or_path"), record.get("sft_adapter"), record.get("adapter_mode")
    try:
        source = models.model_source(str(spec), sft)
    except UserError as e:
        raise UserError(f"ADAPTER_DIR={str(adapter_dir)!r} was trained (per {where}) on model_name_or_path={spec!r}"
                        + (f" and sft_adapter={sft!r}" if sft else "") + f", which cannot be used from here ({e}). "
                        "Run the export from the folder the training ran in, or restore those paths") from None
    if _same_folder(named, source.base_path) is False:
        raise UserError(f"ADAPTER_DIR={str(adapter_dir)!r}: its adapter_config.json names the base {named!r}, but "
                        f"its run (per {where}) trained on {source.base_path}: which base it belongs on is not "
                        "certain, so it is not merged. Copy the adapter files into a folder of their own to merge "
                        "them into the base they name")
    merged_under = source.adapter_path if mode == "new_on_merged" else None  # continue: the adapter carries it
    check_unchanged(inputs, where, source.base_path, merged_under)
    chain = [adapter_dir]
    if source.adapter_path is not None and mode == "new_on_merged":
        chain = [source.adapter_path, adapter_dir]
        log(f"export: {adapter_dir} was trained with adapter_mode=new_on_merged on {source.base_path} + the SFT "
            f"adapter {source.adapter_path}: merging that adapter first, then this one")
    elif source.adapter_path is not None:
        log(f"export: {adapter_dir} continues the SFT adapter {source.adapter_path} (adapter_mode={mode}): "
            f"merging it alone into {source.base_path}")
    tokenizer = _tokenizer(adapter_dir, source.tokenizer_path)
    template = record.get("chat_template") if tokenizer != adapter_dir else None  # a checkpoint has no tokenizer
    return Chain(source.base_path, chain, tokenizer, str(spec), template)


def _tokenizer(adapter_dir: Path, otherwise: Path) -> Path:
    """ADAPTER_DIR when it holds a tokenizer (training may save one beside the adapter), else `otherwise`."""
    return adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else otherwise
