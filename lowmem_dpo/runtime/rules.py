"""The per-device rule book and the decisions made from a device's numbers, as pure functions (numbers in,
numbers out): which rule a device gets, what memory budget a CUDA run plans for, and which dtypes a card can run.

devices.py reads the machine (torch.cuda, oneDNN) and calls these; the tests call them with the numbers of cards
this machine does not have (a T4, a 12 GB card with a display, an 80 GB card capped at 11.25 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_dpo.runtime.units import GiB, MiB, fmt

# Optimizer names (as transformers' `optim`): torch's AdamW, or bitsandbytes' paged 8-bit AdamW, whose two
# states take 2 bytes/param instead of 8 and whose pages move to CPU RAM when the GPU runs out, instead of OOM.
ADAMW_TORCH = "adamw_torch"
PAGED_ADAMW_8BIT = "paged_adamw_8bit"


@dataclass(frozen=True)
class Rule:
    """What one device kind gets. dtype, gradient_checkpointing and share_prompt apply where the config says
    auto; the optimizer and offload are not config keys and always come from here."""

    dtype: str  # weights and compute; also the compute dtype of a 4-bit/8-bit base
    gradient_checkpointing: bool
    optimizer: str  # ADAMW_TORCH or PAGED_ADAMW_8BIT
    offload: str  # what lives off the device's memory, beyond the reference (always on disk: the cache)
    why: str
    # share_prompt=auto: the prompt once per pair (a 4D mask). On CUDA a shared prompt saves its activations, which
    # a small card lacks; its mask costs SDPA's memory-efficient kernel (the unshared batch runs flash, no mask)
    # and T x T bytes, which the planner counts. On mps: not measured, off.
    share_prompt: bool = True


_CKPT_SMALL_GPU = "checkpointing on: it trades ~30% compute for activation memory, which a 7B run needs here"
_PAGED = ("paged 8-bit AdamW: LoRA optimizer state at 2 bytes/param, paged to CPU RAM under memory pressure "
          "instead of an out-of-memory error")
_CPU_FREE = ("no checkpointing: RAM is plentiful and recomputation only costs time; torch AdamW (bitsandbytes' "
             "paged optimizers need CUDA)")
_FP16 = "float16 with dynamic loss scaling (GradScaler; no bf16 on this card, and float32 would double memory)"
_CUDA_OFFLOAD = ("optimizer state (paged); trailing decoder layers streamed from pinned CPU RAM when the planner "
                 "says nothing else fits the budget")

# device kind -> Rule. CUDA kinds by the memory budget (<= 12 GiB, <= 24 GiB, larger: cuda_kind) and native bf16
# support; CPUs by native bf16 (AVX512-BF16 or AMX, as oneDNN reports); Apple GPUs (mps).
RULES: dict[str, Rule] = {
    "cuda-12gb-bf16": Rule("bfloat16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                           f"CUDA budget <= 12 GiB with bf16: bfloat16 halves memory; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-12gb": Rule("float16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                      f"CUDA budget <= 12 GiB without bf16: {_FP16}; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-24gb-bf16": Rule("bfloat16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                           f"CUDA budget <= 24 GiB with bf16: bfloat16 halves memory; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-24gb": Rule("float16", True, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                      f"CUDA budget <= 24 GiB without bf16: {_FP16}; {_CKPT_SMALL_GPU}; {_PAGED}"),
    "cuda-large-bf16": Rule("bfloat16", False, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                            "CUDA budget > 24 GiB with bf16: bfloat16 halves memory; no checkpointing: a 7B LoRA "
                            "run's activations fit at usual batch sizes and recomputation would cost ~30% step time "
                            f"(the planner turns it on when they do not); {_PAGED}"),
    "cuda-large": Rule("float16", False, PAGED_ADAMW_8BIT, _CUDA_OFFLOAD,
                       f"CUDA budget > 24 GiB without bf16: {_FP16}; no checkpointing: activations fit at usual "
                       f"batch sizes; {_PAGED}"),
    "mps": Rule("float32", True, ADAMW_TORCH, "none",
                "Apple GPU (mps): float32 (bf16 there needs macOS 14+); checkpointing on: unified memory is shared "
                "with the system; torch AdamW (bitsandbytes' paged optimizers need CUDA)", share_prompt=False),
    "cpu-bf16": Rule("bfloat16", False, ADAMW_TORCH, "none",
                     "CPU with native bf16 (AVX512-BF16/AMX): bfloat16 runs matmuls ~2x faster than float32 and "
                     f"halves memory, also as a 4-bit/8-bit base's compute dtype; {_CPU_FREE}"),
    "cpu": Rule("float32", False, ADAMW_TORCH, "none",
                f"CPU without native bf16: float32 (16-bit matmuls are emulated and slow); {_CPU_FREE}"),
}


# share_prompt=auto shares only when the repeated prompts are at least this share of the unshared forward's
# tokens (headcheck.decide_sharing; the planner's worst shared row follows from it). Measured on our 2-core CPU
# (bench/README.md): at 15% (llama-25m-cpu.yaml) shared steps took 0.69-0.86 s against 0.70-0.85 s unshared, no
# gain (its longer masked rows cost attention the prompt saves); at 42% (the long-prompt recipe) 1.42 s against
# 1.93 s.
SHARE_MIN_PROMPT_SHARE = 0.25


def memory_tier(budget_bytes: int) -> str:
    """The CUDA memory tier of a budget: 12gb (<= 12 GiB), 24gb (<= 24 GiB) or large."""
    if budget_bytes <= 12 * GiB:
        return "12gb"
    if budget_bytes <= 24 * GiB:
        return "24gb"
    return "large"


def cuda_kind(budget_bytes: int, native_bf16: bool) -> str:
    """The RULES key of a CUDA run: the tier of the memory it may use (not the card's total: an 80 GB card capped
    at 11.25 GiB is a 12 GB card), and whether the card computes bf16 natively (Ampere and later)."""
    return f"cuda-{memory_tier(budget_bytes)}" + ("-bf16" if native_bf16 else "")


@dataclass(frozen=True)
class CudaBudget:
    """What a CUDA run may allocate, and how it is held to it."""

    budget: int  # bytes torch's allocator may hold: what the planner fits and the device rule's tier
    fraction: float  # budget / the card's total, for torch.cuda.set_per_process_memory_fraction
    why: str
    short: bool = False  # memory_budget asked for more than the card has free


# What a CUDA process takes outside torch's allocator after the budget is read (the context exists by then):
# kernels loaded on first use (CUDA's lazy loading: cuBLAS, cuDNN, bitsandbytes), cuDNN's and cuBLAS' handles,
# the paged optimizer's managed pages (LoRA states: ~84 MB at 7B, r=16). Measured on an H200 (torch 2.11, CUDA 13,
# bench/results/gpu_check.json): 0.87 GiB of the card beyond torch's reserve at the step peak, the context
# included, which takes ~0.3-0.5 GiB when the budget is read; gpu_check records the context alone (context_gib).
CUDA_AFTER_START = 512 * MiB


def cuda_budget(free: int, held: int, total: int, memory_budget: int | None) -> CudaBudget:
    """The budget of a CUDA run from the card's numbers (torch.cuda.mem_get_info after the context exists): `free`
    bytes, `held` by this process's allocator already (torch.cuda.memory_reserved), `total`. Available: free +
    held, what torch can get (the display, other processes and this process's CUDA context are gone from free),
    less CUDA_AFTER_START for what CUDA itself takes later. The budget is memory_budget where it is set and fits in
    that, else what is available. It is what the planner fits and what torch's allocator is held to, as a fraction
    of the total: the out-of-memory back-off fires at the budget the plan used, not in cuBLAS, cuDNN or
    bitsandbytes past it, and a large card behaves as the small one it emulates."""
    available = max(0, free + held - CUDA_AFTER_START)
    budget = available if memory_budget is None else min(memory_budget, available)
    enforced = f"enforced: torch.cuda.set_per_process_memory_fraction({budget / total:.4f})"
    if memory_budget is None:
        why = (f"{fmt(available)} for torch on a {fmt(total)} card (torch.cuda.mem_get_info: the display, other "
               f"processes and the CUDA context excluded; {fmt(CUDA_AFTER_START)} kept for kernels and handles CUDA "
               f"loads later; {enforced})")
    elif memory_budget > available:
        why = (f"memory_budget={fmt(memory_budget)} but only {fmt(available)} is free on this {fmt(total)} card: "
               f"planning for {fmt(available)} ({enforced})")
    else:
        why = f"memory_budget={fmt(memory_budget)} of a {fmt(total)} card, {fmt(available)} free ({enforced})"
    return CudaBudget(budget, budget / total, why, short=memory_budget is not None and memory_budget > available)


@dataclass(frozen=True)
class RamBudget:
    """What a CPU run given memory_budget plans for."""

    budget: int  # bytes: what the planner fits
    why: str
    short: bool = False  # memory_budget asked for more RAM than this process's share of what is available


def cpu_budget(available: int, processes: int, memory_budget: int, source: str = "available") -> RamBudget:
    """The budget of a CPU run given memory_budget, from the RAM the OS says new allocations get now without
    swapping (`available`, as `source` names it: Linux's MemAvailable), shared by the run's `processes` on this
    machine, each with its own model. A memory_budget above this process's share is planned at the share, as
    cuda_budget plans a card's free memory: a plan for RAM that is not there ends in swapping or the kernel's
    out-of-memory killer, not in torch's out-of-memory back-off."""
    share = available // max(1, processes)
    of = f"{fmt(share)} of RAM {source}" + (f" ({processes} processes' share)" if processes > 1 else "")
    if memory_budget > share:
        return RamBudget(share, f"memory_budget={fmt(memory_budget)} but only {of} on this machine: planning for "
                         f"{fmt(share)}", short=True)
    return RamBudget(memory_budget, f"memory_budget={fmt(memory_budget)}, {of}")

def dtype_problem(key: str, setting: str, kind: str) -> str | None:
    """Why `key`=`setting` (dtype or ref_dtype, from the recipe) cannot run on a device of rule `kind`, or None.
    bfloat16 on a CUDA card without native bf16 (Turing, Volta: T4, V100, RTX 20xx): its matmuls are emulated and
    SDPA falls back to the math kernel, which materializes the T x T scores."""
    if setting == "bfloat16" and kind.startswith("cuda-") and not kind.endswith("-bf16"):
        return (f"{key}=bfloat16 on a GPU without native bf16 (compute capability below 8.0: T4, V100, RTX 20xx): "
                "its matmuls would be emulated and attention would materialize the T x T scores. Set "
                f"{key}=float16 (trained with dynamic loss scaling) or {key}=auto")
    return None
