"""One train step's work, counted: lowmem_dpo against TRL 1.16 at its best, on this CPU (or from a GPU's profile).

    python bench/step_work.py [--lengths 2048,4096] [--json bench/results/step_work.json]
    python bench/step_work.py --from GPU_CHECK.json [--json OUT]   # the same table from gpu_check.py --profile's runs

For each max_length, lowmem_dpo and TRL train lowmem_dpo:tiny-llama (2 decoder layers) with the Llama-3.1-8B 12 GB
recipe (recipes/llama3.1-8b-qlora-12gb.yaml: 4-bit NF4 base, LoRA on every Linear, gradient checkpointing, 2 pairs
per micro-batch) in bfloat16, the card's compute dtype, on the CPU, as bench/gpu_check.py's children run them
(the same rows, settings and TRL at its best: precomputed reference log-probs, non-reentrant checkpointing), each
in a process of its own. torch.profiler records each tool's 3rd optimizer step, and counts (gpu_check.COUNTS):
  matmul_4bit  bitsandbytes' 4-bit matmuls (MatMul4Bit calls): 7 projections x 2 layers x forward and recompute
  mm           aten::mm, bmm, addmm: every matrix product
  copy_        aten::copy_: copies, casts among them
  op_events    every event the profiler recorded
The target: ours <= TRL in each count at each length. Per layer the counts are the card's: `gpu_check.py --profile
4` records the same on a GPU (with kernel launches and device time), and --from compares its runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

RECIPE = "recipes/llama3.1-8b-qlora-12gb.yaml"
MODEL = "lowmem_dpo:tiny-llama"
STEPS, PROFILED = 4, 3  # optimizer steps per run, and the one profiled (after the first's lazy setup)
SETTINGS = ["dtype=bfloat16"]  # the card's compute dtype (dtype=auto is float32 on a CPU without native bf16)
TOOLS = {"ours": "lowmem_dpo", "trl": "TRL 1.16"}
RESULT = ROOT / "bench" / "results" / "step_work.json"


def counts(entry: dict) -> dict:
    """A gpu_check run's counts of its profiled step (its profile, the op table left out)."""
    if not entry.get("profile"):
        raise SystemExit(f"step_work: {entry.get('tool')} at {entry.get('max_length')} tokens has no profile: "
                         f"{entry.get('error')}\n{entry.get('traceback', entry.get('log_tail', ''))}")
    return {k: v for k, v in entry["profile"].items() if k != "table"}


def measured(lengths: list[int]) -> list[dict]:
    """Each tool's profiled step at each length, a gpu_check child process per run, on this CPU."""
    import gpu_check

    args = gpu_check.parse_args(["--steps", str(STEPS), "--profile", str(PROFILED), "--set", *SETTINGS])
    runs = []
    for length in lengths:
        for tool in TOOLS:
            entry = gpu_check.spawn(tool, "llama", RECIPE, MODEL, length, args, "cpu", None)
            runs.append({"tool": tool, "max_length": length, **counts(entry)})
            print(f"step_work: {TOOLS[tool]} at {length} tokens: {json.dumps(runs[-1])}", file=sys.stderr)
    return runs


def from_check(path: str) -> list[dict]:
    """The profiled runs of a gpu_check.py --profile JSON, by recipe and length (tool: ours | trl)."""
    tools = {"lowmem_dpo": "ours", "trl": "trl"}
    return [{"tool": tools[r["tool"]], "max_length": r["max_length"], "recipe": r["recipe"], **counts(r)}
            for r in json.loads(Path(path).read_text())["runs"] if r["tool"] in tools and r.get("profile")]


def compare(runs: list[dict]) -> list[dict]:
    """Per length and count: ours, TRL's, their ratio and whether ours <= TRL."""
    import gpu_check

    rows = []
    keys = [*gpu_check.COUNTS, "op_events"] + (["kernel_launches", "device_self_s"]
                                                if any("kernel_launches" in r for r in runs) else [])
    for recipe, length in sorted({(r.get("recipe", "llama"), r["max_length"]) for r in runs}):
        pair = {r["tool"]: r for r in runs if (r.get("recipe", "llama"), r["max_length"]) == (recipe, length)}
        if set(pair) != {"ours", "trl"}:
            continue
        for key in keys:
            ours, trl = pair["ours"].get(key), pair["trl"].get(key)
            if ours is None or trl is None:
                continue
            rows.append({"recipe": recipe, "max_length": length, "count": key, "ours": ours, "trl": trl,
                         "ratio": round(ours / trl, 3) if trl else None, "met": ours <= trl})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| recipe | tokens | count | lowmem_dpo | TRL 1.16 | ours / TRL | ours <= TRL |",
           "|---|---|---|---|---|---|---|"]
    out += [f"| {r['recipe']} | {r['max_length']} | {r['count']} | {r['ours']:,} | {r['trl']:,} | {r['ratio']} | "
            f"{'yes' if r['met'] else '**no**'} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,4096", help="max_length of each pair of runs")
    ap.add_argument("--from", dest="source", metavar="JSON", help="compare the profiled runs of a gpu_check.py "
                    "--profile JSON instead of running")
    ap.add_argument("--json", default=str(RESULT), help="where to write the results")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    from machine import command_line, machine_info

    runs = from_check(args.source) if args.source else measured([int(x) for x in args.lengths.split(",")])
    rows = compare(runs)
    print(table(rows))
    report = {"command": command_line("step_work.py", argv), "machine": machine_info(), "recipe": RECIPE,
              "model": MODEL, "settings": SETTINGS, "profiled_step": PROFILED, "source": args.source, "runs": runs,
              "comparison": rows, "met": bool(rows) and all(r["met"] for r in rows)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"step_work: wrote {args.json} ({report['command']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
