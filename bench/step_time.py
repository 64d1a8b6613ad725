"""Step-time benchmark: lowmem_dpo's cached-reference DPO+LoRA step, optionally against TRL's DPOTrainer.

    python bench/step_time.py RECIPE.yaml [key=value ...] --devices cpu,cuda --steps N --json OUT \
        [--warmup W] [--vs-trl] [--trl-set KEY=VALUE ...] [--trl-best-set KEY=VALUE ...] [--trl-runs default,best] \
        [--target-vs-best X] [--limit-repeats R] [--flop-steps K] [--threads T] [--reuse-cache]

Run from the repository root (recipe paths are relative to it). Per device in --devices:
  1. precompute: `lowmem_dpo.precompute.run(cfg)` builds the reference cache (sequences/s; an existing cache for the
     device is removed first unless --reuse-cache);
  2. ours: W warm-up + N timed optimizer steps of lowmem_dpo.train's step (step.optimizer_step: forward and backward, clip_grad_norm_, AdamW
     step, scheduler step, zero_grad), each timed with perf_counter (torch.cuda.synchronize on CUDA);
  3. with --vs-trl: TRL's DPOTrainer on the same model folder, rows, batch size, max_length and LoRA settings,
     W + N steps, each timed by a TrainerCallback (on_step_begin..on_step_end), twice: with its DPOConfig
     defaults (--trl-set changes them) and at its best (trl_step.best_settings: precomputed reference, no
     checkpointing, bf16 where native; --trl-best-set changes them); ours / each is a ratio in the report;
  4. against the machine (bench/limits.py): precompute's sequences/s against a bare forward over the same sequences
     (R repeats), K train steps' FLOPs counted and set against the measured bf16/fp32 matmul FLOP/s.
Devices that are not present are reported as {"available": false, "reason": ...}.

Writes OUT (JSON), OUT with .md (a Markdown table) and OUT with .png (bar plot; needs matplotlib).

The parts: ours.py (precompute, our train step), trl_step.py (TRL's), limits.py (against the machine), timing.py
(how a phase is timed and its peak memory taken), machine.py, report.py (Markdown and plot); this file runs them
per device and writes the report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import limits  # noqa: E402
import torch  # noqa: E402
from machine import command_line, device_name, loadavg, machine_info, unavailable_reason  # noqa: E402
from ours import bench_ours, bench_precompute  # noqa: E402
from report import markdown, plot  # noqa: E402
from timing import guarded, log, release_freed_memory  # noqa: E402
from trl_step import bench_trl  # noqa: E402

TARGET_RATIO = 0.7  # the requirement: ours median step <= 0.7 x TRL's median step (TRL's defaults)
# issue 13: ours <= 0.75 x TRL at its best on llama-25m-cpu.yaml (0.6 on the long-prompt recipe: --target-vs-best)
TARGET_RATIO_VS_BEST = 0.75
TRL_RUNS = ("default", "best")
KNOWN_DEVICES = ("cpu", "cuda")


def ensure_dataset(cfg) -> None:
    """Write the benchmark rows if the recipe points at bench/make_data.py's default files and they are missing."""
    import make_data

    for source in cfg.dataset:
        path = Path(source.path).resolve()
        for kind, default in make_data.DEFAULT_PATHS.items():
            if path in ((ROOT / default).resolve(), default.resolve()):
                make_data.ensure(path, kind=kind)


# (JSON key of the TRL run, of ours / it, of the target and of the verdict) per TRL setup
TRL_KEYS = {"default": ("trl", "ratio_median_step", "target_ratio", "meets_target"),
            "best": ("trl_best", "ratio_median_step_vs_trl_best", "target_ratio_vs_trl_best",
                     "meets_target_vs_trl_best")}


def compare_with_trl(out: dict, cfg, device: str, args) -> None:
    """Per TRL setup in --trl-runs: out[run key], and the ratio of our median step to TRL's against its target.
    Both setups run the same W warm-up + N timed steps over the same rows, timed the same way."""
    for setup in args.trl_runs:
        key, ratio_key, target_key, verdict_key = TRL_KEYS[setup]
        sets = args.trl_sets if setup == "default" else args.trl_best_sets
        log(f"[{device}] TRL DPOTrainer ({setup}): {args.warmup} warm-up + {args.steps} timed steps")
        out[key], ok = guarded(f"TRL ({setup})", device,
                               lambda: bench_trl(cfg, device, args.steps, args.warmup, sets, setup))
        if ok:
            log(f"[{device}] TRL ({setup}): median step {out[key]['median_step_s']} s, "
                f"{out[key]['tokens_per_s']} tokens/s")
            target = TARGET_RATIO if setup == "default" else args.target_vs_best
            ratio = out["ours"]["median_step_s"] / out[key]["median_step_s"]
            out[ratio_key] = round(ratio, 4)
            out[target_key] = target
            out[verdict_key] = ratio <= target
        release_freed_memory()


def precompute_limit(out: dict, cfg, device: str, repeats: int, goal: float = 0.9) -> None:
    log(f"[{device}] precompute against a bare forward: {repeats} repeats")
    vs, ok = guarded("precompute against a bare forward", device,
                     lambda: limits.precompute_vs_bare_forward(cfg, repeats, goal))
    out["precompute_vs_bare_forward"] = vs
    if ok:
        log(f"[{device}] precompute {vs['ours_sequences_per_s']} sequences/s, bare forward "
            f"{vs['bare_sequences_per_s']} sequences/s: ratio {vs['ratio']}")
    release_freed_memory()


def matmul_limit(out: dict, cfg, device: str) -> None:
    log(f"[{device}] matmul FLOP/s (bfloat16, float32)")
    out["matmul_peak"], ok = guarded("matmul FLOP/s", device,
                                     lambda: limits.matmul_peak(torch.device(device), model_matmul_shape(cfg)))
    if ok and "error" not in out["ours"]["flops"]:
        out["train_step_vs_matmul_peak"] = step_vs_peak(out["ours"], out["matmul_peak"])
        log(f"[{device}] train step: {out['train_step_vs_matmul_peak']}")


# -- one device --------------------------------------------------------------------------------------------------
def bench_device(device: str, args) -> dict:
    from lowmem_dpo.config.recipe import load_config

    reason = unavailable_reason(device)
    if reason:
        return {"available": False, "reason": reason}
    base = load_config(args.recipe, args.overrides)
    overrides = list(args.overrides) + [f"device={device}", f"ref_cache_dir={Path(base.ref_cache_dir) / device}",
                                        f"output_dir={Path(base.output_dir) / device}"]
    cfg = load_config(args.recipe, overrides)
    ensure_dataset(cfg)
    out: dict = {"available": True, "device_name": device_name(device), "warmup_steps": args.warmup,
                 "timed_steps": args.steps, "batch_pairs": cfg.per_device_train_batch_size,
                 "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "max_length": cfg.max_length,
                 "torch_threads": torch.get_num_threads()}
    log(f"[{device}] precompute ({'reuse' if args.reuse_cache else 'fresh'} cache in {cfg.ref_cache_dir})")
    out["precompute"] = bench_precompute(cfg, device, args.reuse_cache)
    log(f"[{device}] precompute: {out['precompute']['sequences']} sequences, "
        f"{out['precompute']['sequences_per_s']} sequences/s")
    if args.limit_repeats:
        precompute_limit(out, cfg, device, args.limit_repeats, args.precompute_goal)
    log(f"[{device}] ours: {args.warmup} warm-up + {args.steps} timed steps")
    out["ours"] = bench_ours(cfg, device, args.steps, args.warmup, args.recipe, args.flop_steps)
    log(f"[{device}] ours: median step {out['ours']['median_step_s']} s, {out['ours']['tokens_per_s']} tokens/s")
    release_freed_memory()
    if args.vs_trl:
        compare_with_trl(out, cfg, device, args)
    if args.flop_steps:
        matmul_limit(out, cfg, device)
    out["torch_threads_after"] = torch.get_num_threads()
    return out


def model_matmul_shape(cfg) -> tuple[int, int, int] | None:
    """(tokens of a full batch, hidden, intermediate): the shape of the model's MLP up-projection in a step."""
    from lowmem_dpo.model import models

    try:
        conf = json.loads((models.resolve_model_path(cfg.model_name_or_path) / "config.json").read_text())
        return (2 * cfg.per_device_train_batch_size * cfg.max_length, conf["hidden_size"], conf["intermediate_size"])
    except (OSError, KeyError, ValueError):
        return None


def step_vs_peak(ours: dict, peak: dict) -> dict:
    """Achieved FLOP/s of the median train step against the measured matmul FLOP/s in the step's dtype."""
    dtype = ours["settings"]["dtype"]
    achieved = ours["flops"]["achieved_flop_per_s"]
    ref = peak.get(dtype)
    return {
        "dtype": dtype,
        "achieved_flop_per_s": achieved,
        "matmul_peak_flop_per_s": ref["peak_flop_per_s"] if ref else None,
        "ratio": round(achieved / ref["peak_flop_per_s"], 4) if ref else None,
        "ratio_to_best": round(achieved / ref["best_flop_per_s"], 4) if ref else None,
        # each counted batch's step timed again, right before one timing of a square matmul: see limits.py
        "ratio_back_to_back": (ours["flops"]["back_to_back"] or {}).get("ratio_median"),
    }


# -- main --------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="YAML recipe (lowmem_dpo config)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides, as for python -m lowmem_dpo.train")
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated: cpu, cuda (absent ones are reported "
                    "as unavailable)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per implementation")
    ap.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps before the timed ones")
    ap.add_argument("--json", required=True, help="output JSON path; .md and .png are written next to it")
    ap.add_argument("--vs-trl", action="store_true", help="also time TRL's DPOTrainer, with its defaults and at "
                    "its best (--trl-runs)")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a DPOConfig default for TRL's default run (recorded in the JSON); repeatable")
    ap.add_argument("--trl-best-set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a DPOConfig setting of TRL's best run, over trl_step.best_settings; repeatable")
    ap.add_argument("--trl-runs", default=",".join(TRL_RUNS),
                    help="comma-separated TRL setups that --vs-trl times: default, best (default: both)")
    ap.add_argument("--target-vs-best", type=float, default=TARGET_RATIO_VS_BEST, metavar="X",
                    help=f"goal for ours / TRL at its best (default {TARGET_RATIO_VS_BEST}; the issue's goal for "
                    "the long-prompt recipe is 0.6)")
    ap.add_argument("--precompute-goal", type=float, default=0.9, metavar="X",
                    help="goal for precompute sequences/s / a bare forward's (issue 13: 1.3 on the long-prompt recipe)")
    ap.add_argument("--limit-repeats", type=int, default=3, metavar="R",
                    help="repeats of precompute against a bare forward over all sequences (0: skip)")
    ap.add_argument("--flop-steps", type=int, default=3, metavar="K",
                    help="train steps whose FLOPs are counted, and the matmul peak measured (0: skip both)")
    ap.add_argument("--threads", type=int, default=0, metavar="T",
                    help="torch.set_num_threads(T) for the whole run (default: torch's default, the usable cores)")
    ap.add_argument("--reuse-cache", action="store_true", help="keep an up-to-date reference cache instead of "
                    "rebuilding it (precompute sequences/s then come from build.json of the earlier build)")
    args = ap.parse_args(argv)
    args.devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    bad = [d for d in args.devices if d not in KNOWN_DEVICES]
    if bad:
        ap.error(f"--devices: unknown {', '.join(bad)} (known: {', '.join(KNOWN_DEVICES)})")
    if args.steps < 1 or min(args.warmup, args.limit_repeats, args.flop_steps, args.threads) < 0:
        ap.error("--steps must be >= 1, and --warmup, --limit-repeats, --flop-steps and --threads >= 0")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")
    args.trl_runs = [r.strip() for r in args.trl_runs.split(",") if r.strip()]
    bad = [r for r in args.trl_runs if r not in TRL_RUNS]
    if bad or not args.trl_runs:
        ap.error(f"--trl-runs: expected one or more of {', '.join(TRL_RUNS)}, got {args.trl_runs}")
    args.trl_sets = parse_trl_sets(args.trl_set)
    args.trl_best_sets = parse_trl_sets(args.trl_best_set)
    return args


def parse_trl_sets(items: list[str]) -> dict:
    """--trl-set KEY=VALUE: VALUE parsed as JSON when it parses (true, 1e-6, "x"), else kept as a string."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--trl-set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lowmem_dpo.runtime.errors import UserError

    report = {"devices": {}, "machine": machine_info(),
              "command": command_line("step_time.py", argv)}
    t0 = time.perf_counter()
    failed = False
    for device in args.devices:
        try:
            report["devices"][device] = bench_device(device, args)
        except UserError as e:
            report["devices"][device] = {"available": True, "error": str(e)}
            log(f"[{device}] error: {e}")
            failed = True
        r = report["devices"][device]
        parts = [r.get(k, {}) for k in ("trl", "trl_best", "precompute_vs_bare_forward", "matmul_peak")]
        failed |= any("error" in part for part in parts + [r.get("ours", {}).get("flops", {})])
    report["total_wall_s"] = round(time.perf_counter() - t0, 1)
    report["machine"]["loadavg_at_end"] = loadavg()

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(report))
    problem = plot(report, out.with_suffix(".png"))
    log(f"wrote {out}, {md}" + (f" and {out.with_suffix('.png')}" if problem is None else f" ({problem})"))
    print(md.read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
