"""One torchrun rank of a stage, and its peak RSS written beside the run: what bench/scaling.py starts.

    torchrun --nproc-per-node 2 bench/rank_rss.py OUT_DIR STAGE RECIPE [key=value ...]

Runs `python -m lowmem_dpo.STAGE RECIPE ...` in this process (its run_cli, as the module does), then writes
OUT_DIR/rss-STAGE-rankR.json: {"rank", "stage", "peak_rss_bytes", "work_peak_rss_bytes", "anon_bytes",
"file_bytes"}. peak_rss_bytes is getrusage's ru_maxrss: this process's largest resident set over its whole life, the
load included. work_peak_rss_bytes is the largest from the start of the work (train's loop, precompute's forwards)
on: Linux's peak (VmHWM) is reset there (writing 5 to /proc/self/clear_refs), after the model is loaded and
sharded. anon_bytes and file_bytes split the resident set at the work's end: the process's own memory (RssAnon:
tensors it made, the heap) and pages of files it maps (RssFile: among them the safetensors weights transformers
maps and uses in place, which the processes of one machine share in the page cache, though each counts them).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowmem_dpo.config.cli import run_cli  # noqa: E402


def status(name: str) -> int:
    """A line of /proc/self/status in bytes (VmHWM: the peak resident set since the last reset; RssAnon, RssFile)."""
    for line in open("/proc/self/status"):
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {name} in /proc/self/status")


END = {}  # the resident set's split when the work ended


def reset_peak_at_work(stage: str) -> None:
    """Reset VmHWM when the stage's work starts: train's loop.run, precompute's compute_missing."""
    from lowmem_dpo import precompute
    from lowmem_dpo.training import loop

    owner, name = (loop, "run") if stage in ("train", "sft") else (precompute, "compute_missing")
    real = getattr(owner, name)

    def reset_then(*args, **kwargs):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        result = real(*args, **kwargs)
        END.update(anon_bytes=status("RssAnon"), file_bytes=status("RssFile"))
        return result

    setattr(owner, name, reset_then)


def main(argv: list[str]) -> int:
    out, stage, args = Path(argv[0]), argv[1], argv[2:]
    module = importlib.import_module(f"lowmem_dpo.{stage}")
    reset_peak_at_work(stage)
    code = run_cli(module.main, args, stage, module.__doc__)
    rank = int(os.environ.get("RANK", 0))
    out.mkdir(parents=True, exist_ok=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    (out / f"rss-{stage}-rank{rank}.json").write_text(json.dumps({"rank": rank, "stage": stage,
                                                                   "peak_rss_bytes": peak,
                                                                   "work_peak_rss_bytes": status("VmHWM"), **END}))
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
