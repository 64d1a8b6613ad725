"""Precompute sequences/s and train pairs/s by process count, each count started with torchrun as a user starts it.

    python bench/scaling.py bench/recipes/llama-25m-cpu.yaml --procs 1,2 --steps 8 --json bench/out/scaling.json

Each run gets the machine's cores split between its processes (OMP_NUM_THREADS = cores / processes), so the
1-process run uses every core too. per_device_train_batch_size stays as the recipe says, as transformers counts
it: N processes train on N times the pairs per step. Precompute's sequences/s is build.json's (the forwards of the
whole build, every process's blocks of sequences; a pair is two); train's pairs/s is the step's pairs over the median step time of the
steps after the first (metrics.jsonl's step_time_s, rank 0's clock after the gradient sum). On one machine's CPU
cores, processes only split the same cores: expect little or no gain here; the point is GPUs, one per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from machine import machine_info  # noqa: E402
from step_time import ensure_dataset  # noqa: E402

from lowmem_dpo.config.recipe import load_config  # noqa: E402


def torchrun(procs: int, stage: str, recipe: str, overrides: list[str], threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           "-m", f"lowmem_dpo.{stage}", recipe, *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")


def measure(recipe: str, procs: int, steps: int, work: Path, shard_rows: int) -> dict:
    cores = os.cpu_count() or 1
    threads = max(1, cores // procs)
    cache_dir, out_dir = work / f"cache-{procs}", work / f"train-{procs}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    base = ["device=cpu", f"ref_cache_dir={cache_dir}", f"cache_shard_rows={shard_rows}"]
    torchrun(procs, "precompute", recipe, base, threads)
    build = json.loads((cache_dir / "build.json").read_text())
    torchrun(procs, "train", recipe, [*base, f"output_dir={out_dir}", f"max_steps={steps}", "logging_steps=1",
                                      "save_steps=0", "eval_generations=0"], threads)
    lines = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    times = [line["step_time_s"] for line in lines if line.get("step", 0) > 1 and "step_time_s" in line]
    cfg = load_config(recipe, base)
    pairs_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * procs
    step = statistics.median(times)
    return {"processes": procs, "threads_per_process": threads, "precompute_sequences": build["computed"],
            "precompute_sequences_per_s": build["sequences_per_s"], "train_pairs_per_step": pairs_per_step,
            "train_step_s": round(step, 4), "train_pairs_per_s": round(pairs_per_step / step, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--procs", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="train steps per run (the first is not counted)")
    ap.add_argument("--shard-rows", type=int, default=12, help="cache_shard_rows: a block of that many sequences is one "
                    "process's unit of precompute work, so the data must make several blocks per process")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    ensure_dataset(load_config(args.recipe))
    work = REPO / "bench" / "out" / "scaling"
    rows = [measure(args.recipe, int(n), args.steps, work, args.shard_rows) for n in args.procs.split(",")]
    print("| processes | threads each | precompute sequences/s | train pairs/step | train s/step | train pairs/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['threads_per_process']} | {r['precompute_sequences_per_s']} | "
              f"{r['train_pairs_per_step']} | {r['train_step_s']} | {r['train_pairs_per_s']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "recipe": args.recipe, "runs": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
