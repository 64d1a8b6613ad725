"""Where the config.json a model_name_or_path names comes from, for the memory model (arch.load_arch), without
loading or downloading weights: a local model folder, a built-in model (lowmem_dpo:tiny-llama,
lowmem_dpo:llama-25m), a shipped architecture-only file, lowmem_dpo:arch/NAME (mistral-7b-v0.1, llama-3.1-8b,
llama-3.1-70b, qwen2.5-7b, qwen2.5-14b; also reached by its hub name: mistralai/Mistral-7B-v0.1, meta-llama/
Llama-3.1-8B, meta-llama/Llama-3.1-70B, Qwen/Qwen2.5-7B, Qwen/Qwen2.5-14B and their -Instruct variants), or the hub
(a few KB, online).
"""

from __future__ import annotations

from pathlib import Path

from lowmem_dpo.model.models import resolve_model_path
from lowmem_dpo.model.tiny import BUILTIN_PREFIX
from lowmem_dpo.runtime.errors import UserError

ARCH_PREFIX = "lowmem_dpo:arch/"
ARCHS_DIR = Path(__file__).resolve().parent / "archs"
# Hub names (lowercase) whose architecture ships in archs/: the planner reads these without a download.
HUB_ARCHS = {
    "mistralai/mistral-7b-v0.1": "mistral-7b-v0.1", "mistralai/mistral-7b-instruct-v0.1": "mistral-7b-v0.1",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "qwen/qwen2.5-7b": "qwen2.5-7b", "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-14b": "qwen2.5-14b", "qwen/qwen2.5-14b-instruct": "qwen2.5-14b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b", "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b": "llama-3.1-70b", "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
}


def shipped_archs() -> list[str]:
    return sorted(p.parent.name for p in ARCHS_DIR.glob("*/config.json"))


def arch_config_path(spec: str) -> Path:
    """The config.json that model_name_or_path names, without loading or downloading weights."""
    name = None
    if spec.startswith(ARCH_PREFIX):
        name = spec[len(ARCH_PREFIX):]
    elif spec.lower() in HUB_ARCHS:
        name = HUB_ARCHS[spec.lower()]
    if name is not None:
        path = ARCHS_DIR / name / "config.json"
        if not path.is_file():
            raise UserError(f"model_name_or_path={spec!r}: no shipped architecture {name!r}; shipped: "
                            + ", ".join(ARCH_PREFIX + n for n in shipped_archs()))
        return path
    if spec.startswith(BUILTIN_PREFIX) or Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return resolve_model_path(spec) / "config.json"
    try:  # a hub name the planner does not ship: its config.json alone (a few KB), when online
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(spec, "config.json"))
    except Exception as e:
        raise UserError(f"model_name_or_path={spec!r}: no such folder ({Path(spec).absolute()} does not exist), and "
                        f"not a built-in, a shipped architecture ({', '.join(ARCH_PREFIX + n for n in shipped_archs())})"
                        f" or a hub name whose config.json could be fetched ({type(e).__name__}); check the path, or "
                        "pass a folder holding the model's config.json") from None


def is_arch_only(spec: str) -> bool:
    """model_name_or_path names a shipped architecture (no weights here)."""
    return spec.startswith(ARCH_PREFIX) or (spec.lower() in HUB_ARCHS and not Path(spec).is_dir())

