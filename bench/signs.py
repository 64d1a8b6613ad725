"""Do the warning signs tell a damaged run from a healthy one, on a real chat model? (the calibration of
lowmem_dpo/training/guards.py's limits)

    python bench/signs.py --threads 1 --json bench/results/signs_32a.json  # SmolLM2-135M-Instruct, 6 runs
    python bench/signs.py --runs fast-sft --json bench/results/signs_32b.json   # far from the reference, and good
    python bench/signs.py --kinds style --runs damaged --work bench/out/signs-x   # one run alone
    python bench/signs.py --table bench/results/signs_32[abcd].json      # the table of recorded runs, run nothing
    python bench/signs.py --collect --kinds style --runs damaged --work bench/out/signs-x --json F  # record a run
    python bench/signs.py --smoke                                          # the flow on tiny-llama, ~40 s

The model: SmolLM2-135M-Instruct (readme_recipe.ensure_model: built once by ../shared/tools/make_smollm2.py, or
--model PATH). The data, three kinds of preference on bench/chat_prefs.py's fact questions (the families with a
wrong answer), --rows each, seeded:
  style        chosen "Sure! " + the correct answer, rejected the correct answer alone (the issue's phrase);
  correctness  chosen the correct answer, rejected the same sentence with a wrong fact;
  length       chosen the correct answer, rejected it followed by an off-topic sentence.
Runs of each (RUNS), as a user runs them (`python -m lowmem_dpo.precompute` then `train`, in processes of their
own, recipe RECIPE below): "healthy" (learning_rate 5e-5) and "damaged" (5e-4, the rate that degraded SmolLM2's
answers while every preference metric looked perfect), the same 16 steps of 8 pairs; overtrained, the low rate
for 6x the steps (~6 epochs); fast-sft, the high rate with loss_type [sigmoid, sft]. The names are the settings;
the ground truth is the answers: whether each held-out greedy answer keeps its fact (every word of the correct
answer that the wrong one lacks: "Cairo" for the capital of Egypt), at step 0 and at the end, the same prompts,
judged by a sign test on the answers that changed (worse()). Recorded per run: every warning train wrote, with
its step; every metrics line; each answer's fact, ROUGE-L and content score (content.py), and every answer itself
(samples: a new measure can be tried on them without rerunning). The table shows each sign's worst value beside
its limit, the warnings logged, and the shipped signs replayed on the recorded lines (replay()).
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
        q, answer, wrong = FACT_FAMILIES[len(out) % len(FACT_FAMILIES)](rng)[:3]  # (a fourth: the fact, unused)
        if wrong is None or q in facts:
            continue
        facts[q] = sorted(set(words(answer)) - set(words(wrong)))
        chosen, rejected = {"style": ("Sure! " + answer, answer), "correctness": (answer, wrong),
                            "length": (answer, answer + " " + rng.choice(chat_prefs.RAMBLES).format(
                                t=rng.choice(chat_prefs.RAMBLE_TOPICS)))}[kind]
        out.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out, facts


def facts_per_sample(samples: list[dict], facts: dict[str, list[str]]) -> dict[int, list[bool]]:
    """Whether each held-out answer keeps its question's fact, by step, in the order of samples.jsonl (the same
    prompts at every step)."""
    kept = {}
    for s in samples:
        fact = facts.get(s["prompt"])
        if fact is not None:
            kept.setdefault(s["step"], []).append(all(w in words(s["completion"]) for w in fact))
    return kept


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def run(kind: str, name: str, model: str, args) -> dict:
    """One run (precompute, train) as a user runs it; its warnings, eval lines and facts kept."""
    work = Path(args.work) / f"{kind}-{name}"
    data, _ = rows(kind, args.rows)
    work.mkdir(parents=True, exist_ok=True)
    chat_prefs.write(data, work / "rows.jsonl")
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(model=model, data=work / "rows.jsonl", out=work / "out", cache=work / "cache",
                                    lr=RUNS[name][0], loss=RUNS[name][2], steps=args.steps * RUNS[name][1],
                                    eval_steps=args.eval_steps * RUNS[name][1], samples=args.samples),
                       encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    t0 = time.perf_counter()
    for stage in ("precompute", "train"):
        p = subprocess.run([sys.executable, "-m", f"lowmem_dpo.{stage}", str(recipe), "overwrite_output_dir=true"],
                           cwd=ROOT, capture_output=True, text=True, env=env)
        if p.returncode:
            raise SystemExit(f"{kind}/{name}: {stage} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return {**collect(kind, name, model, work, args.rows), "steps": args.steps * RUNS[name][1],
            "samples": args.samples, "wall_s": round(time.perf_counter() - t0)}


def collect(kind: str, name: str, model: str, work: Path, n_rows: int) -> dict:
    """What a finished run in `work` recorded: its warnings (metrics.jsonl's), every metrics line, the facts its
    held-out answers keep, their ROUGE-L one by one."""
    data, facts = rows(kind, n_rows)
    lines = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (work / "out" / "samples.jsonl").read_text().splitlines()]
    kept = facts_per_sample(samples, facts)
    evals = [x for x in lines if any(k.startswith("eval_") for k in x)]
    return {"kind": kind, "run": name, "learning_rate": float(RUNS[name][0]), "loss_type": RUNS[name][2],
            "facts_kept": {str(k): round(sum(v) / len(v), 3) for k, v in sorted(kept.items())},
            "facts_per_sample": {str(k): [int(x) for x in v] for k, v in sorted(kept.items())},
            "warnings": [{"step": x["step"], "sign": re.split(r"[:(]", w)[0].strip()} for x in lines
                         for w in x.get("warnings", [])],
            "evals": evals, "last_train": [x for x in lines if "loss" in x][-1],
            "train": [x for x in lines if "loss" in x],
            "rejected_tokens": round(mean_tokens(model, data, "rejected"), 2),
            "chosen_tokens": round(mean_tokens(model, data, "chosen"), 2),
            "rouge_per_sample": rouge_per_sample(model, samples),
            "content_per_sample": content_per_sample(model, samples),
            "samples": [{k: s[k] for k in ("step", "prompt", "completion", "chosen")} for s in samples],
            "samples_last": [s for s in samples if s["step"] == max(x["step"] for x in samples)][:3]}


def table(results: list[dict]) -> str:
    """Each run's ground truth (facts kept, ROUGE-L), then each sign's worst value over the run beside its limit
    (guards' constants; ** past it), and the warnings train logged, with the step each first fired."""
    from lowmem_dpo.training import answers as A
    from lowmem_dpo.training import guards as G

    t = G.Thresholds()
    head = ("| kind | run | facts kept (step 0 -> end; answers that lost it, gained it) | ROUGE-L 0 -> end | drift: lowest ROUGE-L (limit) | "
            "content: lowest (limit) | "
            f"repetition (limit {A.COLLAPSE_LEVEL:g}) | length: shortest / end (chosen) | "
            f"chosen nats/token vs ref, train / held out (limit -{t.chosen_drop_per_token:g}; -{t.displaced_per_token:g} backed) | "
            f"context: KL (beyond {A.KL_LIMIT:g}) | context: margin (beyond {t.margin:g}) | "
            f"context: rejected nats/token (beyond -{t.rejected_drop_per_token:g}) | warnings logged (first step) | "
            "the shipped signs on its lines (first step) | answers |")
    out = [head, "|---" * 15 + "|"]
    for r in results:
        values = sign_values(r)
        kept = list(r["facts_kept"].values())
        signs = {}
        for w in r["warnings"]:
            signs.setdefault(w["sign"], w["step"])
        loss = "" if r.get("loss_type", "sigmoid") == "sigmoid" else f", {r['loss_type']}"

        def past(v: float, limit: float, below: bool = True) -> str:
            text = f"{v:.2f}"
            return f"**{text}**" if (v <= limit if below else v >= limit) else text

        rouge0 = values["rouge0"]
        drift_limit = rouge0 - A.DRIFT_DROP
        out.append(
            f"| {r['kind']} | {r['run']} (lr {r['learning_rate']:g}, {r.get('steps', 16)} steps{loss}) | "
            f"{kept[0]:.2f} -> {kept[-1]:.2f}{flips(r)} | {rouge0:.2f} -> {values['rouge_end']:.2f} | "
            f"{past(values['rouge_low'], drift_limit)} ({drift_limit:.2f}) | "
            f"{content_cell(values)} {past(values['repetition'], A.COLLAPSE_LEVEL, False)} | {values['length']:.1f} / {values['length_end']:.1f} ({values['chosen_length']:.1f}) | "
            f"{past(values['chosen_train'], -t.chosen_drop_per_token)} / "
            f"{past(values['chosen_eval'], -t.chosen_drop_per_token)} | {past(values['kl'], A.KL_LIMIT, False)} | "
            f"{past(values['margin'], t.margin, False)} | {past(values['rejected'], -t.rejected_drop_per_token)} | "
            + ("; ".join(f"{s} ({k})" for s, k in signs.items()) or "none") + " | "
            + ("; ".join(f"{s} ({k})" for s, k in replay(r).items()) or "none") + f" | {worse(r)} |")
    return "\n".join(out)


def content_cell(values: dict) -> str:
    """The content sign's cell: step 0's score -> the lowest later, ** past the limit (the drop and twice the noise
    of that eval's change), the limit; '' for a run recorded without its answers."""
    from lowmem_dpo.training import answers as A

    if values.get("content0") is None:
        return "|"
    low, se, limit = values["content_low"], values["content_low_se"] or 0.0, values["content0"] - A.DRIFT_DROP
    text = f"{values['content0']:.2f} -> {low:.2f} ±{se:.2f}"
    fired = low <= limit and values["content0"] - low >= A.DRIFT_SE * se
    return f"{'**' + text + '**' if fired else text} ({limit:.2f}) |"


def replay(r: dict, beta: float = 0.1) -> dict[str, int]:
    """The warnings the shipped guards give on a run's recorded lines, by kind, with the step each first shows: the
    answers' signs exactly (each eval line holds what they read; the change's noise from the answers' own ROUGE-L
    where the line lacks it), likelihood displacement with the data's mean chosen tokens per pair for each window's
    own."""
    from lowmem_dpo.objectives import OBJECTIVES
    from lowmem_dpo.training import answers as A
    from lowmem_dpo.training import guards as G

    first: dict[str, int] = {}
    base = next((with_content(r, e) for e in r["evals"] if e["step"] == 0 and e.get(A.GEN_ROUGE_L) is not None), None)
    steps, tokens, rejected = r.get("steps", 16), r.get("chosen_tokens", 0.0), r.get("rejected_tokens", 0.0)
    several = r.get("loss_type", "sigmoid") != "sigmoid"  # [sigmoid, sft]: judged by SEVERAL, its NLL taken out
    t = G.thresholds(G.SEVERAL if several else OBJECTIVES["sigmoid"].limits, beta, 0.0, tokens)
    lines = [(x, False) for x in r.get("train") or []] + [
        ({k.removeprefix("eval_"): v for k, v in e.items()}, True) for e in r["evals"] if "eval_loss" in e]
    for line, held_out in sorted(lines, key=lambda x: x[0]["step"]):
        if several and line.get("nll_loss") is not None:
            line = {**line, "loss": line["loss"] - line["nll_loss"]}
        for sign in G.warning_signs(line, G.At(line["step"], steps, held_out), beta, tokens, t, rejected):
            first.setdefault(sign.split(":")[0], line["step"])
    per = r.get("rouge_per_sample") or {}
    for e in r["evals"]:
        if str(e["step"]) in per and "0" in per and A.GEN_ROUGE_L_SE not in e:  # a run recorded before train logged it
            e = {**e, A.GEN_ROUGE_L_SE: A.change_se(list(zip(per[str(e["step"])], per["0"])))}
        e = with_content(r, e)
        sign = A.collapse_sign(base, e) if e["step"] > 0 and e.get(A.GEN_ROUGE_L) is not None else None
        if sign:
            first.setdefault(sign.split(":")[0], e["step"])
    return dict(sorted(first.items(), key=lambda kv: kv[1]))


def worse(r: dict) -> str:
    """The ground truth: 'worse' when the held-out answers lost their facts more often than they gained them
    beyond chance (one-sided sign test on the answers that changed, p < 0.05), else 'kept' or 'better' (the
    same test the other way); with p."""
    from math import comb

    per = r.get("facts_per_sample")
    if not per:
        return "?"
    first, last = per[min(per, key=int)], per[max(per, key=int)]
    lost, gained = sum(a and not b for a, b in zip(first, last)), sum(b and not a for a, b in zip(first, last))
    n = lost + gained

    def tail(k: int) -> float:  # P(at least k of n changes go one way | each way equally likely)
        return sum(comb(n, i) for i in range(k, n + 1)) / 2 ** n if n else 1.0

    if tail(lost) < 0.05:
        return f"worse (p {tail(lost):.3f})"
    return f"better (p {tail(gained):.3f})" if tail(gained) < 0.05 else f"not shown worse (p {tail(lost):.2f})"


def flips(r: dict) -> str:
    """' (-7 +1)': the held-out answers that lost their fact by the end and those that gained it, against step 0's
    answers to the same prompts ('' for a run recorded without them)."""
    per = r.get("facts_per_sample")
    if not per:
        return ""
    first, last = per[min(per, key=int)], per[max(per, key=int)]
    lost, gained = sum(a and not b for a, b in zip(first, last)), sum(b and not a for a, b in zip(first, last))
    return f" (-{lost} +{gained})"


def sign_values(r: dict, beta: float = 0.1) -> dict[str, float]:
    """A run's worst value of each sign over its logged lines after step 0 (guards' names and limits). The per-token
    log-ratios divide by the data's mean tokens per completion (train divides each window's by its own: within a few
    percent of these)."""
    from lowmem_dpo.training import answers as A
    from lowmem_dpo.training import guards as G

    evals = [e for e in r["evals"] if e.get(A.GEN_ROUGE_L) is not None]
    later = [e for e in evals if e["step"] > 0] or evals
    scored = [e for e in r["evals"] if "eval_rewards/chosen" in e and e["step"] > 0]
    train = r.get("train") or [r["last_train"]]
    learned = [x for x in train if x.get("rewards/accuracies", 0) >= G.Thresholds().saturated]
    scored_content = [with_content(r, e) for e in evals]
    scored_content = [e for e in scored_content if e.get(A.GEN_CONTENT) is not None]
    low = min((e for e in scored_content if e["step"] > 0), default=None,
              key=lambda e: (e[A.GEN_CONTENT], -(e.get(A.GEN_CONTENT_SE) or 0.0)))
    content = {"content0": scored_content[0][A.GEN_CONTENT] if scored_content else None,
               "content_low": None if low is None else low[A.GEN_CONTENT],
               "content_low_se": None if low is None else low.get(A.GEN_CONTENT_SE)}
    return {**content, "rouge0": evals[0][A.GEN_ROUGE_L], "rouge_end": evals[-1][A.GEN_ROUGE_L],
            "rouge_low": min(e[A.GEN_ROUGE_L] for e in later),
            "repetition": max(e.get(A.GEN_REPETITION, 0.0) for e in later),
            "length": min(e[A.GEN_LENGTH] for e in later), "length_end": evals[-1][A.GEN_LENGTH],
            "chosen_length": evals[-1][A.GEN_CHOSEN_LENGTH],
            "chosen_train": min(x["rewards/chosen"] for x in train) / beta / r.get("chosen_tokens", 1.0),
            "chosen_eval": min((e["eval_rewards/chosen"] for e in scored), default=0.0) / beta
            / r.get("chosen_tokens", 1.0),
            "kl": max(e.get(A.GEN_KL) or 0.0 for e in later),
            "margin": max(x["rewards/margins"] for x in train),
            "rejected": min((x["rewards/rejected"] for x in learned), default=0.0) / beta / r["rejected_tokens"]}


def noise(results: list[dict], sizes=(8, 16, 32)) -> str:
    """ROUGE-L's noise when an eval judges n held-out answers: the standard error of the mean change from step 0
    (the same prompts at both), sd / sqrt(n), over each run's evals; median and largest."""
    import statistics

    per_n = {n: [] for n in sizes}
    for r in results:
        steps = r.get("rouge_per_sample") or {}
        base = steps.get("0")
        for step, scores in steps.items():
            if step == "0" or not base or len(scores) != len(base) or len(scores) < 2:
                continue
            sd = statistics.stdev([a - b for a, b in zip(scores, base)])
            for n in sizes:
                per_n[n].append(sd / n ** 0.5)
    return "; ".join(f"{n} answers: median {statistics.median(v):.3f}, largest {max(v):.3f}"
                     for n, v in per_n.items() if v)


def tokenizer(model: str):
    from lowmem_dpo.model.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))


def mean_tokens(model: str, data: list[dict], side: str) -> float:
    """The `side` completions' mean token count, as the model's tokenizer counts the answer (+1: its end)."""
    tok = tokenizer(model)
    return sum(len(tok(r[side][0]["content"])["input_ids"]) + 1 for r in data) / len(data)


def content_per_sample(model: str, samples: list[dict]) -> dict[str, list[float]]:
    """Each eval's per-sample content score (content.content_scores: the share of what the chosen answer adds to its
    question that the answer holds, each token weighted by its rarity among the chosen answers), by step, the text
    re-tokenized as in rouge_per_sample (the prompt in the chat template): what eval_gen/content averages, for runs
    recorded before train logged it."""
    from lowmem_dpo.training.content import content_scores

    tok, by_step = tokenizer(model), {}
    for s in samples:
        ids = [tok(t.rstrip("\n"), add_special_tokens=False)["input_ids"] for t in (s["completion"], s["chosen"])]
        prompt = tok.apply_chat_template([{"role": "user", "content": s["prompt"]}], add_generation_prompt=True)
        by_step.setdefault(str(s["step"]), []).append((*ids, list(getattr(prompt, "input_ids", prompt))))
    return {k: [round(x, 4) for x in content_scores(*map(list, zip(*v)))] for k, v in by_step.items()}


def with_content(r: dict, e: dict) -> dict:
    """An eval line with eval_gen/content and its change's standard error from the run's per-sample content
    scores, the shipped measure on the recorded answers (in place of what train logged, where it logged them)."""
    from lowmem_dpo.training import answers as A

    per = r.get("content_per_sample") or {}
    scores, base = per.get(str(e["step"])), per.get("0")
    if not scores:
        return e
    se = A.change_se(list(zip(scores, base))) if base and e["step"] > 0 else None
    e = {k: v for k, v in e.items() if k not in (A.GEN_CONTENT, A.GEN_CONTENT_SE)}
    return {**e, A.GEN_CONTENT: sum(scores) / len(scores), **({} if se is None else {A.GEN_CONTENT_SE: se})}


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
    ap.add_argument("--samples", type=int, default=32,
                    help="eval_generations: held-out answers judged per eval (the eval set holds 32 prompts)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--collect", action="store_true",
                    help="record the runs already finished in --work (--kinds x --runs); run nothing")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these results; run nothing")
    args = ap.parse_args(argv)
    if args.table:
        results = [r for f in args.table for r in json.loads(Path(f).read_text())["results"]]
        print(table(results))
        print(f"\nROUGE-L's noise (the change from step 0): {noise(results)}")
        return 0
    if args.smoke:
        model, args.kinds, args.runs, args.steps, args.eval_steps = "lowmem_dpo:tiny-llama", "style", "damaged", 2, 1
    else:
        from readme_recipe import ensure_model

        model = str(ensure_model(args.model))
    if args.collect:
        results = [{**collect(kind, name, model, Path(args.work) / f"{kind}-{name}", args.rows),
                    "steps": args.steps * RUNS[name][1], "samples": args.samples}
                   for kind in args.kinds.split(",") for name in args.runs.split(",")]
    else:
        results = [run(kind, name, model, args) for kind in args.kinds.split(",") for name in args.runs.split(",")]
    print(table(results))
    print(f"\nROUGE-L's noise (the change from step 0): {noise(results)}")
    if args.json:
        from machine import command_line, machine_info

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "command": command_line("signs.py", argv),
                                               "results": results}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
