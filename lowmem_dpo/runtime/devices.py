"""Per-device rules applied to this machine: which device, dtype, gradient checkpointing, optimizer, memory budget
and offload a run gets, and why (the train log prints each choice with its reason); and every call into torch.cuda,
streams and events included. The rule book and the decisions made from a device's numbers are pure functions in
rules.py; this module reads the numbers (torch.cuda, oneDNN) and applies them (the C heap's: heap.py). Hardware
and optional-dependency code lives here and in model/models.py, imported lazily: everything imports on a CPU."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from lowmem_dpo.runtime import distributed, heap, ram, rules
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.ranks import local_size
from lowmem_dpo.runtime.units import fmt, parse_size, size_note

QUANTIZATION_NAMES = {"none": "none", "8bit": "LLM.int8", "4bit": "NF4 with double quantization"}


@dataclass
class Resolved:
    device: torch.device
    kind: str  # a rules.RULES key
    dtype: torch.dtype  # the policy's weights and compute, also the compute dtype of its quantized base
    gradient_checkpointing: bool
    optimizer: str  # rules.ADAMW_TORCH or rules.PAGED_ADAMW_8BIT
    reasons: list[str] = field(default_factory=list)
    quantization: str = "none"  # the policy's base: none|8bit|4bit
    ref_dtype: torch.dtype | None = None  # the reference's (precompute's) dtype; None: the same as dtype
    ref_quantization: str | None = None  # the reference's base: none|8bit|4bit; None: the same as quantization
    offload: str = "none"
    share_prompt: bool = False  # the prompt once per pair, where the model supports it (headcheck.decide_sharing)
    budget: int | None = None  # bytes the run may use on the device; None: the planner's default (RAM on a CPU)
    micro_batch: int | None = None  # pairs per micro-batch the planner fits (policy.apply_plan); None: the recipe's
    activation_offloading: bool = False  # train's saved tensors to pinned host memory (activations.py; CUDA only)
    mlp_tiles: bool = True  # train's MLP in tiles under checkpointing (activations.TiledMLP); the plan may run it whole
    mlp_tile_tokens: int | None = None  # their size, where the plan makes them larger than activations' default
    streamed_layers: int = 0  # train's decoder layers streamed from CPU RAM (policy.apply_plan)
    sharded: bool = False  # several processes: the base sharded over them with FSDP2 (fsdp; runtime/sharding.py)
    shard_offload: bool = False  # the shards in CPU RAM (fsdp_offload_params)

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


def cuda_native_bf16() -> bool:
    """Whether the current CUDA card computes bf16 natively (Ampere and later): by default torch also answers yes
    for the slow emulation on Turing/Volta cards (T4, V100, RTX 20xx), which belong to the float16 rows."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def cuda_memory(device: torch.device) -> tuple[int, int, int]:
    """(free, held, total) bytes of a CUDA card as the driver sees it now: free for anyone, held by this process's
    caching allocator, and the card's total (the first call creates the CUDA context, which free then excludes)."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(torch.cuda.memory_reserved(device)), int(total)


def run_cuda_budget(device: torch.device, memory_budget: str | None):
    """rules.cuda_budget of this card, enforced on torch's allocator: the back-off fires at the planned budget."""
    cap = None if memory_budget is None else parse_size(memory_budget, "memory_budget")
    budget = rules.cuda_budget(*cuda_memory(device), cap)
    if budget.budget == 0:
        raise UserError(f"no memory for torch on {device}: {budget.why}; free it or pick another (CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_per_process_memory_fraction(budget.fraction, device)
    if budget.short:
        log(f"warning: {budget.why}")
    return budget


def run_cpu_budget(memory_budget: str):
    """rules.cpu_budget of this machine's RAM now; a warning when memory_budget asks for more than is there."""
    available, source = ram.available()
    budget = rules.cpu_budget(available, local_size(), parse_size(memory_budget, "memory_budget"), source)
    if budget.short:
        log(f"warning: {budget.why}")
    return budget


def device_kind(device: torch.device, budget: int | None = None) -> str:
    """The rules.RULES key of `device`; for CUDA, of the memory `budget` it may use (default: what is free)."""
    if device.type == "cuda":
        if budget is None:
            free, held, _ = cuda_memory(device)
            budget = free + held
        return rules.cuda_kind(budget, cuda_native_bf16())
    if device.type == "mps":
        return "mps"
    return "cpu-bf16" if cpu_has_native_bf16() else "cpu"


ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second from 2.9)
EXPANDABLE = "expandable_segments:True"


def configure_allocator() -> str:
    """Let CUDA's caching allocator grow segments in place (expandable_segments), unless the user set the
    variable: a run whose batches change shape (every step's lengths differ) then leaves little memory reserved
    but unusable. Through the environment, as torch documents it, which the allocator reads when CUDA starts:
    after that (a notebook that used CUDA first) the log says so. Returns the line the log shows."""
    mine = [name for name in ALLOC_CONF if name in os.environ]
    if mine and os.environ.get(ALLOC_CONF[0]) != _ours.get(ALLOC_CONF[0]):
        return f"CUDA allocator: {mine[0]}={os.environ[mine[0]]} (from the environment)"
    if not mine and torch.cuda.is_available() and torch.cuda.is_initialized():
        return (f"CUDA allocator: torch's defaults (CUDA had started before lowmem_dpo could set {EXPANDABLE}: "
                f"set {ALLOC_CONF[0]}={EXPANDABLE} before starting Python to have it)")
    os.environ[ALLOC_CONF[0]] = _ours[ALLOC_CONF[0]] = EXPANDABLE
    return f"CUDA allocator: {EXPANDABLE} (set by lowmem_dpo; set {ALLOC_CONF[0]} to choose another)"


_ours: dict[str, str] = {}  # what configure_allocator set in the environment itself


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


def _dtype(setting: str, key: str, rule: rules.Rule, kind: str) -> tuple[torch.dtype, str]:
    problem = rules.dtype_problem(key, setting, kind)
    if problem:
        raise UserError(problem)
    if setting == "auto":
        return DTYPES[rule.dtype], f"{key}={rule.dtype} (auto)"
    return DTYPES[setting], f"{key}={setting} (from the recipe)"


def resolve(cfg) -> Resolved:
    """Resolve device, memory budget, dtypes, gradient_checkpointing, optimizer and offload from the config and
    rules.RULES. On CUDA: the allocator's settings, and memory_budget enforced."""
    allocator = configure_allocator()  # before CUDA starts (_pick_device asks torch.cuda for the current device)
    device, device_reason = _pick_device(cfg)
    reasons = [device_reason]
    if device.type == "cuda":
        reasons.append(allocator)
    elif device.type == "cpu":
        reasons.append(heap.configure())
    device, sharded = join(cfg, device, reasons)
    budget = None
    if size_note(cfg.memory_budget) is not None:
        reasons.append(f"memory_budget {size_note(cfg.memory_budget)}")
    if device.type == "cuda":
        cuda = run_cuda_budget(device, cfg.memory_budget)
        budget = cuda.budget
        reasons.append(f"budget {fmt(budget)}: {cuda.why}")
    elif device.type == "cpu" and cfg.memory_budget is not None:
        ram = run_cpu_budget(cfg.memory_budget)
        budget = ram.budget
        reasons.append(f"budget {fmt(budget)}: {ram.why}")
    elif cfg.memory_budget is not None:
        budget = parse_size(cfg.memory_budget, "memory_budget")
    kind = device_kind(device, budget)
    rule = rules.RULES[kind]
    reasons.append(f"device kind {kind}: {rule.why}")
    dtype, why = _dtype(cfg.dtype, "dtype", rule, kind)
    reasons.append(why)
    if cfg.quantization != "none":
        reasons.append(f"quantization={cfg.quantization} ({QUANTIZATION_NAMES[cfg.quantization]}, bitsandbytes; "
                       f"computes in {dtype_name(dtype)}, the dtype)")
    ref_dtype, why = _dtype(cfg.reference_dtype, "ref_dtype" if cfg.ref_dtype else "dtype", rule, kind)
    if cfg.ref_dtype is None:
        why = f"ref_dtype={dtype_name(ref_dtype)} (null: as dtype)"
    ref_q = (f"ref_quantization={cfg.reference_quantization} "
             f"({'null: as quantization' if cfg.ref_quantization is None else 'from the recipe'})")
    reasons.append(f"{why}, {ref_q}: the reference's settings in precompute and in the cache's model side")
    if dtype == torch.float16:
        reasons.append("float16: the loss is scaled dynamically (torch.amp.GradScaler) so that small gradients do "
                       "not underflow; a step whose scaled gradients overflow is skipped and the scale halved (a "
                       "scaler skip, logged as scaler_skips, not as divergence); the LoRA weights stay float32")
    auto = cfg.gradient_checkpointing == "auto"
    ckpt = rule.gradient_checkpointing if auto else cfg.gradient_checkpointing is True
    reasons.append(f"gradient_checkpointing={str(ckpt).lower()} ({'auto' if auto else 'from the recipe'})")
    share = rule.share_prompt if cfg.share_prompt == "auto" else cfg.share_prompt is True
    reasons.append(f"share_prompt={str(share).lower()} ({'auto' if cfg.share_prompt == 'auto' else 'from the recipe'})"
                   f"{', where the model supports it' if share else ''}")
    reasons.append(f"optimizer={rule.optimizer}, offload={rule.offload} (rule for {kind})")
    offload = cfg.activation_offloading is True and device.type == "cuda"
    if cfg.activation_offloading is True:
        reasons.append("activation_offloading=true" + ("" if offload else f": nothing to move on {device.type}, "
                                                       "where activations are in host memory already"))
    return Resolved(device, kind, dtype, ckpt, rule.optimizer, reasons, quantization=cfg.quantization,
                    ref_dtype=ref_dtype, ref_quantization=cfg.reference_quantization, offload=rule.offload,
                    share_prompt=share, budget=budget, activation_offloading=offload, sharded=sharded,
                    shard_offload=sharded and cfg.fsdp_offload_params is True)


def join(cfg, device: torch.device, reasons: list[str]) -> tuple[torch.device, bool]:
    """Under torchrun / accelerate launch: join the group; this rank's device (its GPU), and whether the recipe
    shards the base over the ranks (fsdp=true; auto: the plan decides, memory.cards.sharded_as_planned, and says
    so). One process: (device, False)."""
    device = distributed.init(device)
    w = distributed.world()
    if not w.distributed:
        if cfg.fsdp is True:
            reasons.append("fsdp=true: one process, nothing to shard (torchrun --nproc-per-node N starts N)")
        return device, False
    reasons[0] += f"; process {w.rank} of {w.size} on {device}"
    if cfg.fsdp != "auto":
        reasons.append(fsdp_line(cfg.fsdp is True, "from the recipe", cfg.fsdp is True and cfg.fsdp_offload_params is True))
    return device, cfg.fsdp is True


def fsdp_line(sharded: bool, why: str, offload: bool = False) -> str:
    """The log line that says how several processes share the model."""
    if not sharded:
        return f"fsdp=false ({why}): data parallel, the whole model on each process"
    return (f"fsdp=true ({why}): the frozen weights sharded over the processes (FSDP2), the trained LoRA weights "
            "whole on each" + (", the shards in CPU RAM (fsdp_offload_params)" if offload else ""))


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


def check_bitsandbytes(resolved: Resolved) -> None:
    """Fail before tokenizing and loading, not after, when the run needs bitsandbytes and it cannot load."""
    needs_bnb = ([f"quantization={resolved.quantization}"] if resolved.quantization != "none" else []) + (
        [f"optimizer={resolved.optimizer} (the {resolved.kind} rule)"]
        if resolved.optimizer == rules.PAGED_ADAMW_8BIT else [])
    if needs_bnb:
        import_bitsandbytes(" and ".join(needs_bnb))


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
    if name == rules.PAGED_ADAMW_8BIT:
        bnb = import_bitsandbytes(f"optimizer={rules.PAGED_ADAMW_8BIT} (the rule on CUDA)")
        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == rules.ADAMW_TORCH:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise AssertionError(f"unknown optimizer {name!r} in rules.RULES")


# -- forward-pass helpers ---------------------------------------------------------------------------------------
def autocast(device: torch.device, dtype: torch.dtype):
    """Forward-pass context: with 16-bit base weights, autocast to the same dtype so peft's float32 LoRA path
    (which casts every adapted layer's input up to float32) also runs its matmuls in 16-bit. On a CPU with
    native bf16 this makes a train step ~20% faster; LoRA weights and optimizer state stay float32."""
    if dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


# -- memory telemetry and loss scaling ---------------------------------------------------------------------------
def memory_window(device: torch.device) -> dict[str, int]:
    """The memory numbers of a metrics line on CUDA, then a new window: peak_allocated_bytes and
    peak_reserved_bytes of torch's allocator since the last call (reserved - allocated: fragmentation), and
    device_used_bytes, what the whole card has in use now (every process, the CUDA context: nvidia-smi's). {} off CUDA."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    out = {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
           "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)), "device_used_bytes": int(total - free)}
    torch.cuda.reset_peak_memory_stats(device)
    return out


def grad_scaler(device: torch.device, dtype: torch.dtype):
    """float16's dynamic loss scaling (torch.amp.GradScaler: halved on overflow, doubled after 2000 clean steps)."""
    return torch.amp.GradScaler(device.type) if dtype == torch.float16 else None


# -- streams and events (streaming.py, activations.py; tests/model/test_stream_order.py records their order) --------
def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` of CPU RAM (uint8) that the device reads from: pinned (page-locked) for a CUDA device, so copies run
    asynchronously at full PCIe speed. One buffer for a whole layer: torch rounds each pinned allocation up to a
    power of two, which per tensor would pin ~10-15% more."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def side_stream(device: torch.device):
    """A second CUDA stream, for copies that overlap the compute; None elsewhere (copies are synchronous)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def on_stream(stream):  # the block's CUDA work on `stream` (None: the current stream)
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def mark(device: torch.device, stream=None):
    """An event after the work queued so far on `stream` (None: the current stream of `device`); None off CUDA."""
    return (stream or torch.cuda.current_stream(device)).record_event() if device.type == "cuda" else None


def wait(event, stream=None, device: torch.device | None = None) -> None:
    """Make `stream` (None: the current stream of `device`) wait for `event` (None: nothing to wait for)."""
    if event is not None:
        (stream or torch.cuda.current_stream(device)).wait_event(event)


def copy_async(dst: torch.Tensor, src: torch.Tensor, hold_src: bool = False) -> None:
    """dst <- src on the current stream (async with pinned memory); hold_src: src's memory outlives the copy."""
    dst.copy_(src, non_blocking=True)
    if hold_src and src.is_cuda:
        src.record_stream(torch.cuda.current_stream(src.device))


def rng_state(device: torch.device) -> tuple:
    """The RNG state a forward's dropout draws from: the CPU generator's and, on CUDA, the device's."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def restored_rng(device: torch.device, state: tuple | None):
    """The block draws from `state` (rng_state: a recompute's dropout draws its forward's masks again); the RNG
    after it is as before it. None: nothing to restore."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
