"""One GPU loan's script: what the 12 GB recipes must show on a card, in at most 8 minutes of a 15-minute loan.

    python bench/loan.py --json $OUT/loan.json [--budget-s 480]      # on the lent machine (../shared/GPU.md)
    python bench/loan.py --smoke --json OUT [--recipes llama] [--lengths 2048]   # the flow on the tiny model, a CPU
    python bench/gpu_check.py --combine bench/results/gpu_check.json $OUT/loan.json --loan N \
        --json bench/results/gpu_check.json                          # folded into the loans' record after

What it runs, in this order, each run a process of its own under the 12 GB cap (bench/gpu_check.py's children:
ours as `python -m lowmem_dpo.train` runs it, TRL 1.16 at its best for the same work):
  1. both random-weight models built at once (bench/random_weights.py), while the first runs need only Llama's;
  2. like for like, ours against TRL at 2048 and 4096 tokens on each recipe (Llama first): the same rows, no prompt
     cut by either tool (max_prompt_length null: TRL cuts none), each prompt twice (share_prompt false), the same
     pairs per micro-batch: the recipe's 2 at 2048, 1 at 4096 (where TRL at 2 ran out of memory on the last
     loan), STEPS steps;
  3. step 1 against ln 2 at each recipe's longest max_length (the planner's, at the cap), sequences truly of that
     length (rows of about max_length tokens, no prompt cut: each run reports tokens_per_sequence, read from its
     steps), one step each, the two recipes' runs side by side on the card (each under its own cap: memory and
     step 1 are what they show, not time);
  4. bench/real_lengths.py's rows (Llama 2 Table 6's means) at 2048 on Llama, one epoch of REAL_PAIRS pairs, ours
     (as a user's run: share_prompt as the card's rule says, padding_free) and TRL: time and tokens computed per
     pair.
Each run reads what it ran from itself (tokens per sequence after any cut, pairs per micro-batch, shared or not,
packed or not). A run starts only while the time left covers its estimate (ESTIMATE_S, from the last loan's
runs: ../shared/GPU.md), and is killed at the budget's end: what did not fit is in the JSON as skipped, and the
JSON is rewritten after every run, so a cut-off loan still brings back what it measured. By those estimates the
whole list is ~9.5 minutes of work: the budget cuts Mistral's comparisons, which come last and which a second
call picks up (`--recipes mistral --parts compare`). --smoke: the tiny built-in
model on this CPU, the lengths scaled down (gpu_check.SMOKE_LENGTHS), no budget.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import gpu_check  # noqa: E402

STEPS = 4  # per comparison run: step 1 (its drift line) and 3 timed
PARTS = ("compare", "longest", "real")
PAIRS = {2048: 2, 4096: 1}  # pairs per micro-batch of the comparisons, both tools: at 4096 TRL's 2 ran out of memory
REAL_PAIRS = 24  # the real-lengths epoch at 2048: 12 steps of 2 pairs
REAL_ROWS = 40  # drawn, of which those kept at max_length, in whole steps, up to REAL_PAIRS
# Seconds a run takes on an H200, from the loans so far (../shared/GPU.md): a load, precompute and 6 steps at 2048
# 45-60 s (4 steps here); Llama's 32,256 tokens, 3 steps of 21 s, 130 s (1 step here, the two recipes at once); a
# random-weight 8B built in 66 s. All of it comes to ~9.5 minutes: the budget cuts Mistral's comparisons, last,
# which a second call picks up (--recipes mistral --parts compare).
ESTIMATE_S = {"build": 90, "compare": 40, "longest": 80, "real": 45}
# The comparisons and the longest runs: each prompt twice, as TRL runs it, so that both tools' sequences are the
# data's and tokens_per_sequence is theirs (a shared row holds two completions); the real-lengths epoch runs as
# a user's would (share_prompt auto)
LIKE_TRL = ("share_prompt=false",)


def log(msg: str) -> None:
    print(f"loan: {msg}", file=sys.stderr, flush=True)


class Clock:
    """The loan's budget: a run starts only while its estimate fits what is left; a child gets the rest."""

    def __init__(self, budget_s: float | None):
        self.t0, self.budget = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float | None:
        return None if self.budget is None else self.budget - self.elapsed()

    def allows(self, kind: str) -> bool:
        return self.budget is None or self.left() >= ESTIMATE_S[kind]


def build_models(names: list[str]) -> dict:
    """{recipe name: a future of its random-weight model's folder}, built in processes of their own at once."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(names))

    def build(name: str) -> str:
        arch = gpu_check.RECIPES[name][1]
        code = f"import random_weights; print(random_weights.ensure_model({arch!r}, log=lambda m: None))"
        done = subprocess.run([sys.executable, "-c", code], cwd=BENCH, capture_output=True, text=True, check=True)
        return done.stdout.strip().splitlines()[-1]

    return {name: pool.submit(build, name) for name in names}


def real_rows_file(model: str, max_length: int, pairs_per_step: int) -> tuple[str, dict, int]:
    """bench/real_lengths.py's rows for `model`'s tokenizer, kept at max_length, at most REAL_PAIRS in whole steps:
    the file, their lengths, and the epoch's steps."""
    import real_lengths

    from lowmem_dpo.model import models
    from lowmem_dpo.model.tiny import write_jsonl

    tokenizer = models.load_tokenizer(models.resolve_model_path(model))
    rows, lengths = real_lengths.kept_rows(real_lengths.real_rows(REAL_ROWS, tokenizer), tokenizer, max_length,
                                           pairs_per_step)
    rows = rows[:REAL_PAIRS // pairs_per_step * pairs_per_step]
    path = gpu_check.WORK / "data" / f"real-{Path(model).name.replace(':', '-')}-{max_length}.jsonl"
    write_jsonl(rows, path)
    return str(path), lengths, len(rows) // pairs_per_step


def run(args) -> dict:
    import torch
    from machine import machine_info

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    clock = Clock(None if args.smoke else args.budget_s)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (--smoke)", "machine": machine_info(),
              "cap_gib": args.cap_gib, "smoke": args.smoke, "budget_s": clock.budget,
              "command": shlex.join(["python", *sys.argv]), "runs": [], "skipped": []}
    out = Path(args.json)
    names = args.recipes.split(",")
    models = {n: gpu_check.SMOKE_MODEL for n in names} if args.smoke else build_models(names)

    def model_of(name: str) -> str:
        got = models[name]
        return got if isinstance(got, str) else got.result()

    def length(n: int) -> int:
        return gpu_check.SMOKE_LENGTHS.get(str(n), n) if args.smoke else n

    def add(entry: dict) -> None:
        report["runs"].append(entry)
        report["wall_s"] = round(clock.elapsed(), 1)
        gpu_check.write(report, out)

    def skip(what: str, kind: str) -> bool:
        if clock.allows(kind):
            return False
        report["skipped"].append({"run": what, "left_s": round(clock.left(), 1), "estimate_s": ESTIMATE_S[kind]})
        gpu_check.write(report, out)
        log(f"skipped {what}: {clock.left():.0f} s left, about {ESTIMATE_S[kind]} s needed")
        return True

    # 2. like for like at 2048 and 4096, Llama first
    for name in sorted(names, key=lambda n: n != "llama"):
        recipe = gpu_check.RECIPES[name][0]
        for n, pairs in ((n, PAIRS[n]) for n in args.lengths if "compare" in args.parts):
            for tool in ("ours", "trl"):
                if not skip(f"{tool} {name} {n}", "compare"):
                    add(gpu_check.spawn(tool, name, recipe, model_of(name), length(n), args, device,
                                        f"max_length={n} pairs={pairs}", steps=STEPS,
                                        sets=(f"per_device_train_batch_size={pairs}", *LIKE_TRL), timeout=clock.left()))
        if name == "llama" and "longest" in args.parts:  # 3. the longest runs, both recipes side by side
            longest(names, model_of, args, device, clock, add, skip)
        if name == "llama" and "real" in args.parts:  # 4. real lengths, after Llama's other runs
            real(model_of("llama"), length(2048), args, device, clock, add, skip, report)
    log(f"wrote {out} in {clock.elapsed():.0f} s")
    return report


def longest(names, model_of, args, device, clock, add, skip) -> None:
    """Each recipe's longest max_length at the cap, one step of ours, the runs side by side."""
    limit = 512 if args.smoke else args.longest_limit
    todo = [(n, gpu_check.RECIPES[n][0]) for n in names if not skip(f"ours {n} longest", "longest")]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
        jobs = [pool.submit(gpu_check.spawn, "ours", name, recipe, model_of(name),
                            gpu_check.longest_length(recipe, model_of(name), args.cap_gib, device, limit), args,
                            device, "longest", steps=1, sets=LIKE_TRL, timeout=clock.left()) for name, recipe in todo]
        for job in jobs:
            add(job.result())


def real(model: str, max_length: int, args, device, clock, add, skip, report) -> None:
    """One epoch of real-length rows on Llama at 2048, ours and TRL, 2 pairs per micro-batch."""
    rows, lengths, steps = real_rows_file(model, max_length, 2)
    report["real_lengths_rows"] = lengths
    recipe = gpu_check.RECIPES["llama"][0]
    for tool in ("ours", "trl"):
        if not skip(f"{tool} llama real lengths", "real"):
            add(gpu_check.spawn(tool, "llama", recipe, model, max_length, args, device, "real lengths", steps=steps,
                                sets=("per_device_train_batch_size=2",), rows_file=rows, timeout=clock.left()))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds the script may take (default 8 minutes)")
    ap.add_argument("--cap-gib", type=float, default=11.25)
    ap.add_argument("--recipes", default="llama,mistral")
    ap.add_argument("--longest-limit", type=int, default=32768)
    ap.add_argument("--lengths", default="2048,4096", help="the comparisons' lengths (of 2048, 4096)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)} (a second call after a "
                    "cut-off one: the parts it skipped)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.parts = args.parts.split(",")
    if not set(args.parts) <= set(PARTS):
        ap.error(f"--parts: of {', '.join(PARTS)}")
    if not set(args.lengths) <= set(PAIRS):
        ap.error(f"--lengths: of {', '.join(map(str, PAIRS))}")
    args.set, args.profile, args.steps = [], 0, STEPS  # what gpu_check.spawn reads of a check's arguments
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        log("no CUDA GPU here: run with --smoke on a CPU, or on the lent machine")
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
