"""The C library's heap under a CPU run: what makes the process's RSS follow the live tensors the planner counts.

On a CPU torch takes every tensor from malloc. glibc serves a block under its mmap threshold from its heap, and
raises that threshold (up to 32 MiB) each time a larger mapped block is freed, so after the first step a 7B
model's activations (4-28 MiB each) all come from the heap. Blocks freed in a step then stay resident in the
heap's holes, which later blocks of other sizes do not fill: a 4-bit 7B train step at 512 tokens held ~3.5 GiB
over its live tensors (docs/performance.md). A fixed threshold of MMAP_THRESHOLD gives each larger tensor
its own mapping, returned to the system when freed: RSS is then the process before the model loaded plus the
live tensors, within 0.03 GiB in 4-bit, at +12-30% step time (the fresh pages are zeroed by the kernel).

Only glibc; elsewhere (macOS, musl) the C library's own allocator is left as it is. Everything here is a no-op
there."""

from __future__ import annotations

import ctypes
import gc
import os

MMAP_THRESHOLD = 1 << 20  # 1 MiB: a 7B model's smallest activation (one sequence of 512 tokens, 4096 wide) is 4 MiB
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable, read when the process starts
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def configure() -> str:
    """Fix malloc's mmap threshold at MMAP_THRESHOLD for the rest of the process, unless the environment sets
    MALLOC_MMAP_THRESHOLD_ (glibc applied that at start; the user's choice stands). Returns the line the run's log
    shows: whether RSS is what the plan says."""
    if ENV in os.environ:
        value = os.environ[ENV]
        follows = value.isdigit() and int(value) <= MMAP_THRESHOLD
        return (f"CPU heap: {ENV}={value} from the environment" + ("" if follows else
                f" (the plan assumes at most {MMAP_THRESHOLD >> 20} MiB: RSS can exceed it by the heap's freed blocks)"))
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1:
        return (f"CPU heap: malloc's mmap threshold fixed at {MMAP_THRESHOLD >> 20} MiB, so that a freed tensor "
                f"leaves RAM and RSS follows the plan (costs ~12-30% step time; for speed over RAM set {ENV}="
                f"{32 << 20} before starting Python)")
    return "CPU heap: the C library's own allocator (not glibc): RSS can exceed the plan by what it keeps"


def release_freed_memory() -> None:
    """Ask the heap to return its freed pages to the system (glibc's malloc_trim): after a load that built and
    dropped large temporaries (quantizing every Linear), RSS falls to what is in use."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
