"""Per-device rules: which device, compute dtype and gradient checkpointing a run gets, and why.

Hardware and optional-dependency code lives here, imported lazily, so everything imports on a CPU.
The table is the rule book; `auto` values in the config resolve through it and the train log prints each
choice with its reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from lowmem_dpo.cli import UserError

# device kind -> (dtype, gradient checkpointing, optimizer, reason)
RULES = {
    "cpu-bf16": ("bfloat16", False, "torch AdamW",
                 "CPU with native bf16 (AVX512-BF16/AMX): bfloat16 weights run matmuls ~2x faster than float32 "
                 "and halve memory; no checkpointing: RAM is plentiful and recomputation only costs time"),
    "cpu": ("float32", False, "torch AdamW",
            "CPU without native bf16: float32 (16-bit matmuls are emulated and slow); no checkpointing: RAM is "
            "plentiful and recomputation only costs time"),
    "cuda-bf16": ("bfloat16", True, "torch AdamW",
                  "CUDA with bf16: bfloat16 weights halve memory; checkpointing trades ~30% compute for "
                  "activation memory on a small card"),
    "cuda": ("float32", True, "torch AdamW",
             "CUDA without bf16: float32 (fp16 training would need loss scaling); checkpointing on"),
}


@dataclass
class Resolved:
    device: torch.device
    kind: str
    dtype: torch.dtype
    gradient_checkpointing: bool
    optimizer: str
    reasons: list[str] = field(default_factory=list)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """oneDNN's own check for AVX512-BF16 / AMX (a private torch op: any failure means no)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda-bf16" if torch.cuda.is_bf16_supported() else "cuda"
    return "cpu-bf16" if cpu_has_native_bf16() else "cpu"


def resolve(cfg) -> Resolved:
    """Resolve device, dtype and gradient_checkpointing from the config and the RULES table."""
    reasons = []
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        reasons.append(f"device={device.type} (auto: {'CUDA present' if device.type == 'cuda' else 'no CUDA'})")
    else:
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise UserError("device=cuda but no CUDA GPU is visible to torch: use device=cpu or device=auto, or "
                            "install a CUDA build of torch")
        device = torch.device(cfg.device)
        reasons.append(f"device={device.type} (from the recipe)")
    kind = device_kind(device)
    rule_dtype, rule_ckpt, optimizer, why = RULES[kind]
    if cfg.dtype == "auto":
        dtype = DTYPES[rule_dtype]
        reasons.append(f"dtype={rule_dtype} (auto; {why})")
    else:
        dtype = DTYPES[cfg.dtype]
        reasons.append(f"dtype={cfg.dtype} (from the recipe)")
    if cfg.gradient_checkpointing == "auto":
        ckpt = rule_ckpt
        reasons.append(f"gradient_checkpointing={str(ckpt).lower()} (auto; {kind})")
    else:
        ckpt = cfg.gradient_checkpointing == "true"
        reasons.append(f"gradient_checkpointing={cfg.gradient_checkpointing} (from the recipe)")
    reasons.append(f"optimizer={optimizer}")
    return Resolved(device, kind, dtype, ckpt, optimizer, reasons)


def autocast(resolved: Resolved):
    """Forward-pass context: with 16-bit base weights, autocast to the same dtype so peft's float32 LoRA path
    (which casts every adapted layer's input up to float32) also runs its matmuls in 16-bit. On a CPU with
    native bf16 this makes a train step ~20% faster; LoRA weights and optimizer state stay float32."""
    if resolved.dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(resolved.device.type, dtype=resolved.dtype)
    return contextlib.nullcontext()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes on CUDA since the last reset; None on CPU (see bench/ for RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
