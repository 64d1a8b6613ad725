"""What machine a benchmark ran on: CPU, cores, torch threads, library versions, load."""

from __future__ import annotations

import os
import platform
import re
import shlex
import sys
from pathlib import Path

import torch


def unavailable_reason(device: str) -> str | None:
    if device == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build}): no CUDA GPU here"
    return None


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import peft
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": (_proc_status_kib_meminfo() or 0) * 1024 or None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "lowmem_dpo_home": os.environ.get("LOWMEM_DPO_HOME"),
        "loadavg_at_start": loadavg(),
        # the C heap and torch's CPU allocator (lowmem_dpo/runtime/heap.py): they set a CPU step's time and RSS
        "allocator_env": {k: os.environ[k] for k in ("MALLOC_MMAP_THRESHOLD_", "THP_MEM_ALLOC_ENABLE", "LD_PRELOAD")
                          if k in os.environ},
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: well above 0 before a CPU run means other processes share the cores."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _proc_status_kib_meminfo() -> int | None:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def command_line(script: str, argv: list[str] | None) -> str:
    """The command a bench ran as, to rerun it (`argv`: main's, None: the process's), for its results JSON."""
    return shlex.join(["python", f"bench/{script}", *(argv if argv is not None else sys.argv[1:])])
