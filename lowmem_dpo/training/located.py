"""A trained model as chat finds it (RUN_OR_MERGED, its argument): a model folder, or an adapter with the base and
adapters it belongs on (its run's record, as export merges it: provenance.merge_chain), and the formats its
training rows had (trainer_state.json's row_formats). A folder that is neither says what to pass instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.model import models
from lowmem_dpo.runtime import folders
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import checkpoint, provenance

ARGUMENT = "RUN_OR_MERGED"
WHAT_TO_PASS = ("pass a run's output_dir, one of its checkpoints/checkpoint-STEP folders, or a folder written by "
                "lowmem-dpo export")


@dataclass(frozen=True)
class Source:
    """What RUN_OR_MERGED is: a model folder, or a base with the adapters to put on it, in order."""

    base: Path  # a transformers model folder (RUN_OR_MERGED itself for a merged model)
    adapters: list[Path]  # [], [adapter], or [SFT adapter (merged first), adapter] for adapter_mode=new_on_merged
    tokenizer: Path  # the folder whose tokenizer renders the prompts
    chat_template: str | None  # the run's chat_template key, where `tokenizer` is not the run's own saved one
    record: dict | None  # the config of the run that trained the adapter (None: a model folder, a foreign adapter)
    formats: list[str] | None = None  # its training rows' formats (recorded_formats); None: not recorded


def locate(folder: Path) -> Source:
    """What RUN_OR_MERGED names; anything that is neither a model nor an adapter is a UserError saying which."""
    where = f"{ARGUMENT}={str(folder)!r}"
    if not folder.exists():
        raise UserError(f"{where}: no such folder ({folder.absolute()} does not exist); {WHAT_TO_PASS}")
    if not folder.is_dir():
        raise UserError(f"{where} is a file; {WHAT_TO_PASS}")
    if (folder / models.ADAPTER_CONFIG).is_file():
        return adapter_source(folder)
    if (folder / "config.json").is_file():
        models.weight_files(folder)  # a UserError naming the folder when it holds no weights
        if not models.tokenizer_files(folder):
            raise UserError(f"{where}: a model folder without tokenizer files (tokenizer.json, "
                            "tokenizer_config.json, ...); copy its base's tokenizer files into it")
        return Source(folder, [], folder, None, None)
    raise UserError(f"{where}: {not_a_model(folder)}")


def not_a_model(folder: Path) -> str:
    """Why a folder without adapter_config.json or config.json cannot be chatted with, and what to pass instead."""
    kind = (folders.read_marker(folder) or {}).get("kind")
    if kind in ("dpo run", "sft run") or (folder / provenance.RUN_CONFIG).is_file():
        steps = sorted((p for p in folder.glob(f"{checkpoint.FOLDER}/checkpoint-*") if p.name[11:].isdigit()),
                       key=lambda p: int(p.name[11:]))
        if steps:
            return (f"a run without its final adapter yet (train has not finished, or was stopped): chat with a "
                    f"checkpoint, e.g. {steps[-1]}, or rerun train to finish it (it resumes)")
        return "a run without an adapter or a checkpoint yet: let train save one first (save_steps), or finish it"
    if kind is not None:
        return f"this tool's {kind}, not a run or a model; {WHAT_TO_PASS}"
    return f"neither a run (no {models.ADAPTER_CONFIG}) nor a model folder (no config.json); {WHAT_TO_PASS}"


def adapter_source(folder: Path) -> Source:
    """An adapter's base and adapters as export merges them: its run's record when it has one, else the base its
    adapter_config.json names."""
    record, where, _ = provenance.run_record(folder)
    if record is None:
        base = models.adapter_base(folder, ARGUMENT)
        log(f"chat: {folder} holds no lowmem_dpo run record: putting it, as a plain PEFT adapter, on the base it "
            f"names, {base}")
        tokenizer = folder if models.tokenizer_files(folder) else base
        return Source(base, [folder], tokenizer, None, None)
    spec, sft = record.get("model_name_or_path"), record.get("sft_adapter")
    try:
        models.model_source(str(spec), sft)
    except UserError as e:  # before merge_chain, whose message speaks of the export
        raise UserError(f"{ARGUMENT}={str(folder)!r} was trained (per {where}) on model_name_or_path={spec!r}"
                        + (f" and sft_adapter={sft!r}" if sft else "") + f", which cannot be used from here ({e}). "
                        "Run chat from the folder the training ran in, or restore those paths") from None
    chain = provenance.merge_chain(folder)
    return Source(chain.base, chain.adapters, chain.tokenizer, chain.chat_template, record, recorded_formats(folder))


def recorded_formats(folder: Path) -> list[str] | None:
    """The formats of the training rows ("text", "conversation") that the run of an adapter folder recorded: the
    row_formats of its trainer_state.json (a checkpoint's, or the output_dir's beside the final adapter); None
    where it records none (a run written before they were recorded)."""
    try:
        found = json.loads((folder / checkpoint.STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    formats = found.get("row_formats") if isinstance(found, dict) else None
    return list(formats) if isinstance(formats, list) and formats else None
