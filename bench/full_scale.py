"""A 7B model through the whole pipeline on this machine: plan, precompute and train, unquantized and 4bit.

    python bench/full_scale.py --arch mistral-7b-v0.1 --max-length 512 --steps 3 --json OUT
        [--layers N] [--runs bf16,4bit] [--plain] [--gradient-checkpointing true|false|auto]

1. Model: a deterministic random-weight model of the shipped architecture (bench/random_weights.py), bf16
   safetensors under $LOWMEM_DPO_HOME/full_scale/, built once and reused. --layers N cuts it to its first N
   decoder layers (its own folder): a smoke test at full width.
2. Data: max(4, --steps) deterministic preference rows of about --max-length tokens (prompt ~1/4; prompt +
   chosen and prompt + rejected each as long as whole sentences allow, never cut), a jsonl under
   bench/out/full_scale/MODEL/.
3. Per run (bf16: dtype bfloat16; 4bit: NF4 base computing in bfloat16), a generated recipe (device cpu,
   gradient checkpointing on unless --gradient-checkpointing says otherwise, 1 pair per micro-batch, LoRA r 8 on
   all linear layers, the reference as the cache) and, each stage in a fresh process so that its peaks are its own:
     plan        python -m lowmem_dpo.plan RECIPE --json: the planner's predicted peaks;
     precompute  lowmem_dpo.precompute's CLI (from an empty cache): sequences/s, load time, peaks;
     train       lowmem_dpo.train's CLI (max_steps --steps, one pair each): step times, load time, peaks;
   the stage CLIs run under `python bench/full_scale.py --stage STAGE RECIPE OUT`, which adds the planner's
   tensor meter (with --plain: `python -m lowmem_dpo.STAGE RECIPE`, RSS only). The matmul FLOP/s of this CPU in
   the run's dtype is measured in this process before precompute and after train.
   A failed stage or run is recorded in the JSON with its error (and its log's tail); the other run still runs.

Writes OUT: {"runs": [...], "method": {...}, "machine": {...}, "command": ...} (rewritten after each run), and
prints a table. Each stage's full output is in bench/out/full_scale/MODEL/RUN/STAGE.log. "method" says how each
number is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
for p in (str(ROOT), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

import random_weights  # noqa: E402
import torch  # noqa: E402

from lowmem_dpo.model.tiny import BAD, GOOD, NOUNS  # noqa: E402
from lowmem_dpo.runtime.errors import UserError  # noqa: E402
from lowmem_dpo.runtime.units import fmt  # noqa: E402
from lowmem_dpo.training.step import pair_stream  # noqa: E402

RUNS = {"bf16": ("bfloat16", "none"), "4bit": ("bfloat16", "4bit")}  # name -> (dtype, quantization)
PRECOMPUTE_ROWS = 4
LORA_R = 8
WORK = ROOT / "bench" / "out" / "full_scale"
SAMPLE_S = 0.05  # /proc/PID/status sampling period

METHOD = {
    "measured_peak_bytes": "peak resident set size (anonymous + file-backed pages) of the stage's process from "
        "the end of its model load to its exit: the kernel's high-water mark, reset when the load ends (writing 5 "
        "to /proc/PID/clear_refs) and read at exit (os.wait4 ru_maxrss). bf16 weights load as memory-mapped "
        "safetensors, so they count as file-backed pages once touched. It includes Python and the libraries "
        "(rss_before_load_bytes: RSS when the load starts). load_peak_bytes is the high-water mark up to the end of "
        "the load (VmHWM just before the reset); stage_peak_bytes = max of the two. anon_peak_bytes: the largest "
        f"RssAnon seen sampling /proc/PID/status every {SAMPLE_S} s (memory the kernel cannot drop: no swap).",
    "planned_peak_bytes": "`python -m lowmem_dpo.plan RECIPE --json`: the planner's peak_bytes of train and "
        "precompute for the recipe as given (T = max_length, every position a completion token: its worst case; "
        "on a CPU tensors only, framework_overhead 0). The rows here are a little shorter (data.shapes). "
        "planned_vs_measured_pct = (planned - measured) / measured; planned_vs_measured_above_start_pct sets it "
        "against measured_above_start_bytes = measured_peak_bytes - rss_before_load_bytes (what the process added "
        "from the start of its load: the planner leaves Python and the libraries out).",
    "tensor_peak_bytes": "live tensor bytes, as the planner counts them: the stage runs as `python -m "
        "lowmem_dpo.STAGE` would (its main through lowmem_dpo.config.cli.run_cli), in `python bench/full_scale.py --stage "
        "STAGE RECIPE OUT`, which wraps lowmem_dpo.model.models.load_model so that its first return enters "
        "lowmem_dpo.measure.PeakMeter (the planner's own meter, as `plan --measure` uses it: the live storages "
        "then, the model's memory-mapped weights included, plus every allocation and free of torch's CPU allocator "
        "until the stage ends, recorded by torch.profiler). Not counted: Python, allocator caches, file pages. "
        "planned_vs_tensor_peak_pct = (planned - tensor peak) / tensor peak. The profiler slows each op by "
        "microseconds (visible only on tiny models); --plain runs the stages without it.",
    "load_s": "from the stage's log line before its model load to the first output after it (precompute: "
        "'precompute: N sequences on ...' to its progress bar's first render; train: the 'model: ...' line to the "
        "'resolved: ...' line, so it includes the few rows' tokenization, the LoRA wrap and the optimizer), "
        "timed as the lines arrive. bf16 weights are memory-mapped: their pages are read at the first forward, "
        "not in load_s. 4bit quantizes every decoder Linear on the CPU while loading. The run's load_s is "
        "precompute's.",
    "sequences_per_s": "precompute's sequences (prompt + one completion: a pair is two) / seconds from the end "
        f"of its load to its 'computed N sequences' line (the data's max({PRECOMPUTE_ROWS}, --steps) rows: twice "
        f"that many sequences, {PRECOMPUTE_ROWS} pairs per forward); build_sequences_per_s is the stage's own "
        "figure, its forwards only (ref_cache_dir/build.json, rounded to 3 decimals). Results from before the "
        "reference cache was keyed per sequence have rows_per_s and build_rows_per_s instead: pairs/s.",
    "heap": "train's 'CPU heap:' log line (lowmem_dpo/runtime/heap.py): malloc's mmap threshold, and whether torch's "
        "large blocks are on transparent huge pages; machine.allocator_env: the allocator variables set when it ran.",
    "median_step_s": "median over the --steps steps of metrics.jsonl step_time_s (train's own wall time of "
        "step.optimizer_step: forward, DPO loss against the cached reference, backward, clip, AdamW; "
        "logging_steps 1). Step 1 includes first-touch page faults of the weights.",
    "flops": "counted from the shapes, per step (the step's pair replayed from the seed as train draws it): "
        "forward = 2 x decoder Linear params x real tokens + LoRA (2 r (in + out) per adapted Linear per token) + "
        "attention (QK^T and AV over the causal half: 2 x q_dim x T^2 per layer and sequence) + LM head "
        "(2 x vocab x hidden per completion position: logps.py runs the head on those only). useful = forward + "
        "backward through the frozen base (activation gradients: the same as the forward's Linear and LM head "
        "FLOPs, 2x its attention, 2x its LoRA with LoRA's weight gradients); padding, elementwise ops and AdamW "
        "not counted. Recomputation (the tiled LM head's forward again in its backward, always; every decoder "
        "layer's forward again under gradient checkpointing, as the train log's resolved line says: "
        "train.gradient_checkpointing) is NOT counted in useful_flops; with_recompute adds it.",
    "step_vs_matmul_peak": "median over the steps of useful FLOPs / step_time_s, divided by matmul_flop_per_s: "
        "the largest median FLOP/s of torch.mm in the run's compute dtype (squares 512, 1024, 2048 and the "
        "model's MLP up-projection at the step's token count; bench/limits.py matmul_timer, 5 timings of ~0.15 s "
        "each), measured in this process before the run's precompute and again after its train (`matmul`), the "
        "larger of the two. step_vs_matmul_peak_with_recompute counts the recomputation too.",
}


def log(msg: str) -> None:
    print(f"full_scale: {msg}", file=sys.stderr, flush=True)


# -- data ----------------------------------------------------------------------------------------------------------
def _sentence(rng: random.Random, noun: str, words: list[str]) -> str:
    a, b = rng.sample(words, 2)
    return f"The {noun} is {a} and {b}."


def long_row(tokenizer, max_length: int, i: int) -> dict:
    """Row i: a prompt of earlier reviews up to ~max_length/4 tokens and an instruction, then chosen / rejected
    of the matching / opposite polarity, as many sentences as keep prompt + completion + EOS <= max_length."""
    rng = random.Random(i)
    noun = rng.choice(NOUNS)
    kind = "positive" if i % 2 == 0 else "negative"
    right, wrong = (GOOD, BAD) if kind == "positive" else (BAD, GOOD)
    instruction = f"Write a {kind} review of the {noun}.\n"

    def tokens(text: str, special: bool = True) -> int:
        return len(tokenizer(text, add_special_tokens=special)["input_ids"])

    def prompt_of(context: list[str]) -> str:
        return (f"Earlier reviews: {' '.join(context)}\n" if context else "") + instruction

    # Sentences are added with their own token counts (each with its leading space), the whole text tokenized only
    # to check the end: tokenizing the growing text at each sentence took minutes at 20k tokens.
    context: list[str] = []
    n = tokens(prompt_of(["x"]))
    while n < max_length // 4:
        context.append(_sentence(rng, rng.choice(NOUNS), rng.choice((GOOD, BAD))))
        n += tokens(" " + context[-1], special=False)
    while context and tokens(prompt_of(context + ["x"])) >= max_length // 4:
        context.pop()
    prompt, eos = prompt_of(context), tokenizer.eos_token
    base = tokens(prompt + eos)
    chosen: list[str] = []
    rejected: list[str] = []
    sizes = [0, 0]
    while max(sizes) + base <= max_length:
        chosen.append(_sentence(rng, noun, right))
        rejected.append(_sentence(rng, noun, wrong))
        sizes = [sizes[0] + tokens(" " + chosen[-1], False), sizes[1] + tokens(" " + rejected[-1], False)]
    while chosen and max(tokens(prompt + " ".join(chosen) + eos),
                         tokens(prompt + " ".join(rejected) + eos)) > max_length:
        chosen.pop()
        rejected.pop()
    if not chosen:
        raise UserError(f"--max-length {max_length}: too short for a prompt and one sentence; use >= 48")
    return {"prompt": prompt, "chosen": " ".join(chosen), "rejected": " ".join(rejected)}


def write_data(model_dir: Path, max_length: int, rows: int, path: Path) -> Path:
    from lowmem_dpo.model.models import load_tokenizer
    from lowmem_dpo.model.tiny import write_jsonl

    tokenizer = load_tokenizer(model_dir)
    write_jsonl([long_row(tokenizer, max_length, i) for i in range(rows)], path)
    return path


def data_shapes(model_dir: Path, data: Path, max_length: int) -> dict:
    """Tokens of each row's prompt, chosen and rejected completion as the stages tokenize them."""
    from lowmem_dpo.config.recipe import build_config
    from lowmem_dpo.model import models
    from lowmem_dpo.training import inputs

    cfg = build_config({"model_name_or_path": str(model_dir), "dataset": str(data), "max_length": max_length})
    tok = inputs.tokenized(cfg, models.load_tokenizer(model_dir), progress=False)
    return {"prompt_chosen_rejected_tokens": [[len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)]
                                              for p in tok.pairs],
            "truncated_rows": sum(len(v) for v in tok.truncated.values()), "dropped_rows": len(tok.dropped)}


# -- recipe --------------------------------------------------------------------------------------------------------
def write_recipe(path: Path, model_dir: Path, data: Path, run_dir: Path, dtype: str, quantization: str,
                 max_length: int, steps: int, checkpointing: str = "true") -> Path:
    values = {
        "model_name_or_path": str(model_dir), "dataset": str(data),
        "output_dir": str(run_dir / "train-out"), "ref_cache_dir": str(run_dir / "ref-cache"),
        "device": "cpu", "dtype": dtype, "quantization": quantization,
        # true by default, as the committed series ran; auto: the planner's choice (off where the activations fit)
        "gradient_checkpointing": checkpointing,
        "max_length": max_length, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
        "max_steps": steps, "logging_steps": 1, "save_steps": 0, "resume": "never",
        "precompute_batch_size": PRECOMPUTE_ROWS, "lora_r": LORA_R, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_target_modules": "all-linear", "learning_rate": 5e-6, "beta": 0.1, "seed": 42,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by bench/full_scale.py\n" + "".join(f"{k}: {v}\n" for k, v in values.items()))
    return path


# -- one stage in its own process ------------------------------------------------------------------------------------
def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process in bytes ({} once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB", text, re.M)}


class Stage:
    """One stage in its own process, run from the repository root: its output teed to a log and split into lines
    on \\r and \\n with their arrival times, its RssAnon sampled. `load_start(line)` / `load_end(line)` recognise
    the lines around its model load: when the load ends, the process's RSS high-water mark is read and reset."""

    def __init__(self, argv: list[str], log_path: Path, load_start, load_end):
        self.argv, self.log_path, self.load_start, self.load_end = argv, log_path, load_start, load_end
        self.lines: list[tuple[float, str]] = []  # (seconds since start, text)
        self.marks: dict = {}
        self.anon_peak = 0
        self.done = threading.Event()

    def run(self) -> dict:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threads = [threading.Thread(target=self.reader, daemon=True), threading.Thread(target=self.sampler,
                                                                                      daemon=True)]
        for th in threads:
            th.start()
        try:
            _, status, usage = os.wait4(self.proc.pid, 0)
        except BaseException:
            self.proc.kill()
            raise
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.done.set()
        for th in threads:
            th.join()
        self.proc.stdout.close()
        return self.result(usage.ru_maxrss * 1024)

    def on_line(self, t: float, text: str, partial: bool = False) -> None:
        pid, marks = self.proc.pid, self.marks
        if not partial:
            self.lines.append((t - self.t0, text))
        if "load_start" not in marks and self.load_start(text):
            marks["load_start"] = t - self.t0
            marks["rss_before_load_bytes"] = _status(pid).get("VmRSS")
        elif "load_start" in marks and "load_end" not in marks and self.load_end(text):
            marks["load_end"] = t - self.t0
            marks["load_peak_bytes"] = _status(pid).get("VmHWM")
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM (and what wait4 reports)
                marks["reset"] = True
            except OSError as e:
                marks["reset"] = f"{type(e).__name__}: {e}"

    def reader(self) -> None:
        buf = b""
        with open(self.log_path, "wb") as f:
            while chunk := self.proc.stdout.read1(1 << 16):
                f.write(chunk)
                f.flush()
                *parts, buf = re.split(rb"[\r\n]", buf + chunk)
                now = time.perf_counter()
                for part in parts:
                    if part.strip():
                        self.on_line(now, part.decode(errors="replace").strip())
                if buf.strip():  # a progress bar's render ends at the next one's \r: look at it now
                    self.on_line(now, buf.decode(errors="replace").strip(), partial=True)
        if buf.strip():
            self.on_line(time.perf_counter(), buf.decode(errors="replace").strip())

    def sampler(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.anon_peak = max(self.anon_peak, _status(self.proc.pid).get("RssAnon", 0))

    def result(self, maxrss: int) -> dict:
        """The stage's record; `maxrss`: wait4's peak RSS, since the reset when there was one."""
        marks, rc = self.marks, self.proc.returncode
        out = {"command": shlex.join(self.argv), "log": str(self.log_path), "exit_code": rc,
               "wall_s": round(time.perf_counter() - self.t0, 2), "anon_peak_bytes": self.anon_peak,
               "rss_before_load_bytes": marks.get("rss_before_load_bytes")}
        if marks.get("reset") is True:
            out["measured_peak_bytes"] = maxrss
            out["load_peak_bytes"] = marks["load_peak_bytes"]
            out["stage_peak_bytes"] = max(maxrss, marks["load_peak_bytes"] or 0)
        else:  # no load seen (the stage failed early), or the reset was refused: the whole stage's peak
            out["measured_peak_bytes"] = out["stage_peak_bytes"] = maxrss
            out["measured_peak_note"] = f"whole stage (no high-water reset at the end of the load: {marks.get('reset')})"
        if "load_start" in marks and "load_end" in marks:
            out["load_s"] = round(marks["load_end"] - marks["load_start"], 2)
        if rc != 0:
            why = (f"killed by signal {-rc}" + (" (SIGKILL: the out-of-memory killer?)" if rc == -9 else "")
                   if rc < 0 else f"exit code {rc}")
            out["error"] = why + ": " + " | ".join(text for _, text in self.lines[-8:])
        return out


def stage_argv(stage: str, recipe: Path, meter_json: Path, plain: bool) -> list[str]:
    if plain:
        return [sys.executable, "-m", f"lowmem_dpo.{stage}", str(recipe)]
    return [sys.executable, str(Path(__file__).resolve()), "--stage", stage, str(recipe), str(meter_json)]


def stage_main(stage: str, recipe: str, meter_json: str) -> int:
    """--stage: run lowmem_dpo.STAGE's main as its CLI does, with a PeakMeter from the end of its model load to
    the end of the stage (METHOD["tensor_peak_bytes"]); the meter's figures go to `meter_json`."""
    from lowmem_dpo import measure, precompute, train
    from lowmem_dpo.config.cli import run_cli
    from lowmem_dpo.model import models

    module = {"precompute": precompute, "train": train}[stage]
    meter: list = []
    load_model = models.load_model

    def metered_load_model(*args, **kwargs):
        model = load_model(*args, **kwargs)
        if not meter:  # the stage's model: what it holds from here on is counted
            meter.append(measure.PeakMeter(torch.device("cpu")).__enter__())
        return model

    models.load_model = metered_load_model
    try:
        return run_cli(module.main, [recipe], stage, module.__doc__)
    finally:
        if meter:
            meter[0].__exit__(None, None, None)
            Path(meter_json).write_text(json.dumps({"tensor_peak_bytes": meter[0].peak_bytes,
                                                    "tensor_entry_bytes": meter[0].entry_bytes}))


def add_tensor_peak(out: dict, meter_json: Path) -> None:
    if meter_json.is_file() and out.get("exit_code") == 0:
        out.update(json.loads(meter_json.read_text()))
        out["planned_vs_tensor_peak_pct"] = _error_pct(out.get("planned_peak_bytes"), out["tensor_peak_bytes"])


def first_time(stage: Stage, match) -> float | None:
    return next((t for t, text in stage.lines if match(text)), None)


# -- the stages of one run -------------------------------------------------------------------------------------------
def plan_stage(recipe: Path, run_dir: Path) -> dict:
    """python -m lowmem_dpo.plan RECIPE --json: the planner's peaks for the recipe as given."""
    out_json = run_dir / "plan.json"
    out_json.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "lowmem_dpo.plan", str(recipe), "--json", str(out_json)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    (run_dir / "plan.log").write_text(proc.stdout + proc.stderr)
    if not out_json.is_file() or proc.returncode not in (0, 1):
        return {"command": shlex.join(argv), "exit_code": proc.returncode,
                "error": (proc.stdout + proc.stderr).strip()[-2000:]}
    plan = json.loads(out_json.read_text())
    return {"command": shlex.join(argv), "exit_code": proc.returncode, "fits": proc.returncode == 0,
            "budget_bytes": plan["budget_bytes"], "train_peak_bytes": plan["train"]["peak_bytes"],
            "precompute_peak_bytes": plan["precompute"]["peak_bytes"], "json": str(out_json),
            "wall_s": round(time.perf_counter() - t0, 1)}


def _error_pct(planned: int | None, measured: int | None) -> float | None:
    return round(100 * (planned - measured) / measured, 1) if planned and measured else None


def add_planned(out: dict, planned: int | None) -> None:
    """The planner's peak beside the measured one: against the whole RSS, and against the RSS above what the
    process held before its model load (Python and the libraries, which the planner leaves out on a CPU)."""
    measured, before = out.get("measured_peak_bytes"), out.get("rss_before_load_bytes")
    out["planned_peak_bytes"] = planned
    if out.get("exit_code") != 0:  # a stage that stopped early peaked early: no comparison
        return
    out["planned_vs_measured_pct"] = _error_pct(planned, measured)
    if measured and before:
        out["measured_above_start_bytes"] = measured - before
        out["planned_vs_measured_above_start_pct"] = _error_pct(planned, measured - before)


def precompute_stage(recipe: Path, run_dir: Path, planned: int | None, plain: bool) -> dict:
    from lowmem_dpo import precompute
    from lowmem_dpo.data import cache

    cache_dir, meter_json = run_dir / "ref-cache", run_dir / "precompute-meter.json"
    shutil.rmtree(cache_dir, ignore_errors=True)  # from scratch: sequences/s of a real build
    meter_json.unlink(missing_ok=True)
    stage = Stage(stage_argv("precompute", recipe, meter_json, plain), run_dir / "precompute.log",
                  lambda s: s.startswith("precompute: ") and (" rows on " in s or " sequences on " in s),
                  lambda s: s.startswith("precompute:") and "%|" in s)  # its progress bar, not the load's
    out = stage.run()
    add_planned(out, planned)
    add_tensor_peak(out, meter_json)
    if out["exit_code"] != 0:
        return out
    build = json.loads((cache_dir / precompute.BUILD).read_text())
    sequences = build["computed"]
    end = first_time(stage, lambda s: s.startswith(f"computed {sequences} sequences"))
    load_end = stage.marks.get("load_end")
    out["sequences"] = sequences
    out["build_sequences_per_s"] = build["sequences_per_s"]
    out["sequences_per_s"] = (round(sequences / (end - load_end), 4) if sequences and end and load_end and
                              end > load_end else build["sequences_per_s"])
    with cache.open_store(cache_dir) as store:
        values = store.values(store.side(build["model_side"]))
    logps = torch.tensor([v.logps for v in values], dtype=torch.float64)  # (sequences,)
    n_tokens = sum(v.tokens for v in values)
    out["ref_logps_finite"] = bool(torch.isfinite(logps).all())
    out["ref_logp_per_token"] = round(float(logps.sum() / max(1, n_tokens)), 4)
    return out


def log_lines(log_path: Path) -> list[str]:
    """A stage's log, line by line ([] when it wrote none)."""
    return log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []


def heap_line(lines: list[str]) -> str | None:
    """The stage's "CPU heap: ..." line (runtime/heap.py: the mmap threshold, and huge pages or what the threshold
    costs), which sets its step time and RSS."""
    return next((line.split("CPU heap: ", 1)[1] for line in lines if "CPU heap: " in line), None)


def resolved_checkpointing(lines: list[str]) -> bool | None:
    """The gradient checkpointing the stage ran with: the last "# resolved gradient_checkpointing=..." line of
    the run's config.yaml (the device rule's, or the policy's later one; "resolved ..." in logs before they went
    there), None without one."""
    said = [line.split("gradient_checkpointing=", 1)[1].split()[0] for line in lines
            if line.removeprefix("# ").startswith("resolved gradient_checkpointing=")]
    return said[-1] == "true" if said else None


def train_stage(recipe: Path, run_dir: Path, planned: int | None, plain: bool) -> dict:
    meter_json = run_dir / "train-meter.json"
    shutil.rmtree(run_dir / "train-out", ignore_errors=True)
    meter_json.unlink(missing_ok=True)
    out = Stage(stage_argv("train", recipe, meter_json, plain), run_dir / "train.log",
                lambda s: s.startswith("model: "), lambda s: s.startswith("resolved")).run()
    add_planned(out, planned)
    add_tensor_peak(out, meter_json)
    lines = log_lines(run_dir / "train.log")
    out["heap"] = heap_line(lines)
    out["gradient_checkpointing"] = resolved_checkpointing(log_lines(run_dir / "train-out" / "config.yaml"))
    metrics = run_dir / "train-out" / "metrics.jsonl"
    if out["exit_code"] != 0 or not metrics.is_file():
        return out
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    out["step_s"] = [m["step_time_s"] for m in lines]
    out["median_step_s"] = round(statistics.median(out["step_s"]), 3)
    out["tokens_per_step_from_metrics"] = [round(m["tokens_per_s"] * m["step_time_s"]) for m in lines]
    out["loss"] = [m.get("loss") for m in lines]
    return out


# -- FLOPs and the matmul rate -------------------------------------------------------------------------------------
def step_flops(model_dir: Path, seqs: list[tuple[int, int]], lora_r: int) -> dict:
    """FLOPs of one train step over sequences [(tokens, completion tokens)], from the model's tensor shapes (see
    METHOD["flops"]). LoRA on every decoder Linear (all-linear)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    specs = random_weights.tensor_specs(config)
    layer_mats = [s for n, s in specs.items() if n.startswith("model.layers.") and len(s) == 2]
    vocab, hidden = specs.get("lm_head.weight", specs["model.embed_tokens.weight"])
    q_dim = config.num_attention_heads * (getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
    n = sum(t for t, _ in seqs)
    m = sum(c for _, c in seqs)
    fwd = {"linears": 2 * sum(o * i for o, i in layer_mats) * n,
           "lora": 2 * sum(lora_r * (o + i) for o, i in layer_mats) * n,
           "attention": config.num_hidden_layers * sum(2 * q_dim * t * t for t, _ in seqs),
           "lm_head": 2 * vocab * hidden * m}
    useful = 2 * fwd["linears"] + 3 * fwd["lora"] + 3 * fwd["attention"] + 2 * fwd["lm_head"]
    return {"tokens": n, "completion_tokens": m, "forward": fwd, "useful_flops": useful}


def recomputed(forward: dict, checkpointing: bool) -> int:
    """FLOPs a step computes again: the tiled LM head's forward in its backward, always (head.TiledLogps); under
    gradient checkpointing every decoder layer's forward too."""
    return sum(forward.values()) if checkpointing else forward["lm_head"]


def replayed_steps(recipe: Path, steps: int) -> list[list[tuple[int, int]]]:
    """The (tokens, completion tokens) of the chosen and rejected sequence of each train step, the pairs drawn as
    train draws them (step.pair_stream from the seed)."""
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.model import models
    from lowmem_dpo.training import inputs

    cfg = load_config(recipe)
    tok = inputs.tokenized(cfg, models.load_tokenizer(Path(cfg.model_name_or_path)), progress=False)
    stream = pair_stream(tok.pairs, cfg.seed)
    out = []
    for _ in range(steps):
        p = next(stream)
        out.append([(len(p.prompt_ids) + len(c), len(c)) for c in (p.chosen_ids, p.rejected_ids)])
    return out


def matmul_flop_per_s(dtype: torch.dtype, model_shape: tuple[int, int, int], repeats: int = 5) -> dict:
    """The largest median FLOP/s of torch.mm over square shapes and the model's MLP shape (limits.py's timer)."""
    import limits

    rows = []
    for m, k, n in [(s, s, s) for s in limits.square_sizes(torch.device("cpu"))] + [model_shape]:
        timer = limits.matmul_timer(m, k, n, dtype, torch.device("cpu"))
        rows.append({"m": m, "k": k, "n": n, "median_flop_per_s": round(statistics.median(timer()
                                                                                      for _ in range(repeats)))})
    return {"peak_flop_per_s": max(r["median_flop_per_s"] for r in rows), "shapes": rows,
            "threads": torch.get_num_threads()}


def model_matmul_shape(model_dir: Path, per_step: list[dict]) -> tuple[int, int, int]:
    """(tokens of the largest step, hidden, intermediate): the MLP up-projection of a train step."""
    config = json.loads((model_dir / "config.json").read_text())
    return max(f["tokens"] for f in per_step), config["hidden_size"], config["intermediate_size"]


def add_flops(train: dict, per_step: list[dict], matmul: list[dict]) -> None:
    """The steps' FLOPs against the matmul rate: the best of the measurements in `matmul` (before precompute and
    after train: a measurement taken while other processes share the cores reads low). The recomputation is the
    one of the checkpointing the train stage resolved (its config.yaml's line)."""
    peak = max(mm["peak_flop_per_s"] for mm in matmul)
    times = train["step_s"]
    with_recompute = [f["useful_flops"] + recomputed(f["forward"], train["gradient_checkpointing"]) for f in per_step]
    train["tokens_per_step"] = [f["tokens"] for f in per_step]
    train["useful_flops_per_step"] = [f["useful_flops"] for f in per_step]
    train["flops_with_recompute_per_step"] = with_recompute
    train["forward_flops_by_part"] = per_step[0]["forward"]
    train["matmul_flop_per_s"] = peak
    train["matmul"] = matmul
    train["step_vs_matmul_peak"] = round(statistics.median(f["useful_flops"] / t / peak
                                                           for f, t in zip(per_step, times)), 4)
    train["step_vs_matmul_peak_with_recompute"] = round(statistics.median(f / t / peak
                                                                          for f, t in zip(with_recompute, times)), 4)


# -- a run -----------------------------------------------------------------------------------------------------------
def bench_run(name: str, model_dir: Path, data: Path, work: Path, args, params: int) -> dict:
    dtype, quantization = RUNS[name]
    run_dir = work / name
    recipe = write_recipe(run_dir / "recipe.yaml", model_dir, data, run_dir, dtype, quantization, args.max_length,
                          args.steps, args.gradient_checkpointing)
    run: dict = {"run": name, "params": params, "dtype": dtype, "quantization": quantization,
                 "recipe": str(recipe), "load_s": None}
    try:
        per_step = [step_flops(model_dir, seqs, LORA_R) for seqs in replayed_steps(recipe, args.steps)]
        shape = model_matmul_shape(model_dir, per_step)
        log(f"[{name}] matmul FLOP/s in {dtype}")
        matmul = [matmul_flop_per_s(getattr(torch, dtype), shape)]
        log(f"[{name}] plan")
        run["plan"] = plan = plan_stage(recipe, run_dir)
        log(f"[{name}] precompute ({run_dir / 'precompute.log'})")
        run["precompute"] = pre = precompute_stage(recipe, run_dir, plan.get("precompute_peak_bytes"), args.plain)
        run["load_s"] = pre.get("load_s")
        if "error" in pre:
            log(f"[{name}] precompute failed: {pre['error']}")
            return run
        log(f"[{name}] precompute: {pre['sequences_per_s']} sequences/s, peak {fmt(pre['measured_peak_bytes'])}")
        log(f"[{name}] train, {args.steps} steps ({run_dir / 'train.log'})")
        run["train"] = train = train_stage(recipe, run_dir, plan.get("train_peak_bytes"), args.plain)
        if run["load_s"] is None:
            run["load_s"] = train.get("load_s")
        if "error" in train:
            log(f"[{name}] train failed: {train['error']}")
            return run
        log(f"[{name}] train: median step {train['median_step_s']} s, peak {fmt(train['measured_peak_bytes'])}; "
            "matmul FLOP/s again")
        matmul.append(matmul_flop_per_s(getattr(torch, dtype), shape))
        add_flops(train, per_step, matmul)
    except Exception as e:  # keep what was measured, and the other run
        run["error"] = f"{type(e).__name__}: {e}"
        run["traceback"] = traceback.format_exc()[-4000:]
        log(f"[{name}] failed: {run['error']}")
    return run


def table(runs: list[dict]) -> str:
    def size(v):
        return fmt(v) if isinstance(v, int) else "-"

    def num(v, f="{:.3g}"):
        return f.format(v) if isinstance(v, (int, float)) else "-"

    head = (f"{'run':6}{'params':>8}{'load_s':>8} | {'pre seq/s':>10}{'planned':>11}{'measured':>11}{'err%':>7} | "
            f"{'step_s':>8}{'vs mm':>7}{'planned':>11}{'measured':>11}{'err%':>7}")
    lines = [head, "-" * len(head)]
    for r in runs:
        p, t = r.get("precompute", {}), r.get("train", {})
        lines.append(f"{r['run']:6}{r['params'] / 1e9:>7.2f}B{num(r.get('load_s'), '{:.1f}'):>8} | "
                     f"{num(p.get('sequences_per_s')):>10}{size(p.get('planned_peak_bytes')):>11}"
                     f"{size(p.get('measured_peak_bytes')):>11}{num(p.get('planned_vs_measured_pct'), '{:+.1f}'):>7} | "
                     f"{num(t.get('median_step_s'), '{:.2f}'):>8}{num(t.get('step_vs_matmul_peak'), '{:.3f}'):>7}"
                     f"{size(t.get('planned_peak_bytes')):>11}{size(t.get('measured_peak_bytes')):>11}"
                     f"{num(t.get('planned_vs_measured_pct'), '{:+.1f}'):>7}")
        for stage, part in (("precompute", p), ("train", t)):
            if part.get("tensor_peak_bytes"):
                lines.append(f"  {r['run']} {stage}: tensor peak {size(part['tensor_peak_bytes'])} (planned "
                             f"{num(part.get('planned_vs_tensor_peak_pct'), '{:+.1f}')}%), RssAnon peak "
                             f"{size(part.get('anon_peak_bytes'))}, RSS before load "
                             f"{size(part.get('rss_before_load_bytes'))}, load peak {size(part.get('load_peak_bytes'))}")
        for what, part in (("run", r), ("precompute", p), ("train", t)):
            if "error" in part:
                lines.append(f"  {r['run']} {what} error: {part['error'][:300]}")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, help="a shipped architecture (lowmem_dpo/memory/archs/NAME)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="train steps (1 pair each)")
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to its first N decoder layers "
                    "(a separate folder; for smoke tests). Default: all")
    ap.add_argument("--runs", default="bf16,4bit", help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--gradient-checkpointing", choices=("true", "false", "auto"), default="true",
                    help="the recipe's gradient_checkpointing (default true, as the committed series; auto: the "
                    "planner's choice for this machine's RAM)")
    ap.add_argument("--plain", action="store_true", help="run the stages as `python -m lowmem_dpo.STAGE` "
                    "without the tensor meter (RSS peaks only; no torch profiler in the stage)")
    args = ap.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in args.runs if r not in RUNS]
    if bad or not args.runs:
        ap.error(f"--runs: unknown {', '.join(bad) or 'none given'} (known: {', '.join(RUNS)})")
    if args.steps < 1 or args.max_length < 48:
        ap.error("--steps must be >= 1 and --max-length >= 48")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stage"] and len(argv) == 4:  # one stage, in the process bench_run starts for it
        return stage_main(*argv[1:])
    args = parse_args(argv)
    from machine import command_line, machine_info

    t_start = time.perf_counter()
    report: dict = {"runs": [], "method": METHOD, "machine": machine_info(),
                    "command": command_line("full_scale.py", argv)}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        built = not (random_weights.model_folder(args.arch, args.layers) / random_weights.MARKER).is_file()
        model_dir = random_weights.ensure_model(args.arch, args.layers, log=log)
        build = json.loads((model_dir / random_weights.MARKER).read_text())
        report["model"] = {"folder": str(model_dir), **build, "built_now": built,
                           "build_s": round(time.perf_counter() - t0, 1) if built else None}
        work = WORK / model_dir.name
        rows = max(PRECOMPUTE_ROWS, args.steps)
        data = write_data(model_dir, args.max_length, rows, work / f"data-{args.max_length}-{rows}.jsonl")
        report["data"] = {"path": str(data), "rows": rows, "max_length": args.max_length,
                          "shapes": data_shapes(model_dir, data, args.max_length)}
    except UserError as e:
        log(f"error: {e}")
        return 2
    for name in args.runs:
        report["runs"].append(bench_run(name, model_dir, data, work, args, build["params"]))
        report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report["runs"]))
    log(f"wrote {out} in {report['total_wall_s']} s")
    failed = any("error" in r or "error" in r.get("precompute", {}) or "error" in r.get("train", {})
                 for r in report["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
