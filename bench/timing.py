"""How bench/step_time.py measures one phase: wall and CPU time per step, peak memory, and a failure kept in
the report instead of ending the run."""

from __future__ import annotations

import ctypes
import gc
import re
import resource
import statistics
import sys
import traceback
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(f"step_time: {msg}", file=sys.stderr, flush=True)


def _proc_status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next phase's RSS starts low."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of one phase (a `with` block).

    CPU: peak resident set size. The kernel's high-water mark (VmHWM in /proc/self/status) is reset at the start
    of the phase by writing 5 to /proc/self/clear_refs, so VmHWM at the end is the phase's peak RSS; the delta is
    that peak minus VmRSS at the start. Without /proc (or if the reset is refused) it falls back to
    getrusage(RUSAGE_SELF).ru_maxrss, the process-lifetime peak, and says so in "method".
    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats (tensors only, not the allocator's cache);
    the delta is that peak minus memory_allocated at the start.
    """

    def __init__(self, device: str):
        self.device = device
        self.result: dict = {}

    def __enter__(self):
        release_freed_memory()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.start = (_proc_status_kib("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after reset via /proc/self/clear_refs"
        except OSError:
            self.method = "getrusage ru_maxrss (process-lifetime peak: could not reset)"
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self.result = {"method": "torch.cuda.max_memory_allocated", "peak_bytes": peak,
                           "start_bytes": self.start, "peak_delta_bytes": peak - self.start,
                           "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
            return False
        hwm = _proc_status_kib("VmHWM") if self.method.startswith("VmHWM") else None
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        peak = hwm * 1024
        self.result = {"method": self.method, "peak_bytes": peak, "start_bytes": self.start,
                       "peak_delta_bytes": max(0, peak - self.start)}
        return False


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def summarize(times: list[float], tokens: list[int], cpu_times: list[float]) -> dict:
    return {
        "median_step_s": round(statistics.median(times), 4),
        "min_step_s": round(min(times), 4),
        "max_step_s": round(max(times), 4),
        "mean_step_s": round(statistics.fmean(times), 4),
        "timed_steps": len(times),
        "all_step_s": [round(t, 4) for t in times],
        "tokens_per_step_median": statistics.median(tokens),
        # throughput over the timed steps: non-padding tokens (chosen + rejected sequences) / seconds
        "tokens_per_s": round(sum(tokens) / sum(times), 1),
        # CPU time of this process per step (all threads): less sensitive than wall time to other processes
        # competing for the cores; compare with the wall times to spot a disturbed run
        "cpu_time_median_s": round(statistics.median(cpu_times), 4),
    }


def jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)


def guarded(what: str, device: str, fn) -> tuple[dict, bool]:
    """(fn(), True), or ({"error", "traceback"}, False) when it raises: a failed measurement is reported in the
    JSON and the others are still worth keeping."""
    try:
        return fn(), True
    except Exception as e:
        log(f"[{device}] {what} failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}, False
