"""The memory model's weight terms: the frozen base's bytes per Linear as loaded (16-bit, NF4, LLM.int8), LoRA's
matrices and AdamW's state for them, and a quantized Linear's dequantized copy while it multiplies. Pure
functions of an architecture (arch.Arch); activations.py has the activations'.
"""

from __future__ import annotations

import math

from lowmem_dpo.memory.arch import Arch, adapted
from lowmem_dpo.memory.setup import DTYPE_BYTES, Setup
from lowmem_dpo.runtime.rules import PAGED_ADAMW_8BIT

# bitsandbytes NF4: 64 weights per quantization block; double quantization stores each block's absmax as 1 byte,
# with one float32 absmax per 256 blocks.
NF4_BLOCK = 64
NF4_BLOCK2 = 256
# bitsandbytes' 8-bit optimizers keep 32-bit state for tensors under this many elements (min_8bit_size).
BNB_MIN_8BIT_SIZE = 4096
BNB_OPT_BLOCK = 256

# -- weights and LoRA state ----------------------------------------------------------------------------
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
    """The frozen base: decoder Linears (quantized when asked), and in the dtype, always: everything outside the
    layers (embeddings, position embeddings, the final norm), the LM head (transformers never quantizes it; 0
    when tied), the layers' norms and biases."""
    s = DTYPE_BYTES[dtype]
    linears = sum(linear_weight_bytes(i, o, quantization, s) for i, o in arch.linears().values())
    return {
        "linears": arch.layers * linears,
        "embeddings": arch.outer_params * s,
        "lm_head": 0 if arch.tie_word_embeddings else arch.vocab * arch.hidden * s,
        "norms_biases": arch.layers * arch.layer_extra_params() * s,
    }


# FSDP2 (fsdp): the decoder layers gathered whole at once, the one computing and the next (its all-gather
# overlaps this one's compute), in forward and again in backward.
FSDP_WINDOW = 2


def linear_parts(in_features: int, out_features: int, quantization: str, s: int) -> tuple[int, int]:
    """One frozen Linear's bytes as FSDP2 sees them: (its parameter, which it shards; the rest, kept whole on each
    process). A 4-bit weight's parameter is its packed bytes; its quantization constants (absmax, code tables) are
    an attribute, not a parameter. An 8-bit one's row scales likewise."""
    whole = linear_weight_bytes(in_features, out_features, quantization, s)
    n = in_features * out_features
    param = math.ceil(n / 2) if quantization == "4bit" else n if quantization == "8bit" else whole
    return param, whole - param


def card_weight_bytes(arch: Arch, setup: Setup, reference: bool = False) -> dict[str, int]:
    """The frozen base of train's policy (reference: precompute's) on one card: base_weight_bytes; with fsdp
    (setup.sharded) over setup.processes, each card's share (runtime/sharding.py): 1/N of the layers' parameters
    and of the embeddings (tied to the head: whole), the 4-bit constants and the LM head whole, and FSDP_WINDOW
    layers gathered whole. setup.shard_offload (fsdp_offload_params): the shards in CPU RAM (card_host_bytes), the
    card holding what is gathered."""
    dtype, quantization = (setup.ref_dtype, setup.ref_quantization) if reference else (setup.dtype, setup.quantization)
    processes, offload = setup.processes, setup.shard_offload
    whole = base_weight_bytes(arch, dtype, quantization)
    if not setup.sharded:
        return whole
    s = DTYPE_BYTES[dtype]
    parts = [linear_parts(i, o, quantization, s) for i, o in arch.linears().values()]
    layer = sum(p for p, _ in parts) + arch.layer_extra_params() * s  # what one layer's all-gather brings
    return {"shards": 0 if offload else card_host_bytes(arch, dtype, quantization, processes),
            "constants": arch.layers * sum(c for _, c in parts),
            "embeddings": whole["embeddings"] if arch.tie_word_embeddings else 0,
            # offloaded, each gathered layer's own shard is first copied to the card
            "lm_head": whole["lm_head"], "gathered": min(FSDP_WINDOW, arch.layers) * (
                layer + (math.ceil(layer / processes) if offload else 0))}


def card_host_bytes(arch: Arch, dtype: str, quantization: str, processes: int) -> int:
    """One process's shard of the base (fsdp): what it holds on its card, or in CPU RAM with fsdp_offload_params."""
    s = DTYPE_BYTES[dtype]
    layer = sum(linear_parts(i, o, quantization, s)[0] for i, o in arch.linears().values()) + arch.layer_extra_params() * s
    embeddings = 0 if arch.tie_word_embeddings else arch.outer_params * s
    return math.ceil((arch.layers * layer + embeddings) / processes)


def embedding_gather_bytes(arch: Arch, setup: Setup, reference: bool = False) -> int:
    """fsdp: the embeddings gathered whole for the lookup at each forward's start (and once in backward, after the
    layers), with their own shard copied to the card first when offloaded; 0 when not sharded, or tied to the head
    and so kept whole. In train's dtype (reference: precompute's)."""
    if not setup.sharded or arch.tie_word_embeddings:
        return 0
    whole = arch.outer_params * DTYPE_BYTES[setup.ref_dtype if reference else setup.dtype]
    return whole + (math.ceil(whole / setup.processes) if setup.shard_offload else 0)


def layer_weight_bytes(arch: Arch, dtype: str, quantization: str) -> int:
    """One decoder layer's weights: the unit CPU offload moves."""
    s = DTYPE_BYTES[dtype]
    return (sum(linear_weight_bytes(i, o, quantization, s) for i, o in arch.linears().values())
            + arch.layer_extra_params() * s)


def lora_shapes(arch: Arch, targets: str | tuple[str, ...], r: int) -> list[int]:
    """Element counts of every LoRA matrix: A is (r, in), B is (out, r), per adapted Linear (arch.adapted: what
    peft adapts for `targets`, the LM head included)."""
    return [n for i, o in adapted(arch, targets).shapes(arch) for n in (r * i, o * r)]


def optimizer_state_bytes(shapes: list[int], optimizer: str) -> int:
    """AdamW's two moments per LoRA parameter.

    adamw_torch: 2 float32 states = 8 bytes/param (+ a 4-byte step per tensor).
    paged_adamw_8bit (bitsandbytes, blockwise): tensors of >= 4096 elements keep 2 uint8 states (2 bytes/param)
      + a float32 absmax per 256-element block per state + two 256-entry float32 quantile maps; smaller tensors
      keep 32-bit state (8 bytes/param). Paged: allocated as CUDA unified memory, which moves to CPU RAM under
      pressure instead of failing (and which torch's allocator statistics do not see).
    """
    total = 0
    for n in shapes:
        if optimizer == PAGED_ADAMW_8BIT and n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_OPT_BLOCK) + 2 * 256 * 4
        else:
            total += 8 * n + 4
    return total


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
