"""Model and tokenizer loading: built-in tiny models, local folders, hub names (online)."""

from __future__ import annotations

from pathlib import Path

import torch

from lowmem_dpo.cli import UserError
from lowmem_dpo.tiny import BUILTIN_PREFIX, ensure_builtin

WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def resolve_model_path(spec: str) -> Path:
    """A local folder holding config.json, weights and tokenizer for `model_name_or_path`."""
    if spec.startswith(BUILTIN_PREFIX):
        return ensure_builtin(spec)
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model_name_or_path={spec!r}: the folder has no config.json; point it at a "
                            "transformers model folder")
        return path
    if path.exists() or spec.startswith((".", "/")):
        raise UserError(f"model_name_or_path={spec!r}: not a model folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja"]))
    except Exception as e:
        raise UserError(f"model_name_or_path={spec!r} is not a local folder and could not be fetched from the hub "
                        f"({type(e).__name__}); download it to a folder and pass that path") from None


def weight_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise UserError(f"model folder {str(path)!r} has no .safetensors or .bin weights")
    return [path / "config.json"] + files


def tokenizer_files(path: Path) -> list[Path]:
    return [path / n for n in TOKENIZER_FILES if (path / n).is_file()]


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok


def disable_dropout(model: torch.nn.Module) -> None:
    """The base model's dropout is off for DPO, as in TRL: policy and reference must see the same function."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def load_model(path: Path, device: torch.device, dtype: torch.dtype):
    """The causal LM in eval mode with dropout off, its weights frozen, on `device`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device)
    model.config.use_cache = False
    disable_dropout(model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model
