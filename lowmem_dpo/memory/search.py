"""The search: the first plan that fits a memory budget, its knobs taken in order of their cost, and the decoder
layers a stage streams from CPU RAM when nothing else fits. Every number is a prediction of model.py.

The knobs, cheapest first, each tried only while a stage is over the budget:
  1. micro_batch      per_device_train_batch_size halved, gradient_accumulation_steps doubled: the same pairs per
                      optimizer step (train applies it by itself: the numbers are the same);
  2. checkpointing    gradient_checkpointing=true: ~30% more compute for the activations (train applies it when
                      the key is auto);
     offloading       activation_offloading=true (CUDA): the layer inputs in pinned CPU RAM, copied back a layer
                      ahead in backward, overlapping compute (train applies it when the key is auto);
     unshare          share_prompt=false: each prompt twice, but no (T, T) mask, which long shared rows pay for
                      (train applies it when the key is auto);
  3. quantization     quantization=4bit (the reference too, unless ref_quantization is set): other numbers and a
                      new cache, so it is advice only;
  4. precompute_batch precompute_batch_size halved: time only (precompute applies it; tried before 4bit when only
                      precompute is over);
  5. stream           the trailing decoder layers' frozen weights in pinned CPU RAM, copied to the GPU for each
                      forward (streaming.py; train and precompute apply it on CUDA): last, every forward pays the copy.
                      16-bit and 4-bit bases only.
Once a heavier knob is on, the micro-batch is again the largest that fits with it. Last, train's MLP runs whole
where that still fits (Setup.mlp_tiles off), else in the largest tiles that fit (Setup.mlp_tile_tokens): its tiles
only for the memory they save.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lowmem_dpo.memory.arch import Arch, adapted, load_arch
from lowmem_dpo.memory.model import Prediction, pinned_bytes, predict
from lowmem_dpo.memory.setup import Setup, lora_targets, setup_from_config
from lowmem_dpo.memory.weights import layer_weight_bytes
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.units import fmt

STAGES = ("train", "precompute")
KNOBS = ("micro_batch", "checkpointing", "offloading", "unshare", "quantization", "precompute_batch", "stream")
# What pinned host-to-device copies reach on a consumer card's PCIe 4.0 x16 link (an estimate: x8 cards, e.g. the
# RTX 4060, get half): the plan's time for the streamed bytes.
STREAM_BYTES_PER_S = 20e9
# Streamed layers on the device at once: the one computing and the next, prefetched on a side stream.
STREAM_BUFFERS = 2


# -- streaming ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """The trailing decoder layers of one stage whose frozen weights stay in pinned CPU RAM, copied to the device
    for each forward (as loaded: a 4-bit layer streams its 4-bit bytes)."""

    layers: int  # layers streamed (0: the stage fits as it is)
    layer_bytes: int  # one layer's weights: saved on the device, held in CPU RAM, copied per forward
    device_peak: int  # the stage's device peak while streaming them
    copies_per_step: int  # how often each streamed layer is copied per optimizer step (precompute: per batch)

    @property
    def cpu_bytes(self) -> int:  # pinned: each layer's one host buffer rounded up to a power of two
        return self.layers * pinned_bytes(self.layer_bytes)

    @property
    def copied_bytes(self) -> int:  # over the link, per pass: the layers' own bytes
        return self.layers * self.layer_bytes

    @property
    def bytes_per_step(self) -> int:
        return self.copied_bytes * self.copies_per_step

    @property
    def seconds_per_step(self) -> float:
        return self.bytes_per_step / STREAM_BYTES_PER_S

    def to_json(self) -> dict:
        return {"layers": self.layers, "cpu_bytes": self.cpu_bytes, "device_peak": self.device_peak,
                "streamed_bytes_per_step": self.bytes_per_step,
                "stream_seconds_per_step": round(self.seconds_per_step, 3)}


def streamed_layers(peak: int, budget: int, per_layer: int, layers: int, buffers: int = STREAM_BUFFERS) -> int:
    """The fewest trailing layers to stream so that `peak` fits `budget`: each one streamed saves `per_layer`
    device bytes, and `buffers` layers' worth of device memory holds the ones being computed and prefetched, so
    k = ceil((peak - budget + buffers*per_layer) / per_layer), at most `layers`; 0 when it fits as it is."""
    if layers < 0 or per_layer <= 0:
        raise ValueError(f"layers={layers}, per_layer={per_layer}: expected layers >= 0 and per_layer > 0")
    if peak <= budget:
        return 0
    return min(layers, math.ceil((peak - budget + buffers * per_layer) / per_layer))


def stage_stream(arch: Arch, setup: Setup, pred: Prediction, stage: str, budget: int) -> Stream:
    """What `stage` (train | precompute) of `setup` streams to fit `budget`. Train copies each streamed layer twice
    per micro-batch (its forward, and again for its backward: streaming.py), precompute once per batch."""
    dtype, quantization = ((setup.dtype, setup.quantization) if stage == "train"
                           else (setup.ref_dtype, setup.ref_quantization))
    per_layer = layer_weight_bytes(arch, dtype, quantization)
    peak = getattr(pred, stage).peak_bytes
    k = streamed_layers(peak, budget, per_layer, arch.layers)
    device_peak = peak - k * per_layer + min(k, STREAM_BUFFERS) * per_layer if k else peak
    return Stream(k, per_layer, device_peak, 2 * setup.grad_accum if stage == "train" else 1)


# -- the plan ----------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    setup: Setup
    prediction: Prediction
    overrides: dict[str, str]  # config key -> value that turn the recipe into this plan
    steps: list[str]  # what the search changed, in order, and why
    fits: bool
    streams: dict[str, Stream] = field(default_factory=dict)  # stage -> its streamed layers (stream knob)

    @property
    def offload_bytes(self) -> int:  # train's streamed layers in CPU RAM
        return self.streams["train"].cpu_bytes if "train" in self.streams else 0

    @property
    def precompute_offload_bytes(self) -> int:
        return self.streams["precompute"].cpu_bytes if "precompute" in self.streams else 0

    @property
    def offload_layers(self) -> int:
        return max((stream.layers for stream in self.streams.values()), default=0)

    def to_json(self, budget: int) -> dict:
        return {"fits": self.fits, "overrides": self.overrides, "steps": self.steps,
                "offload_bytes": self.offload_bytes, "precompute_offload_bytes": self.precompute_offload_bytes,
                "offload_layers": self.offload_layers,
                "stream": {stage: stream.to_json() for stage, stream in self.streams.items()},
                "train": self.prediction.train.to_json(budget, self.offload_bytes),
                "precompute": self.prediction.precompute.to_json(budget, self.precompute_offload_bytes)}


def _smaller_micro_batch(b: int) -> int:
    """The largest divisor of b at most b/2 (b even: b/2), so accumulation keeps the effective batch exact."""
    return max(d for d in range(1, b // 2 + 1) if b % d == 0)


def _fits(arch: Arch, setup: Setup, stage: str, budget: int) -> bool:
    return getattr(predict(arch, setup), stage).peak_bytes <= budget


def _largest_micro_batch(arch: Arch, setup: Setup, budget: int) -> Setup:
    """`setup` at the largest micro-batch (a divisor chain of its own, accumulation raised to keep the pairs per
    step) whose train peak fits; at 1 when none does."""
    while setup.micro_batch > 1 and not _fits(arch, setup, "train", budget):
        b = _smaller_micro_batch(setup.micro_batch)
        setup = dataclasses.replace(setup, micro_batch=b, grad_accum=setup.grad_accum * (setup.micro_batch // b))
    return setup


def _largest_precompute_batch(arch: Arch, setup: Setup, budget: int) -> Setup:
    while setup.precompute_batch > 1 and not _fits(arch, setup, "precompute", budget):
        setup = dataclasses.replace(setup, precompute_batch=max(1, setup.precompute_batch // 2))
    return setup


def _levels(start: Setup, knobs) -> list[dict]:
    """The heavier knobs, cumulative: the setup as given, + checkpointing, + activation offloading (CUDA), then 4-bit
    quantization without offloading and with it (offloading only where 4-bit alone does not fit)."""
    levels = [{}]
    if "checkpointing" in knobs and not start.gradient_checkpointing:
        levels.append({"gradient_checkpointing": True})
    base = levels[-1]
    offload = "offloading" in knobs and start.device == "cuda" and not start.activation_offloading
    unshare = "unshare" in knobs and start.share_prompt and not start.share_forced

    def lighter(level: dict) -> list[dict]:  # level, then + offloading, then + no shared rows
        out = [level] + ([{**level, "activation_offloading": True}] if offload else [])
        return out + ([{**out[-1], "share_prompt": False}] if unshare else [])

    levels = levels[:-1] + lighter(base)
    if "quantization" in knobs and start.quantization != "4bit":
        ref_follows = start.ref_quantization == start.quantization
        levels += lighter({**base, "quantization": "4bit",
                           "ref_quantization": "4bit" if ref_follows else start.ref_quantization})
    return levels


def _steps(arch: Arch, start: Setup, end: Setup, budget: int) -> tuple[list[str], dict[str, str]]:
    """What turned `start` into `end`, in the knobs' order, each with the peaks it leaves; and the overrides."""
    steps, overrides, cur = [], {}, start

    def change(text: str, keys: dict[str, str], **changes) -> None:
        nonlocal cur
        cur = dataclasses.replace(cur, **changes)
        overrides.update(keys)
        pred = predict(arch, cur)
        steps.append(text.format(train=fmt(pred.train.peak_bytes), precompute=fmt(pred.precompute.peak_bytes),
                                 host=fmt(pred.train.details["offload.host_bytes"])))

    if end.micro_batch != start.micro_batch:
        change(f"per_device_train_batch_size={end.micro_batch} gradient_accumulation_steps={end.grad_accum}: the "
               "same pairs per optimizer step (train peak {train})",
               {"per_device_train_batch_size": str(end.micro_batch),
                "gradient_accumulation_steps": str(end.grad_accum)},
               micro_batch=end.micro_batch, grad_accum=end.grad_accum)
    if end.gradient_checkpointing != start.gradient_checkpointing:
        change("gradient_checkpointing=true: activations kept for backward drop to the layer inputs (train peak "
               "{train})", {"gradient_checkpointing": "true"}, gradient_checkpointing=True)
    if end.activation_offloading != start.activation_offloading:
        change("activation_offloading=true: the layer inputs in pinned CPU RAM ({host}), back a layer ahead in "
               "backward (train peak {train})", {"activation_offloading": "true"}, activation_offloading=True)
    if end.share_prompt != start.share_prompt:
        change("share_prompt=false: each prompt twice, no (T, T) mask (train peak {train}, precompute {precompute})",
               {"share_prompt": "false"}, share_prompt=False)
    if end.quantization != start.quantization:
        change("quantization=4bit: NF4 base weights, ~0.52 bytes/param (train peak {train}, precompute "
               "{precompute})", {"quantization": "4bit"}, quantization="4bit", ref_quantization=end.ref_quantization)
    if end.precompute_batch != start.precompute_batch:
        change(f"precompute_batch_size={end.precompute_batch}: no effect on the results (precompute peak "
               "{precompute})", {"precompute_batch_size": str(end.precompute_batch)},
               precompute_batch=end.precompute_batch)
    return steps, overrides


def stream_step(stage: str, stream: Stream, layers: int, budget: int) -> str:
    return (f"{stage}: stream {stream.layers} of {layers} decoder layers from pinned CPU RAM "
            f"({fmt(stream.cpu_bytes)}), device peak {fmt(stream.device_peak)}"
            + ("" if stream.device_peak <= budget else " - still over the budget")
            + f"; {fmt(stream.bytes_per_step)} copied per {'optimizer step' if stage == 'train' else 'batch'} "
            f"(~{stream.seconds_per_step:.2f} s at {STREAM_BYTES_PER_S / 1e9:.0f} GB/s; {stage} does it by itself on "
            "CUDA)")


def _largest_mlp_tiles(arch: Arch, setup: Setup, budget: int) -> Setup:
    """The MLP's tiles only for the memory they save: whole where train fits so, else in the largest tiles (the
    default, doubled while train fits and a tile is below a micro-batch's tokens), each tile being one more pass
    over a 4-bit base's dequantized weights."""
    whole = dataclasses.replace(setup, mlp_tiles=False)
    if _fits(arch, whole, "train", budget):
        return whole
    tokens = setup.sequences("train") * setup.shapes("train")[0]  # a micro-batch's
    while 2 * setup.mlp_tile_tokens < tokens:
        bigger = dataclasses.replace(setup, mlp_tile_tokens=2 * setup.mlp_tile_tokens)
        if not _fits(arch, bigger, "train", budget):
            break
        setup = bigger
    return setup


def choose(arch: Arch, cfg_like, budget: int, knobs=KNOBS, stages=STAGES) -> Plan:
    """The recipe's own setup if it fits `budget`, else the first that does along `knobs` (the module doc's
    order; a stage turns only those it can apply, and asks for its own `stages`). `cfg_like`: a Setup, or a
    Config (resolved as in predict)."""
    start = cfg_like if isinstance(cfg_like, Setup) else setup_from_config(cfg_like, budget)
    # the knobs are found in the default tiles; untiled or in larger tiles last, where that fits
    start = dataclasses.replace(start, mlp_tiles=True, mlp_tile_tokens=Setup.mlp_tile_tokens)
    for changes in _levels(start, knobs):
        cur = dataclasses.replace(start, **changes)
        if "micro_batch" in knobs:
            cur = _largest_micro_batch(arch, cur, budget)
        if "precompute_batch" in knobs and "precompute" in stages:  # train's advice never names precompute's
            cur = _largest_precompute_batch(arch, cur, budget)
        if all(_fits(arch, cur, stage, budget) for stage in stages):
            break
    if "train" in stages and cur.gradient_checkpointing and cur.mlp_tiles and arch.mlp_block:
        cur = _largest_mlp_tiles(arch, cur, budget)
    steps, overrides = _steps(arch, start, cur, budget)
    pred, streams, fits = predict(arch, cur), {}, True
    for stage in stages:
        if getattr(pred, stage).peak_bytes <= budget:
            continue
        quantization = cur.quantization if stage == "train" else cur.ref_quantization
        if "stream" not in knobs or quantization == "8bit":  # LLM.int8 holds each weight twice: not streamed
            fits = False
            if "stream" in knobs:
                steps.append(f"{stage}: no streamed layers with an 8-bit base (LLM.int8 keeps a second reference "
                             "to each weight); quantization=4bit streams")
            continue
        if stage == "train" and not cur.gradient_checkpointing:  # streaming saves nothing with every layer's
            cur = dataclasses.replace(cur, gradient_checkpointing=True)  # activations kept: train turns it on
            pred = predict(arch, cur)
        stream = streams[stage] = stage_stream(arch, cur, pred, stage, budget)
        fits = fits and stream.device_peak <= budget
        steps.append(stream_step(stage, stream, arch.layers, budget))
    return Plan(cur, pred, overrides, steps or ["fits as given"], fits, streams)


# The knobs train turns by itself at a fixed micro-batch (for longest_max_length), and the lengths it tries.
TRAIN_KNOBS = ("checkpointing", "offloading", "unshare")
LENGTH_STEP = 256
LENGTH_LIMIT = 1 << 17


def longest_max_length(arch: Arch, setup: Setup, budget: int, micro_batch: int) -> tuple[int, Plan | None]:
    """The longest max_length (a multiple of LENGTH_STEP, at most LENGTH_LIMIT and the model's context) at which
    train fits `budget` with `micro_batch` pairs per micro-batch, the knobs train turns by itself on (TRAIN_KNOBS,
    not streaming); and that plan. (0, None) when not even LENGTH_STEP fits. Binary search: the peak grows with
    max_length."""
    at = dataclasses.replace(setup, micro_batch=micro_batch, seq_len=None, completion_tokens=None)

    def plan(length: int) -> Plan:
        return choose(arch, dataclasses.replace(at, max_length=length), budget, TRAIN_KNOBS, stages=("train",))

    lo, hi = 0, min(LENGTH_LIMIT, arch.context or LENGTH_LIMIT) // LENGTH_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(mid * LENGTH_STEP).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * LENGTH_STEP, (plan(lo * LENGTH_STEP) if lo else None)


def quiet_arch(model_path) -> Arch | None:
    """The planner's Arch of a model folder, or None (not logged) for one it does not model."""
    try:
        return load_arch(str(model_path))
    except UserError:
        return None


def arch_of_run(model_path, cfg, instead: str) -> Arch | None:
    """The planner's Arch for a run's model folder; None, logged with what happens `instead`, for an
    architecture the planner does not model or LoRA targets (cfg's) it cannot resolve in it: the planner never
    blocks a run, it advises."""
    try:
        arch = load_arch(str(model_path))
    except UserError as e:
        log(f"note: no memory plan for this model ({e}); {instead}")
        return None
    try:
        adapted(arch, lora_targets(cfg))
    except UserError as e:
        log(f"note: no memory plan for this run ({e}); {instead}")
        return None
    return arch


def stage_knobs(cfg, stage: str, device_type: str) -> tuple[str, ...]:
    """The knobs a stage turns by itself on `device_type` (the rest it only advises), in the module doc's order:
    precompute its batch, train its micro-batch and gradient checkpointing (when auto); both unshare the prompt
    (share_prompt auto); on CUDA train offloads activations (when auto), and both stream layers last."""
    cuda = device_type == "cuda"
    if stage == "precompute":
        return ("precompute_batch",) + (("unshare",) if cfg.share_prompt == "auto" else ()) + (
            ("stream",) if cuda else ())
    return ("micro_batch",) + (("checkpointing",) if cfg.gradient_checkpointing == "auto" else ()) + (
        ("offloading",) if cuda and cfg.activation_offloading == "auto" else ()) + (
        ("unshare",) if cfg.share_prompt == "auto" else ()) + (("stream",) if cuda else ())


def stage_plan(cfg, arch: Arch, budget: int, stage: str, device_type: str) -> Plan:
    """The plan a stage applies (training.policy.apply_plan, precompute.memory_plan; bench/gpu_check.py reports
    the same one)."""
    return choose(arch, setup_from_config(cfg, budget), budget, stage_knobs(cfg, stage, device_type),
                  stages=(stage,))
