"""lowmem_dpo's side of bench/step_time.py: precompute from scratch, then the train step timed step by step."""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import limits
from timing import PeakMemory, guarded, summarize, synchronize


def clear_cache(cache_dir: Path) -> bool:
    """Remove a previous reference cache (its store and build record) so precompute is timed from scratch."""
    from lowmem_dpo import precompute
    from lowmem_dpo.data import store

    removed = False
    for path in [*cache_dir.glob(store.INDEX + "*"), cache_dir / precompute.BUILD]:
        if path.is_file():
            path.unlink()
            removed = True
    return removed


def bench_precompute(cfg, device: str, reuse: bool) -> dict:
    from lowmem_dpo import precompute

    cache_dir = Path(cfg.ref_cache_dir)
    if not reuse:
        clear_cache(cache_dir)
    build = cache_dir / precompute.BUILD
    before = json.loads(build.read_text()) if build.is_file() else None
    with PeakMemory(device) as pm:
        t0 = time.perf_counter()
        precompute.run(cfg, progress=False)
        synchronize(device)
        wall = time.perf_counter() - t0
    after = json.loads(build.read_text())
    # with --reuse-cache a cache holding every sequence is kept: precompute.run computes nothing, and the
    # sequences/s are those of the earlier build
    rebuilt = after["computed"] > 0
    sequences = after["computed"] + after["reused"]
    return {
        "cache_dir": str(cache_dir),
        "rebuilt": rebuilt,
        "sequences": sequences,
        "batch_size": cfg.precompute_batch_size,
        # sequences_per_s: the forward loop only, as precompute records it in build.json (model load, hashing and
        # tokenization excluded); a pair is two sequences. sequences_per_s_wall: the whole precompute.run call.
        "sequences_per_s": after["sequences_per_s"] if rebuilt else (before or {}).get("sequences_per_s"),
        "wall_s": round(wall, 3),
        "sequences_per_s_wall": round(after["computed"] / wall, 3) if wall > 0 and rebuilt else None,
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }


def bench_ours(cfg, device: str, steps: int, warmup: int, recipe: str, flop_steps: int) -> dict:
    from lowmem_dpo import train
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training.step import optimizer_step

    total = warmup + steps
    with PeakMemory(device) as pm:
        t_setup = time.perf_counter()
        session = train.setup(dataclasses.replace(cfg, max_steps=total), recipe, progress=False)
        resolved, params = session.run.resolved, session.trainee.params
        setup_s = time.perf_counter() - t_setup
        times, cpu_times, tokens, losses = [], [], [], []
        for _ in range(total):
            devices.synchronize(resolved.device)
            c0 = time.process_time()
            t0 = time.perf_counter()
            stats = optimizer_step(session).stats  # exactly the step `python -m lowmem_dpo.train` takes
            devices.synchronize(resolved.device)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            tokens.append(stats.tokens)
            losses.append(stats.means()["loss"])
    out = {
        "settings": {"dtype": devices.dtype_name(resolved.dtype),
                     "gradient_checkpointing": resolved.gradient_checkpointing,
                     "reference": "cached (no reference forward)", "optimizer": resolved.optimizer,
                     "lora_r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                     "lora_target_modules": cfg.lora_target_modules,
                     "trainable_params": sum(p.numel() for p in params)},
        "setup_s": round(setup_s, 3),
        "warmup_s": [round(t, 4) for t in times[:warmup]],
        **summarize(times[warmup:], tokens[warmup:], cpu_times[warmup:]),
        "loss_first_last": [round(losses[0], 6), round(losses[-1], 6)],
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }
    if flop_steps:  # after the timed steps and outside the memory phase: the counter slows steps down
        out["flops"], ok = guarded("FLOP count", device,
                                   functools.partial(limits.train_step_flops, session, warmup, flop_steps))
    if flop_steps and ok:
        # a median step: counted FLOPs per token x the timed steps' median tokens per step / median step seconds
        out["flops"]["achieved_flop_per_s"] = round(out["flops"]["flops_per_token"] * out["tokens_per_step_median"]
                                                    / out["median_step_s"])
    del session, params
    return out
