"""Precompute sequences/s, train pairs/s and each rank's peak RSS by process count, data parallel and with the base
sharded (fsdp), each run started with torchrun as a user starts it.

    python bench/scaling.py bench/recipes/llama-25m-cpu.yaml --procs 1,2 --modes dp,fsdp --steps 8 \
        --json bench/out/scaling.json [key=value ...]

Each run gets the machine's cores split between its processes (OMP_NUM_THREADS = cores / processes), so the
1-process run uses every core too. per_device_train_batch_size stays as the recipe says, as transformers counts
it: N processes train on N times the pairs per step. Precompute's sequences/s is build.json's (the forwards of the
whole build, every process's blocks of sequences; a pair is two); train's pairs/s is the step's pairs over the median
step time of the steps after the first (metrics.jsonl's step_time_s, rank 0's clock after the gradient sum). Each
rank's peak RSS is its own getrusage (bench/rank_rss.py), precompute's and train's apart. --modes: dp (fsdp=false)
and fsdp (fsdp=true) for each count above 1; one process is one run. On one machine's CPU cores, processes only
split the same cores: expect little or no gain in speed here; the point is GPUs, one per process. key=value
overrides go to both stages (e.g. quantization=4bit).
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


def torchrun(procs: int, stage: str, recipe: str, overrides: list[str], threads: int, out: Path
             ) -> tuple[list[dict], str]:
    """The stage on `procs` processes: each rank's resident set (bench/rank_rss.py), in rank order; the log."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
           str(HERE / "rank_rss.py"), str(out), stage, recipe, *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return [json.loads((out / f"rss-{stage}-rank{r}.json").read_text()) for r in range(procs)], p.stderr


def model_bytes(log: str) -> str | None:
    """The log's line of what rank 0 holds of the model under fsdp (policy.shard_over_ranks), or None."""
    lines = [line for line in log.splitlines() if line.startswith("fsdp: ")]
    return lines[0] if lines else None


def measure(recipe: str, procs: int, mode: str, steps: int, work: Path, shard_rows: int, extra: list[str]) -> dict:
    cores = os.cpu_count() or 1
    threads = max(1, cores // procs)
    name = f"{procs}-{mode}"
    cache_dir, out_dir, rss_dir = work / f"cache-{name}", work / f"train-{name}", work / f"rss-{name}"
    for folder in (cache_dir, out_dir, rss_dir):
        shutil.rmtree(folder, ignore_errors=True)
    base = ["device=cpu", f"ref_cache_dir={cache_dir}", f"cache_shard_rows={shard_rows}",
            f"fsdp={str(mode == 'fsdp').lower()}", *extra]
    rss_pre, _ = torchrun(procs, "precompute", recipe, base, threads, rss_dir)
    build = json.loads((cache_dir / "build.json").read_text())
    rss_train, log = torchrun(procs, "train", recipe, [*base, f"output_dir={out_dir}", f"max_steps={steps}",
                                                  "logging_steps=1", "save_steps=0", "eval_generations=0"], threads,
                         rss_dir)
    lines = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    times = [line["step_time_s"] for line in lines if line.get("step", 0) > 1 and "step_time_s" in line]
    cfg = load_config(recipe, base)
    pairs_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * procs
    step = statistics.median(times)
    gib = 2**30
    return {"processes": procs, "mode": mode if procs > 1 else "one process", "threads_per_process": threads,
            "quantization": cfg.quantization, "dtype": cfg.dtype,
            "precompute_sequences": build["computed"], "precompute_sequences_per_s": build["sequences_per_s"],
            "precompute_peak_rss_gib": [round(r["peak_rss_bytes"] / gib, 3) for r in rss_pre],
            "precompute_work_rss_gib": [round(r["work_peak_rss_bytes"] / gib, 3) for r in rss_pre],
            "train_pairs_per_step": pairs_per_step, "train_step_s": round(step, 4),
            "train_pairs_per_s": round(pairs_per_step / step, 3),
            "train_peak_rss_gib": [round(r["peak_rss_bytes"] / gib, 3) for r in rss_train],
            "train_work_rss_gib": [round(r["work_peak_rss_bytes"] / gib, 3) for r in rss_train],
            "train_anon_gib_at_end": [round(r["anon_bytes"] / gib, 3) for r in rss_train],
            "train_file_gib_at_end": [round(r["file_bytes"] / gib, 3) for r in rss_train],
            "model_held": model_bytes(log)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--procs", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="train steps per run (the first is not counted)")
    ap.add_argument("--shard-rows", type=int, default=12, help="cache_shard_rows: a block of that many sequences is one "
                    "process's unit of precompute work, so the data must make several blocks per process")
    ap.add_argument("--modes", default="dp,fsdp", help="for each count above 1: dp (fsdp=false), fsdp (fsdp=true)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="key=value for both stages")
    args = ap.parse_intermixed_args(argv)
    ensure_dataset(load_config(args.recipe))
    work = REPO / "bench" / "out" / "scaling"
    runs = [(int(n), mode) for n in args.procs.split(",")
            for mode in (args.modes.split(",") if int(n) > 1 else ["dp"])]
    rows = [measure(args.recipe, n, mode, args.steps, work, args.shard_rows, args.overrides) for n, mode in runs]
    print("| processes | precompute seq/s | precompute peak RSS per rank | train pairs/step | train s/step | "
          "train pairs/s | train peak RSS per rank | train's own memory (RssAnon) at its end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gib = {k: " / ".join(f"{v:.2f}" for v in r[k]) + " GiB" for k in (
            "precompute_peak_rss_gib", "train_peak_rss_gib", "train_anon_gib_at_end")}
        print(f"| {r['processes']} x {r['threads_per_process']} ({r['mode']}) | {r['precompute_sequences_per_s']} | "
              f"{gib['precompute_peak_rss_gib']} | {r['train_pairs_per_step']} | {r['train_step_s']} | "
              f"{r['train_pairs_per_s']} | {gib['train_peak_rss_gib']} | {gib['train_anon_gib_at_end']} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "recipe": args.recipe,
                                               "overrides": args.overrides, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
