"""The search: the first plan that fits a memory budget, and the CPU-offload device maps train and precompute
load with. Every number is a prediction of model.py.

Knobs, in order, each tried only while the run is over the budget: gradient checkpointing on (train);
quantization=4bit (the reference too, unless ref_quantization is set; when only precompute is over, halving
precompute's batch comes first); halving the micro-batch while doubling accumulation (train); halving
precompute's batch; last, CPU offload of whole decoder layers (train and precompute do it on CUDA by themselves).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lowmem_dpo.errors import UserError, log
from lowmem_dpo.memory.arch import Arch, adapted, load_arch
from lowmem_dpo.memory.model import Prediction, layer_weight_bytes, predict, streamed_layer_bytes
from lowmem_dpo.memory.setup import Setup, lora_targets, setup_from_config
from lowmem_dpo.units import fmt

STAGES = ("train", "precompute")


@dataclass
class Plan:
    setup: Setup
    prediction: Prediction
    overrides: dict[str, str]  # config key -> value that turn the recipe into this plan
    steps: list[str]  # what the search changed, in order, and why
    fits: bool
    offload_bytes: int = 0  # train: weights to keep in CPU RAM (whole decoder layers)
    precompute_offload_bytes: int = 0
    offload_layers: int = 0

    def to_json(self, budget: int) -> dict:
        return {"fits": self.fits, "overrides": self.overrides, "steps": self.steps,
                "offload_bytes": self.offload_bytes, "precompute_offload_bytes": self.precompute_offload_bytes,
                "offload_layers": self.offload_layers,
                "train": self.prediction.train.to_json(budget, self.offload_bytes),
                "precompute": self.prediction.precompute.to_json(budget, self.precompute_offload_bytes)}


# -- offload -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Offload:
    """Whole decoder layers of one stage kept in CPU RAM so its peak fits the budget."""

    layers: int  # moved to CPU RAM (0: it fits as is)
    layer_bytes: int  # one layer's weights on the device, as the stage loads them (quantized or not)
    streamed_bytes: int  # one layer as it sits in CPU RAM and streams through the device buffer
    device_peak: int  # the stage's device peak with those layers moved

    @property
    def cpu_bytes(self) -> int:
        return self.layers * self.streamed_bytes


def _offload(peak: int, budget: int, per_layer: int, layers: int, streamed: int | None = None) -> tuple[int, int]:
    """Whole layers to keep in CPU RAM so `peak` fits: each one moved saves `per_layer` device bytes, and one
    device buffer of `streamed` bytes (default per_layer) holds the layer running now, so
    k = ceil((peak - budget + streamed) / per_layer). Returns (layers moved, CPU RAM they take)."""
    streamed = per_layer if streamed is None else streamed
    if peak <= budget:
        return 0, 0
    k = min(layers, math.ceil((peak - budget + streamed) / per_layer))
    return k, k * streamed


def stage_offload(arch: Arch, setup: Setup, pred: Prediction, stage: str, budget: int) -> Offload:
    """The offload `stage` (train | precompute) of `setup` needs to fit `budget` (_offload's k), with the layer
    sizes of that stage's dtype and quantization."""
    dtype, quantization = ((setup.dtype, setup.quantization) if stage == "train"
                           else (setup.ref_dtype, setup.ref_quantization))
    per_layer = layer_weight_bytes(arch, dtype, quantization)
    streamed = streamed_layer_bytes(arch, dtype, quantization)
    peak = getattr(pred, stage).peak_bytes
    k, _ = _offload(peak, budget, per_layer, arch.layers, streamed)
    return Offload(k, per_layer, streamed, peak - k * per_layer + streamed if k else peak)


# A Llama-style CausalLM's modules besides its decoder layers, before and after them (rotary_emb holds only a
# buffer, listed so the map covers every module that owns tensors); arch.Arch.resident has any model's.
OFFLOAD_RESIDENT = (("model.embed_tokens",), ("model.rotary_emb", "model.norm", "lm_head"))


def layers_on_device(layers: int, layer_bytes: int, other_bytes: int, budget: int,
                     buffer_bytes: int | None = None) -> int:
    """How many leading decoder layers fit `budget` next to `other_bytes` (everything on the device that is not
    a decoder layer's weights: embeddings, norm, LM head, activations, LoRA and optimizer state, overhead).

    All `layers` fit when other + layers*layer_bytes <= budget. Otherwise n layers stay when
    other + n*layer_bytes + buffer_bytes <= budget: the buffer (default one layer) is the device copy each
    offloaded layer streams through; it is larger than a resident layer when the resident ones are quantized
    and the offloaded ones are not (bitsandbytes quantizes on the GPU only). The same rule as _offload.
    0 when not even one layer fits beside the buffer."""
    if layers < 0 or layer_bytes <= 0:
        raise ValueError(f"layers={layers}, layer_bytes={layer_bytes}: expected layers >= 0 and layer_bytes > 0")
    if other_bytes + layers * layer_bytes <= budget:
        return layers
    buffer_bytes = layer_bytes if buffer_bytes is None else buffer_bytes
    return max(0, min(layers - 1, (budget - other_bytes - buffer_bytes) // layer_bytes))


def offload_device_map(layers: int, layer_bytes: int, other_bytes: int, budget: int, device: int | str = 0,
                       layers_prefix: str = "model.layers",
                       resident: tuple[tuple[str, ...], tuple[str, ...]] = OFFLOAD_RESIDENT,
                       buffer_bytes: int | None = None) -> dict[str, int | str]:
    """An accelerate/transformers device_map: the `resident` modules (those before the layer stack, those after)
    and the leading layers that fit (layers_on_device) on `device`, the rest on "cpu" (kept in CPU RAM, copied to
    the device for each forward by accelerate's hooks). Keys in model order: embeddings, layers, then norm and
    head."""
    n = layers_on_device(layers, layer_bytes, other_bytes, budget, buffer_bytes)
    first, rest = resident
    out: dict[str, int | str] = dict.fromkeys(first, device)
    out.update({f"{layers_prefix}.{i}": device if i < n else "cpu" for i in range(layers)})
    out.update(dict.fromkeys(rest, device))
    return out


def offload_map(arch: Arch, setup: Setup, budget: int, stage: str, device: int | str = 0) -> dict | None:
    """The device_map that keeps `stage` (train | precompute) of the setup as given within `budget` by leaving
    the trailing decoder layers in CPU RAM (offload_device_map), or None when it fits without. The numbers are
    the prediction's: per-layer weight bytes and everything else on the device (peak minus the layers'
    weights), so the layers moved are the k of _offload."""
    pred = predict(arch, setup)
    off = stage_offload(arch, setup, pred, stage, budget)
    if not off.layers:
        return None
    peak = getattr(pred, stage).peak_bytes
    return offload_device_map(arch.layers, off.layer_bytes, peak - arch.layers * off.layer_bytes, budget, device,
                              layers_prefix=arch.layers_prefix, resident=arch.resident,
                              buffer_bytes=off.streamed_bytes)


# -- the search --------------------------------------------------------------------------------------------------
@dataclass
class _Search:
    """The setup as the search changes it, its prediction, and what it changed (as overrides and as steps)."""

    arch: Arch
    budget: int
    cur: Setup
    pred: Prediction = None
    overrides: dict[str, str] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.pred = predict(self.arch, self.cur)

    def fits(self, stage: str) -> bool:
        return getattr(self.pred, stage).peak_bytes <= self.budget

    def change(self, step: str, overrides: dict[str, str], **changes) -> None:
        self.cur = dataclasses.replace(self.cur, **changes)
        self.overrides.update(overrides)
        self.pred = predict(self.arch, self.cur)
        self.steps.append(step.format(train=fmt(self.pred.train.peak_bytes),
                                      precompute=fmt(self.pred.precompute.peak_bytes)))

    def checkpointing(self) -> None:
        if not self.fits("train") and not self.cur.gradient_checkpointing:
            self.change("gradient_checkpointing=true: activations kept for backward drop to the layer inputs "
                        "(train peak {train})", {"gradient_checkpointing": "true"}, gradient_checkpointing=True)

    def smaller_precompute_batch(self) -> None:
        while not self.fits("precompute") and self.cur.precompute_batch > 1:
            b = max(1, self.cur.precompute_batch // 2)
            self.change(f"precompute_batch_size={b}: no effect on the results (precompute peak {{precompute}})",
                        {"precompute_batch_size": str(b)}, precompute_batch=b)

    def four_bit(self) -> None:
        if not (self.fits("train") and self.fits("precompute")) and self.cur.quantization != "4bit":
            ref_follows = self.cur.ref_quantization == self.cur.quantization
            self.change("quantization=4bit: NF4 base weights, ~0.52 bytes/param (train peak {train}, precompute "
                        "{precompute})", {"quantization": "4bit"}, quantization="4bit",
                        ref_quantization="4bit" if ref_follows else self.cur.ref_quantization)

    def smaller_micro_batch(self) -> None:
        while not self.fits("train") and self.cur.micro_batch > 1:
            b = _smaller_micro_batch(self.cur.micro_batch)
            accum = self.cur.grad_accum * (self.cur.micro_batch // b)
            self.change(f"per_device_train_batch_size={b} gradient_accumulation_steps={accum}: the same pairs per "
                        "optimizer step (train peak {train})",
                        {"per_device_train_batch_size": str(b), "gradient_accumulation_steps": str(accum)},
                        micro_batch=b, grad_accum=accum)

    def offload(self) -> tuple[bool, dict[str, Offload]]:
        """(whether everything fits, the offload of each stage), the steps noted."""
        ok, offloads = True, {}
        for stage in STAGES:
            off = offloads[stage] = stage_offload(self.arch, self.cur, self.pred, stage, self.budget)
            if off.layers:
                ok = ok and off.device_peak <= self.budget
                self.steps.append(f"{stage}: CPU offload of {off.layers} of {self.arch.layers} decoder layers "
                                  f"({fmt(off.cpu_bytes)} of CPU RAM), device peak {fmt(off.device_peak)}"
                                  + ("" if off.device_peak <= self.budget else " - still over the budget")
                                  + f"; {stage} streams them through the device by itself (CUDA)")
        return ok, offloads


def _smaller_micro_batch(b: int) -> int:
    """The largest divisor of b at most b/2 (b even: b/2), so accumulation keeps the effective batch exact."""
    return max(d for d in range(1, b // 2 + 1) if b % d == 0)


def choose(arch: Arch, cfg_like, budget: int) -> Plan:
    """The recipe's own setup if it fits `budget`, else the first that does along the knobs of the module doc.
    `cfg_like`: a Setup, or a Config (resolved as in predict)."""
    cur = cfg_like if isinstance(cfg_like, Setup) else setup_from_config(cfg_like, budget)
    search = _Search(arch, budget, cur)
    search.checkpointing()
    if search.fits("train") and not search.fits("precompute"):  # its batch costs nothing but time
        search.smaller_precompute_batch()
    search.four_bit()
    search.smaller_micro_batch()
    search.smaller_precompute_batch()
    ok, offloads = search.offload()
    steps = search.steps or ["fits as given"]
    return Plan(search.cur, search.pred, search.overrides, steps, ok, offloads["train"].cpu_bytes,
                offloads["precompute"].cpu_bytes, max(o.layers for o in offloads.values()))


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
