"""The C library's heap under a CPU run: what makes the process's RSS follow the live tensors the planner counts,
at the speed of a heap that keeps its blocks.

On a CPU torch takes every tensor from malloc. glibc serves a block under its mmap threshold from its heap, and
raises that threshold (up to 32 MiB) each time a larger mapped block is freed, so after the first step a 7B
model's activations (4-28 MiB each) all come from the heap. Blocks freed in a step then stay resident in the
heap's holes, which later blocks of other sizes do not fill: a 4-bit 7B train step held 1.3 GiB over its plan
(bench/README.md, full_scale.py). A fixed threshold of MMAP_THRESHOLD gives each larger tensor its own mapping,
returned to the system when freed: RSS is then the process before the model loaded plus the live tensors
(+1.5% at 7B in bf16). Each fresh mapping's pages are faulted in and zeroed by the kernel, 4 KiB at a time:
+31% on a 7B bf16 step (108 s against 81-82 s with glibc's threshold, a quiet 2-core machine).

torch's CPU allocator puts its blocks of 2 MiB and more on transparent huge pages when THP_MEM_ALLOC_ENABLE=1
is in the environment at its first allocation: then the same mappings fault 2 MiB at a time, and the step is
as fast as the heap's (81 s) with RSS still the plan. torch reads the variable once, so the package sets it
when it is imported before torch (`huge_pages_before_torch`, from lowmem_dpo/__init__.py), unless the
environment already says. The kernel must allow huge pages on request (transparent_hugepage "madvise"; under
"always" every large mapping gets them anyway; under "never" the threshold keeps its cost, and the log says so).
The variable holds for the whole process and the processes it starts, whatever the device: a GPU run's host
tensors of 2 MiB and more (few: its weights load to the card, its pinned buffers come from CUDA) and export's
(each above glibc's 32 MiB, so in mappings of their own) get huge pages too.

With room to spare the heap keeps its freed blocks instead (`keep_freed_blocks`): a stage whose plan, plus
what a heap may keep of a step's freed tensors (its activations and its largest transient), fits the budget raises
the threshold to KEPT_THRESHOLD, glibc's own ceiling. A block used again then costs no page fault at all: on the
~25M-parameter bench Llama at 512 tokens, where a step's tensors are a few MiB each and huge pages only cover
their whole 2 MiB pages, the 1 MiB threshold faulted 14M pages in an epoch of 31 steps, 90 s of kernel time in
215 s; kept, 0.17M and 4.5 s in 149 s (bench/README.md, "real_lengths.py"). RSS can then exceed the plan by up to that allowance, which the
budget holds.

Only glibc; elsewhere (macOS, musl) the C library's own allocator is left as it is. Everything here is a no-op
there."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path

from lowmem_dpo.runtime.units import fmt

MMAP_THRESHOLD = 1 << 20  # 1 MiB: a 7B model's smallest activation (one sequence of 512 tokens, 4096 wide) is 4 MiB
KEPT_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit): freed blocks kept
LINE = "CPU heap:"  # how the run's log line about the heap starts (configure, keep_freed_blocks)
ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable, read when the process starts
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's (c10 alloc_cpu): madvise(MADV_HUGEPAGE) on its blocks of >= 2 MiB
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the bracketed one holds
_thp: dict[str, bool] = {}  # "asked": THP_ENV=1 was in the environment before torch's first allocation


def huge_pages_before_torch() -> None:
    """THP_ENV=1 for torch's CPU allocator, unless the environment sets it; called where the package is imported,
    which does it only before torch is (torch reads it once). Linux only."""
    if not sys.platform.startswith("linux"):
        return
    if THP_ENV not in os.environ and "torch" not in sys.modules:
        os.environ[THP_ENV] = "1"
    _thp["asked"] = os.environ.get(THP_ENV) == "1"  # set here, or by the user before Python started


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where it has none."""
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def huge_pages() -> tuple[bool, str]:
    """Whether torch's large blocks are on huge pages in this process: (True, how) or (False, why not)."""
    mode = thp_mode()
    if mode == "always":  # the kernel gives every large enough mapping huge pages, asked or not
        return True, "the kernel's transparent huge pages are always on"
    if not _thp.get("asked"):
        if THP_ENV in os.environ:
            return False, f"{THP_ENV}={os.environ[THP_ENV]} from the environment"
        return False, (f"torch was imported before lowmem_dpo, so its allocator did not see {THP_ENV}=1 (set it "
                       "in the environment)")
    if mode != "madvise":
        return False, f"this kernel's transparent huge pages are {mode or 'not there'}"
    return True, f"{THP_ENV}=1"


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def configure() -> str:
    """Fix malloc's mmap threshold at MMAP_THRESHOLD for the rest of the process, unless the environment sets
    MALLOC_MMAP_THRESHOLD_ (glibc applied that at start; the user's choice stands). Returns the line the run's log
    shows: whether RSS is what the plan says, and what it costs."""
    if ENV in os.environ:
        value = os.environ[ENV]
        follows = value.isdigit() and int(value) <= MMAP_THRESHOLD
        return (f"{LINE} {ENV}={value} from the environment" + ("" if follows else
                f" (the plan assumes at most {MMAP_THRESHOLD >> 20} MiB: RSS can exceed it by the heap's freed blocks)"))
    if not _set_threshold(MMAP_THRESHOLD):
        return f"{LINE} the C library's own allocator (not glibc): RSS can exceed the plan by what it keeps"
    line = (f"{LINE} malloc's mmap threshold fixed at {MMAP_THRESHOLD >> 20} MiB, so that a freed tensor leaves "
            "RAM and RSS follows the plan")
    applies, reason = huge_pages()
    if applies:
        return line + (f"; torch's blocks of 2 MiB and more on transparent huge pages ({reason}), as fast as a heap "
                       "that keeps them")
    return (line + f" (costs ~30% step time: {reason}, and each fresh page is faulted 4 KiB at a time; for speed over "
            f"RAM set {ENV}={32 << 20} before starting Python)")


def _set_threshold(n: int) -> bool:
    """malloc's mmap threshold at n bytes for the rest of the process (glibc's mallopt); whether it took."""
    libc = _libc()
    return libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, n) == 1


def keep_freed_blocks(planned: int, transient: int, budget: int) -> str | None:
    """With room, the heap keeps its freed blocks (module doc): when the stage's planned peak plus `transient` (what
    a heap may hold of the step's freed tensors: the plan's activations and its peak phase) fits `budget`, raise the
    threshold to KEPT_THRESHOLD and return the CPU heap line that replaces configure's; else None, the threshold
    fixed at MMAP_THRESHOLD again (an earlier stage of the same process may have raised it): RSS is the plan. A
    threshold from the environment stands (None)."""
    if ENV in os.environ:
        return None
    if planned + transient > budget or not _set_threshold(KEPT_THRESHOLD):
        _set_threshold(MMAP_THRESHOLD)
        return None
    return (f"{LINE} freed blocks kept (malloc's mmap threshold {KEPT_THRESHOLD >> 20} MiB, no page faults when a "
            f"block is used again): the plan's {fmt(planned)} and up to {fmt(transient)} the heap may keep of a "
            f"step's freed tensors fit the {fmt(budget)} budget, so RSS may exceed the plan by that much")


def release_freed_memory() -> None:
    """Ask the heap to return its freed pages to the system (glibc's malloc_trim): after a load that built and
    dropped large temporaries (quantizing every Linear), RSS falls to what is in use."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
