"""One epoch of rows with a real preference set's lengths, ours against TRL 1.16 at its best.

    python bench/real_lengths.py --json bench/results/real_lengths_cpu.json           # CPU, max_length 512
    python bench/real_lengths.py --max-length 2048 --device cuda --json OUT            # on a card
    python bench/real_lengths.py --smoke --json OUT                                     # the flow in ~20 s
    python bench/real_lengths.py --rows-only OUT.jsonl [--max-length 512]               # the rows and their lengths

The rows. Each row's prompt, chosen and rejected lengths (in the bench model's tokens) are drawn from lognormal
distributions whose means are a real preference set's: the Llama 2 paper's Table 6, "Statistics of human preference
data for reward modeling" (Touvron et al. 2023, arXiv 2307.09288), row "Total" (2.9M comparisons over Anthropic
Helpful and Harmless, OpenAI Summarize and WebGPT, StackExchange, Stanford SHP, synthetic GPT-J and Meta's own):
108.2 tokens in the prompt and 216.9 in a response, on average (--source picks another row of that table). The
table gives means only, pooled over chosen and rejected; no public source we found gives quantiles, so the spread is
ours: a lognormal of sigma PROMPT_SIGMA for prompts and RESPONSE_SIGMA for responses (heavy right tails), chosen and
rejected drawn independently, so a pair's two completions differ in length, and some rows are longer than
max_length and cut. The text is review sentences from the built-in generator (lowmem_dpo.model.tiny), added while a
part is under its drawn length.

Both tools get the same rows: those lowmem_dpo keeps at this max_length (a row whose prompt alone reaches
max_length is dropped by both tools' rules: lowmem_dpo skips it, TRL would train on no completion), the same
truncation (prompt + completion cut at max_length, keep the start: both tools' default), the same pairs per
micro-batch and per step, one whole epoch in the order each tool's own sampler gives. TRL pads each micro-batch to its
longest sequence, its own collator; ours runs as `python -m lowmem_dpo.train` does (padding_free where the model
supports it, the heap's rule, the device's rules). Each tool runs in a process of its own (`--side`), so neither
inherits the other's allocator settings (--smoke runs both in one: the flow, not the timing). TRL at its best: bench/trl_step.py's best_settings (reference log-probs
precomputed, no checkpointing where memory allows, bf16 where native).

Reported per tool, read from the runs: the epoch's step seconds (every step, the first included: a user's epoch),
seconds per pair, real tokens and computed tokens (padding included) per pair, pairs per micro-batch and step, and
what ours ran with (packed or padded, prompts shared, the heap's line). Targets: ours <= TARGETS[device] x TRL's
epoch time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent

# Llama 2 paper, Table 6 (average tokens per comparison): (prompt, response) means by dataset
SOURCES = {"total": (108.2, 216.9), "anthropic-helpful": (17.7, 88.4), "anthropic-harmless": (15.7, 46.4),
           "openai-summarize": (336.0, 35.1), "openai-webgpt": (48.3, 188.9), "stackexchange": (200.1, 240.2),
           "stanford-shp": (199.5, 138.8), "synthetic-gptj": (13.0, 110.3), "meta": (31.4, 234.1)}
PROMPT_SIGMA, RESPONSE_SIGMA = 1.0, 0.8  # our assumption: the table gives means only
MIN_TOKENS = 4
RECIPE = "bench/recipes/llama-25m-cpu.yaml"
TARGETS = {"cpu": 0.6, "cuda": 0.75}  # issue 60: ours / TRL at its best over the epoch
WORK = ROOT / "bench" / "out" / "real_lengths"


def log(msg: str) -> None:
    print(f"real_lengths: {msg}", file=sys.stderr, flush=True)


# -- the rows ----------------------------------------------------------------------------------------------------
def lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A draw of a lognormal with this mean (mu = ln(mean) - sigma^2 / 2), at least MIN_TOKENS."""
    return max(MIN_TOKENS, round(rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma)))


def draw_lengths(n: int, source: str = "total", seed: int = 0) -> list[tuple[int, int, int]]:
    """n (prompt, chosen, rejected) token lengths: SOURCES[source]'s means, the module doc's spread."""
    prompt, response = SOURCES[source]
    rng = random.Random(seed)
    return [(lognormal(rng, prompt, PROMPT_SIGMA), lognormal(rng, response, RESPONSE_SIGMA),
             lognormal(rng, response, RESPONSE_SIGMA)) for _ in range(n)]


class _Sentences:
    """Review sentences of one polarity, in order, each with its token count (as it is appended: after a space)."""

    def __init__(self, rows: list[dict], tokens):
        self.rows, self.tokens, self.next = rows, tokens, 0
        self.counts: dict[str, int] = {}

    def fill(self, goal: int) -> str:
        """Sentences while the text is under `goal` tokens (the last may overshoot by a sentence, ~8 tokens)."""
        out, n = [], 0
        while n < goal:
            text = self.rows[self.next % len(self.rows)]["chosen"]
            self.next += 1
            if text not in self.counts:
                self.counts[text] = self.tokens(" " + text)
            out.append(text)
            n += self.counts[text]
        return " ".join(out)


def real_rows(n: int, tokenizer, source: str = "total", seed: int = 0) -> list[dict]:
    """n rows {prompt, chosen, rejected} of draw_lengths' lengths; chosen of the asked polarity, rejected the
    other. The same n, source, seed and tokenizer give the same rows."""
    from lowmem_dpo.model.tiny import preference_rows

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    pool = preference_rows(4096, seed=seed)  # alternating polarity: even rows positive, odd negative
    polar = [_Sentences(pool[0::2], tokens), _Sentences(pool[1::2], tokens)]
    rows = []
    for i, (p, c, r) in enumerate(draw_lengths(n, source, seed)):
        kind = i % 2
        ask = f"\nWrite a {'positive' if kind == 0 else 'negative'} review.\n"
        context = polar[(i // 2) % 2].fill(max(0, p - tokens(ask)))
        rows.append({"prompt": context + ask, "chosen": polar[kind].fill(c), "rejected": polar[1 - kind].fill(r)})
    return rows


def kept_rows(rows: list[dict], tokenizer, max_length: int, per_step: int) -> tuple[list[dict], dict]:
    """The rows lowmem_dpo keeps at max_length (TRL gets the same), cut to whole steps of `per_step` pairs, and
    their lengths as both tools tokenize them (lengths_of)."""
    import datasets

    from lowmem_dpo.data.encode import tokenize_rows

    tok = tokenize_rows(datasets.Dataset.from_list(rows), tokenizer, max_length, None, "real_lengths",
                        progress=False, strict=False)
    keep = [rows[p.row] for p in tok.pairs]
    keep = keep[:len(keep) // per_step * per_step]
    return keep, {"drawn": len(rows), "dropped": len(tok.dropped), **lengths_of(tok.pairs[:len(keep)], max_length)}


def lengths_of(pairs: list, max_length: int) -> dict:
    """Token lengths of tokenized pairs after the cut (prompt, chosen, rejected, longer sequence): p50, p90, max."""
    def spread(values: list[int]) -> dict:
        values = sorted(values)
        return {"p50": values[len(values) // 2], "p90": values[int(0.9 * (len(values) - 1))], "max": values[-1],
                "mean": round(statistics.fmean(values), 1)}

    parts = {"prompt": [len(p.prompt_ids) for p in pairs], "chosen": [len(p.chosen_ids) for p in pairs],
             "rejected": [len(p.rejected_ids) for p in pairs],
             "sequence": [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]}
    out = {k: spread(v) for k, v in parts.items()}
    out["rows"] = len(pairs)
    out["at_max_length"] = sum(s >= max_length for s in parts["sequence"])
    out["chosen_rejected_differ"] = sum(c != r for c, r in zip(parts["chosen"], parts["rejected"]))
    out["prompt_share"] = round(sum(2 * x for x in parts["prompt"]) / sum(
        2 * p + c + r for p, c, r in zip(parts["prompt"], parts["chosen"], parts["rejected"])), 3)
    return out


# -- one side, in its own process --------------------------------------------------------------------------------
def side_ours(cfg, recipe: str, steps: int) -> dict:
    """lowmem_dpo over one epoch: train's setup and `steps` optimizer steps, each timed; what it ran with."""
    from lowmem_dpo import precompute, train
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training.step import optimizer_step

    t0 = time.perf_counter()
    precompute.run(cfg, progress=False)
    precompute_s = time.perf_counter() - t0
    session = train.setup(cfg, recipe, progress=False)
    run = session.run
    times, tokens, computed, pairs = [], [], [], []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        result = optimizer_step(session)  # the step `python -m lowmem_dpo.train` takes, timed with the device synced
        times.append(result.seconds)
        tokens.append(result.stats.tokens)
        computed.append(result.stats.computed)
        pairs.append(result.stats.items)
    after = resource.getrusage(resource.RUSAGE_SELF)
    resolved = run.resolved
    return {"step_s": times, "tokens": tokens, "computed": computed, "pairs": pairs,
            "precompute_s": round(precompute_s, 3),
            # the steps' kernel time and page faults (the heap's cost, where it returns its blocks)
            "steps_rusage": {"system_s": round(after.ru_stime - before.ru_stime, 2),
                             "user_s": round(after.ru_utime - before.ru_utime, 2),
                             "minor_faults": after.ru_minflt - before.ru_minflt},
            "ran_with": {"padding_free": run.objective.packed, "share_prompt": run.objective.shared,
                         "micro_batch": session.progress.micro_batch, "grad_accum": session.progress.grad_accum,
                         "dtype": devices.dtype_name(resolved.dtype),
                         "gradient_checkpointing": resolved.gradient_checkpointing,
                         "heap": next((r for r in resolved.reasons if r.startswith("CPU heap:")), None)}}


def side_trl(cfg, steps: int) -> dict:
    """TRL 1.16's DPOTrainer at its best (trl_step.best_settings) over the same epoch: each step timed, each
    micro-batch's real and padded tokens counted from its collated input."""
    from trl_step import bench_trl

    out = bench_trl(cfg, cfg.device, steps, 0, {}, "best")
    return {"step_s": out["step_times_s"], "tokens": out["tokens_per_step"], "computed": out["computed_per_step"],
            "pairs": [cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps] * len(out["step_times_s"]),
            "ran_with": {"settings": out["settings"], "weights_dtype": out["weights_dtype"],
                         "reference": out["reference"]}}


def side_main(args) -> int:
    """--side ours|trl: one tool's epoch; its JSON on stdout's last line."""
    sys.path.insert(0, str(BENCH))
    if args.side == "ours":
        import lowmem_dpo  # noqa: F401  first, as `python -m lowmem_dpo.train` is: torch's allocator reads its setting
    from lowmem_dpo.config.recipe import load_config

    cfg = load_config(args.recipe, args.set)
    out = side_ours(cfg, args.recipe, args.steps) if args.side == "ours" else side_trl(cfg, args.steps)
    print(json.dumps(out))
    return 0


# -- the comparison ----------------------------------------------------------------------------------------------
def summary(side: dict) -> dict:
    """One side's epoch: seconds, per pair, tokens per pair (real, computed), the steps' spread."""
    pairs, total = sum(side["pairs"]), sum(side["step_s"])
    steps = sorted(side["step_s"])
    return {"steps": len(steps), "pairs": pairs, "epoch_s": round(total, 3), "s_per_pair": round(total / pairs, 4),
            "epoch_s_after_step_1": round(total - side["step_s"][0], 3),
            "step_s": {"min": round(steps[0], 3), "median": round(statistics.median(steps), 3),
                       "max": round(steps[-1], 3)},
            "real_tokens_per_pair": round(sum(side["tokens"]) / pairs, 1),
            "computed_tokens_per_pair": round(sum(side["computed"]) / pairs, 1)}


def spawn(side: str, recipe: str, overrides: list[str], steps: int, env: dict | None = None) -> dict:
    """One side's epoch in a process of its own, `env` added to its environment."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--recipe", recipe, "--steps", str(steps),
           *[f"--set={o}" for o in overrides]]
    log(f"{side}: {steps} steps (one epoch) in a process of its own" + (f", with {env}" if env else ""))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise SystemExit(f"real_lengths: the {side} side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def in_process(side: str, recipe: str, overrides: list[str], steps: int) -> dict:
    """--smoke: a side in this process (the flow, not the timing: the two sides share its allocator)."""
    from lowmem_dpo.config.recipe import load_config

    cfg = load_config(recipe, overrides)
    log(f"{side}: {steps} steps (one epoch) in this process (--smoke)")
    return side_ours(cfg, recipe, steps) if side == "ours" else side_trl(cfg, steps)


def run(args) -> dict:
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.model import models
    from lowmem_dpo.model.tiny import write_jsonl

    base = load_config(args.recipe, args.set)
    tokenizer = models.load_tokenizer(models.resolve_model_path(base.model_name_or_path))
    per_step = base.per_device_train_batch_size * base.gradient_accumulation_steps
    rows, lengths = kept_rows(real_rows(args.rows, tokenizer, args.source, args.seed), tokenizer, args.max_length,
                              per_step)
    name = f"{args.source}-{args.max_length}-{args.rows}-{args.device}"
    data = WORK / f"{name}.jsonl"
    write_jsonl(rows, data)
    overrides = [*args.set, f"dataset={data}", f"max_length={args.max_length}", "max_prompt_length=null",
                 f"device={args.device}", f"output_dir={WORK / name / 'out'}", f"ref_cache_dir={WORK / name / 'cache'}",
                 "eval_fraction=0", "save_steps=0", "resume=never", "overwrite_output_dir=true", "logging_steps=1",
                 "max_skipped_share=1", "max_truncated_share=1"]  # rows are cut on purpose: the report counts them
    steps = len(rows) // per_step
    ours_env = dict(item.split("=", 1) for item in args.ours_env)
    sides = {side: in_process(side, args.recipe, overrides, steps) if args.smoke else
             spawn(side, args.recipe, overrides, steps, ours_env if side == "ours" else None)
             for side in ("ours", "trl")}
    out = {"recipe": args.recipe, "overrides": overrides, "ours_env": ours_env, "device": args.device,
           "max_length": args.max_length,
           "source": {"name": args.source, "means": SOURCES[args.source], "prompt_sigma": PROMPT_SIGMA,
                      "response_sigma": RESPONSE_SIGMA, "seed": args.seed,
                      "cited": "Llama 2 (arXiv 2307.09288), Table 6"},
           "rows": lengths, "pairs_per_micro_batch": base.per_device_train_batch_size,
           "pairs_per_step": per_step, **{side: {**summary(v), "ran_with": v["ran_with"]} for side, v in sides.items()}}
    out["ours"].update(precompute_s=sides["ours"]["precompute_s"], steps_rusage=sides["ours"]["steps_rusage"])
    out["ratio_epoch"] = round(out["ours"]["epoch_s"] / out["trl"]["epoch_s"], 4)
    out["ratio_computed_tokens"] = round(out["ours"]["computed_tokens_per_pair"]
                                         / out["trl"]["computed_tokens_per_pair"], 4)
    out["target"] = TARGETS.get(args.device)
    out["meets_target"] = out["target"] is not None and out["ratio_epoch"] <= out["target"]
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=RECIPE, help=f"the run's recipe (default {RECIPE})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe key changed")
    ap.add_argument("--ours-env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable "
                    "of ours' process alone (MALLOC_MMAP_THRESHOLD_=1048576: the heap's threshold fixed, as before)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--rows", type=int, default=128, help="rows drawn (those kept, in whole steps, are the epoch)")
    ap.add_argument("--source", default="total", choices=sorted(SOURCES), help="the Table 6 row of the means")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--smoke", action="store_true", help="the tiny built-in model, 24 rows at max_length 256, both "
                    "sides in this process")
    ap.add_argument("--rows-only", metavar="OUT", help="write the kept rows to OUT and print their lengths")
    ap.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.set = ["model_name_or_path=lowmem_dpo:tiny-llama", *args.set]
        args.rows, args.max_length = min(args.rows, 24), min(args.max_length, 256)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if args.side:
        return side_main(args)
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.model import models

    if args.rows_only:
        from lowmem_dpo.model.tiny import write_jsonl

        cfg = load_config(args.recipe, args.set)
        tokenizer = models.load_tokenizer(models.resolve_model_path(cfg.model_name_or_path))
        rows, lengths = kept_rows(real_rows(args.rows, tokenizer, args.source, args.seed), tokenizer,
                                  args.max_length, 1)
        write_jsonl(rows, Path(args.rows_only))
        print(json.dumps(lengths, indent=1))
        return 0
    t0 = time.perf_counter()
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    from machine import command_line, machine_info

    report["machine"], report["command"] = machine_info(), command_line("real_lengths.py", sys.argv[1:])
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    o, t = report["ours"], report["trl"]
    print(f"{report['rows']['rows']} pairs at max_length {args.max_length}, {report['pairs_per_micro_batch']} per "
          f"micro-batch: ours {o['epoch_s']} s ({o['computed_tokens_per_pair']} tokens computed per pair), TRL at "
          f"its best {t['epoch_s']} s ({t['computed_tokens_per_pair']}): ratio {report['ratio_epoch']} (target "
          f"{report['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
