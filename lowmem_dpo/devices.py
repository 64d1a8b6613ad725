"""Per-device rules: which device, dtype, gradient checkpointing, optimizer and offload a run gets, and why.

Hardware and optional-dependency code (bitsandbytes) lives here and in models.py, imported lazily, so
everything imports on a CPU. The RULES table is the rule book; `auto` values in the config resolve through it
and the train log prints each choice with its reason.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from lowmem_dpo import distributed
from lowmem_dpo.errors import UserError, log
from lowmem_dpo.units import GiB

# Optimizer names (as transformers' `optim`): torch's AdamW, or bitsandbytes' paged 8-bit AdamW, whose two
# states take 2 bytes/param instead of 8 and whose pages move to CPU RAM when the GPU runs out, instead of OOM.
ADAMW_TORCH = "adamw_torch"
PAGED_ADAMW_8BIT = "paged_adamw_8bit"


@dataclass(frozen=True)
class Rule:
    """What one device kind gets. dtype and gradient_checkpointing apply where the config says auto; the
    optimizer and offload are not config keys and always come from here."""

    dtype: str  # weights and compute; also the compute dtype of a 4-bit/8-bit base
    gradient_checkpointing: bool
    optimizer: str  # ADAMW_TORCH or PAGED_ADAMW_8BIT
    offload: str  # what lives off the device's memory, beyond the reference (always on disk: the cache)
    why: str
    # share_prompt=auto: the prompt once per pair (a custom attention mask). Off on GPUs until measured there: a
    # custom mask rules out the fastest fused attention kernels.
    share_prompt: bool = False


_CKPT_SMALL_GPU = "checkpointing on: it trades ~30% compute for activation memory, which a 7B run needs here"
_PAGED = ("paged 8-bit AdamW: LoRA optimizer state at 2 bytes/param, paged to CPU RAM under memory pressure "
          "instead of an out-of-memory error")
_CPU_FREE = "no checkpointing: RAM is plentiful and recomputation only costs time; torch AdamW (bitsandbytes' " \
            "paged optimizers need CUDA)"

_CUDA_OFFLOAD = ("optimizer state (paged); trailing decoder layers to CPU RAM when the planner says the run does "
                 "not fit memory_budget")

# device kind -> Rule. CUDA kinds by total memory (<= 12 GiB, <= 24 GiB, larger) and bf16 support; CPUs by
# native bf16 (AVX512-BF16 or AMX, as oneDNN reports); Apple GPUs (mps).
RULES: dict[str, Rule] = {
    "cuda-12gb-bf16": Rule("bfloat16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                           f"CUDA <= 12 GiB with bf16: bfloat16 halves memory; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-12gb": Rule("float32", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                      f"CUDA <= 12 GiB without bf16: float32 (fp16 training would need loss scaling); "
                      f"{_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-24gb-bf16": Rule("bfloat16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                           f"CUDA <= 24 GiB with bf16: bfloat16 halves memory; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-24gb": Rule("float32", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                      f"CUDA <= 24 GiB without bf16: float32 (fp16 training would need loss scaling); "
                      f"{_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-large-bf16": Rule("bfloat16", False, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                            "CUDA > 24 GiB with bf16: bfloat16 halves memory; no checkpointing: a 7B LoRA run's "
                            "activations fit at usual batch sizes and recomputation would cost ~30% step time "
                            f"(set gradient_checkpointing=true for long sequences); {_PAGED}"),
    "cuda-large": Rule("float32", False, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                       "CUDA > 24 GiB without bf16: float32 (fp16 training would need loss scaling); no "
                       f"checkpointing: activations fit at usual batch sizes; {_PAGED}"),
    "mps": Rule("float32", True, ADAMW_TORCH, "none",
                "Apple GPU (mps): float32 (bf16 there needs macOS 14+); checkpointing on: unified memory is shared "
                "with the system; torch AdamW (bitsandbytes' paged optimizers need CUDA)"),
    "cpu-bf16": Rule("bfloat16", False, ADAMW_TORCH, "none",
                     "CPU with native bf16 (AVX512-BF16/AMX): bfloat16 runs matmuls ~2x faster than float32 and "
                     f"halves memory, also as a 4-bit/8-bit base's compute dtype; {_CPU_FREE}", share_prompt=True),
    "cpu": Rule("float32", False, ADAMW_TORCH, "none",
                f"CPU without native bf16: float32 (16-bit matmuls are emulated and slow); {_CPU_FREE}",
                share_prompt=True),
}

QUANTIZATION_NAMES = {"none": "none", "8bit": "LLM.int8", "4bit": "NF4 with double quantization"}


@dataclass
class Resolved:
    device: torch.device
    kind: str  # a RULES key
    dtype: torch.dtype  # the policy's weights and compute, also the compute dtype of its quantized base
    gradient_checkpointing: bool
    optimizer: str  # ADAMW_TORCH or PAGED_ADAMW_8BIT
    reasons: list[str] = field(default_factory=list)
    quantization: str = "none"  # the policy's base: none|8bit|4bit
    ref_dtype: torch.dtype | None = None  # the reference's (precompute's) dtype; None: the same as dtype
    ref_quantization: str | None = None  # the reference's base: none|8bit|4bit; None: the same as quantization
    offload: str = "none"
    share_prompt: bool = False  # the prompt once per pair, where the model supports it (headcheck.decide_sharing)

    def __post_init__(self):
        if self.ref_dtype is None:
            self.ref_dtype = self.dtype
        if self.ref_quantization is None:
            self.ref_quantization = self.quantization


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """oneDNN's own check for AVX512-BF16 / AMX (a private torch op: any failure means no)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def memory_tier(total_bytes: int) -> str:
    """CUDA memory tier of a card: 12gb (<= 12 GiB), 24gb (<= 24 GiB) or large."""
    if total_bytes <= 12 * GiB:
        return "12gb"
    if total_bytes <= 24 * GiB:
        return "24gb"
    return "large"


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        tier = memory_tier(torch.cuda.get_device_properties(device).total_memory)
        # Native bf16 only (Ampere and later): by default torch also answers yes for the slow emulation on
        # Turing/Volta cards (T4, V100, RTX 20xx), which belong to the float32 rows.
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return f"cuda-{tier}" + ("-bf16" if bf16 else "")
    if device.type == "mps":
        return "mps"
    return "cpu-bf16" if cpu_has_native_bf16() else "cpu"


def _pick_device(cfg) -> tuple[torch.device, str]:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device()), "device=cuda (auto: CUDA present)"
        if torch.backends.mps.is_available():
            return torch.device("mps"), "device=mps (auto: no CUDA, Apple GPU present)"
        return torch.device("cpu"), "device=cpu (auto: no CUDA or mps)"
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("device=cuda but no CUDA GPU is visible to torch: use device=cpu or device=auto, or "
                            "install a CUDA build of torch")
        return torch.device("cuda", torch.cuda.current_device()), "device=cuda (from the recipe)"
    if cfg.device == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but torch sees no Apple GPU (mps): use device=cpu or device=auto")
    return torch.device(cfg.device), f"device={cfg.device} (from the recipe)"


def _dtype(setting: str, key: str, rule: Rule) -> tuple[torch.dtype, str]:
    if setting == "auto":
        return DTYPES[rule.dtype], f"{key}={rule.dtype} (auto)"
    return DTYPES[setting], f"{key}={setting} (from the recipe)"


def resolve(cfg) -> Resolved:
    """Resolve device, dtypes, gradient_checkpointing, optimizer and offload from the config and RULES."""
    device, device_reason = _pick_device(cfg)
    device = distributed.init(device)  # under torchrun / accelerate launch: join the group, this rank's GPU
    w = distributed.world()
    if w.distributed:
        device_reason += f"; process {w.rank} of {w.size} on {device} (data parallel)"
    kind = device_kind(device)
    rule = RULES[kind]
    reasons = [device_reason, f"device kind {kind}: {rule.why}"]
    dtype, why = _dtype(cfg.dtype, "dtype", rule)
    reasons.append(why)
    if cfg.quantization != "none":
        reasons.append(f"quantization={cfg.quantization} ({QUANTIZATION_NAMES[cfg.quantization]}, bitsandbytes; "
                       f"computes in {dtype_name(dtype)}, the dtype)")
    ref_dtype, why = _dtype(cfg.reference_dtype, "ref_dtype", rule)
    if cfg.ref_dtype is None:
        why = f"ref_dtype={dtype_name(ref_dtype)} (null: as dtype)"
    ref_q = (f"ref_quantization={cfg.reference_quantization} "
             f"({'null: as quantization' if cfg.ref_quantization is None else 'from the recipe'})")
    reasons.append(f"{why}, {ref_q}: the reference's settings in precompute and in the cache fingerprint")
    if cfg.gradient_checkpointing == "auto":
        ckpt = rule.gradient_checkpointing
        reasons.append(f"gradient_checkpointing={str(ckpt).lower()} (auto)")
    else:
        ckpt = cfg.gradient_checkpointing == "true"
        reasons.append(f"gradient_checkpointing={cfg.gradient_checkpointing} (from the recipe)")
    share = rule.share_prompt if cfg.share_prompt == "auto" else cfg.share_prompt == "true"
    reasons.append(f"share_prompt={str(share).lower()} ({'auto' if cfg.share_prompt == 'auto' else 'from the recipe'})"
                   f"{', where the model supports it' if share else ''}")
    reasons.append(f"optimizer={rule.optimizer}, offload={rule.offload} (rule for {kind})")
    return Resolved(device, kind, dtype, ckpt, rule.optimizer, reasons, quantization=cfg.quantization,
                    ref_dtype=ref_dtype, ref_quantization=cfg.reference_quantization, offload=rule.offload,
                    share_prompt=share)


# -- bitsandbytes (optional at import time; needed for quantization and the paged optimizer) ----------------------
def import_bitsandbytes(needed_for: str):
    """The bitsandbytes module, imported on first use, or a UserError saying how to install it."""
    import logging

    # At import, on CPUs with AVX512-BF16, bitsandbytes warns that the optional `kernels` package is missing; it
    # only serves the packed inference path that models.load_model turns off. Not the user's to act on.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except Exception as e:  # missing, or a build that does not match this machine's CUDA/CPU
        detail = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{needed_for} needs bitsandbytes, which could not be imported ({type(e).__name__}: "
                        f"{detail}). Install it with: pip install 'bitsandbytes>=0.45' (on a GPU, after your CUDA "
                        "build of torch)") from None
    return bitsandbytes


# -- other optional packages (matplotlib for the report, tensorboard for report_to) --------------------------------
def import_optional(module: str, needed_for: str, install: str):
    """`module`, imported on first use, or a UserError "{needed_for}: pip install {install}", e.g.
    import_optional("matplotlib", "curves.png needs matplotlib", "'lowmem_dpo[report]'")."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{needed_for}: pip install {install}") from None


def make_optimizer(name: str, params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer a rule names, over `params` (the LoRA weights, float32)."""
    if name == PAGED_ADAMW_8BIT:
        bnb = import_bitsandbytes(f"optimizer={PAGED_ADAMW_8BIT} (the rule on CUDA)")
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == ADAMW_TORCH:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise AssertionError(f"unknown optimizer {name!r} in devices.RULES")


# -- forward-pass helpers ---------------------------------------------------------------------------------------
def autocast(device: torch.device, dtype: torch.dtype):
    """Forward-pass context: with 16-bit base weights, autocast to the same dtype so peft's float32 LoRA path
    (which casts every adapted layer's input up to float32) also runs its matmuls in 16-bit. On a CPU with
    native bf16 this makes a train step ~20% faster; LoRA weights and optimizer state stay float32."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA's (and mps') out-of-memory error, or the CPU allocator's failure."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))


def halving_on_oom(run, size: int, device: torch.device, retrying, exhausted: str, cleanup=None,
                   any_rank=lambda failed: failed):
    """run(size), retried at half the size on out-of-memory, down to 1: `cleanup()` (e.g. drop a partial step's
    gradients) and the cached blocks released before each retry, whose log line is retrying(new size). Out of
    memory at 1 raises UserError(exhausted). `any_rank(failed)` says whether any process failed
    (distributed.any_rank; `run` makes no collective call): then every process retries at the same size."""
    while True:
        failed = False
        try:
            result = run(size)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            del e  # its traceback holds the failed attempt's tensors
            failed = True
        if any_rank(failed):
            if cleanup is not None:
                cleanup()
            release_memory(device)
            if size == 1:
                raise UserError(exhausted) from None
            size = max(1, size // 2)
            log(retrying(size))
        else:
            return result


def release_memory(device: torch.device) -> None:
    """Hand cached blocks back after an out-of-memory error, so a smaller retry starts from a clean pool."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak allocated bytes on CUDA since the last reset; None on CPU (see bench/ for RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


# -- CPU offload: the device_map's placement (the maps themselves: memory/search.py) ---------------------------
def offloaded_layers(device_map: dict | None) -> list[str]:
    """The device_map's entries that live off the execution device: "cpu" and "disk" ones when the map names
    an accelerator, only "disk" ones when the CPU itself computes (as accelerate's dispatch decides)."""
    device_map = device_map or {}
    off = ("cpu", "disk") if any(v not in ("cpu", "disk") for v in device_map.values()) else ("disk",)
    return [k for k, v in device_map.items() if v in off]


def release_freed_memory() -> None:
    """Ask the C heap to return its freed pages to the OS (glibc's malloc_trim): after a load that built and
    dropped large temporaries (quantizing every Linear), RSS falls to what is in use. A no-op without glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        pass
