"""Memory planner: will a recipe fit? Peak memory of precompute and train from the model's config.json alone.

    python -m lowmem_dpo.plan RECIPE.yaml [key=value ...] [--budget 12GiB] [--json OUT] [--measure] [--slice N]

No weights are loaded. The architecture comes from the config.json of a local model folder, of a built-in model
(lowmem_dpo:tiny-llama, lowmem_dpo:llama-25m), or of a shipped architecture-only file: lowmem_dpo:arch/NAME
(mistral-7b-v0.1, llama-3.1-8b, qwen2.5-7b), also reached by its hub name (mistralai/Mistral-7B-v0.1,
meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B and their -Instruct variants).

Prints the predicted peak of train and of precompute, term by term, for the recipe as given. If it does not fit
the budget, searches the knobs in this order and prints the first plan that fits, as key=value overrides:
gradient checkpointing on; quantization=4bit; halve per_device_train_batch_size and double
gradient_accumulation_steps (the effective batch stays); halve precompute_batch_size (first, when only precompute
is over); last, CPU offload of whole decoder layers (offload_bytes; train and precompute do it on CUDA by themselves). The formulas are small
pure functions below (predict, choose), documented term by term; train can use them for its auto choices.

The device planned for is the recipe's (device=cuda plans for a GPU on any machine; auto is this machine's).

Exit status: 0 when the recipe or the printed plan fits the budget, 1 when nothing fits (so a script can run
`python -m lowmem_dpo.plan R.yaml && python -m lowmem_dpo.train R.yaml`), 2 for bad input.

options:
  --budget SIZE  device memory to fit, e.g. 12GiB, 11.5GB, 12000MiB or bytes. Default: the memory of the device
                 planned for (the GPU's total memory; the machine's RAM on a CPU).
  --json OUT     write {"train", "precompute", "plan", "budget_bytes", ...} to OUT.
  --measure      run real steps on this machine with the recipe as given (precompute's forward on its longest
                 batch, then train.setup and --steps optimizer steps) and report measured_peak_bytes beside the
                 prediction. Peak = live tensor memory, see PeakMeter: the same thing the prediction counts.
  --slice N      with --measure: measure a model with the recipe's architecture (layer sizes, vocabulary) cut to N
                 decoder layers and random weights, against the prediction for N layers: checks a 7B-width model
                 on a small machine.
  --steps K      optimizer steps --measure runs (default 2: the second has the optimizer state).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.cli import UserError

GiB = 1 << 30
MiB = 1 << 20
ARCH_PREFIX = "lowmem_dpo:arch/"
ARCHS_DIR = Path(__file__).resolve().parent / "archs"
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
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# bitsandbytes NF4: 64 weights per quantization block; double quantization stores each block's absmax as 1 byte,
# with one float32 absmax per 256 blocks.
NF4_BLOCK = 64
NF4_BLOCK2 = 256
# bitsandbytes' 8-bit optimizers keep 32-bit state for tensors under this many elements (min_8bit_size).
BNB_MIN_8BIT_SIZE = 4096
BNB_OPT_BLOCK = 256
# Estimates for CUDA only (nothing here measures them): the CUDA context with cuBLAS/cuDNN handles, which
# torch.cuda.max_memory_allocated does not count, and the caching allocator's fragmentation (reserved - allocated).
CUDA_CONTEXT_BYTES = 512 * MiB
CUDA_FRAGMENTATION = 0.05


# -- architecture ------------------------------------------------------------------------------------------------
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
    from lowmem_dpo.tiny import BUILTIN_PREFIX

    if spec.startswith(BUILTIN_PREFIX) or Path(spec).is_dir() or spec.startswith((".", "/")):
        from lowmem_dpo.models import resolve_model_path

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


# -- what a run is -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The resolved knobs a prediction depends on (a Config plus the device rule's choices)."""

    device: str  # cuda | cpu | mps
    kind: str  # the devices.RULES key
    dtype: str  # the policy's weights and compute (also the compute dtype of a quantized base)
    quantization: str  # the policy's base: none | 8bit | 4bit
    ref_dtype: str  # the reference's, in precompute
    ref_quantization: str
    gradient_checkpointing: bool
    optimizer: str  # devices.ADAMW_TORCH | devices.PAGED_ADAMW_8BIT
    micro_batch: int  # preference pairs per micro-batch: 2x sequences per forward
    grad_accum: int
    precompute_batch: int  # pairs per precompute forward
    max_length: int
    lora_r: int
    lora_targets: tuple[str, ...]  # names from LORA_MODULES
    lora_dropout: float = 0.0
    seq_len: int | None = None  # padded tokens per sequence; None: max_length (the worst case)
    completion_tokens: int | None = None  # completion tokens per sequence; None: seq_len - 1 (the worst case)
    precompute_seq_len: int | None = None
    precompute_completion_tokens: int | None = None

    @property
    def autocast(self) -> bool:
        """train and precompute autocast the forward to a 16-bit dtype (devices.autocast)."""
        return DTYPE_BYTES[self.dtype] == 2

    def shapes(self, stage: str) -> tuple[int, int]:
        """(T, completion tokens per sequence) for `stage`."""
        if stage == "precompute":
            t = self.precompute_seq_len or self.max_length
            return t, self.precompute_completion_tokens or t - 1
        t = self.seq_len or self.max_length
        return t, self.completion_tokens or t - 1


def lora_targets(names: list[str]) -> tuple[str, ...]:
    if names == ["all-linear"]:
        return LORA_MODULES
    unknown = [n for n in names if n.split(".")[-1] not in LORA_MODULES]
    if unknown:
        raise UserError(f"lora_target_modules={names}: the planner knows the Llama-style names "
                        f"{', '.join(LORA_MODULES)} and all-linear, not {', '.join(unknown)}")
    return tuple(m for m in LORA_MODULES if m in {n.split(".")[-1] for n in names})


def device_kind_for(device: str, budget: int | None) -> str:
    """The devices.RULES key a run on `device` resolves to. A GPU this machine has is asked; one it lacks is
    assumed bf16-capable, with the memory tier of the budget."""
    import torch

    from lowmem_dpo import devices

    if device == "cuda":
        if torch.cuda.is_available():
            return devices.device_kind(torch.device("cuda"))
        if budget is None:
            raise UserError("device=cuda but no GPU here to read its memory from: pass --budget, e.g. 12GiB")
        return f"cuda-{devices.memory_tier(budget)}-bf16"
    return devices.device_kind(torch.device(device))


def planned_device(cfg) -> str:
    import torch

    if cfg.device != "auto":
        return cfg.device
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def setup_from_config(cfg, budget: int | None = None) -> Setup:
    """Resolve a Config through the device rules (devices.RULES) the way train and precompute do, for the
    device the recipe names (cuda plans for a GPU even on a machine without one)."""
    from lowmem_dpo import devices

    device = planned_device(cfg)
    kind = device_kind_for(device, budget)
    rule = devices.RULES[kind]
    dtype = rule.dtype if cfg.dtype == "auto" else cfg.dtype
    ref_dtype = cfg.reference_dtype
    ref_dtype = rule.dtype if ref_dtype == "auto" else ref_dtype
    ckpt = rule.gradient_checkpointing if cfg.gradient_checkpointing == "auto" else cfg.gradient_checkpointing == "true"
    return Setup(device=device, kind=kind, dtype=dtype, quantization=cfg.quantization, ref_dtype=ref_dtype,
                 ref_quantization=cfg.reference_quantization, gradient_checkpointing=ckpt, optimizer=rule.optimizer,
                 micro_batch=cfg.per_device_train_batch_size, grad_accum=cfg.gradient_accumulation_steps,
                 precompute_batch=cfg.precompute_batch_size, max_length=cfg.max_length, lora_r=cfg.lora_r,
                 lora_targets=lora_targets(cfg.lora_target_modules), lora_dropout=cfg.lora_dropout)


# -- formulas: weights and LoRA state ----------------------------------------------------------------------------
def linear_weight_bytes(in_features: int, out_features: int, quantization: str, s: int) -> int:
    """One frozen Linear weight (n = in*out elements), s = bytes of the dtype.

    none: n*s.
    4bit (bitsandbytes NF4, double quantization): n/2 packed 4-bit + n/64 uint8 block absmax + 4*n/(64*256)
      float32 second-level absmax + 1 KiB of code tables (~0.516 bytes/param).
    8bit (LLM.int8): n int8 + 4*out float32 row scales.
    """
    n = in_features * out_features
    if quantization == "4bit":
        blocks = math.ceil(n / NF4_BLOCK)
        return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_BLOCK2) + 4 * (256 + 16 + 1)
    if quantization == "8bit":
        return n + 4 * out_features
    return n * s


def base_weight_bytes(arch: Arch, dtype: str, quantization: str) -> dict[str, int]:
    """The frozen base: decoder Linears (quantized when asked), and in the dtype, always: embeddings, the LM head
    (transformers never quantizes it; 0 when tied), norms and biases."""
    s = DTYPE_BYTES[dtype]
    linears = sum(linear_weight_bytes(i, o, quantization, s) for i, o in arch.linears().values())
    return {
        "linears": arch.layers * linears,
        "embeddings": arch.vocab * arch.hidden * s,
        "lm_head": 0 if arch.tie_word_embeddings else arch.vocab * arch.hidden * s,
        "norms_biases": ((2 * arch.layers + 1) * arch.hidden + arch.layers * arch.bias_params()) * s,
    }


def layer_weight_bytes(arch: Arch, dtype: str, quantization: str) -> int:
    """One decoder layer's weights: the unit CPU offload moves."""
    s = DTYPE_BYTES[dtype]
    return (sum(linear_weight_bytes(i, o, quantization, s) for i, o in arch.linears().values())
            + (2 * arch.hidden + arch.bias_params()) * s)


def lora_shapes(arch: Arch, targets: tuple[str, ...], r: int) -> list[int]:
    """Element counts of every LoRA matrix: A is (r, in), B is (out, r), per adapted Linear per layer."""
    out = []
    for name, (i, o) in arch.linears().items():
        if name in targets:
            out += [r * i, o * r] * arch.layers
    return out


def optimizer_state_bytes(shapes: list[int], optimizer: str) -> int:
    """AdamW's two moments per LoRA parameter.

    adamw_torch: 2 float32 states = 8 bytes/param (+ a 4-byte step per tensor).
    paged_adamw_8bit (bitsandbytes, blockwise): tensors of >= 4096 elements keep 2 uint8 states (2 bytes/param)
      + a float32 absmax per 256-element block per state + two 256-entry float32 quantile maps; smaller tensors
      keep 32-bit state (8 bytes/param). Paged: allocated as CUDA unified memory, which moves to CPU RAM under
      pressure instead of failing (and which torch's allocator statistics do not see).
    """
    from lowmem_dpo import devices

    total = 0
    for n in shapes:
        if optimizer == devices.PAGED_ADAMW_8BIT and n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_OPT_BLOCK) + 2 * 256 * 4
        else:
            total += 8 * n + 4
    return total


# -- formulas: activations ---------------------------------------------------------------------------------------
def layer_saved_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int) -> dict[str, int]:
    """Bytes one decoder layer keeps for backward in train, for n_seq sequences of seq_len tokens (NT tokens),
    s = bytes of the dtype. What autograd saves in transformers' Llama/Mistral/Qwen2 layer with peft LoRA on a
    frozen base (measured term by term with saved-tensor hooks):

    norms:        2 RMSNorms keep their float32 input (a float32 copy when s=2): 2*H*4*NT, + 2*4*NT rsqrt.
    lora_inputs:  every adapted Linear's LoRA A keeps its input (the frozen base Linear keeps nothing). With s=4,
                  the Linears reading one tensor share it: H (q/k/v) + H (gate/up) + I (down)
                  (o_proj reads the attention output, kept anyway); with s=2 (autocast) peft casts each input to
                  float32 and autocast casts it back, so each keeps its own s-byte copy: sum of in_features * s.
                  Times NT. lora_dropout > 0: each keeps its own copy (the dropped-out input, 4 bytes; with
                  autocast its s-byte cast) and the dropout mask of its float32 input: 1 byte (bool) on CUDA, 4
                  bytes on a CPU (there dropout multiplies by a float noise tensor).
    lora_mids:    each LoRA B keeps A's output: r per adapted Linear, in s (autocast) or 4 bytes, times NT.
    attention:    SDPA keeps q, k, v, its output and its float32 logsumexp: ((2*q_dim + 2*kv)*s + 4*heads)*NT,
                  kv = q_dim with grouped kv heads (with padding, transformers repeats them to every head instead of
                  using SDPA's GQA), else kv_dim; and the padding mask made an s-byte additive mask, n_seq*T^2*s.
    mlp:          SiLU keeps gate, the product keeps act and up: 3*I*s*NT.
    """
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    lin = arch.linears()
    adapted = [m for m in LORA_MODULES if m in setup.lora_targets]
    mid_bytes = s if setup.autocast else 4
    if setup.lora_dropout > 0:
        mask = 1 if setup.device == "cuda" else 4
        inputs = sum(lin[m][0] for m in adapted) * ((s if setup.autocast else 4) + mask)
    elif setup.autocast:
        inputs = sum(lin[m][0] for m in adapted) * s
    else:
        shared = (arch.hidden if {"q_proj", "k_proj", "v_proj"} & set(adapted) else 0) \
            + (arch.hidden if {"gate_proj", "up_proj"} & set(adapted) else 0) \
            + (arch.intermediate if "down_proj" in adapted else 0)
        inputs = shared * s
    kv = arch.q_dim if arch.kv_heads < arch.heads else arch.kv_dim
    return {
        "norms": nt * (2 * arch.hidden * 4 + 2 * 4),
        "lora_inputs": nt * inputs,
        "lora_mids": nt * setup.lora_r * len(adapted) * mid_bytes,
        "attention": nt * ((2 * arch.q_dim + 2 * kv) * s + 4 * arch.heads) + n_seq * seq_len * seq_len * s,
        "mlp": nt * 3 * arch.intermediate * s,
    }


def kept_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int, completion: int) -> dict[str, int]:
    """What train keeps for backward across the whole forward, beyond the decoder layers' own:

    layer_inputs: with gradient checkpointing, each layer keeps only its input: L*H*s*NT.
    final_norm:   the last RMSNorm's float32 input: H*4*NT.
    completion:   the hidden states of the M = n_seq*completion predicting positions that logps.py gathers
                  (the LM head's input, kept by its checkpointed chunks): M*H*s.
    mask:         transformers' boolean padding mask, n_seq*T^2 bytes.
    int8_inputs:  8bit with checkpointing: LLM.int8's autograd function keeps its input on its context object,
                  out of checkpointing's reach, so every layer keeps the inputs of its quantized Linears: the
                  attention's normed input, o_proj's input, the MLP's normed input and down_proj's input,
                  L*NT*(2H + q_dim + I)*s (without checkpointing they are among the layers' saved activations).
    """
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    int8_kept = setup.quantization == "8bit" and setup.gradient_checkpointing
    return {
        "layer_inputs": arch.layers * nt * arch.hidden * s if setup.gradient_checkpointing else 0,
        "final_norm": nt * arch.hidden * 4,
        "completion": n_seq * completion * arch.hidden * s,
        "mask": n_seq * seq_len * seq_len,
        "int8_inputs": arch.layers * nt * (2 * arch.hidden + arch.q_dim + arch.intermediate) * s if int8_kept else 0,
    }


def dequant_bytes(arch: Arch, quantization: str, s: int) -> int:
    """A quantized Linear runs by dequantizing its weight: the largest one's weight in the compute dtype (n*s)
    plus its float32 block absmax (4*n/64) exist for the duration of one matmul (forward, and again in
    backward). 8bit: the dequantized weight, n*s, in backward (the forward multiplies in int8: int8_buffers)."""
    n = max(i * o for i, o in arch.linears().values())
    if quantization == "4bit":
        return n * s + 4 * math.ceil(n / NF4_BLOCK)
    if quantization == "8bit":
        return n * s
    return 0


def int8_buffers(arch: Arch, quantization: str, nt: int) -> int:
    """LLM.int8's forward of one Linear (8bit only): the int8 copy of its (NT, in) input, and three 4-byte
    (NT, out) tensors: the int32 accumulator, its float32 dequantized copy and the float32 outlier product:
    NT*(in + 12*out) for the largest such Linear (gate/up_proj, in=H, out=I). Fitted to CPU measurements of
    precompute (tiny-llama and llama-25m, float32: within 1%; bfloat16: -5%..-15%); bitsandbytes' CUDA
    kernels differ."""
    if quantization != "8bit":
        return 0
    return nt * max(i + 12 * o for i, o in arch.linears().values())


def layer_working_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int) -> int:
    """Transient bytes at a layer's peak in train, beyond what is kept (measured: the MLP, in forward or backward),
    the larger of two moments:
    LoRA path: a float32 (N,T,I) tensor (the gradient flowing into the MLP's product; with autocast, also peft's
      float32 cast of down_proj's input), an (N,T,I) s-byte gradient with autocast, and an (N,T,H) s-byte
      gradient: NT*(4*I + (s*I if autocast) + s*H);
    quantized base Linear: its dequantized weight (dequant_bytes) with the (N,T,I) and (N,T,H) s-byte gradients
      around its matmul: NT*(s*I + s*H) + dequant;
    8bit forward (recomputed in backward with checkpointing): the (N,T,H) input and LLM.int8's buffers."""
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    lora_path = nt * (4 * arch.intermediate + (s * arch.intermediate if setup.autocast else 0) + s * arch.hidden)
    dequant = dequant_bytes(arch, setup.quantization, s)
    int8_forward = nt * s * arch.hidden + int8_buffers(arch, setup.quantization, nt)
    return max(lora_path, (nt * s * (arch.intermediate + arch.hidden) + dequant) if dequant else 0, int8_forward)


def chunk_tokens(arch: Arch, completion_positions: int) -> int:
    """Rows of one LM-head chunk in logps.completion_logps: CHUNK_ELEMENTS // V, at most the M positions."""
    from lowmem_dpo.logps import CHUNK_ELEMENTS

    return max(1, min(completion_positions, CHUNK_ELEMENTS // arch.vocab))


def logits_train_bytes(arch: Arch, completion_positions: int) -> int:
    """The LM head in train (logps.py): only the M completion positions, in chunks of c = min(M, 2^24 // V) rows,
    each checkpointed. Nothing (c, V)-sized is kept; at the peak (one chunk's backward: LogsumexpBackward) four
    float32 (c, V) tensors live: the recomputed logits, logits - logsumexp, its exp, and the gradient.
    4 * c * V * 4 bytes, at most 256 MiB whatever the batch, sequence length or vocabulary (never N*T*V*4)."""
    return 4 * chunk_tokens(arch, completion_positions) * arch.vocab * 4


def logits_inference_bytes(arch: Arch, completion_positions: int) -> int:
    """The LM head under inference_mode (precompute): one chunk's float32 logits and logsumexp's exp(logits - max)
    (computed in place), 2 * c * V * 4 (the s-byte logits before the float32 cast are gone by then)."""
    return 2 * chunk_tokens(arch, completion_positions) * arch.vocab * 4


def precompute_layer_bytes(arch: Arch, n_seq: int, seq_len: int, s: int, quantization: str) -> int:
    """One layer's working set under inference_mode (nothing is kept between layers), the largest of:
    MLP product: the embedding output, the layer input, the residual and the norm output (4*H), SiLU(gate), up
      and their product (3*I): NT*(4H + 3I)*s (measured: the peak for these architectures unquantized);
    up_proj of a quantized base: 4*H, SiLU(gate) and up's output (2*I), and the dequantized weight (4bit) or
      LLM.int8's buffers (8bit, int8_buffers): NT*(4H + 2I)*s + that (measured: the peak with 4-bit and 8-bit);
    attention: NT*(4H + 3*q_dim + 2*kv_dim)*s + the boolean and the s-byte additive masks, n_seq*T^2*(1 + s)
      (+ dequant)."""
    nt = n_seq * seq_len
    # forward only: 8bit multiplies in int8 (its buffers), 4bit dequantizes the weight
    dequant = int8_buffers(arch, quantization, nt) if quantization == "8bit" else dequant_bytes(arch, quantization, s)
    mlp = nt * (4 * arch.hidden + 3 * arch.intermediate) * s
    up_proj = (nt * (4 * arch.hidden + 2 * arch.intermediate) * s + dequant) if dequant else 0
    attn = nt * (4 * arch.hidden + 3 * arch.q_dim + 2 * arch.kv_dim) * s + n_seq * seq_len * seq_len * (1 + s)
    return max(mlp, up_proj, attn + dequant)


def framework_overhead(device: str, tensor_peak: int) -> int:
    """Memory the device needs beyond live tensors. CUDA: the context (~512 MiB, not counted by torch) and the
    caching allocator's fragmentation (~5% of the tensor peak): estimates. CPU and mps: 0 (the planner and
    --measure count tensor memory; Python and the libraries' own RSS are not in the budget)."""
    if device == "cuda":
        return CUDA_CONTEXT_BYTES + int(CUDA_FRAGMENTATION * tensor_peak)
    return 0


EXIT_NO_FIT = 1

# -- prediction --------------------------------------------------------------------------------------------------
@dataclass
class StagePrediction:
    """Predicted peak of one stage. `breakdown` adds up to `peak_bytes`; `phases` shows both candidates for
    the transient peak (the larger one is `breakdown["peak_phase"]`)."""

    breakdown: dict[str, int]
    phases: dict[str, int]
    details: dict[str, int]
    tensor_peak_bytes: int  # live tensor bytes: what --measure measures
    peak_bytes: int  # + framework overhead: what must fit the budget
    shapes: dict[str, int]


@dataclass
class Prediction:
    train: StagePrediction
    precompute: StagePrediction
    setup: Setup


def predict_train(arch: Arch, setup: Setup) -> StagePrediction:
    """Peak of one optimizer step: weights + LoRA state + what the forward keeps + the larger transient phase.

    no checkpointing:  kept = L layers' saved activations + kept_bytes; phase = max(layer working set, logits).
    checkpointing:     kept = layer inputs + kept_bytes; phase = max(one recomputed layer's saved activations +
                       its working set, logits) (the logits' backward runs before any layer is recomputed).
    The optimizer step itself (activations freed by then) adds 2 float32 copies of the LoRA params for
    torch's foreach AdamW on CUDA; it counts only if larger than the backward peak.
    """
    from lowmem_dpo import devices

    seq_len, completion = setup.shapes("train")
    n_seq = 2 * setup.micro_batch
    m = n_seq * completion
    weights = base_weight_bytes(arch, setup.dtype, setup.quantization)
    shapes = lora_shapes(arch, setup.lora_targets, setup.lora_r)
    n_lora = sum(shapes)
    layer = layer_saved_bytes(arch, setup, n_seq, seq_len)
    kept = kept_bytes(arch, setup, n_seq, seq_len, completion)
    layer_total = sum(layer.values())
    activations = sum(kept.values()) + (0 if setup.gradient_checkpointing else arch.layers * layer_total)
    layer_phase = layer_working_bytes(arch, setup, n_seq, seq_len) + (
        layer_total if setup.gradient_checkpointing else 0)
    logits_phase = logits_train_bytes(arch, m)
    breakdown = {
        "base_weights": sum(weights.values()),
        "lora_params": 4 * n_lora,
        "lora_grads": 4 * n_lora,
        "optimizer_state": optimizer_state_bytes(shapes, setup.optimizer),
        "activations": activations,
        "peak_phase": max(layer_phase, logits_phase),
    }
    if setup.device == "cuda" and setup.optimizer == devices.ADAMW_TORCH:
        opt_step = 2 * 4 * n_lora  # foreach AdamW temporaries, when the activations are gone
        excess = opt_step - (breakdown["activations"] + breakdown["peak_phase"])
        if excess > 0:
            breakdown["peak_phase"] += excess
    tensor_peak = sum(breakdown.values())
    overhead = framework_overhead(setup.device, tensor_peak)
    breakdown["framework_overhead"] = overhead
    details = {**{f"weights.{k}": v for k, v in weights.items()}, **{f"layer.{k}": v for k, v in layer.items()},
               **{f"kept.{k}": v for k, v in kept.items()}, "lora_param_count": n_lora}
    return StagePrediction(breakdown, {"layer": layer_phase, "logits": logits_phase}, details, tensor_peak,
                           tensor_peak + overhead,
                           {"sequences": n_seq, "seq_len": seq_len, "completion_tokens": completion})


def predict_precompute(arch: Arch, setup: Setup) -> StagePrediction:
    """Peak of one precompute forward under inference_mode (nothing kept between layers): weights of the
    reference + the larger of one layer's working set and the LM head phase (the final hidden states, the
    gathered completion positions and one chunk's logits)."""
    s = DTYPE_BYTES[setup.ref_dtype]
    seq_len, completion = setup.shapes("precompute")
    n_seq = 2 * setup.precompute_batch
    m = n_seq * completion
    weights = base_weight_bytes(arch, setup.ref_dtype, setup.ref_quantization)
    layer_phase = precompute_layer_bytes(arch, n_seq, seq_len, s, setup.ref_quantization)
    logits_phase = (n_seq * seq_len + m) * arch.hidden * s + logits_inference_bytes(arch, m)
    breakdown = {"base_weights": sum(weights.values()), "lora_params": 0, "lora_grads": 0, "optimizer_state": 0,
                 "activations": 0, "peak_phase": max(layer_phase, logits_phase)}
    tensor_peak = sum(breakdown.values())
    overhead = framework_overhead(setup.device, tensor_peak)
    breakdown["framework_overhead"] = overhead
    return StagePrediction(breakdown, {"layer": layer_phase, "logits": logits_phase},
                           {f"weights.{k}": v for k, v in weights.items()}, tensor_peak, tensor_peak + overhead,
                           {"sequences": n_seq, "seq_len": seq_len, "completion_tokens": completion})


def predict(arch: Arch, cfg_like, budget: int | None = None) -> Prediction:
    """Predicted peaks of train and precompute. `cfg_like`: a Setup, or a Config (resolved through the device
    rules; `budget` picks the memory tier of a GPU this machine lacks)."""
    setup = cfg_like if isinstance(cfg_like, Setup) else setup_from_config(cfg_like, budget)
    return Prediction(predict_train(arch, setup), predict_precompute(arch, setup), setup)


# -- choosing a plan ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    setup: Setup
    prediction: Prediction
    overrides: dict[str, str]  # config key -> value that turn the recipe into this plan
    steps: list[str]  # what the search changed, in order, and why
    fits: bool
    offload_bytes: int = 0  # train: weights to keep in CPU RAM (whole decoder layers)
    precompute_offload_bytes: int = 0
    offload_layers: int = 0

    def to_json(self, budget: int) -> dict:
        return {"fits": self.fits, "overrides": self.overrides, "steps": self.steps,
                "offload_bytes": self.offload_bytes, "precompute_offload_bytes": self.precompute_offload_bytes,
                "offload_layers": self.offload_layers,
                "train": stage_json(self.prediction.train, budget, self.offload_bytes),
                "precompute": stage_json(self.prediction.precompute, budget, self.precompute_offload_bytes)}


def _smaller_micro_batch(b: int) -> int:
    """The largest divisor of b at most b/2 (b even: b/2), so accumulation keeps the effective batch exact."""
    return max(d for d in range(1, b // 2 + 1) if b % d == 0)


def streamed_layer_bytes(arch: Arch, dtype: str, quantization: str) -> int:
    """One offloaded decoder layer's weights as they sit in CPU RAM and stream through the device: bitsandbytes
    quantizes on the GPU only, so with 4bit/8bit the layers a device_map puts on the CPU stay unquantized, in
    `dtype` (transformers' llm_int8_enable_fp32_cpu_offload)."""
    return layer_weight_bytes(arch, dtype, "none")


def _offload(peak: int, budget: int, per_layer: int, layers: int, streamed: int | None = None) -> tuple[int, int]:
    """Whole layers to keep in CPU RAM so `peak` fits: each one moved saves `per_layer` device bytes, and one
    device buffer of `streamed` bytes (default per_layer) holds the layer running now, so
    k = ceil((peak - budget + streamed) / per_layer). Returns (layers moved, CPU RAM they take)."""
    streamed = per_layer if streamed is None else streamed
    if peak <= budget:
        return 0, 0
    k = min(layers, math.ceil((peak - budget + streamed) / per_layer))
    return k, k * streamed


def choose(arch: Arch, cfg_like, budget: int) -> Plan:
    """The recipe's own setup if it fits `budget`, else the first that does along: gradient checkpointing on
    (train), quantization=4bit (the reference too, unless ref_quantization is set; when only precompute is over,
    halving precompute's batch comes first), halving the micro-batch while doubling accumulation (train),
    halving precompute's batch, and last CPU offload of whole decoder layers.
    `cfg_like`: a Setup, or a Config (resolved as in predict)."""
    overrides: dict[str, str] = {}
    steps: list[str] = []
    cur = cfg_like if isinstance(cfg_like, Setup) else setup_from_config(cfg_like, budget)

    def fits(p: Prediction) -> tuple[bool, bool]:
        return p.train.peak_bytes <= budget, p.precompute.peak_bytes <= budget

    pred = predict(arch, cur)
    train_ok, pre_ok = fits(pred)
    if not train_ok and not cur.gradient_checkpointing:
        cur = dataclasses.replace(cur, gradient_checkpointing=True)
        overrides["gradient_checkpointing"] = "true"
        pred = predict(arch, cur)
        steps.append(f"gradient_checkpointing=true: activations kept for backward drop to the layer inputs "
                     f"(train peak {fmt(pred.train.peak_bytes)})")
        train_ok, pre_ok = fits(pred)
    def smaller_precompute_batch(cur: Setup, pred: Prediction) -> tuple[Setup, Prediction]:
        while pred.precompute.peak_bytes > budget and cur.precompute_batch > 1:
            cur = dataclasses.replace(cur, precompute_batch=max(1, cur.precompute_batch // 2))
            overrides["precompute_batch_size"] = str(cur.precompute_batch)
            pred = predict(arch, cur)
            steps.append(f"precompute_batch_size={cur.precompute_batch}: no effect on the results (precompute "
                         f"peak {fmt(pred.precompute.peak_bytes)})")
        return cur, pred

    if train_ok and not pre_ok:  # only precompute is over: its batch costs nothing but time
        cur, pred = smaller_precompute_batch(cur, pred)
        train_ok, pre_ok = fits(pred)
    if not (train_ok and pre_ok) and cur.quantization != "4bit":
        ref_follows = cur.ref_quantization == cur.quantization
        cur = dataclasses.replace(cur, quantization="4bit",
                                  ref_quantization="4bit" if ref_follows else cur.ref_quantization)
        overrides["quantization"] = "4bit"
        pred = predict(arch, cur)
        steps.append(f"quantization=4bit: NF4 base weights, ~0.52 bytes/param (train peak "
                     f"{fmt(pred.train.peak_bytes)}, precompute {fmt(pred.precompute.peak_bytes)})")
        train_ok, pre_ok = fits(pred)
    while not train_ok and cur.micro_batch > 1:
        b = _smaller_micro_batch(cur.micro_batch)
        cur = dataclasses.replace(cur, micro_batch=b, grad_accum=cur.grad_accum * (cur.micro_batch // b))
        overrides["per_device_train_batch_size"] = str(cur.micro_batch)
        overrides["gradient_accumulation_steps"] = str(cur.grad_accum)
        pred = predict(arch, cur)
        steps.append(f"per_device_train_batch_size={cur.micro_batch} gradient_accumulation_steps={cur.grad_accum}: "
                     f"the same pairs per optimizer step (train peak {fmt(pred.train.peak_bytes)})")
        train_ok, pre_ok = fits(pred)
    cur, pred = smaller_precompute_batch(cur, pred)
    per_layer = layer_weight_bytes(arch, cur.dtype, cur.quantization)
    streamed = streamed_layer_bytes(arch, cur.dtype, cur.quantization)
    k_train, off_train = _offload(pred.train.peak_bytes, budget, per_layer, arch.layers, streamed)
    ref_layer = layer_weight_bytes(arch, cur.ref_dtype, cur.ref_quantization)
    ref_streamed = streamed_layer_bytes(arch, cur.ref_dtype, cur.ref_quantization)
    k_pre, off_pre = _offload(pred.precompute.peak_bytes, budget, ref_layer, arch.layers, ref_streamed)
    ok = True
    for stage, k, off, layer_bytes, buffer, peak in (
            ("train", k_train, off_train, per_layer, streamed, pred.train.peak_bytes),
            ("precompute", k_pre, off_pre, ref_layer, ref_streamed, pred.precompute.peak_bytes)):
        if k:
            left = peak - k * layer_bytes + buffer
            ok = ok and left <= budget
            steps.append(f"{stage}: CPU offload of {k} of {arch.layers} decoder layers ({fmt(off)} of CPU RAM), "
                         f"device peak {fmt(left)}" + ("" if left <= budget else " - still over the budget")
                         + (f"; {stage} streams them through the device by itself (CUDA)"))
    if not steps:
        steps.append("fits as given")
    return Plan(cur, pred, overrides, steps, ok, off_train, off_pre, max(k_train, k_pre))


# -- measuring ---------------------------------------------------------------------------------------------------
class PeakMeter:
    """Peak of live tensor memory on a device while the `with` block runs, the tensors alive at entry included.

    CUDA: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats (the caching allocator's
      bytes in live tensors; its reserve and the CUDA context are not counted).
    CPU:  the same quantity, exact: at entry, the bytes of every live CPU tensor's storage (found through the
      garbage collector, each storage once however many views share it: parameters, buffers, quantization
      state, optimizer state); then every allocation and free of the CPU allocator while the block runs, as
      torch.profiler(profile_memory=True) records them, summed in order; the peak is entry + the running sum's
      maximum. A free counts only for a block whose size is known (allocated in the block, or live at entry).
      Not counted: Python objects, allocator caches, libraries' own memory (RSS noise).
    """

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.peak_bytes = 0
        self.entry_bytes = 0

    def __enter__(self):
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.entry_bytes = torch.cuda.memory_allocated(self.device)
            return self
        if self.device.type != "cpu":
            raise UserError(f"--measure supports cpu and cuda, not {self.device.type}")
        self._live = live_storages(self.device)
        self.entry_bytes = sum(self._live.values())
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto prints a line on start and stop
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return False
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = self.entry_bytes + _running_peak(self._prof, self._live, self.device)
        return False


def live_storages(device) -> dict[int, int]:
    """data_ptr -> bytes of every live tensor storage on `device` the garbage collector can see."""
    import gc
    import warnings

    import torch

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() touches deprecated lazy module attributes
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device == device and obj.layout == torch.strided:
                    st = obj.untyped_storage()
                    if st.nbytes():
                        out[st.data_ptr()] = st.nbytes()
            except Exception:  # tensors without storage (meta, functional wrappers)
                continue
    return out


def _running_peak(prof, live_at_entry: dict[int, int], device) -> int:
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        extra = ev.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == device.type:
            events.append((ev.start_time_ns, extra.alloc_size, extra.ptr))
    events.sort(key=lambda e: e[0])
    blocks, entry = {}, dict(live_at_entry)
    cur = peak = 0
    for _, size, ptr in events:
        if size > 0:
            blocks[ptr] = size
            cur += size
            peak = max(peak, cur)
        elif ptr in blocks:
            cur -= blocks.pop(ptr)
        elif ptr in entry:
            cur -= entry.pop(ptr)
    return peak


class _quiet_stderr:
    """Silence file descriptor 2 (C-level prints) for the duration of the block."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        return False


def _pair_shape(pairs) -> tuple[int, int]:
    """(padded T, completion tokens) of the micro-batch `pairs` as data.collate builds it."""
    lengths = [len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    return max(lengths), sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)


def _longest_rows(cfg, tokenizer, n: int, out: Path) -> Path:
    """The n rows with the longest tokenized pairs, written as JSONL: measuring on them is measuring the worst
    batches of the data, in seconds."""
    from lowmem_dpo import data, inputs

    tok = inputs.tokenized(cfg, tokenizer, progress=False)
    ordered = sorted(tok.pairs, key=lambda p: -(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))))
    ds = data.load_rows(cfg.dataset, cfg.dataset_split)
    with open(out, "w", encoding="utf-8") as f:
        for p in ordered[:n]:
            row = ds[p.row]
            f.write(json.dumps({k: row[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
    return out


def measure(cfg, steps: int = 2) -> dict:
    """Measured peaks of precompute and train for `cfg` on this machine (PeakMeter), on the dataset's longest
    rows, in a temporary folder (the recipe's output_dir and ref_cache_dir are not touched).

    precompute: the reference loaded as precompute loads it, then precompute.shard_logps over one batch of
      precompute_batch_size of the longest rows. train: precompute.run into a temporary cache, then
      train.setup and `steps` train.optimizer_step calls (the second step has the optimizer state)."""
    import gc
    import tempfile

    import torch

    from lowmem_dpo import data, devices, inputs, precompute, train
    from lowmem_dpo.models import load_model

    resolved = devices.resolve(cfg)
    rows = max(cfg.precompute_batch_size, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * steps)
    with tempfile.TemporaryDirectory(prefix="lowmem_dpo-measure-") as tmp:
        tmp = Path(tmp)
        ins = inputs.prepare(cfg, resolved)
        subset = _longest_rows(cfg, ins.tokenizer, rows, tmp / "rows.jsonl")
        mcfg = dataclasses.replace(cfg, dataset=str(subset), dataset_split="train", ref_cache_dir=str(tmp / "cache"),
                                   output_dir=str(tmp / "out"), max_steps=steps, save_steps=0)
        tok = inputs.tokenized(mcfg, ins.tokenizer, progress=False)
        batch_pairs = precompute.shard_plan(tok.pairs, len(tok.pairs))[0][:cfg.precompute_batch_size]
        pad = data.pad_token_id(ins.tokenizer)
        model = load_model(ins.model_path, resolved.device, resolved.ref_dtype, resolved.ref_quantization)

        class _NoBar:
            def update(self, n):
                pass

        with PeakMeter(resolved.device) as pre:
            precompute.shard_logps(model, batch_pairs, cfg.precompute_batch_size, pad, resolved, _NoBar())
        del model
        gc.collect()
        precompute.run(mcfg, progress=False)
        session = train.setup(mcfg, progress=False)
        taken = []

        def recording(stream):
            for pair in stream:
                taken.append(pair)
                yield pair

        session.stream = recording(session.stream)
        with PeakMeter(resolved.device) as tr:
            for _ in range(steps):
                train.optimizer_step(session)
        seen = [_pair_shape(pairs) for pairs in train.split(taken, session.micro_batch)]
        del session
        gc.collect()
        if resolved.device.type == "cuda":
            torch.cuda.empty_cache()
    pre_t, pre_m = _pair_shape(batch_pairs)
    n_pre = 2 * len(batch_pairs)
    t = max(s[0] for s in seen)
    m = max(s[1] for s in seen)
    n_train = 2 * cfg.per_device_train_batch_size
    return {
        "device": resolved.device.type,
        "dtype": devices.dtype_name(resolved.dtype),
        "train": {"measured_peak_bytes": tr.peak_bytes, "entry_bytes": tr.entry_bytes, "steps": steps,
                  "seq_len": t, "completion_tokens": math.ceil(m / n_train)},
        "precompute": {"measured_peak_bytes": pre.peak_bytes, "entry_bytes": pre.entry_bytes,
                       "seq_len": pre_t, "completion_tokens": math.ceil(pre_m / n_pre)},
    }


def at_measured_shapes(setup: Setup, measured: dict) -> Setup:
    """The setup at the sequence shapes --measure ran (the data's longest rows may be shorter than max_length)."""
    return dataclasses.replace(setup, seq_len=measured["train"]["seq_len"],
                               completion_tokens=measured["train"]["completion_tokens"],
                               precompute_seq_len=measured["precompute"]["seq_len"],
                               precompute_completion_tokens=measured["precompute"]["completion_tokens"])


def write_slice_model(arch_spec: str, layers: int, out: Path) -> Path:
    """A model folder with the architecture of `arch_spec` (its layer sizes and vocabulary) cut to `layers`
    decoder layers, random weights in the config's dtype, and the built-in tokenizer (its ids are valid in any
    vocabulary of >= 1024): enough to measure a 7B-width layer and LM head on a small machine."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lowmem_dpo.tiny import BUILTIN_PREFIX, ensure_builtin

    config = AutoConfig.from_pretrained(arch_config_path(arch_spec).parent)
    config.num_hidden_layers = layers
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = layers
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tiny = ensure_builtin(BUILTIN_PREFIX + "tiny-llama")
    from lowmem_dpo.models import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        if (tiny / name).is_file():
            (out / name).write_bytes((tiny / name).read_bytes())
    return out


def measure_slice(cfg, layers: int = 2, steps: int = 2) -> dict:
    """--slice: measure the recipe's architecture cut to `layers` layers (random weights) and predict the same.
    Returns {"arch": the cut Arch, "measured": measure()'s dict, "prediction": the Prediction at its shapes}."""
    import tempfile

    arch = load_arch(cfg.model_name_or_path).with_layers(layers)
    with tempfile.TemporaryDirectory(prefix="lowmem_dpo-slice-") as tmp:
        folder = write_slice_model(cfg.model_name_or_path, layers, Path(tmp))
        scfg = dataclasses.replace(cfg, model_name_or_path=str(folder))
        measured = measure(scfg, steps)
    setup = at_measured_shapes(setup_from_config(cfg), measured)
    return {"arch": arch, "measured": measured, "prediction": predict(arch, setup)}


# -- output ------------------------------------------------------------------------------------------------------
def fmt(n: int | float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def parse_size(text: str, what: str = "--budget") -> int:
    """'12GiB', '11.5GB', '12000MiB', '12G' (= GiB), or plain bytes."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": MiB, "mib": MiB, "mb": 10 ** 6,
             "g": GiB, "gib": GiB, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units or float(m.group(1)) <= 0:
        raise UserError(f"{what} {text!r}: expected a size such as 12GiB, 11.5GB, 12000MiB or a number of bytes")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def run_budget(cfg, device: str) -> int:
    """The budget train and precompute plan for: memory_budget, or the device's memory."""
    if cfg.memory_budget is not None:
        return parse_size(cfg.memory_budget, "memory_budget")
    return default_budget(device)


def arch_of_run(model_path, instead: str) -> Arch | None:
    """The planner's Arch for a run's model folder; None, logged with what happens `instead`, for an
    architecture the planner does not model."""
    from lowmem_dpo.cli import log

    try:
        return load_arch(str(model_path))
    except UserError as e:
        log(f"note: no memory plan for this model ({e}); {instead}")
        return None


def default_budget(device: str) -> int:
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device=cuda but no GPU here to read its memory from: pass --budget, e.g. 12GiB")
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def stage_json(p: StagePrediction, budget: int, offload: int = 0) -> dict:
    return {"peak_bytes": p.peak_bytes, "tensor_peak_bytes": p.tensor_peak_bytes, "fits": p.peak_bytes <= budget,
            "offload_bytes": offload, "breakdown": p.breakdown, "phases": p.phases, "details": p.details,
            "shapes": p.shapes}


ROWS = (("base_weights", "base weights"), ("lora_params", "LoRA params (fp32)"), ("lora_grads", "LoRA grads (fp32)"),
        ("optimizer_state", "optimizer state"), ("activations", "activations kept for backward"),
        ("peak_phase", "peak phase (layer or LM head)"), ("framework_overhead", "framework overhead"))


def describe_setup(s: Setup, stage: str) -> str:
    if stage == "precompute":
        return (f"{s.ref_dtype}, quantization {s.ref_quantization}, batch {s.precompute_batch} pairs, "
                f"T={s.shapes('precompute')[0]}")
    return (f"{s.dtype}, quantization {s.quantization}, checkpointing {'on' if s.gradient_checkpointing else 'off'}, "
            f"micro-batch {s.micro_batch} pairs x {s.grad_accum} accumulation, T={s.shapes('train')[0]}, "
            f"LoRA r={s.lora_r} on {len(s.lora_targets)} modules, {s.optimizer}")


def table(columns: list[tuple[str, StagePrediction]], budget: int, measured: list[int | None] | None = None) -> str:
    width, col = 31, 22
    lines = [f"{'':{width}}" + "".join(f"{name:>{col}}" for name, _ in columns)]
    for key, label in ROWS:
        lines.append(f"{label:{width}}" + "".join(f"{fmt(p.breakdown[key]) if p.breakdown[key] else '-':>{col}}"
                                                  for _, p in columns))
    lines.append(f"{'  phases: layer / LM head':{width}}"
                 + "".join(f"{fmt(p.phases['layer']) + ' / ' + fmt(p.phases['logits']):>{col}}" for _, p in columns))
    lines.append(f"{'peak':{width}}" + "".join(f"{fmt(p.peak_bytes):>{col}}" for _, p in columns))
    lines.append(f"{'fits ' + fmt(budget):{width}}"
                 + "".join(f"{'yes' if p.peak_bytes <= budget else 'NO':>{col}}" for _, p in columns))
    if measured:
        lines.append(f"{'measured (tensor peak)':{width}}"
                     + "".join(f"{fmt(m) if m is not None else '':>{col}}" for m in measured))
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, through run_cli
        raise UserError(f"{message}; usage: python -m lowmem_dpo.plan RECIPE.yaml [key=value ...] [--budget SIZE] "
                        "[--json OUT] [--measure] [--slice N] [--steps K]")


def is_arch_only(spec: str) -> bool:
    """model_name_or_path names a shipped architecture (no weights here)."""
    return spec.startswith(ARCH_PREFIX) or (spec.lower() in HUB_ARCHS and not Path(spec).is_dir())


def _error_pct(predicted: int, measured: int) -> float:
    return round(100 * (predicted - measured) / measured, 1)


def main(argv: list[str]) -> int:
    from lowmem_dpo.config import load_config

    ap = _Parser(prog="python -m lowmem_dpo.plan", add_help=False)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--budget")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--slice", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_intermixed_args(argv)
    if args.slice is not None and (args.slice < 1 or not args.measure):
        raise UserError("--slice N needs N >= 1 and --measure")
    if args.steps < 1:
        raise UserError("--steps K needs K >= 1")
    cfg = load_config(args.recipe, args.overrides)
    if cfg.sft_adapter or Path(cfg.model_name_or_path).is_dir():
        from lowmem_dpo import adapters, models

        # an SFT adapter train continues: plan with its rank and target modules, as train does
        cfg = adapters.planned_lora(cfg, models.model_source(cfg.model_name_or_path, cfg.sft_adapter))
    budget = parse_size(args.budget) if args.budget else default_budget(planned_device(cfg))
    arch = load_arch(cfg.model_name_or_path)
    if args.measure and not args.slice and is_arch_only(cfg.model_name_or_path):
        raise UserError(f"--measure needs weights: model_name_or_path={cfg.model_name_or_path} is architecture-only "
                        "here; add --slice N to measure its first N layers with random weights, or pass a model "
                        "folder")
    setup = setup_from_config(cfg, budget)
    pred = predict(arch, setup)
    chosen = choose(arch, setup, budget)
    _, as_given_offload = _offload(pred.train.peak_bytes, budget,
                                   layer_weight_bytes(arch, setup.dtype, setup.quantization), arch.layers,
                                   streamed_layer_bytes(arch, setup.dtype, setup.quantization))
    report = {"model": cfg.model_name_or_path, "arch": dataclasses.asdict(arch), "device": setup.device,
              "device_kind": setup.kind, "budget_bytes": budget, "setup": dataclasses.asdict(setup),
              "train": stage_json(pred.train, budget, as_given_offload),
              "precompute": stage_json(pred.precompute, budget), "plan": chosen.to_json(budget)}
    print(f"model    {arch.describe()}")
    print(f"device   {setup.device} (rule {setup.kind}), budget {fmt(budget)}")
    print(f"train    {describe_setup(setup, 'train')}")
    print(f"precomp. {describe_setup(setup, 'precompute')}")
    print()
    columns = [("train", pred.train), ("precompute", pred.precompute)]
    if chosen.overrides:
        columns += [("train (plan)", chosen.prediction.train), ("precompute (plan)", chosen.prediction.precompute)]
    measured_row, notes = None, []
    if args.measure:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        if args.slice:
            result = measure_slice(cfg, args.slice, args.steps)
            sliced, measured = result["prediction"], result["measured"]
            columns = [(f"train ({args.slice} layers)", sliced.train),
                       (f"precompute ({args.slice} layers)", sliced.precompute)]
            report["slice"] = {"layers": args.slice, "arch": dataclasses.asdict(result["arch"])}
        else:
            measured = measure(cfg, args.steps)
            sliced = predict(arch, at_measured_shapes(setup, measured))
        measured_row = []
        for stage in ("train", "precompute"):
            m, p = measured[stage], getattr(sliced, stage)
            entry = {**m, "predicted_at_measured_shapes": p.tensor_peak_bytes,
                     "error_pct": _error_pct(p.tensor_peak_bytes, m["measured_peak_bytes"])}
            if args.slice:
                report["slice"][stage] = {**stage_json(p, budget), **entry}
            else:
                report[stage].update(entry)
            measured_row.append(m["measured_peak_bytes"])
            notes.append(f"measured {stage}: {fmt(m['measured_peak_bytes'])} on {measured['device']} "
                         f"(T={m['seq_len']}, {m['completion_tokens']} completion tokens/sequence); predicted at "
                         f"those shapes {fmt(p.tensor_peak_bytes)}: {entry['error_pct']:+.1f}%")
        measured_row += [None] * (len(columns) - len(measured_row))
    print(table(columns, budget, measured_row))
    for note in notes:
        print(note)
    if "8bit" in (setup.quantization, setup.ref_quantization):
        print("note: 8bit's LLM.int8 buffers are modeled from CPU measurements (bitsandbytes' CUDA kernels differ): "
              "allow a margin on a GPU")
    print()
    c = chosen.setup
    print(f"plan: quantization={c.quantization} gradient_checkpointing={str(c.gradient_checkpointing).lower()} "
          f"micro-batch {c.micro_batch} x {c.grad_accum} accumulation, precompute batch {c.precompute_batch}, "
          f"offload {fmt(chosen.offload_bytes) if chosen.offload_bytes else 'none'}: "
          + ("the recipe as given " if not chosen.overrides and not chosen.offload_bytes else "")
          + (f"fits {fmt(budget)}" if chosen.fits else f"DOES NOT FIT {fmt(budget)} even with every knob"))
    if chosen.overrides or chosen.offload_bytes or chosen.precompute_offload_bytes:
        for step in chosen.steps:
            print(f"  - {step}")
        if chosen.overrides:
            print("  overrides: " + " ".join(f"{k}={v}" for k, v in chosen.overrides.items()))
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if chosen.fits else EXIT_NO_FIT


if __name__ == "__main__":
    from lowmem_dpo.cli import run_cli

    raise SystemExit(run_cli(main, None, "plan", __doc__))


def offload_map(arch: Arch, setup: Setup, budget: int, stage: str, device: int | str = 0) -> dict | None:
    """The device_map that keeps `stage` (train | precompute) of the setup as given within `budget` by leaving
    the trailing decoder layers in CPU RAM (devices.offload_device_map), or None when it fits without. The
    numbers are the prediction's: per-layer weight bytes and everything else on the device (peak minus the
    layers' weights), so the layers moved are the k of _offload."""
    from lowmem_dpo import devices

    pred = predict(arch, setup)
    dtype, quantization = ((setup.dtype, setup.quantization) if stage == "train"
                           else (setup.ref_dtype, setup.ref_quantization))
    peak = pred.train.peak_bytes if stage == "train" else pred.precompute.peak_bytes
    if peak <= budget:
        return None
    per_layer = layer_weight_bytes(arch, dtype, quantization)
    return devices.offload_device_map(arch.layers, per_layer, peak - arch.layers * per_layer, budget, device,
                                      buffer_bytes=streamed_layer_bytes(arch, dtype, quantization))
