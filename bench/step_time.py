"""Step-time benchmark: lowmem_dpo's cached-reference DPO+LoRA step, optionally against TRL's DPOTrainer.

    python bench/step_time.py RECIPE.yaml [key=value ...] --devices cpu,cuda --steps N --json OUT \
        [--warmup W] [--vs-trl] [--trl-set KEY=VALUE ...] [--limit-repeats R] [--flop-steps K] [--threads T] \
        [--reuse-cache]

Run from the repository root (recipe paths are relative to it). Per device in --devices:
  1. precompute: `lowmem_dpo.precompute.run(cfg)` builds the reference cache (rows/s; an existing cache for the
     device is removed first unless --reuse-cache);
  2. ours: W warm-up + N timed optimizer steps of lowmem_dpo.train's step (train_step, clip_grad_norm_, AdamW
     step, scheduler step, zero_grad), each timed with perf_counter (torch.cuda.synchronize on CUDA);
  3. with --vs-trl: TRL's DPOTrainer with its DPOConfig defaults on the same model folder, rows, batch size,
     max_length and LoRA settings, W + N steps, each timed by a TrainerCallback (on_step_begin..on_step_end);
  4. against the machine (bench/limits.py): precompute's rows/s against a bare forward over the same batches
     (R repeats), K train steps' FLOPs counted and set against the measured bf16/fp32 matmul FLOP/s.
Devices that are not present are reported as {"available": false, "reason": ...}.

Writes OUT (JSON), OUT with .md (a Markdown table) and OUT with .png (bar plot; needs matplotlib).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import platform
import re
import resource
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import limits  # noqa: E402
import torch  # noqa: E402

TARGET_RATIO = 0.7  # the requirement: ours median step <= 0.7 x TRL's median step
KNOWN_DEVICES = ("cpu", "cuda")


# -- memory ------------------------------------------------------------------------------------------------------
def _proc_status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(m.group(1)) if m else None


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so the next phase's RSS starts low."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of one phase (a `with` block).

    CPU: peak resident set size. The kernel's high-water mark (VmHWM in /proc/self/status) is reset at the start
    of the phase by writing 5 to /proc/self/clear_refs, so VmHWM at the end is the phase's peak RSS; the delta is
    that peak minus VmRSS at the start. Without /proc (or if the reset is refused) it falls back to
    getrusage(RUSAGE_SELF).ru_maxrss, the process-lifetime peak, and says so in "method".
    CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats (tensors only, not the allocator's cache);
    the delta is that peak minus memory_allocated at the start.
    """

    def __init__(self, device: str):
        self.device = device
        self.result: dict = {}

    def __enter__(self):
        _release_freed_memory()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.start = (_proc_status_kib("VmRSS") or 0) * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM after reset via /proc/self/clear_refs"
        except OSError:
            self.method = "getrusage ru_maxrss (process-lifetime peak: could not reset)"
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            self.result = {"method": "torch.cuda.max_memory_allocated", "peak_bytes": peak,
                           "start_bytes": self.start, "peak_delta_bytes": peak - self.start,
                           "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
            return False
        hwm = _proc_status_kib("VmHWM") if self.method.startswith("VmHWM") else None
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        peak = hwm * 1024
        self.result = {"method": self.method, "peak_bytes": peak, "start_bytes": self.start,
                       "peak_delta_bytes": max(0, peak - self.start)}
        return False


# -- helpers -----------------------------------------------------------------------------------------------------
def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def summarize(times: list[float], tokens: list[int], cpu_times: list[float]) -> dict:
    return {
        "median_step_s": round(statistics.median(times), 4),
        "min_step_s": round(min(times), 4),
        "max_step_s": round(max(times), 4),
        "mean_step_s": round(statistics.fmean(times), 4),
        "timed_steps": len(times),
        "all_step_s": [round(t, 4) for t in times],
        "tokens_per_step_median": statistics.median(tokens),
        # throughput over the timed steps: non-padding tokens (chosen + rejected sequences) / seconds
        "tokens_per_s": round(sum(tokens) / sum(times), 1),
        # CPU time of this process per step (all threads): less sensitive than wall time to other processes
        # competing for the cores; compare with the wall times to spot a disturbed run
        "cpu_time_median_s": round(statistics.median(cpu_times), 4),
    }


def unavailable_reason(device: str) -> str | None:
    if device == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only torch build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            return f"torch.cuda.is_available() is False (torch {torch.__version__}, {build}): no CUDA GPU here"
    return None


def clear_cache(cache_dir: Path) -> bool:
    """Remove a previous reference cache (manifest and shard folders only) so precompute is timed from scratch."""
    import shutil

    removed = False
    if (cache_dir / "manifest.json").is_file():
        (cache_dir / "manifest.json").unlink()
        removed = True
    for d in cache_dir.glob("shards-*"):
        shutil.rmtree(d, ignore_errors=True)
        removed = True
    return removed


def ensure_dataset(cfg) -> None:
    """Write the benchmark rows if the recipe points at bench/make_data.py's default file and it is missing."""
    import make_data

    path = Path(cfg.dataset).resolve()
    if path in ((ROOT / make_data.DEFAULT_PATH).resolve(), make_data.DEFAULT_PATH.resolve()):
        make_data.ensure(path)


# -- ours --------------------------------------------------------------------------------------------------------
def bench_precompute(cfg, device: str, reuse: bool) -> dict:
    from lowmem_dpo import cache, precompute

    cache_dir = Path(cfg.ref_cache_dir)
    if not reuse:
        clear_cache(cache_dir)
    before = cache.read_manifest(cache_dir)
    with PeakMemory(device) as pm:
        t0 = time.perf_counter()
        precompute.run(cfg, progress=False)
        synchronize(device)
        wall = time.perf_counter() - t0
    manifest = cache.read_manifest(cache_dir) or {}
    rows = manifest.get("num_pairs", 0)
    # with --reuse-cache an up-to-date cache is kept: precompute.run only checks it, and the manifest's rows/s
    # are those of the earlier build
    rebuilt = before is None or before.get("created") != manifest.get("created")
    return {
        "cache_dir": str(cache_dir),
        "rebuilt": rebuilt,
        "rows": rows,
        "batch_size": cfg.precompute_batch_size,
        # rows_per_s: the forward loop only, as precompute records it in the manifest (model load, hashing and
        # tokenization excluded). rows_per_s_wall: the whole precompute.run call.
        "rows_per_s": manifest.get("rows_per_s"),
        "wall_s": round(wall, 3),
        "rows_per_s_wall": round(rows / wall, 3) if wall > 0 and rebuilt else None,
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }


def bench_ours(cfg, device: str, steps: int, warmup: int, recipe: str, flop_steps: int) -> dict:
    import dataclasses

    from lowmem_dpo import devices, train

    total = warmup + steps
    with PeakMemory(device) as pm:
        t_setup = time.perf_counter()
        session = train.setup(dataclasses.replace(cfg, max_steps=total), recipe, progress=False)
        resolved, params = session.resolved, session.params
        setup_s = time.perf_counter() - t_setup
        times, cpu_times, tokens, losses = [], [], [], []
        for _ in range(total):
            devices.synchronize(resolved.device)
            c0 = time.process_time()
            t0 = time.perf_counter()
            stats, _, _ = train.optimizer_step(session)  # exactly the step `python -m lowmem_dpo.train` takes
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


# -- TRL ---------------------------------------------------------------------------------------------------------
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


def bench_trl(cfg, device: str, steps: int, warmup: int, trl_sets: dict) -> dict:
    import transformers
    import trl
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from lowmem_dpo import data, models

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step: on_step_begin .. on_step_end (forward, backward, clip, step)."""

        def __init__(self):
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.c0 = time.process_time()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self.t0)
            self.cpu_times.append(time.process_time() - self.c0)

    class CountingDPOTrainer(DPOTrainer):
        """DPOTrainer that notes each micro-batch's non-padding token count (a lazy tensor sum, no sync)."""

        bench_tokens: list = []

        def training_step(self, model, inputs, *args, **kwargs):
            self.bench_tokens.append(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    model_path = models.resolve_model_path(cfg.model_name_or_path)
    with PeakMemory(device) as pm:
        t_setup = time.perf_counter()
        rows = data.load_rows(cfg.dataset, cfg.dataset_split)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        # Only what must match ours (or keep the run short and quiet) is set; everything else is DPOConfig's default.
        required = {
            "output_dir": str(Path(cfg.output_dir) / "trl"),
            "per_device_train_batch_size": cfg.per_device_train_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "max_length": cfg.max_length,
            "max_steps": warmup + steps,
            "report_to": "none",
            "save_strategy": "no",  # no checkpoint at the end (after the last on_step_end: not in any step time)
            "disable_tqdm": True,
            "use_cpu": device == "cpu",
        }
        settings = {**required, **trl_sets}
        defaults = DPOConfig(output_dir=required["output_dir"], use_cpu=required["use_cpu"], report_to="none")
        args = DPOConfig(**settings)
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules="all-linear" if cfg.lora_target_modules == ["all-linear"]
                          else cfg.lora_target_modules, task_type="CAUSAL_LM")
        timer = StepTimer()
        CountingDPOTrainer.bench_tokens = []
        trainer = CountingDPOTrainer(model=str(model_path), args=args, train_dataset=rows,
                                     processing_class=tokenizer, peft_config=lora, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # keep stdout for the table (logging itself still happens)
        setup_s = time.perf_counter() - t_setup
        result = trainer.train()
    tokens = [int(t) for t in CountingDPOTrainer.bench_tokens]
    per_step = [sum(tokens[i:i + cfg.gradient_accumulation_steps])
                for i in range(0, len(tokens), cfg.gradient_accumulation_steps)]
    keys = ("bf16", "fp16", "gradient_checkpointing", "gradient_checkpointing_kwargs", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "optim", "weight_decay", "max_grad_norm", "beta", "loss_type",
            "precompute_ref_log_probs", "disable_dropout", "padding_free", "pad_to_multiple_of",
            "truncation_mode", "dataloader_num_workers", "torch_compile", "seed", "logging_steps",
            "activation_offloading", "use_liger_kernel")
    effective = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    effective.update({k: getattr(args, k) for k in required if hasattr(args, k)})
    changed = {k: {"default": _jsonable(getattr(defaults, k, None)), "used": _jsonable(v)}
               for k, v in trl_sets.items()}
    param = next(trainer.model.parameters())
    out = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "settings": {k: _jsonable(v) for k, v in effective.items()},
        "set_beyond_required": changed,
        "lora": {"r": cfg.lora_r, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
                 "target_modules": "all-linear" if cfg.lora_target_modules == ["all-linear"]
                 else cfg.lora_target_modules},
        "reference": "live forward with the adapter disabled (TRL default for a PEFT model, no precompute)",
        "weights_dtype": str(param.dtype).removeprefix("torch."),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "setup_s": round(setup_s, 3),
        "warmup_s": [round(t, 4) for t in timer.times[:warmup]],
        **summarize(timer.times[warmup:], per_step[warmup:len(timer.times)], timer.cpu_times[warmup:]),
        "train_loss": round(float(result.training_loss), 6),
        "peak_memory": pm.result, "peak_mem_bytes": pm.result.get("peak_bytes"),
    }
    del trainer
    return out


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def guarded(what: str, device: str, fn) -> tuple[dict, bool]:
    """(fn(), True), or ({"error", "traceback"}, False) when it raises: a failed measurement is reported in the
    JSON and the others are still worth keeping."""
    try:
        return fn(), True
    except Exception as e:
        log(f"[{device}] {what} failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}, False


# -- one device --------------------------------------------------------------------------------------------------
def bench_device(device: str, args) -> dict:
    from lowmem_dpo.config import load_config

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
    log(f"[{device}] precompute: {out['precompute']['rows']} rows, {out['precompute']['rows_per_s']} rows/s")
    if args.limit_repeats:
        log(f"[{device}] precompute against a bare forward: {args.limit_repeats} repeats")
        vs, ok = guarded("precompute against a bare forward", device,
                         lambda: limits.precompute_vs_bare_forward(cfg, args.limit_repeats))
        out["precompute_vs_bare_forward"] = vs
        if ok:
            log(f"[{device}] precompute {vs['ours_rows_per_s']} rows/s, bare forward {vs['bare_rows_per_s']} "
                f"rows/s: ratio {vs['ratio']}")
        _release_freed_memory()
    log(f"[{device}] ours: {args.warmup} warm-up + {args.steps} timed steps")
    out["ours"] = bench_ours(cfg, device, args.steps, args.warmup, args.recipe, args.flop_steps)
    log(f"[{device}] ours: median step {out['ours']['median_step_s']} s, {out['ours']['tokens_per_s']} tokens/s")
    _release_freed_memory()
    if args.vs_trl:
        log(f"[{device}] TRL DPOTrainer: {args.warmup} warm-up + {args.steps} timed steps")
        out["trl"], ok = guarded("TRL", device, lambda: bench_trl(cfg, device, args.steps, args.warmup,
                                                                    args.trl_sets))
        if ok:
            log(f"[{device}] TRL: median step {out['trl']['median_step_s']} s, {out['trl']['tokens_per_s']} tokens/s")
            ratio = out["ours"]["median_step_s"] / out["trl"]["median_step_s"]
            out["ratio_median_step"] = round(ratio, 4)
            out["target_ratio"] = TARGET_RATIO
            out["meets_target"] = ratio <= TARGET_RATIO
        _release_freed_memory()
    if args.flop_steps:
        log(f"[{device}] matmul FLOP/s (bfloat16, float32)")
        out["matmul_peak"], ok = guarded("matmul FLOP/s", device,
                                         lambda: limits.matmul_peak(torch.device(device), model_matmul_shape(cfg)))
        if ok and "error" not in out["ours"]["flops"]:
            out["train_step_vs_matmul_peak"] = step_vs_peak(out["ours"], out["matmul_peak"])
            log(f"[{device}] train step: {out['train_step_vs_matmul_peak']}")
    out["torch_threads_after"] = torch.get_num_threads()
    return out


def model_matmul_shape(cfg) -> tuple[int, int, int] | None:
    """(tokens of a full batch, hidden, intermediate): the shape of the model's MLP up-projection in a step."""
    from lowmem_dpo import models

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


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import peft
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": (_proc_status_kib_meminfo() or 0) * 1024 or None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "lowmem_dpo_home": os.environ.get("LOWMEM_DPO_HOME"),
        "loadavg_at_start": loadavg(),
    }
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: well above 0 before a CPU run means other processes share the cores."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _proc_status_kib_meminfo() -> int | None:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def log(msg: str) -> None:
    print(f"step_time: {msg}", file=sys.stderr, flush=True)


# -- reports -----------------------------------------------------------------------------------------------------
def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cpu_affinity']} usable cores, "
             f"torch {report['machine']['torch']} ({report['machine']['torch_threads']} threads), "
             f"transformers {report['machine']['transformers']}, peft {report['machine']['peft']}, "
             f"trl {report['machine']['trl']}", "",
             "| device | implementation | median step s | min s | max s | tokens/s | peak mem MiB (delta) | "
             "precompute rows/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for dev, r in report["devices"].items():
        if not r.get("available") or "error" in r:
            status, why = ("not available", r.get("reason")) if not r.get("available") else ("failed", r["error"])
            lines.append(f"| {dev} | {status} | - | - | - | - | - | - |")
            notes.append(f"{dev}: {why}")
            continue
        pre = r["precompute"]
        for name, label in (("ours", "lowmem_dpo (cached ref)"), ("trl", "TRL DPOTrainer")):
            s = r.get(name)
            if s is None:
                continue
            if "error" in s:
                lines.append(f"| {dev} | {label} | failed | | | | | |")
                notes.append(f"{dev} {label}: {s['error']}")
                continue
            pm = s["peak_memory"]
            wall = f"{pre['rows_per_s_wall']} wall" if pre["rebuilt"] else "cache reused: an earlier build's"
            pre_col = (f"{pre['rows_per_s']} ({wall})" if name == "ours" else "-")
            lines.append(f"| {dev} | {label} | {s['median_step_s']:.3f} | {s['min_step_s']:.3f} | {s['max_step_s']:.3f} | "
                         f"{s['tokens_per_s']:,.0f} | {_mib(pm['peak_bytes'])} ({_mib(pm['peak_delta_bytes'])}) | "
                         f"{pre_col} |")
        if "ratio_median_step" in r:
            verdict = "meets" if r["meets_target"] else "MISSES"
            notes.append(f"{dev}: ours / TRL median step = {r['ratio_median_step']:.3f} ({verdict} the <= "
                         f"{r['target_ratio']} target)")
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines + limits_table(report)) + "\n"


def _g(flops) -> str:
    return "-" if flops is None else f"{flops / 1e9:,.0f}"


def limits_table(report: dict) -> list[str]:
    """Precompute against a bare forward, and the train step's counted FLOP/s against the matmul peak."""
    lines = ["", "| device | precompute rows/s (shard_logps) | bare forward rows/s | precompute / bare (goal >= 0.9) "
             "| step GFLOP (counted) | step GFLOP/s | matmul GFLOP/s bf16 / fp32 | step / matmul (dtype) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = 0
    for dev, r in report["devices"].items():
        vs, step, peak = r.get("precompute_vs_bare_forward"), r.get("train_step_vs_matmul_peak"), r.get("matmul_peak")
        if not (vs or step):
            continue
        rows += 1
        if vs and "error" in vs:
            pre = "failed | - | -"
        else:
            pre = (f"{vs['ours_rows_per_s']:.1f} | {vs['bare_rows_per_s']:.1f} | {vs['ratio']:.2f}" if vs
                   else "- | - | -")
        if step:
            flops = r["ours"]["flops"]
            per_step = statistics.median(flops["flops_per_step"])
            ratio = "-" if step["ratio"] is None else f"{step['ratio']:.2f} ({step['dtype']})"
            if step.get("ratio_back_to_back") is not None:
                ratio += f"; back to back {step['ratio_back_to_back']:.2f}"
            mm = f"{_g(peak['bfloat16']['peak_flop_per_s'])} / {_g(peak['float32']['peak_flop_per_s'])}"
            train = f"{_g(per_step)} | {_g(step['achieved_flop_per_s'])} | {mm} | {ratio}"
        else:
            train = "- | - | - | -"
        lines.append(f"| {dev} | {pre} | {train} |")
    if not rows:
        return []
    return lines + ["", "- precompute / bare: rows/s of precompute.shard_logps over precompute's batches against a "
                    "bare `model(input_ids, attention_mask).logits` of the same model on the same batches "
                    "(medians of repeats, timed back to back).",
                    "- step GFLOP: FlopCounterMode over train.optimizer_step (matmuls and attention only); "
                    "step GFLOP/s = counted FLOPs per token x median tokens per step / median step s; matmul GFLOP/s: the "
                    "fastest median of torch.mm over square and model-shaped matrices; back to back: the "
                    "counted steps timed again, each followed by one square-matmul timing (median of the "
                    "per-step ratios)."]


def limits_bars(report: dict) -> list[tuple[str, float]]:
    """(label, ratio) for the plot's second panel: precompute / bare forward and step / matmul peak per device."""
    bars = []
    for dev, r in report["devices"].items():
        if "ratio" in r.get("precompute_vs_bare_forward", {}):
            bars.append((f"{dev}\nprecompute /\nbare forward", r["precompute_vs_bare_forward"]["ratio"]))
        step = r.get("train_step_vs_matmul_peak")
        if step and step["ratio"] is not None:
            bars.append((f"{dev}\nstep FLOP/s /\n{step['dtype']} matmul", step["ratio"]))
    return bars


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, medians, lows, highs, colors = [], [], [], [], []
    for dev, r in report["devices"].items():
        if not r.get("available") or "error" in r:
            continue
        for name, label, color in (("ours", "lowmem_dpo", "tab:blue"), ("trl", "TRL DPOTrainer", "tab:orange")):
            s = r.get(name)
            if not s or "error" in s:
                continue
            labels.append(f"{dev}\n{label}")
            medians.append(s["median_step_s"])
            lows.append(s["median_step_s"] - s["min_step_s"])
            highs.append(s["max_step_s"] - s["median_step_s"])
            colors.append(color)
    if not medians:
        return "no numbers to plot"
    limit_bars = limits_bars(report)
    width = 1.8 + 1.6 * len(medians)
    if limit_bars:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(width + 1.8 + 1.6 * len(limit_bars), 4.5),
                                      gridspec_kw={"width_ratios": [len(medians), len(limit_bars)]})
        names, values = zip(*limit_bars)
        ax2.bar(range(len(values)), values, color="tab:green")
        ax2.set_xticks(range(len(values)), names, fontsize=8)
        ax2.axhline(0.9, color="gray", linestyle="--", linewidth=1)
        ax2.set_ylabel("ratio to the limit")
        ax2.set_title("against the machine\n(dashed: precompute goal 0.9)")
        for i, v in enumerate(values):
            ax2.text(i, v / 2, f"{v:.2f}", ha="center", va="center", color="white", fontweight="bold")
    else:
        fig, ax = plt.subplots(figsize=(width, 4))
    ax.bar(range(len(medians)), medians, yerr=[lows, highs], capsize=6, color=colors)
    ax.set_xticks(range(len(medians)), labels)
    ax.set_ylabel("median optimizer step (s); bars: min..max")
    title = "DPO+LoRA step time"
    ratios = [f"{d}: ours/TRL = {r['ratio_median_step']:.2f}" for d, r in report["devices"].items()
              if "ratio_median_step" in r]
    if ratios:
        title += "\n" + ", ".join(ratios)
    ax.set_title(title)
    for i, m in enumerate(medians):
        ax.text(i, m / 2, f"{m:.2f} s", ha="center", va="center", color="white", fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


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
    ap.add_argument("--vs-trl", action="store_true", help="also time TRL's DPOTrainer with its defaults")
    ap.add_argument("--trl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a DPOConfig default for the TRL run (recorded in the JSON); repeatable")
    ap.add_argument("--limit-repeats", type=int, default=3, metavar="R",
                    help="repeats of precompute against a bare forward over all rows (0: skip)")
    ap.add_argument("--flop-steps", type=int, default=3, metavar="K",
                    help="train steps whose FLOPs are counted, and the matmul peak measured (0: skip both)")
    ap.add_argument("--threads", type=int, default=0, metavar="T",
                    help="torch.set_num_threads(T) for the whole run (default: torch's default, the usable cores)")
    ap.add_argument("--reuse-cache", action="store_true", help="keep an up-to-date reference cache instead of "
                    "rebuilding it (precompute rows/s then come from the manifest of the earlier build)")
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
    args.trl_sets = parse_trl_sets(args.trl_set)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lowmem_dpo.cli import UserError

    report = {"devices": {}, "machine": machine_info(),
              "command": shlex.join(["python", "bench/step_time.py", *argv])}
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
        parts = [r.get(k, {}) for k in ("trl", "precompute_vs_bare_forward", "matmul_peak")]
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
