"""Re-pairing for free: one cache keyed per sequence, against TRL's precompute, on data with 4 completions a prompt.

    python bench/repairing.py [--prompts 500] [--device cpu] [--no-trl] [--json bench/results/repairing.json]
    python bench/repairing.py --smoke     # 12 prompts on the tiny model: the flow, in seconds

The data is UltraFeedback's shape: --prompts prompts, each with 4 completions scored best to worst (bench/make_data's
reviews on lowmem_dpo:llama-25m, ~230 tokens a sequence: prompt i's completions are row i's chosen, row i + n's
chosen and rejected, row i's rejected). Each scenario is one precompute.run on the cache the one before left (bench
recipe llama-25m-cpu.yaml: dtype auto, max_length 256, batch 8), timed from the call to its return:

  best vs worst      n pairs                       an empty cache: its 2n completions
  best vs each       3n pairs                      only the 2n completions never paired before
  every pair         6n pairs                      nothing: every completion is there
  a subset           the 2nd against the 3rd       nothing
  kto                4n unpaired rows (best two    only the KL sequences (each row's prompt with its block's
                     desirable, shuffled)          neighbour's completion, ~4n); the rows' own completions are there

TRL 1.16 (--no-trl skips it): its precompute for each of the first, second and fifth, DPOTrainer's and
KTOTrainer's own _precompute_ref_logps on their prepared datasets (precompute_batch_size 8, the same dtype), timed
alone: it keys its cache file by the whole dataset's fingerprint, so each pairing recomputes every row.

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

from cache_reuse import RECIPE, timed_build, write  # noqa: E402 (bench/ on the path first)


def four_completions(rows: list[dict], n: int) -> list[dict]:
    """n prompts with 4 completions each, best first, in UltraFeedback's shape."""
    return [{"prompt": rows[i]["prompt"], "completions": [
        {"response": rows[i]["chosen"], "overall_score": 9.0}, {"response": rows[i + n]["chosen"], "overall_score": 7.0},
        {"response": rows[i + n]["rejected"], "overall_score": 4.0},
        {"response": rows[i]["rejected"], "overall_score": 2.0}]} for i in range(n)]


def pairings(prompts: list[dict]) -> dict[str, list[dict]]:
    """Each scenario's rows: pairs {prompt, chosen, rejected} or KTO's {prompt, completion, label}."""
    def pairs(which: list[tuple[int, int]]) -> list[dict]:
        return [{"prompt": p["prompt"], "chosen": p["completions"][i]["response"],
                 "rejected": p["completions"][j]["response"]} for p in prompts for i, j in which]

    return {"best vs worst": pairs([(0, 3)]), "best vs each": pairs([(0, 1), (0, 2), (0, 3)]),
            "every pair": pairs([(i, j) for i in range(4) for j in range(i + 1, 4)]), "a subset": pairs([(1, 2)]),
            "kto": kto_rows(prompts)}


def kto_rows(prompts: list[dict]) -> list[dict]:
    """The same completions as KTO's rows (the best two desirable), shuffled (seed 0): in prompt order a block's
    KL sequences would all pair a prompt with its own completions (preflight warns)."""
    rows = [{"prompt": p["prompt"], "completion": c["response"], "label": k < 2}
            for p in prompts for k, c in enumerate(p["completions"])]
    random.Random(0).shuffle(rows)
    return rows


def config(dataset: str, cache_dir: Path, device: str, smoke: bool, kto: bool):
    from lowmem_dpo.config.recipe import load_config

    overrides = [f"device={device}", f"ref_cache_dir={cache_dir}", "eval_fraction=0", f"dataset={dataset}",
                 "loss_type=kto" if kto else "loss_type=sigmoid"]
    if smoke:
        overrides += ["model_name_or_path=lowmem_dpo:tiny-llama", "max_length=64"]
    return load_config(RECIPE, overrides)


def run_ours(work: Path, scenarios: dict, device: str, smoke: bool) -> list[dict]:
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training import inputs

    cache_dir, out = work / "cache", []
    first = config(write(work / "s0.jsonl", scenarios["best vs worst"]), cache_dir, device, smoke, False)
    inputs.prepare(first, devices.resolve(first))  # untimed: the built-in model's first build, its files' digests
    for k, (name, rows) in enumerate(scenarios.items()):
        cfg = config(write(work / f"s{k}.jsonl", rows), cache_dir, device, smoke, name == "kto")
        out.append({"scenario": name, "rows": len(rows), **timed_build(cfg, cache_dir)})
        print(f"ours  {name:14s} {len(rows):5d} rows: computed {out[-1]['computed']:5d} reused "
              f"{out[-1]['reused']:5d} sequences  {out[-1]['wall_s']:8.2f} s", flush=True)
    return out


def trl_precompute(cfg, rows: list[dict], kto: bool) -> float:
    """Seconds of TRL 1.16's own reference precompute (its trainer's _precompute_ref_logps) over `rows`."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_dpo.model import models
    from lowmem_dpo.runtime import devices

    if kto:
        from trl import KTOConfig as Config
        from trl import KTOTrainer as Trainer
    else:
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    path = models.resolve_model_path(cfg.model_name_or_path)
    dtype = devices.resolve(cfg).ref_dtype
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    args = Config(output_dir=str(Path(cfg.ref_cache_dir) / "trl-out"), per_device_train_batch_size=4,
                  max_length=cfg.max_length, report_to="none", use_cpu=cfg.device == "cpu",
                  bf16=dtype == torch.bfloat16, disable_tqdm=True, precompute_ref_log_probs=False)
    trainer = Trainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(path, dtype=dtype), args=args,
                      train_dataset=datasets.Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(path))
    trainer._precompute_model_hash = "bench"  # what its cache file is named by (the precompute itself runs below)
    t0 = time.perf_counter()
    trainer._precompute_ref_logps(trainer.train_dataset, "train", cfg.precompute_batch_size)
    return time.perf_counter() - t0


def run_trl(work: Path, scenarios: dict, device: str, smoke: bool) -> list[dict]:
    out = []
    for name in ("best vs worst", "best vs each", "kto"):
        rows = scenarios[name]
        cfg = config(write(work / f"trl-{len(out)}.jsonl", rows), work / "trl-cache", device, smoke, name == "kto")
        seconds = trl_precompute(cfg, rows, name == "kto")
        out.append({"scenario": name, "rows": len(rows), "precompute_s": round(seconds, 3)})
        print(f"trl   {name:14s} {len(rows):5d} rows, every one computed  {seconds:8.2f} s", flush=True)
    return out


def table(ours: list[dict], trl: list[dict]) -> str:
    trl_by = {r["scenario"]: r["precompute_s"] for r in trl}
    lines = ["| scenario | rows | sequences | computed | reused | ours s | TRL precompute s |",
             "|---|---|---|---|---|---|---|"]
    for r in ours:
        trl_s = f"{trl_by[r['scenario']]:.1f}" if r["scenario"] in trl_by else "-"
        lines.append(f"| {r['scenario']} | {r['rows']} | {r['sequences']} | {r['computed']} | {r['reused']} | "
                     f"{r['wall_s']:.1f} | {trl_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="12 prompts on lowmem_dpo:tiny-llama")
    ap.add_argument("--json", default=str(BENCH / "results" / "repairing.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts = 12
    from make_data import bench_rows

    from lowmem_dpo.model.tiny import preference_rows

    make = preference_rows if args.smoke else bench_rows  # the tiny model's rows fit its max_length of 64
    scenarios = pairings(four_completions(make(2 * args.prompts, seed=0), args.prompts))
    with tempfile.TemporaryDirectory(prefix="repairing-") as tmp:
        work = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf-datasets")  # TRL's cache files: this run's, never a hit
        ours = run_ours(work, scenarios, args.device, args.smoke)
        trl = [] if args.no_trl else run_trl(work, scenarios, args.device, args.smoke)
    from machine import command_line, machine_info

    report = {"command": command_line("repairing.py", argv),
              "model": "lowmem_dpo:tiny-llama" if args.smoke else "lowmem_dpo:llama-25m", "device": args.device,
              "machine": machine_info(), "ours": ours, "trl": trl}
    if not args.smoke:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(table(ours, trl))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
