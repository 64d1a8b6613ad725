"""The memory model: peak bytes of precompute and of a train step, term by term, as pure functions of an
architecture (arch.Arch) and a setup (setup.Setup), from the weights' terms (weights.py) and the activations'
(activations.py). Each formula says what it counts and how it was measured; search.py chooses knobs with them,
and `lowmem-dpo plan --measure` checks them against measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowmem_dpo.memory import weights
from lowmem_dpo.memory.activations import (
    head_tile_bytes,
    kept_bytes,
    layer_saved_bytes,
    layer_working_bytes,
    logits_train_bytes,
    precompute_layer_bytes,
)
from lowmem_dpo.memory.arch import Arch, adapted
from lowmem_dpo.memory.setup import DTYPE_BYTES, Setup, setup_from_config
from lowmem_dpo.runtime.rules import ADAMW_TORCH

# CUDA's caching allocator holds more than its live tensors (reserved - allocated): an estimate of that share of
# the tensor peak, with expandable segments (devices.configure_allocator). The budget is what torch may allocate
# (devices.run_cuda_budget), so the CUDA context is outside it and not counted here.
CUDA_FRAGMENTATION = 0.05
# A CPU run's RSS before its model loads: Python and the packages imported, the recipe and the tokenizer read
# (bench/full_scale.py's rss_before_load_bytes: 0.42-0.48 GiB with torch 2.13).
CPU_PROCESS = 480 * 2**20
OFFLOAD_WINDOW = 2  # offloaded layers on the device at once in backward: one computing, one prefetched below


def pinned_bytes(nbytes: int) -> int:
    """The host RAM that torch's caching host allocator pins for an `nbytes` request: the next power of two (it
    rounds every pinned block up to one; a 164 MB layer input pins 256 MiB)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def framework_overhead(device: str, tensor_peak: int) -> int:
    """Memory the budget must hold beyond live tensors. CUDA: the caching allocator's fragmentation (~5% of the
    tensor peak: an estimate; a GPU run's metrics log peak_reserved_bytes beside peak_allocated_bytes). CPU: the
    process before the model loads (CPU_PROCESS): the plan is RSS where the heap returns freed tensors (runtime/
    heap.py; with room to spare it keeps them, up to StagePrediction.transient more). mps: 0."""
    if device == "cuda":
        return int(CUDA_FRAGMENTATION * tensor_peak)
    return CPU_PROCESS if device == "cpu" else 0


# -- prediction --------------------------------------------------------------------------------------------------
@dataclass
class StagePrediction:
    """Predicted peak of one stage. `breakdown` adds up to `peak_bytes`; `phases`: the transient peak's candidates."""

    breakdown: dict[str, int]
    phases: dict[str, int]
    details: dict[str, int]
    tensor_peak_bytes: int  # live tensor bytes: what --measure measures
    peak_bytes: int  # + framework overhead: what must fit the budget
    shapes: dict[str, int]

    @property
    def transient(self) -> int:  # a step's freed tensors: what a heap that keeps its blocks may hold beyond the plan
        return self.breakdown["activations"] + self.breakdown["peak_phase"]

    def to_json(self, budget: int, offload: int = 0) -> dict:
        return {"peak_bytes": self.peak_bytes, "tensor_peak_bytes": self.tensor_peak_bytes,
                "fits": self.peak_bytes <= budget, "offload_bytes": offload, "breakdown": self.breakdown,
                "phases": self.phases, "details": self.details, "shapes": self.shapes}


@dataclass
class Prediction:
    train: StagePrediction
    precompute: StagePrediction
    setup: Setup


def _offloaded(arch: Arch, setup: Setup, kept: dict[str, int], layer: dict[str, int], layer_total: int
               ) -> tuple[int, int]:
    """activation_offloading: (the activations the device keeps, the host bytes they pin). What the backbone saves
    (each layer's input with checkpointing, else each of its terms in `layer`, whose sum is `layer_total`; the
    final norm's input) is pinned in host memory; the device keeps OFFLOAD_WINDOW layers' worth of it, the LM
    head's inputs, the mask and LLM.int8's inputs (`kept`: kept_bytes)."""
    per_layer = kept["layer_inputs"] // arch.layers if setup.gradient_checkpointing else layer_total
    # each saved tensor pinned on its own: a layer's input (checkpointing), else each of a layer's terms
    tensors = [per_layer] if setup.gradient_checkpointing else list(layer.values())
    host = arch.layers * sum(pinned_bytes(n) for n in tensors) + pinned_bytes(kept["final_norm"])
    activations = (kept["completion"] + kept["mask"] + kept["int8_inputs"]
                   + min(arch.layers, OFFLOAD_WINDOW) * per_layer)
    return activations, host


def predict_train(arch: Arch, setup: Setup) -> StagePrediction:
    """Peak of one optimizer step: weights + LoRA state + what the forward keeps + the larger transient phase.

    no checkpointing:  kept = L layers' saved activations + kept_bytes; phase = max(layer working set, logits).
    checkpointing:     kept = layer inputs + kept_bytes; phase = max(one recomputed layer's saved activations +
                       its working set, logits) (the logits' backward runs before any layer is recomputed).
    activation_offloading: what the backbone saves (the layer inputs, or every layer's activations, and the final
                       norm's input) is in host memory (details "offload.host_bytes"); the device keeps
                       OFFLOAD_WINDOW layers' worth of it, the LM head's inputs, the mask and LLM.int8's inputs.
    The optimizer step itself (activations freed by then) adds 2 float32 copies of the LoRA params for
    torch's foreach AdamW on CUDA; it counts only if larger than the backward peak. In a 16-bit dtype the LoRA
    params and grads have their compute copies (s bytes each) beside the float32 ones.
    """
    copy = DTYPE_BYTES[setup.dtype] if setup.autocast else 0
    seq_len, completion = setup.shapes("train")
    n_seq = setup.sequences("train")
    m = n_seq * completion
    base = weights.card_weight_bytes(arch, setup)
    shapes = weights.lora_shapes(arch, setup.lora_targets, setup.lora_r)
    n_lora = sum(shapes)
    ad = adapted(arch, setup.lora_targets)
    saved = {names: sum(layer_saved_bytes(arch, setup, n_seq, seq_len, names).values()) for names in set(ad.per_layer)}
    layer = layer_saved_bytes(arch, setup, n_seq, seq_len, max(saved, key=saved.get))  # the largest layer's terms
    kept = kept_bytes(arch, setup, n_seq, seq_len, completion)
    layer_total = max(saved.values())
    all_layers = sum(saved[names] for names in ad.per_layer)
    activations = sum(kept.values()) + (0 if setup.gradient_checkpointing else all_layers)
    host = 0
    if setup.activation_offloading:
        activations, host = _offloaded(arch, setup, kept, layer, layer_total)
    layer_phase = layer_working_bytes(arch, setup, n_seq, seq_len) + (
        layer_total if setup.gradient_checkpointing else 0)
    gather = weights.embedding_gather_bytes(arch, setup)  # the weights' term before the LM head's (model/head.py)
    logits_phase = logits_train_bytes(arch, m, ad.lm_head, DTYPE_BYTES[setup.dtype], setup.device)
    breakdown = {
        "base_weights": sum(base.values()),
        "lora_params": (4 + copy) * n_lora,  # float32, and in 16-bit the copies the forward reads
        "lora_grads": (4 + copy) * n_lora,  # the same for their gradients (model/compute_copies.py)
        "optimizer_state": weights.optimizer_state_bytes(shapes, setup.optimizer),
        "activations": activations,
        "peak_phase": max(layer_phase, logits_phase, gather - activations),
    }
    if setup.device == "cuda" and setup.optimizer == ADAMW_TORCH:
        opt_step = 2 * 4 * n_lora  # foreach AdamW temporaries, when the activations are gone
        excess = opt_step - (breakdown["activations"] + breakdown["peak_phase"])
        if excess > 0:
            breakdown["peak_phase"] += excess
    tensor_peak = sum(breakdown.values())
    overhead = framework_overhead(setup.device, tensor_peak)
    breakdown["framework_overhead"] = overhead
    details = {**{f"weights.{k}": v for k, v in base.items()}, **{f"layer.{k}": v for k, v in layer.items()},
               **{f"kept.{k}": v for k, v in kept.items()}, "lora_param_count": n_lora, "offload.host_bytes": host}
    return StagePrediction(breakdown, {"layer": layer_phase, "logits": logits_phase}, details, tensor_peak,
                           tensor_peak + overhead,
                           {"sequences": n_seq, "seq_len": seq_len, "completion_tokens": completion,
                            "shared": setup.share_prompt})


def predict_precompute(arch: Arch, setup: Setup) -> StagePrediction:
    """Peak of one precompute forward under inference_mode (nothing kept between layers): weights of the
    reference + the larger of one layer's working set and the LM head phase (the final hidden states, the
    gathered completion positions and one tile of logits)."""
    s = DTYPE_BYTES[setup.ref_dtype]
    seq_len, completion = setup.shapes("precompute")
    n_seq = setup.sequences("precompute")
    m = n_seq * completion
    base = weights.card_weight_bytes(arch, setup, reference=True)
    layer_phase = precompute_layer_bytes(arch, setup, n_seq, seq_len)
    gather = weights.embedding_gather_bytes(arch, setup, True)
    logits_phase = (n_seq * seq_len + m) * arch.hidden * s + head_tile_bytes(arch, m, s, setup.device)  # one tile
    breakdown = {"base_weights": sum(base.values()), "lora_params": 0, "lora_grads": 0, "optimizer_state": 0,
                 "activations": 0, "peak_phase": max(layer_phase, logits_phase, gather)}
    tensor_peak = sum(breakdown.values())
    overhead = framework_overhead(setup.device, tensor_peak)
    breakdown["framework_overhead"] = overhead
    return StagePrediction(breakdown, {"layer": layer_phase, "logits": logits_phase},
                           {f"weights.{k}": v for k, v in base.items()}, tensor_peak, tensor_peak + overhead,
                           {"sequences": n_seq, "seq_len": seq_len, "completion_tokens": completion,
                            "shared": setup.share_prompt})


def predict(arch: Arch, cfg_like, budget: int | None = None) -> Prediction:
    """Predicted peaks of train and precompute. `cfg_like`: a Setup, or a Config (resolved through the device
    rules; `budget` picks the memory tier of a GPU this machine lacks). share_prompt=auto without the data's
    prompt length: the run shares only data whose prompts are long enough (headcheck.decide_sharing), so each
    stage is the larger of its shared worst case (Setup.shapes) and its unshared one."""
    setup = cfg_like if isinstance(cfg_like, Setup) else setup_from_config(cfg_like, budget)
    if not (setup.share_prompt and not setup.share_forced and setup.prompt_tokens is None and setup.seq_len is None):
        return Prediction(predict_train(arch, setup), predict_precompute(arch, setup), setup)
    alone = dataclasses.replace(setup, share_prompt=False)
    return Prediction(max(predict_train(arch, setup), predict_train(arch, alone), key=_peak),
                      max(predict_precompute(arch, setup), predict_precompute(arch, alone), key=_peak), setup)


def _peak(p: StagePrediction) -> int:
    return p.peak_bytes
