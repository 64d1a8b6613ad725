"""The reference cache keyed by sequence content, against a full rebuild: what each change of the data costs.

    python bench/cache_reuse.py [--rows 2000] [--device cpu] [--no-trl] [--json bench/results/cache_reuse.json]
    python bench/cache_reuse.py --smoke      # 44 short rows on the tiny model: the flow, in seconds

On lowmem_dpo:llama-25m (bench/recipes/llama-25m-cpu.yaml: dtype auto, max_length 256, batch 8) with --rows rows
of bench/make_data.py's reviews (~230 tokens each, nothing cut), each scenario is one precompute.run on the cache
the scenario before left, timed in this process from the call to its return (tokenization, sequence lookups,
the model's load and forwards of the sequences it computes, the preflight report; not the built-in model's first
build or the first hashing of its files, done before). Ours counts sequences (a prompt and one completion: a pair
is two, a completion several pairs share is one); TRL's counts rows (pairs):

  full              the rows, an empty cache: T
  10% new rows      the same rows and 10% more                       goal <= 0.15 T, computes only the new rows
  reordered         the rows shuffled                                goal <= 0.05 T, computes nothing
  subset            every other row                                  goal <= 0.05 T, computes nothing
  max_train_samples half the rows, chosen by seed                    computes nothing
  eval split        eval_fraction 0 -> 0.2                           computes nothing
  mixture 10%       the rows and 10% of a second source of as many rows    computes that 10%
  mixture 20%       its fraction raised to 20%                       computes only the rows the 20% adds

TRL 1.16 (--no-trl skips it): DPOTrainer with precompute_ref_log_probs=True at its best (bench/trl_step.py
"best"), on the same rows, then on them reordered. Its cache file is keyed by the tokenized dataset's
fingerprint and a hash of the model, so any change above (a new fingerprint) recomputes every row; its first
build is its cost per change. Each TRL run trains 1 step after its precompute (not timed).

Writes the JSON (--json) and prints a Markdown table; bench/README.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

RECIPE = ROOT / "bench" / "recipes" / "llama-25m-cpu.yaml"
GOALS = {"10% new rows": 0.15, "reordered": 0.05, "subset": 0.05}


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def scenarios(work: Path, rows: list[dict], other: list[dict]) -> list[tuple[str, dict]]:
    """(name, the config's keys) in the order they run, each on the cache the one before left."""
    n = len(rows)
    base = write(work / "rows.jsonl", rows[:n * 10 // 11])  # the last 1/11 are the "10% new rows"
    shuffled = rows[:n * 10 // 11]
    random.Random(0).shuffle(shuffled)
    second = write(work / "second.jsonl", other)
    return [
        ("full", {"dataset": base}),
        ("10% new rows", {"dataset": write(work / "grown.jsonl", rows)}),
        ("reordered", {"dataset": write(work / "reordered.jsonl", shuffled)}),
        ("subset", {"dataset": write(work / "subset.jsonl", rows[:n * 10 // 11:2])}),
        ("max_train_samples", {"dataset": base, "max_train_samples": n * 5 // 11}),
        ("eval split", {"dataset": base, "eval_fraction": 0.2}),
        ("mixture 10%", {"dataset": [base, {"path": second, "fraction": 0.1}]}),
        ("mixture 20%", {"dataset": [base, {"path": second, "fraction": 0.2}]}),
    ]


def config(keys: dict, cache_dir: Path, device: str, smoke: bool):
    """The bench recipe with `keys` (a mixture written as JSON, which the override's YAML reads)."""
    from lowmem_dpo.config.recipe import load_config

    overrides = [f"device={device}", f"ref_cache_dir={cache_dir}", "eval_fraction=0",
                 *(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in keys.items())]
    if smoke:
        overrides += ["model_name_or_path=lowmem_dpo:tiny-llama", "max_length=64"]
    return load_config(RECIPE, overrides)


def timed_build(cfg, cache_dir: Path) -> dict:
    """One precompute.run on the cache as it is, timed from the call to its return: build.json's counts (in
    sequences: a pair is two), its wall seconds and its forwards' seconds."""
    from lowmem_dpo import precompute

    t0 = time.perf_counter()
    precompute.run(cfg, progress=False)
    wall = time.perf_counter() - t0
    build = json.loads((cache_dir / precompute.BUILD).read_text())
    return {"sequences": build["computed"] + build["reused"], "computed": build["computed"],
            "reused": build["reused"], "wall_s": round(wall, 3), "forward_s": build["compute_s"]}


def run_ours(work: Path, rows: list[dict], other: list[dict], device: str, smoke: bool) -> list[dict]:
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training import inputs

    cache_dir, out = work / "cache", []
    plan = scenarios(work, rows, other)
    first = config(plan[0][1], cache_dir, device, smoke)
    inputs.prepare(first, devices.resolve(first))  # untimed: the built-in model's first build, its files' digests
    for name, keys in plan:
        out.append({"scenario": name, **timed_build(config(keys, cache_dir, device, smoke), cache_dir)})
        print(f"ours  {name:18s} computed {out[-1]['computed']:5d} reused {out[-1]['reused']:5d} sequences  "
              f"{out[-1]['wall_s']:8.2f} s", flush=True)
    full = out[0]["wall_s"]
    for r in out:
        r["of_full"] = round(r["wall_s"] / full, 4)
        r["goal"] = GOALS.get(r["scenario"])
        r["meets_goal"] = None if r["goal"] is None else r["of_full"] <= r["goal"]
    return out


def run_trl(work: Path, rows: list[dict], device: str, smoke: bool) -> list[dict]:
    """TRL's precompute on the rows, then on them reordered (a new dataset fingerprint)."""
    import trl_step

    out = []
    shuffled = rows[:len(rows) * 10 // 11]
    random.Random(0).shuffle(shuffled)
    for name, data in (("full", rows[:len(rows) * 10 // 11]), ("reordered", shuffled)):
        cfg = config({"dataset": write(work / f"trl-{name}.jsonl", data)}, work / "trl-unused-cache", device,
                     smoke)
        result = trl_step.bench_trl(cfg, device, steps=1, warmup=0, trl_sets={}, setup="best")
        (pre,) = [p for p in result["reference_precompute"] if p["dataset"] == "train"]
        # counts in rows (pairs): TRL computes a row's chosen and rejected together
        out.append({"scenario": name, "rows": pre["rows"], "computed": pre["rows"], "precompute_s": pre["seconds"]})
        print(f"trl   {name:18s} computed {pre['rows']:5d} rows                     {pre['seconds']:8.2f} s",
              flush=True)
    return out


def table(ours: list[dict], trl: list[dict]) -> str:
    """Markdown: each change, ours against the full build (sequences: a pair is two), and TRL's precompute
    (measured for the full build and the reordered rows, every row computed; the other changes give its cache a
    new fingerprint too: its full build again, marked *)."""
    trl_by = {r["scenario"]: r["precompute_s"] for r in trl}
    lines = ["| change | sequences | computed | reused | ours s | of our full build | goal | TRL precompute s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ours:
        measured = trl_by.get(r["scenario"])
        trl_s = "" if not trl_by else f"{measured:.1f}" if measured is not None else f"{trl_by['full']:.1f}*"
        goal = "" if r["goal"] is None else f"<= {r['goal']} ({'met' if r['meets_goal'] else 'MISSED'})"
        lines.append(f"| {r['scenario']} | {r['sequences']} | {r['computed']} | {r['reused']} | {r['wall_s']:.2f} | "
                     f"{r['of_full']:.3f} | {goal} | {trl_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2200, help="rows in all: the first 10/11 are the base build, the "
                    "rest the 10%% new rows (2200: a base of 2,000)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="44 rows on lowmem_dpo:tiny-llama")
    ap.add_argument("--json", default=str(BENCH / "results" / "cache_reuse.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows = 44
    from make_data import bench_rows

    from lowmem_dpo.model.tiny import preference_rows

    make = preference_rows if args.smoke else bench_rows  # the tiny model's rows fit its max_length of 64
    rows, other = make(args.rows, seed=0), make(args.rows * 10 // 11, seed=1)
    with tempfile.TemporaryDirectory(prefix="cache-reuse-") as tmp:
        work = Path(tmp)
        if not args.no_trl:  # TRL's cache files in the run's folder (read by datasets at its import: a script's)
            os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")
        ours = run_ours(work, rows, other, args.device, args.smoke)
        trl = [] if args.no_trl else run_trl(work, rows, args.device, args.smoke)
    from machine import command_line, machine_info

    report = {"command": command_line("cache_reuse.py", argv),
              "model": "lowmem_dpo:tiny-llama" if args.smoke else "lowmem_dpo:llama-25m", "device": args.device,
              "machine": machine_info(), "ours": ours, "trl": trl}
    if not args.smoke:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(table(ours, trl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
