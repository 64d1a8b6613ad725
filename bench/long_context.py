"""Long sequences on a 12 GB card: per max_length, the plan for Llama-3.1-8B QLoRA DPO at 11.25 GiB, and a
measured slice of the same architecture on this machine.

    python bench/long_context.py [--lengths 1024,2048,4096,8192] [--layers 1] [--prompt-share 0.9]
        [--json bench/results/long_context.json]
    python bench/long_context.py --smoke      # tiny-llama at 256 and 512 tokens: the flow in a minute

For each length L (tokens per sequence; a pair is two sequences):
  planned   the full model as recipes/llama3.1-8b-qlora-12gb.yaml sets it (4-bit NF4 base, bf16 compute, LoRA r16 on
            every linear layer, gradient checkpointing, the MLP in tiles), 1 pair per micro-batch of two sequences
            (share_prompt=false), the data's shape (--prompt-share), at the 11.25 GiB budget: the train peak with
            the knobs train turns by itself (activation offloading), whether it fits, and the pinned host RAM
            offloading takes;
  measured  the same architecture cut to --layers decoder layers with random weights (measure.measure_slice, as
            `plan --measure --slice N` runs it), bf16 unquantized on this CPU (the activations are the same; a
            4-bit base adds its dequantization buffers), against the planner's prediction for that slice at the
            measured shapes; then one more train step, timed without the meter (its profiler slows each op):
            seconds and tokens per second.
The rows are prompt-heavy, as long-context preference data is (RAG, summaries, long chats): a prompt of
--prompt-share x L tokens (max_prompt_length) and chosen / rejected answers filling the rest, cut by the tokenizer,
nothing dropped. The planner's longest max_length at 1 pair per micro-batch is printed too.

On a GPU the real model under the cap, against TRL at its best at the same cap, is bench/gpu_check.py with these
lengths (`--recipes llama --lengths 4096,8192,16384`); bench/README.md says how to run it on a lent machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

RECIPE = ROOT / "recipes" / "llama3.1-8b-qlora-12gb.yaml"
BUDGET_GIB = 11.25
GiB = 1 << 30


def rows_file(path: Path, length: int, n: int = 4) -> Path:
    """n rows whose prompt and answers are each longer than `length` tokens of the built-in tokenizer (the
    max_length cut makes the shapes)."""
    from lowmem_dpo.model.tiny import preference_rows

    pool = preference_rows(max(64, length // 2))  # each review ~8 tokens: ~4 L tokens per text
    texts = [r["chosen"] for r in pool]
    rows = [{"prompt": " ".join(texts[i:] + texts[:i]), "chosen": " ".join(texts[::2] * 2),
             "rejected": " ".join(texts[1::2] * 2)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(length: int, prompt_share: float, data: Path, smoke: bool) -> list[str]:
    out = [f"dataset={data}", f"max_length={length}", f"max_prompt_length={int(prompt_share * length)}",
           "per_device_train_batch_size=1", "gradient_accumulation_steps=1", "precompute_batch_size=1",
           "share_prompt=false", "eval_fraction=0", "load_best_model_at_end=false",
           "gradient_checkpointing=true"]
    return out + (["model_name_or_path=lowmem_dpo:tiny-llama"] if smoke else [])


def planned(length: int, prompt_share: float, smoke: bool) -> dict:
    """The full model at 11.25 GiB on a CUDA card, 1 pair per micro-batch, with train's own knobs."""
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.memory.search import TRAIN_KNOBS, choose
    from lowmem_dpo.memory.setup import setup_from_config, with_prompts

    budget = int(BUDGET_GIB * GiB)
    cfg = load_config(RECIPE, [f"max_length={length}", f"max_prompt_length={int(prompt_share * length)}",
                               "per_device_train_batch_size=1",
                               "gradient_accumulation_steps=16"] + (["model_name_or_path=lowmem_dpo:tiny-llama"]
                                                                    if smoke else []))
    # two sequences per pair, as the measured slice runs them (with_prompts: the LM head's completion tokens)
    setup = dataclasses.replace(with_prompts(setup_from_config(cfg, budget), int(prompt_share * length)),
                                share_prompt=False)
    plan = choose(load_arch(cfg.model_name_or_path), setup, budget, TRAIN_KNOBS, stages=("train",))
    train = plan.prediction.train
    return {"peak_gib": round(train.peak_bytes / GiB, 2), "fits": plan.fits, "overrides": plan.overrides,
            "host_gib": round(train.details["offload.host_bytes"] / GiB, 2), "seq_len": train.shapes["seq_len"],
            "shared": train.shapes.get("shared", False)}


def measured(length: int, prompt_share: float, layers: int, work: Path, smoke: bool) -> dict:
    """The slice on this CPU: peaks against the prediction at the measured shapes, and a timed step."""
    from lowmem_dpo import measure
    from lowmem_dpo.config.recipe import load_config

    data = rows_file(work / f"rows-{length}.jsonl", length)
    cfg = load_config(RECIPE, overrides(length, prompt_share, data, smoke) + [
        "device=cpu", "dtype=bfloat16", "quantization=none", f"output_dir={work / 'out'}",
        f"ref_cache_dir={work / 'cache'}"])
    t0 = time.perf_counter()
    if smoke:
        m = measure.measure(cfg, steps=1, timed=1)
        from lowmem_dpo.memory.arch import load_arch
        from lowmem_dpo.memory.model import predict
        from lowmem_dpo.memory.setup import setup_from_config

        pred = predict(load_arch(cfg.model_name_or_path), measure.at_measured_shapes(setup_from_config(cfg), m))
    else:
        result = measure.measure_slice(cfg, layers, steps=1, timed=1)
        m, pred = result["measured"], result["prediction"]
    out = {"wall_s": round(time.perf_counter() - t0, 1), "layers": None if smoke else layers}
    for stage in ("train", "precompute"):
        got, want = m[stage]["measured_peak_bytes"], getattr(pred, stage).tensor_peak_bytes
        out[stage] = {"measured_mib": round(got / 2**20, 1), "predicted_mib": round(want / 2**20, 1),
                      "error_pct": round(100 * (want - got) / got, 1), "seq_len": m[stage]["seq_len"]}
    seconds, tokens = m["train"]["step_s"][0], m["train"]["step_tokens"][0]
    out["step_s"], out["tokens_per_s"] = seconds, round(tokens / seconds, 1)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| max_length | planned train peak (8B, 12 GB card) | knobs | pinned host RAM | measured slice: train "
             "/ precompute (predicted, error) | slice step s | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, m = r["planned"], r["measured"]
        knobs = " ".join(f"{k}={v}" for k, v in p["overrides"].items()) or "-"
        tr, pre = m["train"], m["precompute"]
        lines.append(f"| {r['length']} | {p['peak_gib']} GiB{'' if p['fits'] else ' (no fit)'} | {knobs} | "
                     f"{p['host_gib']} GiB | {tr['measured_mib']} MiB ({tr['predicted_mib']}, {tr['error_pct']:+}%)"
                     f" / {pre['measured_mib']} MiB ({pre['predicted_mib']}, {pre['error_pct']:+}%) | "
                     f"{m['step_s']} | {m['tokens_per_s']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--prompt-share", type=float, default=0.9)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=str(BENCH / "results" / "long_context.json"))
    args = ap.parse_args(argv)
    lengths = [256, 512] if args.smoke else [int(x) for x in args.lengths.split(",")]
    from machine import command_line, machine_info

    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.memory.search import longest_max_length
    from lowmem_dpo.memory.setup import setup_from_config, with_prompts

    rows = []
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        for length in lengths:
            row = {"length": length, "planned": planned(length, args.prompt_share, args.smoke),
                   "measured": measured(length, args.prompt_share, args.layers, Path(tmp), args.smoke)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    cfg = load_config(RECIPE, ["per_device_train_batch_size=1", "max_prompt_length=null"])
    budget = int(BUDGET_GIB * GiB)
    setup = with_prompts(setup_from_config(cfg, budget), 1)  # the longest at any prompt share: no shared rows
    longest = {b: longest_max_length(load_arch(cfg.model_name_or_path), dataclasses.replace(setup, micro_batch=b),
                                     budget, b)[0] for b in (1, 2, 4)}
    report = {"command": command_line("long_context.py", argv),
              "machine": machine_info(), "budget_gib": BUDGET_GIB, "prompt_share": args.prompt_share,
              "longest_max_length_by_micro_batch": longest, "rows": rows}
    if not args.smoke:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(table(rows))
    print(f"longest max_length at {BUDGET_GIB} GiB (8B, unshared rows), by pairs per micro-batch: {longest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
