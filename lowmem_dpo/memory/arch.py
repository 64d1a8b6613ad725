"""A decoder's numbers for the memory model: hidden size, layers, heads, vocabulary, from a config.json alone.

No weights are loaded. The config.json comes from a local model folder, a built-in model (lowmem_dpo:tiny-llama,
lowmem_dpo:llama-25m), a shipped architecture-only file, lowmem_dpo:arch/NAME (mistral-7b-v0.1, llama-3.1-8b,
qwen2.5-7b; also reached by its hub name: mistralai/Mistral-7B-v0.1, meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B and
their -Instruct variants), or the hub (a few KB, online).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.errors import UserError
from lowmem_dpo.models import resolve_model_path
from lowmem_dpo.tiny import BUILTIN_PREFIX

ARCH_PREFIX = "lowmem_dpo:arch/"
ARCHS_DIR = Path(__file__).resolve().parent.parent / "archs"
# Hub names (lowercase) whose architecture ships in archs/: the planner reads these without a download.
HUB_ARCHS = {
    "mistralai/mistral-7b-v0.1": "mistral-7b-v0.1",
    "mistralai/mistral-7b-instruct-v0.1": "mistral-7b-v0.1",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Arch:
    """The numbers of a Llama-style decoder (q/k/v/o attention, gate/up/down MLP, RMSNorm) the planner needs."""

    name: str
    model_type: str
    hidden: int  # H
    intermediate: int  # I
    layers: int  # L
    heads: int  # attention heads
    kv_heads: int  # key/value heads (GQA when below heads)
    head_dim: int
    vocab: int  # V
    tie_word_embeddings: bool
    qkv_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's Linear layers: name -> (in_features, out_features)."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def params(self) -> int:
        per_layer = sum(a * b for a, b in self.linears().values()) + 2 * self.hidden + self.bias_params()
        head = 0 if self.tie_word_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * per_layer + self.hidden

    def bias_params(self) -> int:
        """Bias elements of one layer (Qwen2: q/k/v have biases)."""
        qkv = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return qkv + (2 * self.intermediate + self.hidden if self.mlp_bias else 0)

    def with_layers(self, layers: int) -> "Arch":
        return dataclasses.replace(self, name=f"{self.name} (first {layers} layers)", layers=layers)

    def describe(self) -> str:
        n = self.params()
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        return (f"{self.name}: {self.model_type}, {self.layers} layers, hidden {self.hidden}, intermediate "
                f"{self.intermediate}, heads {self.heads}/{self.kv_heads} kv, vocab {self.vocab}, {size} params")


def arch_from_config(config: dict, name: str, where: str) -> Arch:
    """Arch from a transformers config.json mapping; `where` names the file in error messages."""
    if "text_config" in config and "hidden_size" not in config:
        config = config["text_config"]
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise UserError(f"{where}: no integer {', '.join(missing)}; the planner needs a Llama-style decoder config "
                        "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size)")
    heads = config["num_attention_heads"]
    model_type = str(config.get("model_type", "unknown"))
    return Arch(name=name, model_type=model_type, hidden=config["hidden_size"],
                intermediate=config["intermediate_size"], layers=config["num_hidden_layers"], heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab=config["vocab_size"],
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
                mlp_bias=bool(config.get("mlp_bias", False)))


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
    if spec.startswith(BUILTIN_PREFIX) or Path(spec).is_dir() or spec.startswith((".", "/")):
        return resolve_model_path(spec) / "config.json"
    try:  # a hub name the planner does not ship: its config.json alone (a few KB), when online
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(spec, "config.json"))
    except Exception as e:
        raise UserError(f"model_name_or_path={spec!r}: not a local folder, a built-in, a shipped architecture "
                        f"({', '.join(ARCH_PREFIX + n for n in shipped_archs())}) or a hub name whose config.json "
                        f"could be fetched ({type(e).__name__}); pass a folder holding its config.json") from None


def load_arch(spec: str) -> Arch:
    path = arch_config_path(spec)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable config.json ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    return arch_from_config(config, spec, str(path))


def is_arch_only(spec: str) -> bool:
    """model_name_or_path names a shipped architecture (no weights here)."""
    return spec.startswith(ARCH_PREFIX) or (spec.lower() in HUB_ARCHS and not Path(spec).is_dir())

