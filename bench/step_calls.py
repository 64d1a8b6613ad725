"""How much code one optimizer step runs: the distinct lowmem_dpo functions a DPO step of the built-in tiny
recipe calls (its update alone: loop.optimizer_step without outputs), and the files they live in, traced with
sys.setprofile on the second step (the first builds the optimizer state).

    python bench/step_calls.py [--list]          # ~10 s; --list: each file and function with its call count
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def trace_step(work: Path) -> dict[tuple[str, str], int]:
    """(file under lowmem_dpo/, function) -> calls, in one optimizer step after a first one."""
    from lowmem_dpo import precompute, train
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.training import loop

    cfg = load_config("lowmem_dpo:tiny-cpu", [f"output_dir={work / 'run'}", f"ref_cache_dir={work / 'cache'}",
                                              "max_steps=3", "save_steps=0", "eval_fraction=0",
                                              "load_best_model_at_end=false"])
    precompute.run(cfg, progress=False)
    s = train.setup(cfg, progress=False)
    loop.optimizer_step(s)
    root = str(Path(loop.__file__).parents[1])
    calls: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            key = (os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_name)
            calls[key] = calls.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        loop.optimizer_step(s)
    finally:
        sys.setprofile(None)
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="each file and function with its call count")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="step-calls-") as tmp:
        calls = trace_step(Path(tmp))
    files = sorted({f for f, _ in calls})
    print(f"one optimizer step: {len(calls)} distinct functions in {len(files)} files")
    if args.list:
        for (f, name), n in sorted(calls.items()):
            print(f"  {f:32} {name:32} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
