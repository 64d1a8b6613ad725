"""The measuring harness behind `lowmem-dpo plan --measure`: run precompute's forward and train's
steps on this machine and measure their peak tensor memory, to set against the memory model's prediction.

It imports the stages (precompute, train) and nothing in the package imports it but the plan CLI.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.schema import Config
from lowmem_dpo.config.sources import Source
from lowmem_dpo.data import cache
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.arch_source import arch_config_path
from lowmem_dpo.memory.model import predict
from lowmem_dpo.memory.setup import Setup, setup_from_config
from lowmem_dpo.model import headcheck, models
from lowmem_dpo.model.tiny import BUILTIN_PREFIX, ensure_builtin
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import inputs, policy
from lowmem_dpo.training.step import micro_batches, optimizer_step


class PeakMeter:
    """Peak of live tensor memory on a device while the `with` block runs, the tensors alive at entry included.

    CUDA: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats (the caching allocator's
      bytes in live tensors; its reserve and the CUDA context are not counted).
    CPU:  the same quantity, exact: at entry, the bytes of every live CPU tensor's storage (found through the
      garbage collector, each storage once however many views share it: parameters, buffers, quantization
      state, optimizer state); then every allocation and free of the CPU allocator while the block runs, as
      torch.profiler(profile_memory=True) records them, summed in order; the peak is entry + the running sum's
      maximum. A free counts only for a block whose size is known (allocated in the block, or live at entry).
      Not counted: Python objects, allocator caches, libraries' own memory (RSS noise).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self.entry_bytes = 0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.entry_bytes = torch.cuda.memory_allocated(self.device)
            return self
        if self.device.type != "cpu":
            raise UserError(f"--measure supports cpu and cuda, not {self.device.type}")
        self._live = live_storages(self.device)
        self.entry_bytes = sum(self._live.values())
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # kineto prints a line on start and stop
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return False
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = self.entry_bytes + _running_peak(self._prof, self._live, self.device)
        return False


def live_storages(device) -> dict[int, int]:
    """data_ptr -> bytes of every live tensor storage on `device` the garbage collector can see."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() touches deprecated lazy module attributes
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device == device and obj.layout == torch.strided:
                    st = obj.untyped_storage()
                    if st.nbytes():
                        out[st.data_ptr()] = st.nbytes()
            except Exception:  # tensors without storage (meta, functional wrappers)
                continue
    return out


def _running_peak(prof, live_at_entry: dict[int, int], device) -> int:
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        extra = ev.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == device.type:
            events.append((ev.start_time_ns, extra.alloc_size, extra.ptr))
    events.sort(key=lambda e: e[0])
    blocks, entry = {}, dict(live_at_entry)
    cur = peak = 0
    for _, size, ptr in events:
        if size > 0:
            blocks[ptr] = size
            cur += size
            peak = max(peak, cur)
        elif ptr in blocks:
            cur -= blocks.pop(ptr)
        elif ptr in entry:
            cur -= entry.pop(ptr)
    return peak


class _quiet_stderr:
    """Silence file descriptor 2 (C-level prints) for the duration of the block."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)
        return False


def _pair_shape(pairs, shared: bool = False) -> tuple[int, int]:
    """(padded T, completion tokens) of the micro-batch `pairs` as data.collate builds it, or
    data.collate_shared (`shared`: one row [prompt, chosen, rejected] per pair)."""
    if shared:
        lengths = [len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
    else:
        lengths = [len(p.prompt_ids) + len(c) for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    return max(lengths), sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)


def _longest_rows(cfg: Config, tokenizer, n: int, out: Path) -> list[Source]:
    """The n rows with the longest tokenized pairs, written as JSONL into `out`, one file per source of the
    dataset they come from (sources may differ in format): measuring on them is measuring the worst batches of
    the data, in seconds. Returns those files as the sources of a dataset."""
    mix, tok = inputs.tokenized_mixture(cfg, tokenizer, progress=False)
    ordered = sorted(tok.pairs, key=lambda p: -(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))))
    by_part: dict[int, list[dict]] = {}
    for p in sorted(ordered[:n], key=lambda p: p.row):
        row = mix.row(p.row)
        by_part.setdefault(mix.locate(p.row)[0], []).append({k: row[k] for k in ("prompt", "chosen", "rejected")})
    written = []
    for k, rows in sorted(by_part.items()):
        path = out / f"rows-{k}.jsonl"
        path.write_text("".join(json.dumps(written_row) + "\n" for written_row in rows), encoding="utf-8")
        written.append(Source(str(path)))
    return written


def _measure_precompute(mcfg: Config, prepared: inputs.Inputs, resolved: devices.Resolved):
    """(PeakMeter, (padded T, completion tokens, forward rows), shared) of precompute.units_logps over one batch of
    the longest sequences, the reference loaded as precompute loads it."""
    tok = inputs.tokenized(mcfg, prepared.tokenizer, progress=False)
    model = policy.setup_model(mcfg, resolved, prepared.model_path, source=prepared.source, reference=True)
    pad_id = data.pad_token_id(prepared.tokenizer)
    layout = headcheck.bring_up(model, mcfg, resolved, pad_id, tok.pairs[:1], tok.pairs)  # as precompute.run
    shared = layout.shared
    rows = mcfg.precompute_batch_size * (1 if shared else 2)  # a pair is one shared row, or two unshared ones
    units = precompute.forward_units(tok.pairs, [cache.pair_keys(p) for p in tok.pairs], None, shared)
    units = precompute.longest_first(units)[:rows]
    with PeakMeter(resolved.device) as meter:
        precompute.units_logps(precompute.ReferenceForward(model, pad_id, resolved, layout), units, rows)
    del model
    gc.collect()
    lengths = [len(u[0].prompt_ids) + sum(len(seq.completion_ids) for seq in u) for u in units]
    return meter, (max(lengths), sum(len(seq.completion_ids) for u in units for seq in u), len(units)), shared


def _measure_train(mcfg: Config, steps: int, timed: int = 0):
    """(PeakMeter, [(T, completion tokens)] of each micro-batch, whether the batches were shared, [(seconds,
    tokens)] of `timed` more steps run without the meter (its profiler slows each op), (whether the MLP ran in
    tiles, their size)) of `steps` step.optimizer_step calls after precompute.run and train.setup, as train runs
    them."""
    precompute.run(mcfg, progress=False)
    session = train.setup(mcfg, progress=False)
    taken = []

    def recording(stream):
        for pair in stream:
            taken.append(pair)
            yield pair

    session.progress.stream = recording(session.progress.stream)
    with PeakMeter(session.run.resolved.device) as meter:
        for _ in range(steps):
            optimizer_step(session)
    times = []
    for _ in range(timed):
        t0 = time.perf_counter()
        stats = optimizer_step(session).stats
        devices.synchronize(session.run.resolved.device)
        times.append((time.perf_counter() - t0, stats.tokens))
    resolved = session.run.resolved
    shared, mlp_tiles = session.run.objective.shared, (resolved.mlp_tiles, resolved.mlp_tile_tokens)
    taken_steps = micro_batches(taken, session.run.items_per_step)
    seen = [_pair_shape(pairs, shared) for step in taken_steps  # as step.accumulate splits each step
            for group in session.run.objective.groups(step, session.run.world)
            for pairs in micro_batches(group, session.progress.micro_batch)]
    del session
    gc.collect()
    if meter.device.type == "cuda":
        torch.cuda.empty_cache()
    return meter, seen, shared, times, mlp_tiles


def measure(cfg: Config, steps: int = 2, timed: int = 0) -> dict:
    """Measured peaks of precompute and train for `cfg` on this machine (PeakMeter), on the dataset's longest
    rows, in a temporary folder (the recipe's output_dir and ref_cache_dir are not touched).

    precompute: the reference loaded as precompute loads it, then precompute.units_logps over one batch of
      precompute_batch_size pairs' worth of the longest sequences. train: precompute.run into a temporary cache, then
      train.setup and `steps` step.optimizer_step calls (the second step has the optimizer state)."""
    resolved = devices.resolve(cfg)
    rows = max(cfg.precompute_batch_size,
               cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * (steps + timed))
    with tempfile.TemporaryDirectory(prefix="lowmem_dpo-measure-") as tmp:
        tmp = Path(tmp)
        prepared = inputs.prepare(cfg, resolved)
        subset = _longest_rows(cfg, prepared.tokenizer, rows, tmp)
        # the longest rows, cut at max_length on purpose (the peak is at full length): past any share limit;
        # padded, as the plan counts them (a packed row of rows of unequal length would measure less)
        mcfg = dataclasses.replace(cfg, dataset=subset, dataset_split="train", max_train_samples=None,
                                   ref_cache_dir=str(tmp / "cache"), max_skipped_share=1.0, max_truncated_share=1.0,
                                   output_dir=str(tmp / "out"), max_steps=steps + timed, save_steps=0,
                                   padding_free=False)
        pre, (pre_t, pre_m, n_pre), _ = _measure_precompute(mcfg, prepared, resolved)
        tr, seen, shared, times, mlp_tiles = _measure_train(mcfg, steps, timed)
    t = max(shape[0] for shape in seen)
    positions = max(shape[1] for shape in seen)
    n_train = cfg.per_device_train_batch_size * (1 if shared else 2)
    return {
        "device": resolved.device.type,
        "dtype": devices.dtype_name(resolved.dtype),
        "train": {"measured_peak_bytes": tr.peak_bytes, "entry_bytes": tr.entry_bytes, "steps": steps,
                  "seq_len": t, "completion_tokens": math.ceil(positions / n_train), "share_prompt": shared,
                  "mlp_tiles": mlp_tiles[0], "mlp_tile_tokens": mlp_tiles[1],
                  "step_s": [round(shape, 3) for shape, _ in times], "step_tokens": [n for _, n in times]},
        "precompute": {"measured_peak_bytes": pre.peak_bytes, "entry_bytes": pre.entry_bytes,
                       "seq_len": pre_t, "completion_tokens": math.ceil(pre_m / n_pre)},
    }


def at_measured_shapes(setup: Setup, measured: dict) -> Setup:
    """The setup at the sequence shapes --measure ran (the data's longest rows may be shorter than max_length)."""
    return dataclasses.replace(setup, share_prompt=measured["train"].get("share_prompt", False),
                               mlp_tiles=measured["train"].get("mlp_tiles", True),
                               mlp_tile_tokens=measured["train"].get("mlp_tile_tokens") or setup.mlp_tile_tokens,
                               seq_len=measured["train"]["seq_len"],
                               completion_tokens=measured["train"]["completion_tokens"],
                               precompute_seq_len=measured["precompute"]["seq_len"],
                               precompute_completion_tokens=measured["precompute"]["completion_tokens"])


def write_slice_model(arch_spec: str, layers: int, out: Path) -> Path:
    """A model folder with the architecture of `arch_spec` (its layer sizes and vocabulary) cut to `layers`
    decoder layers, random weights in the config's dtype, and the built-in tokenizer (its ids are valid in any
    vocabulary of >= 1024): enough to measure a 7B-width layer and LM head on a small machine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(arch_config_path(arch_spec).parent)
    config.num_hidden_layers = layers
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = layers
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    del model
    tiny = ensure_builtin(BUILTIN_PREFIX + "tiny-llama")
    for name in models.TOKENIZER_FILES:
        if (tiny / name).is_file():
            (out / name).write_bytes((tiny / name).read_bytes())
    return out


def measure_slice(cfg: Config, layers: int = 2, steps: int = 2, timed: int = 0) -> dict:
    """--slice: measure the recipe's architecture cut to `layers` layers (random weights) and predict the same.
    Returns {"arch": the cut Arch, "measured": measure()'s dict, "prediction": the Prediction at its shapes}."""
    arch = load_arch(cfg.model_name_or_path).with_layers(layers)
    with tempfile.TemporaryDirectory(prefix="lowmem_dpo-slice-") as tmp:
        folder = write_slice_model(cfg.model_name_or_path, layers, Path(tmp))
        scfg = dataclasses.replace(cfg, model_name_or_path=str(folder))
        measured = measure(scfg, steps, timed)
    setup = at_measured_shapes(setup_from_config(cfg), measured)
    return {"arch": arch, "measured": measured, "prediction": predict(arch, setup)}
