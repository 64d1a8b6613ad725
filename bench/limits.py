"""How close precompute and a train step come to what the machine can do; used by bench/step_time.py.

    python bench/step_time.py RECIPE.yaml --devices cpu --steps N --json OUT   # runs these per device

1. `precompute_vs_bare_forward`: precompute's own code path over the data's sequences (`precompute.units_logps`
   on `forward_units` sorted `longest_first`: collate, forward under the reference's autocast, completion log-probs,
   copies to the CPU) against a bare `model(input_ids, attention_mask).logits` of the same loaded model over the
   same sequences in the same batches (pre-collated one sequence per row, same inference mode and autocast).
   Sequences/s ours / sequences/s bare; the goal is >= 0.9 (>= 1.3 on prompt-heavy data, where each prompt once
   pays off: step_time.py --precompute-goal).
2. `matmul_peak`: dense `torch.mm` FLOP/s of square matrices (and one matmul of the model's own MLP shape) in
   bfloat16 and float32 on the same threads, median over repeats.
3. `train_step_flops`: the FLOPs of `step.optimizer_step` counted by `torch.utils.flop_counter.FlopCounterMode`
   (matmuls and attention, forward and backward as they run; no elementwise ops), which step_time.py turns into
   achieved FLOP/s and a ratio to the matmul peak in the step's dtype.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils import flop_counter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. precompute against a bare forward -------------------------------------------------------------------------
def precompute_vs_bare_forward(cfg, repeats: int, goal: float = 0.9) -> dict:
    """Sequences/s of `precompute.units_logps` and of a bare forward over precompute's batches (the same
    sequences), timed batch by batch back to back (the order alternates between repeats), after one untimed batch
    of each."""
    from lowmem_dpo import data, precompute
    from lowmem_dpo.model import headcheck
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training import inputs

    resolved = devices.resolve(cfg)
    prepared = inputs.prepare(cfg, resolved)
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress=False, limits=False)  # rows cut at length on purpose
    seqs = list(dataset.sequences().values())  # what precompute computes from an empty cache: each sequence once
    pairs = dataset.tok.pairs
    bs = cfg.precompute_batch_size  # in pairs
    model, _ = precompute.load_model(cfg, resolved, prepared, len(seqs))  # as precompute loads it
    pad_id = data.pad_token_id(prepared.tokenizer)
    device = resolved.device
    # As precompute decides it: each prompt once where the device rule and the model allow (share_prompt).
    layout = headcheck.bring_up(model, cfg, resolved, pad_id, pairs[:1], pairs)
    shared = layout.shared
    # precompute's batches: forward units longest first, cut into batches within each commit's units; a pair is
    # one shared unit or two unshared ones (precompute.chunk_with_backoff)
    per_batch = bs * (1 if shared else 2)
    order = precompute.longest_first(precompute.forward_units(*dataset.all_pairs(), None, shared))
    commits = [order[i:i + cfg.cache_shard_rows] for i in range(0, len(order), cfg.cache_shard_rows)]
    batches = [units[i:i + per_batch] for units in commits for i in range(0, len(units), per_batch)]
    # the bare forward: the same sequences of each batch, one per row (the prompt in every row)
    collated = [data.collate_completions([s for u in b for s in u], pad_id).to(device) for b in batches]
    reference = precompute.ReferenceForward(model, pad_id, resolved, layout)

    def ours(k: int) -> None:
        precompute.units_logps(reference, batches[k], per_batch)

    @torch.inference_mode()
    def bare(k: int) -> None:
        with devices.autocast(device, resolved.ref_dtype):
            model(input_ids=collated[k].input_ids, attention_mask=collated[k].attention_mask).logits

    def timed(fn, k: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn(k)
        _sync(device)
        return time.perf_counter() - t0

    ours(0)
    bare(0)
    sequences = sum(len(u) for b in batches for u in b)
    per_repeat = []
    for r in range(repeats):
        t_ours = t_bare = 0.0
        for k in range(len(batches)):
            if r % 2 == 0:
                t_ours += timed(ours, k)
                t_bare += timed(bare, k)
            else:
                t_bare += timed(bare, k)
                t_ours += timed(ours, k)
        per_repeat.append((sequences / t_ours, sequences / t_bare))
    ours_sps = statistics.median(o for o, _ in per_repeat)
    bare_sps = statistics.median(b for _, b in per_repeat)
    return {
        "sequences": sequences,
        "batches": len(batches),
        "batch_pairs": bs,
        "batch_units": per_batch,
        "dtype": devices.dtype_name(resolved.ref_dtype),
        "repeats": repeats,
        "ours": "precompute.units_logps per batch of forward units: collate, forward (LM head on completion "
                "positions only), log-probs, .cpu()" + ("; each prompt once (share_prompt)" if shared else ""),
        "share_prompt": shared,
        "bare": "model(input_ids, attention_mask).logits on the same sequences pre-collated one per row "
                "(full-vocabulary LM head), inference_mode + the same autocast",
        "ours_sequences_per_s": round(ours_sps, 3),
        "bare_sequences_per_s": round(bare_sps, 3),
        "per_repeat_ratio": [round(o / b, 4) for o, b in per_repeat],
        "ratio": round(ours_sps / bare_sps, 4),
        "goal": goal,
        "meets_goal": ours_sps / bare_sps >= goal,
    }


# -- 2. matmul peak -----------------------------------------------------------------------------------------------
def matmul_timer(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, target_s: float = 0.15):
    """A function returning the FLOP/s of one timing of torch.mm (m, k) @ (k, n) in a loop lasting ~target_s
    (the loop length is set from one call after a warm-up call)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)

    @torch.inference_mode()
    def loop(inner: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b, out=out)
        _sync(device)
        return time.perf_counter() - t0

    loop(1)  # warm-up (oneDNN primitive creation, CUDA context)
    inner = max(1, int(target_s / max(loop(1), 1e-6)))
    return lambda: 2 * m * k * n * inner / loop(inner)


def _mm_flop_per_s(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int,
                   target_s: float) -> tuple[float, float]:
    """(median, best) FLOP/s of torch.mm (m, k) @ (k, n) over `repeats` timings."""
    timer = matmul_timer(m, k, n, dtype, device, target_s)
    rates = [timer() for _ in range(repeats)]
    return statistics.median(rates), max(rates)


def square_sizes(device: torch.device) -> tuple[int, ...]:
    """Square matmul sizes timed on `device`, smallest to largest (the largest is usually the fastest)."""
    return (512, 1024, 2048) if device.type == "cpu" else (1024, 2048, 4096, 8192)


def matmul_peak(device: torch.device, model_shape: tuple[int, int, int] | None, repeats: int = 5,
                target_s: float = 0.15) -> dict:
    """Dense matmul FLOP/s in bfloat16 and float32: squares and the model's (tokens, hidden) @ (hidden,
    intermediate). `peak_flop_per_s` per dtype is the largest median over the shapes."""
    sizes = square_sizes(device)
    shapes = [(n, n, n) for n in sizes] + ([tuple(model_shape)] if model_shape else [])
    out: dict = {"threads": torch.get_num_threads(), "repeats": repeats,
                 "method": f"torch.mm(out=) in a loop of ~{target_s} s per timing, median of {repeats}; "
                           "FLOPs = 2*m*k*n"}
    for dtype in (torch.bfloat16, torch.float32):
        rows = []
        for m, k, n in shapes:
            med, best = _mm_flop_per_s(m, k, n, dtype, device, repeats, target_s)
            rows.append({"m": m, "k": k, "n": n, "median_flop_per_s": round(med), "best_flop_per_s": round(best)})
        out[str(dtype).removeprefix("torch.")] = {
            "shapes": rows, "peak_flop_per_s": max(r["median_flop_per_s"] for r in rows),
            "best_flop_per_s": max(r["best_flop_per_s"] for r in rows)}
    return out


# -- 3. FLOPs of a train step -------------------------------------------------------------------------------------
def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# torch's counter knows the CUDA attention kernels but not the CPU flash kernel that SDPA uses on a CPU; the same
# formulas as for the CUDA kernels (full query x key product, as torch counts every SDPA kernel)
CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


def count_flops(fn):
    """(fn's result, total FLOPs, FLOPs per aten op) with FlopCounterMode counting matmuls and attention."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as counter:
        result = fn()
    by_op = {str(op): n for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return result, counter.get_total_flops(), by_op


def _replay(session, warmup: int) -> None:
    """Rebuild the session's pair stream from the seed, as train.setup builds it, and skip the warm-up steps'
    pairs: the next steps see the batches of the first timed steps again."""
    from lowmem_dpo.training.step import next_items, pair_stream

    session.progress.stream = pair_stream(session.run.items, session.run.cfg.seed)
    next_items(session.progress.stream, warmup * session.run.items_per_step)


def train_step_flops(session, warmup: int, count: int, back_to_back: bool = True) -> dict:
    """FLOPs of `count` more `step.optimizer_step` calls on `session`, replaying the batches of the first timed
    steps. Call after the timed steps (the counted steps train the adapter further; the counter slows them down).

    With `back_to_back`: the same `count` batches are replayed once more without the counter, each step timed
    and followed by one timing of the largest square matmul of `square_sizes` in the step's dtype, so each step's FLOP/s is set against
    matmul FLOP/s measured seconds apart (`back_to_back`: robust to load that changes over the run)."""
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training.step import optimizer_step

    _replay(session, warmup)
    flops, tokens, by_op = [], [], {}
    for _ in range(count):
        step, n, ops = count_flops(lambda: optimizer_step(session))
        flops.append(n)
        tokens.append(step.stats.tokens)
        for op, v in ops.items():
            by_op[op] = by_op.get(op, 0) + v
    paired = None
    if back_to_back:
        device = session.run.resolved.device
        size = square_sizes(device)[-1]
        timer = matmul_timer(size, size, size, session.run.resolved.dtype, device)
        _replay(session, warmup)
        ratios = []
        for n in flops:
            _sync(device)
            t0 = time.perf_counter()
            optimizer_step(session)
            _sync(device)
            ratios.append(n / (time.perf_counter() - t0) / timer())
        paired = {"matmul": {"m": size, "k": size, "n": size, "dtype": devices.dtype_name(session.run.resolved.dtype)},
                        "per_step_ratio": [round(r, 4) for r in ratios],
                        "ratio_median": round(statistics.median(ratios), 4)}
    return {
        "counted_steps": count,
        "method": "torch.utils.flop_counter.FlopCounterMode around step.optimizer_step (forward, backward "
                  "including recomputation, optimizer): matmuls (mm/addmm/bmm) and attention (SDPA forward and "
                  "backward, full T x T product) only; elementwise, norms, softmax of the loss and AdamW are "
                  "not counted",
        "flops_per_step": flops,
        "tokens_per_step": tokens,
        "flops_per_token": round(sum(flops) / sum(tokens)),
        "flops_per_step_by_op": {op: v // count for op, v in sorted(by_op.items())},
        "back_to_back": paired,
    }
