"""Where does one lowmem_dpo train step spend its time? Step times and a torch.profiler op table.

    python bench/profile_step.py RECIPE.yaml [key=value ...] [--steps 5] [--warmup 2] [--profile 2]

Sets up exactly as `python -m lowmem_dpo.train` does (`train.setup`, which needs the recipe's reference
cache: run precompute first) and times `step.optimizer_step`, the step train takes. `--profile K` profiles K more
steps and prints the ops by self CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="K", help="profile K more steps")
    ap.add_argument("--rows", type=int, default=25, help="rows of the op table")
    args = ap.parse_args(argv)

    from lowmem_dpo import train
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training.step import optimizer_step

    cfg = load_config(args.recipe, args.overrides)
    total = args.warmup + args.steps + args.profile
    session = train.setup(dataclasses.replace(cfg, max_steps=total), args.recipe, progress=False)

    def step() -> float:
        devices.synchronize(session.run.resolved.device)
        t0 = time.perf_counter()
        optimizer_step(session)
        devices.synchronize(session.run.resolved.device)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    r = session.run.resolved
    print(f"device={r.device.type} dtype={devices.dtype_name(r.dtype)} gradient_checkpointing="
          f"{r.gradient_checkpointing} threads={torch.get_num_threads()}")
    print(f"step s: median {statistics.median(times):.3f}  all {[round(t, 3) for t in times]}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                        max_name_column_width=50))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
