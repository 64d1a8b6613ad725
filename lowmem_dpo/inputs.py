"""What every stage reads: the model folder, the tokenizer, the tokenized data, and the cache fingerprint of
those inputs. Shared by precompute, preflight and train so they tokenize and fingerprint the same way."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo import cache, data, models
from lowmem_dpo.config import Config, cache_settings
from lowmem_dpo.devices import Resolved, dtype_name
from lowmem_dpo.files import files_digest

# cache_settings key -> its name in the fingerprint (the manifest's "components"), where the two differ: the
# cache has always called the reference's resolved precision "dtype" and "quantization".
COMPONENT_NAMES = {"ref_dtype": "dtype", "ref_quantization": "quantization"}
# The keys declared reference="files" (config.py), each read by file_components: a new one needs a line there.
FILE_KEYS = frozenset({"model_name_or_path", "sft_adapter", "dataset", "dataset_split", "eval_dataset", "eval_split"})


@dataclass
class Inputs:
    model_path: Path  # the base model folder
    source: models.ModelSource  # the base and the SFT adapter on it, if any
    tokenizer: object
    fingerprint: dict  # components; cache.fingerprint_digest() of it keys the cache


def file_components(cfg: Config, model_path: Path, adapter_path: Path | None, tokenizer_path: Path,
                    rows=None) -> dict:
    """The fingerprint of the keys declared reference="files" (model_name_or_path, sft_adapter, dataset,
    dataset_split), by the content of the files they name: the base's weights and config, the SFT adapter's files
    (the reference is base + adapter; adapter_mode is not in it, see adapters.py), the tokenizer's files, and the
    dataset's bytes (a hub dataset: `datasets`' own content fingerprint, of `rows` when they are loaded)."""
    files = data.data_files(cfg.dataset)
    if files:
        root = Path(cfg.dataset) if Path(cfg.dataset).is_dir() else None
        dataset = {"files": files_digest(files, root), "split": cfg.dataset_split if root else None}
    else:
        rows = rows if rows is not None else data.load_rows(cfg.dataset, cfg.dataset_split)
        dataset = {"hub": cfg.dataset, "split": cfg.dataset_split, "fingerprint": rows._fingerprint}
    return {
        "model": files_digest(models.weight_files(model_path)),
        "adapter": None if adapter_path is None else files_digest(models.adapter_files(adapter_path)),
        "tokenizer": files_digest(models.tokenizer_files(tokenizer_path)),
        "dataset": dataset,
    }


def fingerprint_components(cfg: Config, resolved: Resolved, model_path: Path, adapter_path: Path | None = None,
                           tokenizer_path: Path | None = None) -> dict:
    """Everything the reference log-probs depend on, and nothing they don't: the keys Config declares
    reference="files" by content (file_components) and those declared reference="value" by value
    (config.cache_settings). `dtype` and `quantization` are the reference's resolved settings (ref_dtype and
    ref_quantization, which default to dtype and quantization; a dtype of auto as the device resolves it), not
    the policy's: a cache computed unquantized serves a 4-bit policy. With an SFT adapter (`adapter_path`) the
    reference is base + adapter; the tokenizer is read from `tokenizer_path` (default: the model folder)."""
    values = {**cache_settings(cfg), "ref_dtype": dtype_name(resolved.ref_dtype),  # auto: as the device resolves it
              "ref_quantization": resolved.ref_quantization}
    files = file_components(cfg, model_path, adapter_path, tokenizer_path or model_path)
    return {"format": cache.FORMAT_VERSION, **files, **{COMPONENT_NAMES.get(k, k): v for k, v in values.items()}}


def prepare(cfg: Config, resolved: Resolved) -> Inputs:
    source = models.model_source(cfg.model_name_or_path, cfg.sft_adapter)  # the stages log source.description
    tokenizer = models.load_tokenizer(source.tokenizer_path)
    return Inputs(source.base_path, source, tokenizer,
                  fingerprint_components(cfg, resolved, source.base_path, source.adapter_path, source.tokenizer_path))


def tokenized(cfg: Config, tokenizer, progress: bool = True) -> data.TokenizedData:
    rows = data.load_rows(cfg.dataset, cfg.dataset_split)
    return data.tokenize_rows(rows, tokenizer, cfg.max_length, cfg.max_prompt_length, spec=cfg.dataset,
                              progress=progress, strict=cfg.strict)


def tokens_digest(items: list) -> str:
    """One digest over tokenized items (data.TokenizedPair or TokenizedCompletion): each one's row and token ids.
    It changes with the tokenizer's files, the tokenizers/transformers library, max_length and the data."""
    h = hashlib.sha256()
    for item in items:
        for value in vars(item).values():  # row, then the id lists, in field order
            ids = value if isinstance(value, list) else [value]
            h.update(array("q", [len(ids), *ids]).tobytes())
    return h.hexdigest()


def run_inputs(files: dict, items: list) -> dict:
    """What a training run trains on, by digest, under the names a refused resume gives (checkpoint.check_inputs):
    `files` is file_components' (or fingerprint_components') dict, `items` the tokenized data. Train adds its
    "reference cache"."""
    return {"data": files["dataset"], "model weights": files["model"], "adapter weights": files["adapter"],
            "tokenizer": files["tokenizer"], "tokenization": tokens_digest(items)}
