"""How much code one optimizer step runs: the distinct lowmem_dpo functions a DPO step of the built-in tiny
recipe calls (its update alone: optimizer_step without outputs), the files they live in, and its deepest
chain of lowmem_dpo calls (how far a reader follows one call into the next), traced with sys.setprofile on the
second step (the first builds the optimizer state).

    python bench/step_calls.py [--list]          # ~10 s; --list: each file and function with its call count
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def trace_step(work: Path) -> tuple[dict[tuple[str, str], int], list[tuple[str, str]]]:
    """(file under lowmem_dpo/, function) -> calls, in one optimizer step after a first one; and its deepest chain
    of lowmem_dpo calls, outermost first (comprehensions and generator expressions left out: no reader follows
    them into another function)."""
    from lowmem_dpo import precompute, train
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.training.step import optimizer_step

    cfg = load_config("lowmem_dpo:tiny-cpu", [f"output_dir={work / 'run'}", f"ref_cache_dir={work / 'cache'}",
                                              "max_steps=3", "save_steps=0", "eval_fraction=0",
                                              "load_best_model_at_end=false"])
    precompute.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)
    optimizer_step(session)
    root = str(Path(optimizer_step.__code__.co_filename).parents[1])
    calls: dict[tuple[str, str], int] = {}
    stack: list[tuple[str, str]] = []
    deepest: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root) or event not in ("call", "return"):
            return
        key = (os.path.relpath(frame.f_code.co_filename, root), frame.f_code.co_name)
        if key[1].startswith("<"):  # <genexpr>, <listcomp>: counted, not a step of the chain
            calls[key] = calls.get(key, 0) + (event == "call")
            return
        if event == "call":
            calls[key] = calls.get(key, 0) + 1
            stack.append(key)
            if len(stack) > len(deepest):
                deepest[:] = stack
        elif stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        optimizer_step(session)
    finally:
        sys.setprofile(None)
    return calls, deepest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="each file and function with its call count")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="step-calls-") as tmp:
        calls, deepest = trace_step(Path(tmp))
    files = sorted({f for f, _ in calls})
    named = [key for key in calls if not key[1].startswith("<")]
    print(f"one optimizer step: {len(named)} distinct functions in {len(files)} files (and "
          f"{len(calls) - len(named)} comprehensions, lambdas and generator expressions: {len(calls)} code objects)")
    print(f"its deepest chain: {len(deepest)} calls in {len({f for f, _ in deepest})} files: "
          + " -> ".join(f"{Path(f).stem}.{name}" for f, name in deepest))
    if args.list:
        for (f, name), n in sorted(calls.items()):
            print(f"  {f:32} {name:32} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
