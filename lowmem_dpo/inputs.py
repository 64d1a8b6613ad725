"""What every stage reads: the model folder, the tokenizer, the tokenized data, and the cache fingerprint of
those inputs. Shared by precompute and train so both tokenize and fingerprint the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import cache, data, models
from lowmem_dpo.config import Config
from lowmem_dpo.devices import Resolved, dtype_name


@dataclass
class Inputs:
    model_path: Path  # the base model folder
    source: models.ModelSource  # the base and the SFT adapter on it, if any
    tokenizer: object
    fingerprint: dict  # components; cache.fingerprint_digest() of it keys the cache


def fingerprint_components(cfg: Config, resolved: Resolved, model_path: Path, adapter_path: Path | None = None,
                           tokenizer_path: Path | None = None) -> dict:
    """Everything the reference log-probs depend on, and nothing they don't (no training knobs).

    With an SFT adapter (`adapter_path`) the reference is base + adapter, so the adapter's files are in it;
    adapter_mode is not (the reference is base + adapter in both modes, see adapters.py).

    `dtype` and `quantization` are the reference's resolved settings (ref_dtype and ref_quantization, which
    default to dtype and quantization), not the policy's: a cache computed unquantized serves a 4-bit policy."""
    files = data.data_files(cfg.dataset)
    if files:
        root = Path(cfg.dataset) if Path(cfg.dataset).is_dir() else None
        dataset = {"files": cache.files_digest(files, root), "split": cfg.dataset_split if root else None}
    else:  # hub dataset: datasets' own content fingerprint
        dataset = {"hub": cfg.dataset, "split": cfg.dataset_split,
                   "fingerprint": data.load_rows(cfg.dataset, cfg.dataset_split)._fingerprint}
    return {
        "format": cache.FORMAT_VERSION,
        "model": cache.files_digest(models.weight_files(model_path)),
        "adapter": None if adapter_path is None else cache.files_digest(models.adapter_files(adapter_path)),
        "tokenizer": cache.files_digest(models.tokenizer_files(tokenizer_path or model_path)),
        "dataset": dataset,
        "max_length": cfg.max_length,
        "max_prompt_length": cfg.max_prompt_length,
        "dtype": dtype_name(resolved.ref_dtype),
        "quantization": resolved.ref_quantization,
    }


def prepare(cfg: Config, resolved: Resolved) -> Inputs:
    source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)  # the stages log source.description
    tokenizer = models.load_tokenizer(source.tokenizer_path)
    return Inputs(source.base_path, source, tokenizer,
                  fingerprint_components(cfg, resolved, source.base_path, source.adapter_path, source.tokenizer_path))


def tokenized(cfg: Config, tokenizer, progress: bool = True) -> data.TokenizedData:
    rows = data.load_rows(cfg.dataset, cfg.dataset_split)
    return data.tokenize_rows(rows, tokenizer, cfg.max_length, cfg.max_prompt_length, spec=cfg.dataset,
                              progress=progress, strict=cfg.strict)
