"""Does a compiled MLP pay? Train steps with each decoder layer's MLP (and norms) through torch.compile, against the
same steps plain, on the real-length rows (bench/real_lengths.py; run it first, it writes the rows and the cache).

    python bench/real_lengths.py --json bench/results/real_lengths_cpu.json     # once: the rows and their cache
    python bench/compiled_mlp.py [--steps 12] [--json OUT]

Each mode runs in a process of its own, the same steps in the same order (the run's seeded stream): plain, the MLP
compiled (dynamic shapes: a packed row's length changes every step), the MLP and both norms compiled. Reports the
first step (compilation included) and the sum of the others, and the losses of the first steps (the same numbers).
The attention stays as it is: a packed row's per-sequence bounds are Python ints, which a compiled layer would
guard on and recompile for at every step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "bench" / "out" / "real_lengths" / "total-512-128-cpu"
MODES = ("plain", "mlp", "mlp+norms")


def one(mode: str, steps: int) -> dict:
    import torch

    import lowmem_dpo  # noqa: F401  first, as `python -m lowmem_dpo.train` is
    from lowmem_dpo import train
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.training.step import optimizer_step

    cfg = load_config(str(ROOT / "bench/recipes/llama-25m-cpu.yaml"), [
        f"dataset={ROWS}.jsonl", "max_length=512", "max_prompt_length=null", f"ref_cache_dir={ROWS}/cache",
        f"output_dir={ROOT}/bench/out/compiled_mlp/{mode}", "eval_fraction=0", "save_steps=0", "resume=never",
        "overwrite_output_dir=true", "max_skipped_share=1", "max_truncated_share=1", f"max_steps={steps}"])
    session = train.setup(cfg, progress=False)
    for layer in session.trainee.model.get_base_model().model.layers if mode != "plain" else []:
        layer.mlp = torch.compile(layer.mlp, dynamic=True)
        if mode == "mlp+norms":
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)
    t0 = time.perf_counter()
    results = [optimizer_step(session)]
    first = time.perf_counter() - t0
    results += [optimizer_step(session) for _ in range(steps - 1)]
    return {"mode": mode, "first_step_s": round(first, 2), "other_steps_s": round(sum(r.seconds for r in results[1:]), 2),
            "losses": [round(r.loss, 7) for r in results[:4]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(one(args.mode, args.steps)))
        return 0
    if not (ROWS / "cache").is_dir():
        raise SystemExit(f"compiled_mlp: no rows at {ROWS}: run python bench/real_lengths.py first")
    runs = []
    for mode in MODES:
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)],
                              capture_output=True, text=True, cwd=ROOT, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    report = {"command": "python bench/compiled_mlp.py " + " ".join(sys.argv[1:]), "runs": runs,
              "ratio_other_steps": {r["mode"]: round(r["other_steps_s"] / runs[0]["other_steps_s"], 3) for r in runs}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["ratio_other_steps"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
