"""Do the warning signs tell a damaged run from a healthy one, on a real chat model? (the calibration of
lowmem_dpo/training/guards.py's limits)

    python bench/signs.py --threads 1 --json bench/results/signs.json      # SmolLM2-135M-Instruct, 6 runs
    python bench/signs.py --kinds style --runs damaged --work bench/out/signs-x   # one run alone
    python bench/signs.py --runs fast-sft --samples 24 --json bench/results/signs_fast_sft.json  # far and good
    python bench/signs.py --smoke                                          # the flow on tiny-llama, ~1 min

The model: SmolLM2-135M-Instruct (readme_recipe.ensure_model: built once by ../shared/tools/make_smollm2.py, or
--model PATH). The data, three kinds of preference on bench/chat_prefs.py's fact questions (the families with a
wrong answer), --rows each, seeded:
  style        chosen "Sure! " + the correct answer, rejected the correct answer alone (the issue's phrase);
  correctness  chosen the correct answer, rejected the same sentence with a wrong fact;
  length       chosen the correct answer, rejected it followed by an off-topic sentence.
Two runs of each, as a user runs them (`python -m lowmem_dpo.precompute` then `train`, in processes of their
own, recipe RECIPE below): healthy (learning_rate 5e-5) and damaged (5e-4, the rate that degraded SmolLM2's
answers while every preference metric looked perfect), the same 16 steps of 8 pairs; --runs overtrained adds
the healthy rate for 6x the steps (~6 epochs). The ground truth is the
answers: the share of held-out greedy samples that keep their fact (every word of the correct answer that the
wrong one lacks: "Cairo" for the capital of Egypt), at step 0 and at the end. A damaged run loses facts; a healthy
one keeps them. Recorded per run: every warning train logged, with its step; and per eval the signs' numbers
(eval_loss, accuracy, margins, logps, eval_gen/rouge_l, kl, length, chosen_length, repetition, empty).
Prints a Markdown table; --json writes everything with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import chat_prefs  # noqa: E402

WORK = ROOT / "bench" / "out" / "signs"
KINDS = ("style", "correctness", "length")
# learning_rate, how many times --steps, and the loss: overtrained is the healthy rate for 6x as long (~6 epochs);
# fast-sft is the damaged run's rate kept on course by the sft term (RPO): a run that moves far from its reference
# and stays good, which no sign may flag
RUNS = {"healthy": ("5e-5", 1, "sigmoid"), "damaged": ("5e-4", 1, "sigmoid"), "overtrained": ("5e-5", 6, "sigmoid"),
        "fast-sft": ("5e-4", 1, "[sigmoid, sft]")}
RECIPE = """model_name_or_path: {model}
dataset: {data}
output_dir: {out}
ref_cache_dir: {cache}
max_length: 128
beta: 0.1
loss_type: {loss}
learning_rate: {lr}
lr_scheduler_type: constant_with_warmup
warmup_steps: 1
per_device_train_batch_size: 8
max_steps: {steps}
lora_r: 16
lora_alpha: 32
lora_target_modules: all-linear
seed: 0
logging_steps: 1
eval_fraction: 0.2
eval_on_start: true
eval_steps: {eval_steps}
eval_generations: {samples}
max_new_tokens: 32
save_steps: 0
"""
FACT_FAMILIES = [f for f in chat_prefs.FAMILIES if f.__name__ not in ("_tip", "_definition")]


def rows(kind: str, n: int, seed: int = 0) -> tuple[list[dict], dict[str, list[str]]]:
    """n conversational rows of `kind` (module doc), and each question's fact: the words its correct answer has
    and its wrong one lacks."""
    rng, out, facts = random.Random(seed), [], {}
    while len(out) < n:
        q, answer, wrong = FACT_FAMILIES[len(out) % len(FACT_FAMILIES)](rng)
        if wrong is None or q in facts:
            continue
        facts[q] = sorted(set(words(answer)) - set(words(wrong)))
        chosen, rejected = {"style": ("Sure! " + answer, answer), "correctness": (answer, wrong),
                            "length": (answer, answer + " " + rng.choice(chat_prefs.RAMBLES).format(
                                t=rng.choice(chat_prefs.RAMBLE_TOPICS)))}[kind]
        out.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out, facts


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def run(kind: str, name: str, model: str, args) -> dict:
    """One run (precompute, train) as a user runs it; its warnings, eval lines and facts kept."""
    work = Path(args.work) / f"{kind}-{name}"
    data, facts = rows(kind, args.rows)
    work.mkdir(parents=True, exist_ok=True)
    chat_prefs.write(data, work / "rows.jsonl")
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=model, data=work / "rows.jsonl", out=work / "out", cache=work / "cache",
                                    lr=RUNS[name][0], loss=RUNS[name][2], steps=args.steps * RUNS[name][1],
                                    eval_steps=args.eval_steps * RUNS[name][1], samples=args.samples),
                       encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    t0, logs = time.perf_counter(), ""
    for stage in ("precompute", "train"):
        p = subprocess.run([sys.executable, "-m", f"lowmem_dpo.{stage}", str(recipe), "overwrite_output_dir=true"],
                           cwd=ROOT, capture_output=True, text=True, env=env)
        logs += p.stderr
        if p.returncode:
            raise SystemExit(f"{kind}/{name}: {stage} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    lines = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (work / "out" / "samples.jsonl").read_text().splitlines()]
    kept = {}
    for s in samples:
        fact = facts.get(s["prompt"])
        if fact is not None:
            kept.setdefault(s["step"], []).append(all(w in words(s["completion"]) for w in fact))
    evals = [x for x in lines if any(k.startswith("eval_") for k in x)]
    warnings = [m.groups() for m in re.finditer(r"warning: step (\d+): ([^:(]+)", logs)]
    return {"kind": kind, "run": name, "learning_rate": float(RUNS[name][0]), "loss_type": RUNS[name][2],
            "steps": args.steps * RUNS[name][1], "samples": args.samples,
            "wall_s": round(time.perf_counter() - t0),
            "facts_kept": {str(k): round(sum(v) / len(v), 3) for k, v in sorted(kept.items())},
            "warnings": [{"step": int(s), "sign": w.strip()} for s, w in warnings],
            "evals": evals, "last_train": [x for x in lines if "loss" in x][-1],
            "train": [x for x in lines if "loss" in x],
            "rejected_tokens": round(mean_tokens(model, data, "rejected"), 2),
            "chosen_tokens": round(mean_tokens(model, data, "chosen"), 2),
            "rouge_per_sample": rouge_per_sample(model, samples),
            "samples_last": [s for s in samples if s["step"] == max(x["step"] for x in samples)][:3]}


def table(results: list[dict]) -> str:
    head = ("| kind | run | facts kept (step 0 -> end) | eval acc | eval margin | ROUGE-L (0 -> end) | KL end | "
            "length (chosen) | rejected nats/token vs ref | warnings (first step) |")
    out = [head, "|---" * 10 + "|"]
    for r in results:
        e0, e1 = r["evals"][0], r["evals"][-1]
        kept = list(r["facts_kept"].values())
        signs = {}
        for w in r["warnings"]:
            signs.setdefault(w["sign"], w["step"])
        loss = "" if r.get("loss_type", "sigmoid") == "sigmoid" else f", {r['loss_type']}"
        out.append(f"| {r['kind']} | {r['run']} (lr {r['learning_rate']:g}, {r.get('steps', 16)} steps{loss}) | "
                   f"{kept[0]:.2f} -> {kept[-1]:.2f} | "
                   f"{e1.get('eval_rewards/accuracies', 0):.2f} | {e1.get('eval_rewards/margins', 0):.2f} | "
                   f"{e0.get('eval_gen/rouge_l', 0):.2f} -> {e1.get('eval_gen/rouge_l', 0):.2f} | "
                   f"{e1.get('eval_gen/kl') or 0:.2f} | {e1.get('eval_gen/length', 0):.1f} "
                   f"({e1.get('eval_gen/chosen_length', 0):.1f}) | {rejected_per_token(r):.2f} | "
                   + ("; ".join(f"{s} ({k})" for s, k in signs.items()) or "none") + " |")
    return "\n".join(out)


def rejected_per_token(r: dict) -> float:
    """The last train line's rejected log-ratio per rejected token, as guards' likelihood displacement reads it
    (beta 0.1)."""
    return r["last_train"]["rewards/rejected"] / 0.1 / r["rejected_tokens"]


def tokenizer(model: str):
    from lowmem_dpo.model.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))


def mean_tokens(model: str, data: list[dict], side: str) -> float:
    """The `side` completions' mean token count, as the model's tokenizer counts the answer (+1: its end)."""
    tok = tokenizer(model)
    return sum(len(tok(r[side][0]["content"])["input_ids"]) + 1 for r in data) / len(data)


def rouge_per_sample(model: str, samples: list[dict]) -> dict[str, list[float]]:
    """Each eval's per-sample token ROUGE-L against the held-out chosen answer, by step (the text re-tokenized:
    within rounding of what eval_gen/rouge_l averages), in the order of samples.jsonl: the noise of the mean."""
    from lowmem_dpo.training.guards import rouge_l

    tok, out = tokenizer(model), {}
    for s in samples:
        ids = [tok(t.rstrip("\n"), add_special_tokens=False)["input_ids"] for t in (s["completion"], s["chosen"])]
        out.setdefault(str(s["step"]), []).append(round(rouge_l(*ids), 4))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--runs", default="healthy,damaged")
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eval-steps", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8, help="eval_generations: held-out answers judged per eval")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.smoke:
        model, args.kinds, args.runs, args.steps, args.eval_steps = "lowmem_dpo:tiny-llama", "style", "damaged", 2, 1
    else:
        from readme_recipe import ensure_model

        model = str(ensure_model(args.model))
    results = [run(kind, name, model, args) for kind in args.kinds.split(",") for name in args.runs.split(",")]
    print(table(results))
    if args.json:
        from machine import command_line, machine_info

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "command": command_line("signs.py", argv),
                                               "results": results}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
