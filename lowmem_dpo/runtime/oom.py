"""Out of memory, on any device: recognizing it, saying what torch failed to allocate, retrying at half the batch,
and torch's CUDA memory snapshot of the first one (memory_snapshot_on_oom). A stage turns what is left into one
line (UserError, exit 2) that says what to lower."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lowmem_dpo.runtime.errors import UserError, log

# What an allocation failure says when it is not torch.OutOfMemoryError: the CPU allocator's, and cuBLAS' when it
# cannot create its workspace on a full card ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate").
OOM_TEXTS = ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA's (and mps') out-of-memory error, cuBLAS' allocation failure, or the CPU allocator's failure."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(text in str(e) for text in OOM_TEXTS))


def torch_said(e: BaseException) -> str:
    """The first two sentences of torch's error: on CUDA, what it failed to allocate ("Tried to allocate 2.81 GiB")."""
    return ". ".join(str(e).strip().split(". ")[:2])[:300]


def seen_out_of_memory(e: BaseException) -> None:
    """Log what torch failed to allocate (the one-line error after it does not say), then write the memory
    snapshot (the first error's only) when memory_snapshot_on_oom asked for one."""
    log(f"out of memory: {torch_said(e)}")
    dump_snapshot()


@contextlib.contextmanager
def out_of_memory_means(message: str):
    """Out of memory inside the block becomes UserError(message) (exit 2, one line: what to lower), after the
    memory snapshot when memory_snapshot_on_oom asked for one."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        seen_out_of_memory(e)
        del e  # its traceback holds the failed attempt's tensors
        raise UserError(message) from None


@dataclass(frozen=True)
class Said:
    """What halving_on_oom says: each retry's log line (retrying(new size)), the UserError when out of memory at 1
    (exhausted), and where the attempt's forwards are collectives (fsdp), which a process cannot leave alone, the
    UserError at the first out of memory (collective; the launcher ends the others); None: not so."""

    retrying: Callable[[int], str]
    exhausted: str
    collective: str | None = None


def halving_on_oom(run, size: int, device: torch.device, said: Said, cleanup=None, any_rank=None):
    """run(size), retried at half the size on out-of-memory, down to 1: `cleanup()` (e.g. drop a partial step's
    gradients) and the cached blocks released before each retry, whose log line is said.retrying(new size). Out of
    memory at 1 raises UserError(said.exhausted); with said.collective, the first one raises it. `any_rank(failed)`
    says whether any process failed (distributed.any_rank; `run` makes no collective call): then every process
    retries at the same size. None: one process, whose own failure decides."""
    while True:
        failed = False
        try:
            result = run(size)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            seen_out_of_memory(e)
            del e  # its traceback holds the failed attempt's tensors
            if said.collective:
                raise UserError(said.collective) from None
            failed = True
        if (failed if any_rank is None else any_rank(failed)):
            if cleanup is not None:
                cleanup()
            release_memory(device)
            if size == 1:
                raise UserError(said.exhausted) from None
            size = max(1, size // 2)
            log(said.retrying(size))
        else:
            return result


def release_memory(device: torch.device) -> None:  # after out of memory: a smaller retry starts from a clean pool
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


_snapshot: dict[str, Path] = {}  # memory_snapshot_on_oom: where the first out-of-memory error writes
SNAPSHOT = "memory_snapshot.pickle"


def record_snapshots(device: torch.device, folder: str | Path) -> str:
    """memory_snapshot_on_oom: record CUDA's allocations from now on, for dump_snapshot. Returns the log line."""
    if device.type != "cuda":
        return f"memory_snapshot_on_oom: CUDA only; nothing is recorded on {device.type}"
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")  # C++ stacks: slow
    _snapshot["path"] = Path(folder) / SNAPSHOT
    return f"memory_snapshot_on_oom: recording CUDA allocations; an out-of-memory error writes {_snapshot['path']}"


def dump_snapshot() -> Path | None:
    """Write the recorded memory snapshot (once: the first out-of-memory error's), or None when none is recorded.
    Open it at https://pytorch.org/memory_viz."""
    path = _snapshot.pop("path", None)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as e:  # a full disk must not hide the out-of-memory error itself
        log(f"warning: out of memory, and the memory snapshot could not be written to {path} ({type(e).__name__})")
        return None
    log(f"out of memory: torch's memory snapshot is in {path} (open it at https://pytorch.org/memory_viz)")
    return path
