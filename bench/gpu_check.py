"""The 12 GB recipes for real: one command for a CUDA machine, against TRL at its best, under what torch gets of a
12 GB card.

    python bench/gpu_check.py [--cap-gib 11.25] [--steps 20] [--recipes mistral,llama] [--tools ours,trl]
        [--lengths recipe,2048,longest] [--no-step-compare] [--json bench/results/gpu_check.json]
    python bench/gpu_check.py --smoke [...]         # the whole flow on the tiny built-in model, on this CPU
    python bench/gpu_check.py --part N --json $OUT/partN.json   # one part of at most 8 minutes (PARTS), N = 1..8
    python bench/gpu_check.py --profile 4 [...]      # each run's 4th step profiled: counts, and its op table
    python bench/gpu_check.py --combine A.json B.json [--loan N] --json bench/results/gpu_check.json
    make gpu-check

For each shipped 12 GB recipe (recipes/mistral-7b-qlora-12gb.yaml, recipes/llama3.1-8b-qlora-12gb.yaml), on a
random-weight model of its architecture (bench/random_weights.py, built on this machine's disk: no download):
  ours  plan, precompute and --steps train steps of lowmem_dpo, as `python -m lowmem_dpo.train` runs them, with
        memory_budget = the cap (which lowmem_dpo enforces with torch.cuda.set_per_process_memory_fraction);
  trl   TRL 1.16's DPOTrainer at its best for this work at the same cap (set the same way), lengths and settings:
        the same 4-bit NF4 base with bf16 compute, LoRA, paged 8-bit AdamW, precomputed reference log-probs,
        gradient checkpointing (non-reentrant), expandable segments;
at the recipe's max_length, at 2048, and at the longest max_length the planner says fits the cap (of 256-token
steps). Each run is a process of its own (its cap, its peaks, a clean allocator); an out-of-memory error is a
result (oom: true), not a crash. Every run takes one pair per... as the recipe says (per_device_train_batch_size),
with gradient_accumulation_steps=1 so that 20 steps take minutes (accumulation costs no memory), no eval and no
checkpoints; the rows are synthetic reviews of about max_length tokens (bench/full_scale.long_row), nothing cut.
Then the CPU-vs-GPU step: the bench recipe bench/recipes/llama-25m-cpu.yaml's median train step on cuda and on
cpu (--no-step-compare skips it).

Writes one JSON: {"device", "machine", "cap_gib", "command", "runs": [...]}, rewritten after every run. A run has
tool (lowmem_dpo | trl), recipe, variant (null for a recipe as shipped, else what differs: "max_length=2048",
"longest", "device=cpu"), max_length, cap_gib, planned_gib (the planner's train peak for the run as train applies
it, at the budget train resolved), allocated_gib / reserved_gib (the largest per-step peaks of torch's allocator over the train steps),
device_used_gib (the card's used memory at its highest, all processes and the CUDA context), oom, median_step_s and
tokens_per_s (steps 2.., non-padding tokens), step1_loss_minus_ln2, and what it ran with, read from the run
(budget_gib, micro_batch, grad_accum, streamed_layers, activation_offloading, gradient_checkpointing, mlp_tiles,
share_prompt); its host RAM planned (host_planned_gib, by term) against measured (pinned_peak_gib: torch's pinned
allocator; peak_rss_gib: resident, the load's file pages included); step 1's drift line (step1_drift_per_token,
step1_drift_loss_offset); context_gib (the card
with the bare CUDA context), beyond_torch_gib (device_used - reserved at the peak: context, kernels, managed
pages), its wall time, and its error and log tail when it failed. --grads adds a "lowmem_dpo gradients" run:
one step's LoRA gradients on one batch with and without activation offloading (plain twice: the card's own
noise; rel_l2, max_abs_diff, cosine), their peaks and times. Timings on an H100 are not a consumer card's; memory
figures carry over.

--profile STEP records that optimizer step of each run with torch.profiler (CPU and CUDA activities): the run's
"profile" has its counts (COUNTS: 4-bit matmuls, matrix products, copies; op events; on CUDA kernel launches and
device time) and op table, which is also written beside the JSON (STEM-prof-TOOL-RECIPE-LENGTH.txt); the profiled
step is left out of the median. bench/step_work.py --from compares the two tools' counts. --set KEY=VALUE changes
every run's recipe (TRL's dtype follows a dtype set so).

--smoke swaps every model for lowmem_dpo:tiny-llama, runs on the CPU (the cap is then only the planner's budget)
and shortens the lengths, so the script is known to work end to end before a GPU is lent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

GiB = 1 << 30
RECIPES = {"mistral": ("recipes/mistral-7b-qlora-12gb.yaml", "mistral-7b-v0.1"),
           "llama": ("recipes/llama3.1-8b-qlora-12gb.yaml", "llama-3.1-8b")}
STEP_RECIPE = "bench/recipes/llama-25m-cpu.yaml"
SMOKE_MODEL = "lowmem_dpo:tiny-llama"
SMOKE_LENGTHS = {"recipe": 96, "2048": 128, "4096": 160, "16384": 192}  # --smoke: the tiny model's stand-ins
# The check in parts of at most 8 minutes each on an H100/H200 (a lent machine's 10-minute command, its model built
# in the part that first needs it); peak memory does not depend on the steps' count, so 6 steps (5 timed) do.
PARTS = {
    1: dict(recipes="mistral", tools="ours", lengths="recipe,longest,2048", grads=True, step_compare=False, steps=6),
    2: dict(recipes="mistral", tools="trl", lengths="recipe,2048", grads=False, step_compare=False, steps=6),
    3: dict(recipes="llama", tools="ours", lengths="recipe,longest,2048", grads=False, step_compare=False, steps=6),
    4: dict(recipes="llama", tools="trl", lengths="recipe,2048", grads=False, step_compare=True, steps=6),
    # issue 46: the step at 2048 and 4096, ours and TRL, the 4th step of each profiled (its op table)
    5: dict(recipes="llama", tools="ours,trl", lengths="2048,4096", grads=False, step_compare=False, steps=6,
            profile=4),
    6: dict(recipes="mistral", tools="ours,trl", lengths="2048,4096", grads=False, step_compare=False, steps=6,
            profile=4),
    # issue 48: the long runs, 3 steps each (step 1's drift line, two timed): Llama at its longest and at 16,384,
    # the offloading gradient check (at --grads-length), Mistral at its longest; host RAM against pinned, resident
    7: dict(recipes="llama", tools="ours", lengths="16384,longest", grads=True, step_compare=False, steps=3),
    8: dict(recipes="mistral", tools="ours", lengths="longest", grads=False, step_compare=False, steps=3),
}
WORK = ROOT / "bench" / "out" / "gpu_check"
RESULT = ROOT / "bench" / "results" / "gpu_check.json"
LENGTH_STEP = 256  # the longest max_length is searched in these steps
DISTINCT_ROWS = 8  # synthetic rows per length, repeated to fill the steps


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


# -- the runs ----------------------------------------------------------------------------------------------------
def data_file(model: str, max_length: int, rows: int) -> Path:
    """Synthetic reviews of about max_length tokens (prompt ~1/4), DISTINCT_ROWS of them repeated to `rows`."""
    from full_scale import long_row

    from lowmem_dpo.model.models import load_tokenizer, resolve_model_path
    from lowmem_dpo.model.tiny import write_jsonl

    path = WORK / "data" / f"{Path(model).name.replace(':', '-')}-{max_length}-{rows}.jsonl"
    if not path.is_file():
        tokenizer = load_tokenizer(resolve_model_path(model))
        distinct = [long_row(tokenizer, max_length, i) for i in range(DISTINCT_ROWS)]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl([distinct[i % DISTINCT_ROWS] for i in range(rows)], path)
    return path


def run_overrides(name: str, recipe_cfg, model: str, max_length: int, steps: int, cap_gib: float, device: str,
                  work: Path, rows_file: str | None = None) -> dict:
    """The recipe's keys a check run changes: the model and rows (rows_file's, else data_file's), where it writes,
    its length and run length, no eval, no checkpoints, one step's pairs at a time, the cap. No prompt is cut
    (max_prompt_length null), as TRL 1.16 cuts none: both tools train sequences of the same length (the last loan's
    runs cut ours to the recipe's 512 and not TRL's)."""
    rows = steps * recipe_cfg.per_device_train_batch_size
    return {"model_name_or_path": model, "dataset": rows_file or str(data_file(model, max_length, rows)),
            "output_dir": str(work / "out"), "ref_cache_dir": str(work / "cache"), "device": device,
            "max_length": max_length, "max_prompt_length": None, "max_steps": steps, "gradient_accumulation_steps": 1,
            "logging_steps": 1, "save_steps": 0, "eval_fraction": 0.0, "eval_steps": None,
            "load_best_model_at_end": False, "resume": "never", "memory_budget": f"{cap_gib}GiB",
            "max_skipped_share": 1.0, "max_truncated_share": 1.0}


def planned_train(cfg, budget: int | None = None) -> dict:
    """The planner's train peak (GiB) for the run as train applies it (search.stage_plan at `budget`, the one
    train resolved; default the recipe's cap, before the run), whether that plan fits, and its host RAM (pinned
    activations, streamed layers, paged optimizer state: memory/host.py)."""
    from lowmem_dpo.memory import search
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.memory.host import host_ram
    from lowmem_dpo.memory.setup import run_budget
    from lowmem_dpo.model import models

    arch = load_arch(str(models.resolve_model_path(cfg.model_name_or_path)))
    budget = budget if budget is not None else run_budget(cfg, cfg.device)
    plan = search.stage_plan(cfg, arch, budget, "train", cfg.device)
    stream = plan.streams.get("train")
    peak = stream.device_peak if stream else plan.prediction.train.peak_bytes
    host = host_ram(arch, plan, "train")
    return {"planned_gib": round(peak / GiB, 3), "fits": plan.fits, "host_planned_gib": _gib(host.total),
            "host_planned": {name: _gib(n) for name, n in host.terms.items()}}


def host_measured(cuda: bool) -> dict:
    """This process's host RAM at its peak: pinned (torch's host allocator, CUDA) and resident (ru_maxrss, the
    load's file pages included), precompute's (run in the same process, before train) included."""
    import resource

    out = {"peak_rss_gib": _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}  # KiB on Linux
    if cuda:
        import torch

        out["pinned_peak_gib"] = _gib(torch.cuda.host_memory_stats().get("allocated_bytes.peak"))
    return out


def ran_with(session) -> dict:
    """What the run applied, read from the session train set up (not from a plan made beside it): the budget it
    planned and torch enforces, the micro-batch and accumulation, streamed layers, offloading, checkpointing, the
    MLP in tiles and their size, the prompt shared or not, the micro-batches packed or not."""
    from lowmem_dpo.memory.setup import run_budget

    run, progress = session.run, session.progress
    resolved = run.resolved
    budget = resolved.budget if resolved.budget is not None else run_budget(run.cfg, resolved.device.type)
    return {"budget_gib": _gib(budget), "micro_batch": progress.micro_batch, "grad_accum": progress.grad_accum,
            "streamed_layers": resolved.streamed_layers, "activation_offloading": resolved.activation_offloading,
            "gradient_checkpointing": resolved.gradient_checkpointing, "mlp_tiles": resolved.mlp_tiles,
            "mlp_tile_tokens": resolved.mlp_tile_tokens, "share_prompt": run.objective.shared,
            "padding_free": run.objective.packed}


def counted(steps: list[tuple], sequences_per_step: int) -> dict:
    """The run's steps as counted where they ran, every step (the first included): (seconds, real tokens, computed
    positions, pairs) each. Their sums (an epoch's), and the real tokens per sequence (what ran, after any cut)."""
    seconds, tokens, computed, pairs = (list(x) for x in zip(*steps)) if steps else ([], [], [], [])
    return {"step_s_all": [round(s, 4) for s in seconds], "epoch_s": round(sum(seconds), 3), "pairs_done": sum(pairs),
            "real_tokens": sum(tokens), "computed_tokens": sum(computed),
            "tokens_per_sequence": round(sum(tokens) / (sequences_per_step * len(steps)), 1) if steps else None}


def summarize(lines: list[dict], tokens_key: str = "tokens_per_s", profiled: int = 0) -> dict:
    """The run's figures from its per-step lines (step, loss, step_time_s, tokens_per_s, memory keys); the
    `profiled` step (the profiler slows it) is not timed."""
    steps = [line for line in lines if "loss" in line]
    timed = [line for line in steps if line["step"] >= 2 and line["step"] != profiled] or steps
    peak = {k: max((line[k] for line in steps if line.get(k) is not None), default=None)
            for k in ("peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes")}
    first = next((line for line in steps if line["step"] == 1), None)
    return {"allocated_gib": _gib(peak["peak_allocated_bytes"]), "reserved_gib": _gib(peak["peak_reserved_bytes"]),
            "device_used_gib": _gib(peak["device_used_bytes"]),
            "median_step_s": round(statistics.median(line["step_time_s"] for line in timed), 4) if timed else None,
            "tokens_per_s": round(statistics.median(line[tokens_key] for line in timed), 1) if timed else None,
            "step1_loss_minus_ln2": None if first is None or first.get("loss") is None
            else round(first["loss"] - math.log(2), 6), "steps_done": len(steps),
            # what the process holds beyond torch's reserve at the peak: context, kernels, managed pages
            "beyond_torch_gib": _gib(peak["device_used_bytes"] - peak["peak_reserved_bytes"])
            if peak["device_used_bytes"] is not None and peak["peak_reserved_bytes"] is not None else None}


def _gib(n) -> float | None:
    return None if n is None else round(n / GiB, 3)


# -- one step's op table (--profile; bench/step_work.py counts the same on the CPU) ----------------------------------
# What one step's work is counted in: 4-bit matmuls (bitsandbytes' autograd function, one per 4-bit Linear call:
# forward and recompute), matrix products, copies, and all op events; on CUDA kernel launches and device time.
COUNTS = {"matmul_4bit": ("MatMul4Bit",), "mm": ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_"),
          "copy_": ("aten::copy_",)}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def step_profile(prof, wall_s: float, cuda: bool, rows: int = 45) -> dict:
    """The counts (COUNTS, op events) and the op table of a torch.profiler run over one optimizer step."""
    ka = prof.key_averages()
    by_name = {e.key: e.count for e in ka}
    out = {name: sum(by_name.get(k, 0) for k in keys) for name, keys in COUNTS.items()}
    out["op_events"] = sum(e.count for e in ka)
    out["wall_s"] = round(wall_s, 4)
    if cuda:
        out["kernel_launches"] = sum(by_name.get(k, 0) for k in LAUNCHES)
        out["device_self_s"] = round(sum(getattr(e, "self_device_time_total", 0) or 0 for e in ka) / 1e6, 4)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    out["table"] = ka.table(sort_by=sort, row_limit=rows, max_name_column_width=80)
    return out


class StepProfiler:
    """torch.profiler over the `step`-th optimizer step (1-based) of a run: start() and stop() around it."""

    def __init__(self, step: int, cuda: bool):
        self.step, self.cuda, self.result, self.prof, self.t0 = step, cuda, None, None, 0.0

    def start(self, step: int) -> None:
        if step != self.step:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self, step: int) -> None:
        if step != self.step or self.prof is None:
            return
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        self.result = step_profile(self.prof, wall, self.cuda)
        self.prof = None


def run_ours(args) -> dict:
    """lowmem_dpo's plan, precompute and train in this process (a child of the check)."""
    from lowmem_dpo import precompute, train
    from lowmem_dpo.runtime.errors import UserError
    from lowmem_dpo.training import loop

    cfg = child_config(args)
    out = planned_train(cfg)  # before the run: what a run that fails to start is reported with
    if args.device == "cuda":  # the card with this process's bare CUDA context (rules.CUDA_AFTER_START's base)
        import torch

        free, total = torch.cuda.mem_get_info()
        out["context_gib"] = _gib(total - free)
    profiler = StepProfiler(args.profile_step, args.device == "cuda") if args.profile_step else None
    steps: list[tuple] = []
    try:
        precompute.run(cfg, progress=False)
        session = train.setup(cfg, progress=False)
        out.update(ran_with(session))
        out.update(planned_train(cfg, session.run.resolved.budget))
        with profiled_steps(profiler, steps):
            loop.run(session, progress=False)
        out.update(ran_with(session))  # again: an out-of-memory back-off changes the micro-batch
        out.update(host_measured(args.device == "cuda"))
    except UserError as e:
        out.update(oom="out of memory" in str(e), error=str(e))
    if profiler is not None:
        out["profile"] = profiler.result
    lines = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()] \
        if (Path(cfg.output_dir) / "metrics.jsonl").is_file() else []
    sequences = out.get("micro_batch", cfg.per_device_train_batch_size) * (1 if out.get("share_prompt") else 2)
    return {**out, **summarize(lines, profiled=args.profile_step), **counted(steps, sequences * out.get("grad_accum", 1))}


@contextlib.contextmanager
def profiled_steps(profiler: StepProfiler | None, steps: list):
    """step.optimizer_step, the step train runs: each call's (seconds, real tokens, computed positions, pairs)
    appended to `steps`, and `profiler` around its profiler.step-th call."""

    from lowmem_dpo.training import loop  # train_step calls loop's optimizer_step (step.optimizer_step)

    real, calls = loop.optimizer_step, [0]

    def step(*a, **k):
        calls[0] += 1
        if profiler is not None:
            profiler.start(calls[0])
        try:
            result = real(*a, **k)
        finally:
            if profiler is not None:
                profiler.stop(calls[0])
        steps.append((result.seconds, result.stats.tokens, result.stats.computed, result.stats.items))
        return result

    loop.optimizer_step = step
    try:
        yield
    finally:
        loop.optimizer_step = real


def child_config(args, **changes):
    """A child run's config: the recipe with --set, run_overrides' keys, then `changes`."""
    from lowmem_dpo.config.recipe import build_config, load_config

    recipe_cfg = load_config(args.recipe, args.set)
    overrides = run_overrides(args.name, recipe_cfg, args.model, args.max_length, args.steps, args.cap_gib,
                              args.device, Path(args.work), args.rows_file)
    return build_config({**_values(recipe_cfg), **overrides, **changes})


def _values(cfg) -> dict:
    import dataclasses

    from lowmem_dpo.config.sources import yaml_form

    return {f.name: yaml_form(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def run_trl(args) -> dict:
    """TRL 1.16's DPOTrainer at its best for the same work (a child of the check): see the module doc."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, TrainerCallback
    from trl import DPOConfig
    from trl_step import counting_trainer

    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.model import models
    from lowmem_dpo.runtime import devices, oom

    cfg = load_config(args.recipe, args.set)
    cuda = args.device == "cuda"
    if cuda:
        free, held, total = devices.cuda_memory(torch.device("cuda"))
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    if cfg.dtype == "auto":  # as ours resolves it
        bf16 = devices.cuda_native_bf16() if cuda else devices.cpu_has_native_bf16()
        fp16 = cuda and not bf16  # a card without bf16 (T4): float16 with a loss scale, as ours runs
    else:  # the recipe's (--set dtype=...), as ours runs it
        bf16, fp16 = cfg.dtype == "bfloat16", cfg.dtype == "float16"
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    path = models.resolve_model_path(args.model)
    work = Path(args.work)
    source = Path(args.rows_file) if args.rows_file else data_file(args.model, args.max_length,
                                                                   args.steps * cfg.per_device_train_batch_size)
    rows = [json.loads(x) for x in source.read_text().splitlines()]
    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype) if cfg.quantization == "4bit" else None)
    lines: list[dict] = []
    profiler = StepProfiler(args.profile_step, cuda) if args.profile_step else None

    class Meter(TrainerCallback):  # each step's time, tokens and peaks, reset per step as ours are
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if profiler is not None:  # global_step counts the steps done: this one is the next
                profiler.start(state.global_step + 1)
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            line = {"step": state.global_step}
            if cuda:
                torch.cuda.synchronize()
                line.update(devices.memory_window(torch.device("cuda")))
            line["step_time_s"] = time.perf_counter() - self.t0
            line["pairs"] = cfg.per_device_train_batch_size  # one micro-batch a step (gradient_accumulation_steps=1)
            if profiler is not None:
                profiler.stop(state.global_step)
            lines.append(line)

    out: dict = {"planned_gib": None, "micro_batch": cfg.per_device_train_batch_size, "grad_accum": 1,
                 "streamed_layers": 0}
    trainer, trainer_class = None, counting_trainer()  # each micro-batch's real tokens and computed positions
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=quant,
                                                     device_map={"": 0} if cuda else None)
        if quant is not None:  # --smoke on a CPU: bitsandbytes' packed CPU kernel refuses the tiny model's shapes
            models._one_numeric_path(model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        targs = DPOConfig(
            output_dir=str(work / "trl"), per_device_train_batch_size=cfg.per_device_train_batch_size,
            gradient_accumulation_steps=1, max_length=args.max_length, max_steps=args.steps, logging_steps=1,
            learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, warmup_steps=cfg.warmup_steps,
            beta=cfg.beta, seed=cfg.seed, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=not cuda,
            precompute_ref_log_probs=True, precompute_ref_batch_size=cfg.precompute_batch_size,
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}, bf16=bf16, fp16=fp16,
            optim="paged_adamw_8bit" if cuda else "adamw_torch")
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.peft_target_modules, task_type="CAUSAL_LM")
        trainer = trainer_class(model=model, args=targs, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, peft_config=lora, callbacks=[Meter()])
        trainer.train()
    except Exception as e:
        if not oom.is_out_of_memory(e):
            raise
        out.update(oom=True, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    history = {h["step"]: h for h in (trainer.state.log_history if trainer is not None else []) if "loss" in h}
    for line in lines:
        line["loss"] = history.get(line["step"], {}).get("loss")
    summary = summarize(lines, tokens_key="step_time_s", profiled=args.profile_step)
    tokens = [int(t) for t in trainer_class.bench_tokens]  # TRL logs no token count: its collated micro-batches'
    steps = [(line["step_time_s"], n, c, line["pairs"]) for line, n, c in zip(lines, tokens, trainer_class.bench_computed)]
    summary.update(counted(steps, 2 * cfg.per_device_train_batch_size))
    if summary["median_step_s"]:  # the timed steps' median real tokens, as ours are counted
        timed = [n for line, n in zip(lines, tokens) if line["step"] >= 2] or tokens
        summary["tokens_per_s"] = round(statistics.median(timed) / summary["median_step_s"], 1)
    if profiler is not None:
        out["profile"] = profiler.result
    return {**out, **summary}


def run_grads(args) -> dict:
    """One step's LoRA gradients on one batch, on one loaded model: without activation offloading (twice: the
    noise floor of the card's kernels), then with it (activations.offload_activations, as train attaches it).
    No cap (the plain run need not fit 12 GB), lora_dropout 0 (the same forward each time), the reference live."""
    import torch

    from lowmem_dpo import train
    from lowmem_dpo.model import activations
    from lowmem_dpo.training.step import accumulate, next_items

    # ref_source=live: the reference from the same model (one load, no precompute; the gradients' question alike)
    cfg = child_config(args, activation_offloading="false", lora_dropout=0.0, memory_budget=None, ref_source="live")
    session = train.setup(cfg, None, False)
    items = next_items(session.progress.stream, session.run.items_per_step)
    cuda = session.run.resolved.device.type == "cuda"

    def grads() -> tuple[list, dict]:
        session.trainee.zero_grad()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        accumulate(session, items, session.progress.micro_batch)
        if cuda:
            torch.cuda.synchronize()
        seen = {"s": round(time.perf_counter() - t0, 3),
                "peak_allocated_gib": _gib(torch.cuda.max_memory_allocated()) if cuda else None}
        return [p.grad.detach().float().cpu().clone() for p in session.trainee.params if p.grad is not None], seen

    plain, plain_seen = grads()
    again, again_seen = grads()
    offloader = activations.offload_activations(session.trainee.model, session.run.resolved.device, force=not cuda)
    if not cuda:  # --smoke: the tiny model's saved tensors are all under OFFLOAD_MIN_BYTES; move them all
        offloader.min_bytes = 0
    off, off_seen = grads()
    return {"pairs": len(items), "tensors": len(plain), "plain": plain_seen, "plain_again": again_seen,
            "offloaded": {**off_seen, "packed": offloader.packed, "fetched": offloader.fetched},
            "plain_again_vs_plain": grad_difference(again, plain), "offloaded_vs_plain": grad_difference(off, plain)}


def grad_difference(a: list, b: list) -> dict:
    """How far gradients `a` are from `b`: the largest absolute difference, the norm of the difference over b's
    norm, and the cosine of the two flattened."""
    import torch

    # float64: the sums over ~40M entries in float32 gave a cosine of 1.011 on the first GPU run
    fa, fb = torch.cat([t.flatten() for t in a]).double(), torch.cat([t.flatten() for t in b]).double()
    return {"max_abs_diff": float((fa - fb).abs().max()), "max_abs": float(fb.abs().max()),
            "rel_l2": float((fa - fb).norm() / fb.norm().clamp_min(1e-30)),
            "cosine": float(torch.nn.functional.cosine_similarity(fa, fb, dim=0))}


def child(args) -> int:
    """One run in this process: its result JSON to --out, whatever happens."""
    from lowmem_dpo.runtime import devices

    t0 = time.perf_counter()
    # first, as `python -m lowmem_dpo.train` does (config/cli.py): the first GPU run's children asked CUDA for its
    # free memory before lowmem_dpo set expandable segments, so ours ran on torch's defaults while TRL had them
    allocator = devices.configure_allocator()
    try:
        result = {"ours": run_ours, "trl": run_trl, "grads": run_grads}[args.child](args)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["wall_s"], result["allocator"] = round(time.perf_counter() - t0, 1), allocator
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# -- the check -----------------------------------------------------------------------------------------------------
def longest_length(recipe: str, model: str, cap_gib: float, device: str, limit: int) -> int:
    """The longest max_length (in LENGTH_STEP steps, at most `limit`) whose train and precompute the planner fits
    in the cap, with the knobs train and precompute apply by themselves."""
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.memory import search
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.model import models

    arch = load_arch(str(models.resolve_model_path(model)))
    budget = int(cap_gib * GiB)
    best = 0
    for length in range(LENGTH_STEP, limit + 1, LENGTH_STEP):
        cfg = load_config(recipe, [f"model_name_or_path={model}", f"max_length={length}", "max_prompt_length=null",
                                   f"device={device}"])
        if not all(search.stage_plan(cfg, arch, budget, stage, device).fits for stage in ("train", "precompute")):
            break
        best = length
    return best


def spawn(tool: str, name: str, recipe: str, model: str, length: int, args, device: str, variant,
          steps: int | None = None, sets: tuple = (), rows_file: str | None = None, timeout: float | None = None) -> dict:
    """One run in a process of its own; its result with what it was. steps, sets (more recipe keys) and rows_file
    (the rows, else data_file's) for this run; timeout: seconds before it is killed (an error in its result)."""
    from lowmem_dpo.training.guards import DRIFT_LINE

    suffix = "-" + "-".join(variant.split()) if variant else ""
    work = WORK / "runs" / f"{name}-{tool}-{length}-{device}{suffix}"
    out = work / "result.json"
    shutil.rmtree(work, ignore_errors=True)  # a rerun that fails before train writes reports nothing of the last
    work.mkdir(parents=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", tool, "--name", name, "--recipe", recipe,
            "--model", model, "--max-length", str(length), "--cap-gib", str(args.cap_gib), "--steps",
            str(steps or args.steps), "--device", device, "--work", str(work), "--out", str(out)]
    if args.profile and tool != "grads":
        argv += ["--profile-step", str(args.profile)]
    if rows_file:
        argv += ["--rows-file", rows_file]
    if args.set or sets:
        argv += ["--set", *args.set, *sets]
    log(f"{tool} {name} max_length={length} on {device}: {shlex.join(argv[2:])}")
    with open(work / "log.txt", "w") as logfile:
        try:
            rc = subprocess.run(argv, cwd=ROOT, stdout=logfile, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"killed after its {timeout:.0f} s"
    result = json.loads(out.read_text()) if out.is_file() else {"error": f"the run died (exit {rc})"}
    text = (work / "log.txt").read_text(errors="replace")
    if result.get("error"):
        result["log_tail"] = "\n".join(x for x in text.splitlines() if "%|" not in x)[-4000:]  # not the bars' lines
    drift = DRIFT_LINE.search(text)  # train's drift line at step 1 (guards.drift_lines)
    if drift:
        result["step1_drift_per_token"], result["step1_drift_loss_offset"] = map(float, drift.groups())
    entry = {"tool": {"ours": "lowmem_dpo", "grads": "lowmem_dpo gradients"}.get(tool, tool), "recipe": Path(recipe).stem, "variant": variant,
             "max_length": length, "cap_gib": args.cap_gib if device == "cuda" else None, "device": device,
             "oom": False, **result}
    log(f"  -> {json.dumps({k: entry.get(k) for k in ('oom', 'planned_gib', 'allocated_gib', 'reserved_gib', 'median_step_s', 'step1_loss_minus_ln2', 'error')})}")
    if entry.get("profile"):
        counts = {k: v for k, v in entry["profile"].items() if k != "table"}
        log(f"  profiled step {args.profile}: {json.dumps(counts)}")
    return entry


def lengths(args, recipe: str, model: str, device: str) -> list[tuple[int, str | None]]:
    """(max_length, variant) of each run of a recipe, from --lengths."""
    from lowmem_dpo.config.recipe import load_config

    shipped = load_config(recipe).max_length
    out = []
    for what in args.lengths.split(","):
        if what == "recipe":
            out.append((SMOKE_LENGTHS["recipe"] if args.smoke else shipped, None))
        elif what == "longest":
            limit = 512 if args.smoke else args.longest_limit
            out.append((longest_length(recipe, model, args.cap_gib, device, limit), "longest"))
        else:
            n = SMOKE_LENGTHS[what] if args.smoke and what in SMOKE_LENGTHS else int(what)
            out.append((n, f"max_length={what}"))
    return [(n, v) for i, (n, v) in enumerate(out) if n and n not in [m for m, _ in out[:i]]]


def write(report: dict, path: Path) -> None:
    """The JSON, and each profiled run's op table beside it (STEM-prof-TOOL-RECIPE-LENGTH.txt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    for run in report["runs"]:
        table = (run.get("profile") or {}).get("table")
        if table:
            counts = {k: v for k, v in run["profile"].items() if k != "table"}
            name = f"{path.stem}-prof-{run['tool']}-{run['recipe']}-{run['max_length']}.txt"
            (path.parent / name).write_text(f"{run['tool']} {run['recipe']} {run['max_length']}: {json.dumps(counts)}\n"
                                            + table + "\n")


def check(args) -> int:
    import torch
    from machine import machine_info

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.smoke:
        log("no CUDA GPU here: run with --smoke on a CPU, or on a CUDA machine")
        return 2
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (--smoke)", "machine": machine_info(),
              "cap_gib": args.cap_gib, "smoke": args.smoke, "command": shlex.join(["python", *sys.argv]),
              "runs": []}
    out = Path(args.json)
    for name in args.recipes.split(","):
        recipe, arch = RECIPES[name]
        if args.smoke:
            model = SMOKE_MODEL
        else:
            import random_weights

            model = str(random_weights.ensure_model(arch, log=log))
        for k, (length, variant) in enumerate(lengths(args, recipe, model, device)):
            for tool in args.tools.split(","):
                report["runs"].append(spawn(tool, name, recipe, model, length, args, device, variant))
                write(report, out)
            if k == 0 and args.grads:  # after the recipe's own runs: the offloading check before the long ones
                glen = SMOKE_LENGTHS["recipe"] if args.smoke else args.grads_length
                report["runs"].append(spawn("grads", name, recipe, model, glen, args, device, "offloading"))
                write(report, out)
    if args.step_compare:
        model = SMOKE_MODEL if args.smoke else "lowmem_dpo:llama-25m"
        for dev in (["cuda"] if cuda else []) + ["cpu"]:
            entry = spawn("ours", "step", STEP_RECIPE, model, 256 if not args.smoke else 96, args, dev,
                          f"device={dev}")
            report["runs"].append(entry)
            write(report, out)
    log(f"wrote {out}")
    return 0


def combine(paths: list[str], out: Path, loan: int | None = None) -> int:
    """One JSON from several calls' (each a part of the check, e.g. one per recipe): the first one's header, every
    run; `loan` marks the runs that carry no loan number yet (a new GPU loan's files beside earlier ones)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]  # a part may be an earlier combination: its commands
    report = {**parts[0], "runs": [{"command": p["command"], **({"loan": loan} if loan else {}), **r}
                                   for p in parts for r in p["runs"]],
              "commands": [c for p in parts for c in p.get("commands", [p["command"]])]}
    write(report, out)
    log(f"wrote {out}: {len(report['runs'])} runs from {len(parts)} files")
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-gib", type=float, default=11.25, help="memory torch may use (a 12 GB card's share)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--recipes", default="mistral,llama")
    ap.add_argument("--tools", default="ours,trl")
    ap.add_argument("--lengths", default="recipe,2048,longest", help="recipe, a number, or longest")
    ap.add_argument("--longest-limit", type=int, default=32768, help="the longest max_length tried")
    ap.add_argument("--no-step-compare", dest="step_compare", action="store_false")
    ap.add_argument("--grads", action="store_true", help="also the offloaded gradients against plain ones")
    ap.add_argument("--grads-length", type=int, default=4096, help="max_length of the gradient comparison")
    ap.add_argument("--profile", type=int, default=0, metavar="STEP", help="profile this optimizer step of each run "
                    "(torch.profiler, CPU and CUDA): its counts and op table in the JSON, the table beside it")
    ap.add_argument("--part", type=int, choices=sorted(PARTS), help="one part of the check (PARTS), for a short "
                    "GPU loan: sets --recipes, --tools, --lengths, --grads, --no-step-compare and --steps")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=str(RESULT))
    ap.add_argument("--combine", nargs="+", metavar="JSON")
    ap.add_argument("--loan", type=int, help="with --combine: the loan number of runs that have none")
    # a child run (internal)
    ap.add_argument("--child", choices=("ours", "trl", "grads"))
    for name in ("--name", "--recipe", "--model", "--device", "--work", "--out"):
        ap.add_argument(name)
    ap.add_argument("--max-length", type=int)
    ap.add_argument("--rows-file", help="the rows of a child run (default: data_file's synthetic rows)")
    ap.add_argument("--profile-step", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], help="recipe keys for every run, e.g. dtype=bfloat16")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return child(args)
    if args.part:
        vars(args).update(PARTS[args.part])
    # `timeout` ends the check with SIGTERM: as an exception, so that subprocess.run kills the running child too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.combine:
        return combine(args.combine, Path(args.json), args.loan)
    return check(args)


if __name__ == "__main__":
    raise SystemExit(main())
