"""A user's own columns on a chat model: a question/good/bad CSV of plain text, trained on SmolLM2-135M-Instruct with
the README's recipe, with and without apply_chat_template; and the small max_length trap, refused with the
max_length that keeps 95% of the rows whole.

    python bench/own_columns.py --json bench/results/own_columns.json   # SmolLM2, 120 rows, 6 steps of 2 pairs
    python bench/own_columns.py --model PATH ...   # a SmolLM2-135M-Instruct folder built before
    python bench/own_columns.py --smoke            # the flow on tiny-llama, its stages in this process: seconds

1. The model: SmolLM2-135M-Instruct, built once by ../shared/tools/make_smollm2.py (bench/readme_recipe.py's
   ensure_model), or --model PATH. Its chat template puts a ~20-token system line before every prompt.
2. The data: bench/chat_prefs.py's rows flattened to what a user exports from a spreadsheet: a CSV with the
   columns question, good and bad, plain text (the user turn's text, and each assistant answer's).
3. The runs, each as a user runs it (`lowmem-dpo precompute` then `lowmem-dpo train`, processes of their own;
   --smoke: in this one), on the README's recipe read from README.md, with prompt_column=question,
   chosen_column=good, rejected_column=bad and a few steps (STEPS):
   - "template": apply_chat_template=true, so each question is a user turn and each answer an assistant turn;
   - "as written": apply_chat_template=false, the plain text tokenized as written (TRL's way).
   Then "the trap": precompute at max_length=TRAP (38 on SmolLM2, as the issue's user set it), which must exit 2
   naming the max_length that keeps 95% of the rows whole, and precompute at that max_length, which keeps them.
4. The numbers: each run's step-0 and last eval_loss, and how many of its last greedy samples (answers to the
   held-out questions) are empty; the trap's exit code and message, and the rows the advised max_length keeps
   whole.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import re
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from readme_recipe import ensure_model, readme_recipe, results, run_stage  # noqa: E402

COLUMNS = ["prompt_column=question", "chosen_column=good", "rejected_column=bad"]
# A few short steps: enough to show what the template changes in the answers, on a 2-core CPU
STEPS = ["max_steps=6", "eval_steps=3", "save_steps=3", "eval_generations=8", "max_new_tokens=24",
         "gradient_accumulation_steps=1", "max_length=256", "max_prompt_length=128"]
SMOKE_STEPS = ["max_steps=4", "eval_steps=2", "save_steps=2", "eval_generations=2", "max_new_tokens=8"]
TRAP, SMOKE_TRAP = 38, 12  # SmolLM2's system line alone is ~20 tokens; the tiny rows are ~10-20 tokens


def csv_rows(rows: list[dict]) -> list[dict]:
    """Rows {prompt, chosen, rejected} (text, or one-turn conversations) as a spreadsheet's {question, good, bad}."""
    def text(value):
        return value[-1]["content"] if isinstance(value, list) else value.strip()

    return [{"question": text(r["prompt"]), "good": text(r["chosen"]), "bad": text(r["rejected"])} for r in rows]


def write_csv(rows: list[dict], path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "good", "bad"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def stage_in_process(argv: list[str]) -> tuple[int, str]:
    """lowmem-dpo ARGV in this process: its exit code and what it printed (the trap loads no model)."""
    from lowmem_dpo import __main__ as one

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = one.main(argv)
    return code, out.getvalue().replace("\r", "\n")


def trap(recipe: Path, paths: list[str], work: Path, max_length: int) -> dict:
    """precompute at `max_length`: its exit code and last line; then at the max_length it advises (if any): the
    rows kept and the completions cut there."""
    cache = f"ref_cache_dir={work / 'trap-cache'}"
    code, out = stage_in_process(["precompute", str(recipe), *paths, *COLUMNS, "apply_chat_template=true",
                                  f"max_length={max_length}", "max_prompt_length=null", cache])
    message = out.strip().splitlines()[-1] if out.strip() else ""
    advised = re.search(r"max_length=(\d+) keeps 95%", message)
    got = {"max_length": max_length, "exit_code": code, "message": message, "advised": None}
    if advised:
        code2, out2 = stage_in_process(["precompute", str(recipe), *paths, *COLUMNS, "apply_chat_template=true",
                                        f"max_length={advised[1]}", "max_prompt_length=null", cache])
        kept = re.search(r"kept (\d+) of (\d+) rows.*?; (?:(\d+) of (\d+) completions|no completion)", out2)
        got["advised"] = {"max_length": int(advised[1]), "exit_code": code2, "kept_line": kept[0] if kept else None}
    return got


def empty_samples(out: Path) -> dict:
    """The last eval's greedy samples: how many, and how many are empty."""
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    last = [s for s in samples if s["step"] == max(s["step"] for s in samples)]
    return {"step": last[0]["step"], "of": len(last), "empty": sum(not s["completion"].strip() for s in last),
            "first": last[0]["completion"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a SmolLM2-135M-Instruct folder (default: built into bench/out/smollm2)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the CSV (default 120; --smoke 48)")
    ap.add_argument("--work", help="where the data, caches and runs go (default bench/out/own_columns; --smoke: a "
                    "temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="the flow on lowmem_dpo:tiny-llama, in seconds")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from chat_prefs import chat_rows

    with tempfile.TemporaryDirectory(prefix="own-columns-") as tmp:
        work = Path(args.work or (tmp if args.smoke else BENCH / "out" / "own_columns")).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if args.smoke:
            from lowmem_dpo.model.tiny import preference_rows

            model, rows = "lowmem_dpo:tiny-llama", csv_rows(preference_rows(args.rows or 48, seed=0))
        else:
            model, rows = str(ensure_model(args.model).resolve()), csv_rows(chat_rows(args.rows or 120, seed=0))
        data = write_csv(rows, work / "prefs.csv")
        recipe = work / "readme.yaml"
        recipe.write_text(readme_recipe(), encoding="utf-8")
        paths = [f"model_name_or_path={model}", f"dataset={data}"]
        steps = SMOKE_STEPS if args.smoke else STEPS
        runs = {}
        for name, template in (("template", "true"), ("as written", "false")):
            out = work / name.replace(" ", "-")
            overrides = [*paths, *COLUMNS, f"apply_chat_template={template}", *steps, f"output_dir={out}",
                         f"ref_cache_dir={work / 'cache'}"]
            for stage in ("precompute", "train"):
                run_stage(stage, recipe, overrides, work / f"{out.name}-{stage}.log", None, args.smoke)
            got = results(out)
            runs[name] = {"apply_chat_template": template == "true", "overrides": overrides,
                          "eval_loss_first": got["evals"][0]["eval_loss"], "eval_loss_last": got["evals"][-1]["eval_loss"],
                          # the recipe's sft term (loss_type [sigmoid, sft]): step 0 is ln 2 plus this
                          "eval_nll_loss_first": got["evals"][0].get("eval_nll_loss", 0.0),
                          "samples": empty_samples(out)}
        trapped = trap(recipe, paths, work, SMOKE_TRAP if args.smoke else TRAP)
    from machine import command_line, machine_info

    report = {"command": command_line("own_columns.py", argv), "model": model, "rows": len(rows), "ln2": math.log(2),
              "machine": machine_info(), "runs": runs, "trap": trapped}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print("| run | apply_chat_template | eval_loss step 0 | eval_loss last | empty samples (last eval) |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        s = r["samples"]
        print(f"| {name} | {str(r['apply_chat_template']).lower()} | {r['eval_loss_first']:.4f} | "
              f"{r['eval_loss_last']:.4f} | {s['empty']} of {s['of']} |")
    print()
    print(f"max_length={trapped['max_length']}: exit {trapped['exit_code']}: {trapped['message']}")
    if trapped["advised"]:
        a = trapped["advised"]
        print(f"max_length={a['max_length']}: exit {a['exit_code']}: {a['kept_line']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
