"""The memory model: peak bytes of precompute and of a train step, term by term, as pure functions of an
architecture (arch.Arch) and a setup (setup.Setup). Each formula says what it counts and how it was measured;
search.py chooses knobs with them, and `lowmem-dpo plan --measure` checks them against measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lowmem_dpo.memory import attention, weights
from lowmem_dpo.memory.arch import Arch, adapted
from lowmem_dpo.memory.setup import DTYPE_BYTES, Setup, setup_from_config
from lowmem_dpo.model.activations import MLP_TILE_TOKENS
from lowmem_dpo.model.head import HEAD_TILE_ELEMENTS, OUT_DTYPE, head_tile
from lowmem_dpo.runtime.kernels import FUSED_HEAD_TILE
from lowmem_dpo.runtime.rules import ADAMW_TORCH

# CUDA's caching allocator holds more than its live tensors (reserved - allocated): an estimate of that share of
# the tensor peak, with expandable segments (devices.configure_allocator). The budget is what torch may allocate
# (devices.run_cuda_budget), so the CUDA context is outside it and not counted here.
CUDA_FRAGMENTATION = 0.05
# A CPU run's RSS before its model loads: Python and the packages imported, the recipe and the tokenizer read
# (bench/full_scale.py's rss_before_load_bytes: 0.42-0.48 GiB with torch 2.13).
CPU_PROCESS = 480 * 2**20
OFFLOAD_WINDOW = 2  # offloaded layers on the device at once in backward: one computing, one prefetched below


# -- formulas: activations ---------------------------------------------------------------------------------------
def mlp_tokens(arch: Arch, setup: Setup, n_seq: int, seq_len: int, stage: str = "train") -> int:
    """Tokens the MLP works on at once (activations.tile_mlps) where the layers have an MLP block: in precompute
    tiles of MLP_TILE_TOKENS, in train with checkpointing setup.mlp_tile_tokens where the plan tiles; else n_seq*T."""
    if not arch.mlp_block or (stage != "precompute" and not (setup.gradient_checkpointing and setup.mlp_tiles)):
        return n_seq * seq_len
    return min(n_seq * seq_len, MLP_TILE_TOKENS if stage == "precompute" else setup.mlp_tile_tokens)


def attention_masks(arch: Arch, setup: Setup, n_seq: int, seq_len: int) -> tuple[int, int]:
    """(a boolean (N, 1, T, T) mask, its s-byte additive copy) where one exists, in bytes. A right-padded causal
    batch needs none (logps.completion_logps passes no padding mask, and SDPA runs causal: its flash or
    memory-efficient kernel builds nothing T x T); a shared-prompt batch passes its own mask, and eager attention
    (Gemma2) or a sliding window shorter than T make transformers build one. The additive copy: SDPA's (or eager
    attention's) float bias, kept by each layer for its backward."""
    s = DTYPE_BYTES[setup.dtype]
    window = arch.sliding_window is not None and seq_len > arch.sliding_window
    if not (setup.share_prompt or arch.eager_attention or window):
        return 0, 0
    return n_seq * seq_len * seq_len, n_seq * seq_len * seq_len * s


def _lora_widths(arch: Arch, setup: Setup, linears) -> int:
    """Bytes per token the LoRA A of `linears` keep of their inputs (layer_saved_bytes' lora_inputs)."""
    s = DTYPE_BYTES[setup.dtype]
    if setup.lora_dropout > 0:
        mask = 1 if setup.device == "cuda" else 4
        return sum(m.in_features for m in linears) * ((s if setup.autocast else 4) + mask)
    if setup.autocast:
        return sum(m.in_features for m in linears) * s
    return arch.distinct_inputs(linears) * s


def layer_saved_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int,
                      names: tuple[str, ...] | None = None) -> dict[str, int]:
    """Bytes one decoder layer keeps for backward in train, for n_seq sequences of seq_len tokens (NT tokens),
    s = bytes of the dtype, with LoRA on the layer's Linears `names` (default: the most adapted layer's). What
    autograd saves in a transformers decoder layer with peft LoRA on a frozen base (measured term by term with
    saved-tensor hooks on Llama/Mistral/Qwen2; the roles of arch.Linear carry it to other layouts). The MLP's
    own terms count its tokens at once (mlp_tokens: one tile in a checkpointed layer's recompute), the others NT:

    norms:        each norm keeps its float32 input (a float32 copy when s=2) and per-token statistics: RMSNorm
                  H*4 + 4 (rsqrt), LayerNorm H*4 + 8 (mean, rstd), times the layer's norms, times NT.
    lora_inputs:  every adapted Linear's LoRA A keeps its input (the frozen base Linear keeps nothing). With s=4,
                  the Linears reading one tensor share it: H (q/k/v or a fused qkv) + H (gate/up, or fc) + I
                  (down) (the attention's output projection reads the attention output, kept anyway); with s=2
                  (autocast) peft casts each input to float32 and autocast casts it back, so each keeps its own
                  s-byte copy: sum of in_features * s. lora_dropout > 0: each keeps its own copy (the dropped-out
                  input, 4 bytes; with autocast its s-byte cast) and the dropout mask of its float32 input: 1 byte
                  (bool) on CUDA, 4 bytes on a CPU (there dropout multiplies by a float noise tensor).
    lora_mids:    each LoRA B keeps A's output: r per adapted Linear, in s (autocast) or 4 bytes.
    attention:    SDPA keeps q, k, v, its output and its float32 logsumexp: ((2*q_dim + 2*kv)*s + 4*heads)*NT,
                  kv = kv_dim, or q_dim with grouped kv heads repeated to every head (transformers does for a
                  mask; policy.attention_path on a card where SDPA's GQA would run the math kernel); the additive
                  mask where there is one (attention_masks); and where the kernel is math all the same
                  (attention.cuda_attention), its float32 (N, heads, T, T) softmax (attention.math_kept).
    mlp:          gated (SwiGLU): SiLU keeps gate, the product keeps act and up: 3*I*s. Not gated (fc -> act ->
                  proj): the activation keeps its input, and its output is kept for the projection's LoRA when
                  that is adapted (lora_inputs), 1*I*s; a tanh-GELU written in Python ops (GPT-2's gelu_new)
                  keeps three more I-wide tensors (its tanh, the halved input and 1 + tanh): 4*I*s.
    """
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    mt = mlp_tokens(arch, setup, n_seq, seq_len)
    if names is None:
        names = max(adapted(arch, setup.lora_targets).per_layer, key=len)
    by_name = {m.name: m for m in arch.layer_linears}
    ad = [by_name[n] for n in names]
    attn = [m for m in ad if m.role.startswith("attn")]
    mlp = [m for m in ad if not m.role.startswith("attn")]
    mid_bytes = s if setup.autocast else 4
    masks = attention_masks(arch, setup, n_seq, seq_len)
    kv = arch.q_dim if attention.cuda_attention(arch, setup, seq_len, bool(masks[0]), grad=True)[1] else arch.kv_dim
    return {
        "norms": nt * arch.norms_per_layer * (arch.hidden * 4 + (4 if arch.norm_kind == "rms" else 8)),
        "lora_inputs": nt * _lora_widths(arch, setup, attn) + mt * _lora_widths(arch, setup, mlp),
        "lora_mids": (nt * len(attn) + mt * len(mlp)) * setup.lora_r * mid_bytes,
        "attention": nt * ((2 * arch.q_dim + 2 * kv) * s + 4 * arch.heads) + masks[1]
        + n_seq * arch.heads * seq_len * seq_len * _eager_saved(arch, s)
        + attention.math_kept(arch, setup, n_seq, seq_len, bool(masks[0]))[0],
        "mlp": mt * _mlp_saved_widths(arch) * arch.intermediate * s,
    }


def _eager_saved(arch: Arch, s: int) -> int:
    """Bytes per (sequence, head, query, key) that eager attention (transformers' matmul-softmax-matmul, used
    where SDPA cannot do the model's attention: Gemma2's logit softcapping) keeps for backward: softmax's float32
    output, its cast back to s bytes (when s = 2), and with softcapping tanh's output. 0 with SDPA."""
    if not arch.eager_attention:
        return 0
    return 4 + (s if s == 2 else 0) + (s if arch.attention_softcap else 0)


def _mlp_saved_widths(arch: Arch) -> int:
    """I-wide tensors the MLP's activation keeps (layer_saved_bytes' mlp)."""
    if arch.gated_mlp:
        return 3
    return 4 if arch.activation == "gelu_new" else 1


def pinned_bytes(nbytes: int) -> int:
    """The host RAM that torch's caching host allocator pins for an `nbytes` request: the next power of two (it
    rounds every pinned block up to one; a 164 MB layer input pins 256 MiB)."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def kept_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int, completion: int) -> dict[str, int]:
    """What train keeps for backward across the whole forward, beyond the decoder layers' own:

    layer_inputs: with gradient checkpointing, each layer keeps only its input: L*H*s*NT.
    final_norm:   the last RMSNorm's float32 input: H*4*NT.
    completion:   the hidden states of the M = n_seq*completion predicting positions that logps.py gathers
                  (the LM head's input, kept by its checkpointed chunks): M*H*s.
    mask:         the boolean attention mask, where there is one (attention_masks).
    int8_inputs:  8bit with checkpointing: LLM.int8's autograd function keeps its input on its context object,
                  out of checkpointing's reach, so every layer keeps the inputs of its quantized Linears: the
                  attention's normed input, o_proj's input, the MLP's normed input and down_proj's input,
                  L*NT*(2H + q_dim + I)*s for Llama (without checkpointing they are among the layers' saved
                  activations).
    """
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    int8_kept = setup.quantization == "8bit" and setup.gradient_checkpointing
    return {
        "layer_inputs": arch.layers * nt * arch.hidden * s if setup.gradient_checkpointing else 0,
        "final_norm": nt * arch.hidden * 4,
        "completion": n_seq * completion * arch.hidden * s,
        "mask": attention_masks(arch, setup, n_seq, seq_len)[0],
        "int8_inputs": arch.layers * nt * arch.quantized_inputs() * s if int8_kept else 0,
    }


def int8_buffers(arch: Arch, quantization: str, nt: int, mlp_nt: int | None = None) -> int:
    """LLM.int8's forward of one Linear (8bit only): the int8 copy of its (NT, in) input, and three 4-byte
    (NT, out) tensors: the int32 accumulator, its float32 dequantized copy and the float32 outlier product:
    NT*(in + 12*out) for the largest such Linear (gate/up_proj, in=H, out=I; the MLP's at mlp_nt tokens, one
    tile). Fitted to CPU measurements of precompute (tiny-llama and llama-25m, float32: within 1%; bfloat16:
    -5%..-15%); bitsandbytes' CUDA kernels differ."""
    if quantization != "8bit":
        return 0
    mlp_nt = nt if mlp_nt is None else mlp_nt
    return max((nt if m.role.startswith("attn") else mlp_nt) * (m.in_features + 12 * m.out_features)
               for m in arch.layer_linears)


def layer_working_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int) -> int:
    """Transient bytes at a layer's peak in train, beyond what is kept (measured: the MLP, in forward or backward),
    the larger of two moments, with M = mlp_tokens (one tile in a checkpointed layer's recompute) and NT tokens:
    LoRA path: a float32 (M, I) tensor (the gradient flowing into the MLP's product; with autocast, also peft's
      float32 cast of down_proj's input), an (M, I) s-byte gradient with autocast, and an (NT, H) s-byte
      gradient: M*(4*I + (s*I if autocast)) + NT*s*H;
    quantized base Linear: its dequantized weight (dequant_bytes) with the (M, I) and (NT, H) s-byte gradients
      around its matmul: M*s*I + NT*s*H + dequant;
    8bit forward (recomputed in backward with checkpointing): the (NT, H) input and LLM.int8's buffers."""
    s = DTYPE_BYTES[setup.dtype]
    nt = n_seq * seq_len
    mt = mlp_tokens(arch, setup, n_seq, seq_len)
    lora_path = mt * (4 * arch.intermediate + (s * arch.intermediate if setup.autocast else 0)) + nt * s * arch.hidden
    dequant = weights.dequant_bytes(arch, setup.quantization, s)
    int8_forward = nt * s * arch.hidden + int8_buffers(arch, setup.quantization, nt, mt)
    math = attention.math_kept(arch, setup, n_seq, seq_len, bool(attention_masks(arch, setup, n_seq, seq_len)[0]))[1]
    return max(lora_path, (mt * s * arch.intermediate + nt * s * arch.hidden + dequant) if dequant else 0,
               int8_forward, math)


def chunk_tokens(arch: Arch, completion_positions: int) -> int:
    """Rows of one checkpointed chunk of a LoRA-adapted LM head (logps.chunked_head): 2^24 // V, at most M."""
    return max(1, min(completion_positions, HEAD_TILE_ELEMENTS // arch.vocab))


def head_tile_bytes(arch: Arch, m: int, s: int, device: str) -> int:
    """One LM-head tile of logps' frozen head (head.tiled_logps: c = min(M, 4096) rows x v = 2^24 // c entries,
    measured on the CPU): its float32 logits, transformed and turned into the softmax's gradient in place, and the
    larger of its s-byte product before the float32 copy (s = 2) and, with a softcapped head (Gemma2), a second
    float32 tile (the softmax beside the capped logits its derivative reads): (4 + max(s | 0, 4 | 0))*c*v. On CUDA
    the larger of that and TRL's fused kernel's s-byte (4096, 32768) tile (kernels.fused_head, where installed)."""
    c, v = head_tile(m, arch.vocab)
    ours = (4 + max(s if s != 4 else 0, 4 * arch.softcapped_head)) * c * v
    tokens, entries = FUSED_HEAD_TILE
    return max(ours, min(m, tokens) * min(arch.vocab, entries) * s) if device == "cuda" else ours


def logits_train_bytes(arch: Arch, completion_positions: int, lora_head: bool = False, s: int = 4,
                       device: str = "cpu") -> int:
    """The LM head in train (logps.py) over the M completion positions, nothing (M, V)-sized. A frozen head at a
    tile's backward: the tile (head_tile_bytes), its rows' float32 gradient (c*H*4), the hidden states' gradient
    (M*H*s; twice on CUDA, where TRL's fused kernel may take h in 4096-row parts, counted whether it runs or not:
    their gradients and the split's concatenation exist together), and 16-bit a float32 copy of the weight's tile
    (off CUDA, and on it before torch 2.8: head.OUT_DTYPE). LoRA on the LM head:
    checkpointed chunks of 2^24 // V rows, the whole vocabulary each: four float32 (c, V) tensors at a chunk's
    backward (logits, minus logsumexp, exp, gradient), its B output one more, a softcap one more."""
    m = completion_positions
    if lora_head:
        return (4 + 1 + arch.softcapped_head) * chunk_tokens(arch, m) * arch.vocab * 4
    c, v = head_tile(m, arch.vocab)
    upcast = v * arch.hidden * 4 if s != 4 and (device != "cuda" or not OUT_DTYPE) and v < arch.vocab else 0
    return head_tile_bytes(arch, m, s, device) + c * arch.hidden * 4 + m * arch.hidden * s * (1 + (device == "cuda")) \
        + upcast


def precompute_layer_bytes(arch: Arch, setup: Setup, n_seq: int, seq_len: int) -> int:
    """One layer's working set under inference_mode (nothing is kept between layers), with M = mlp_tokens (one
    tile) and NT tokens, the largest of:
    MLP product: the embedding output, the layer input, the residual and the norm output (4*H), SiLU(gate), up
      and their product (3*I): (NT*4H + M*3I)*s (measured: the peak for these architectures unquantized); tiled,
      one tile's (M, H) output more, beside the output it is copied into (activations.TiledMLP.run);
    (not gated: fc's output and the activation's, 2*I; 4*I for gelu_new's Python ops);
    up_proj of a quantized base: 4*H, SiLU(gate) and up's output (2*I; not gated 1*I, 3*I with gelu_new), and
      the dequantized weight (4bit) or LLM.int8's buffers (8bit, int8_buffers): (NT*4H + M*2I)*s + that
      (measured: the peak with 4-bit and 8-bit);
    attention: NT*(4H + 3*q_dim + 2*kv_dim)*s + the boolean and the s-byte additive masks where there are
      some (attention_masks) (+ dequant)."""
    s = DTYPE_BYTES[setup.ref_dtype]
    quantization = setup.ref_quantization
    nt = n_seq * seq_len
    mt = mlp_tokens(arch, setup, n_seq, seq_len, "precompute")
    # forward only: 8bit multiplies in int8 (its buffers), 4bit dequantizes the weight
    dequant = (int8_buffers(arch, quantization, nt, mt) if quantization == "8bit"
               else weights.dequant_bytes(arch, quantization, s))
    # I-wide tensors alive at the MLP's product (gated) or activation (fc's output and the activation's; a
    # Python-op tanh-GELU, GPT-2's gelu_new, holds two more temporaries: measured)
    inner = 3 if arch.gated_mlp else (4 if arch.activation == "gelu_new" else 2)
    outer = (nt * 4 + (mt if mt < nt else 0)) * arch.hidden
    mlp = (outer + mt * inner * arch.intermediate) * s
    up_proj = ((outer + mt * (inner - 1) * arch.intermediate) * s + dequant) if dequant else 0
    bool_mask, additive = attention_masks(arch, dataclasses.replace(setup, dtype=setup.ref_dtype), n_seq, seq_len)
    attn = nt * (4 * arch.hidden + 3 * arch.q_dim + 2 * arch.kv_dim) * s + bool_mask + additive
    if arch.eager_attention:  # the scores and softmax's float32 output (+ its s-byte cast when s = 2): 8 bytes
        attn += n_seq * arch.heads * seq_len * seq_len * (s + 4 + (s if s == 2 else 0))
    return max(mlp, up_proj, attn + dequant)


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
        per_layer = kept["layer_inputs"] // arch.layers if setup.gradient_checkpointing else layer_total
        # each saved tensor pinned on its own: a layer's input (checkpointing), else each of a layer's terms
        tensors = [per_layer] if setup.gradient_checkpointing else list(layer.values())
        host = arch.layers * sum(pinned_bytes(n) for n in tensors) + pinned_bytes(kept["final_norm"])
        activations = (kept["completion"] + kept["mask"] + kept["int8_inputs"]
                       + min(arch.layers, OFFLOAD_WINDOW) * per_layer)
    layer_phase = layer_working_bytes(arch, setup, n_seq, seq_len) + (
        layer_total if setup.gradient_checkpointing else 0)
    logits_phase = logits_train_bytes(arch, m, ad.lm_head, DTYPE_BYTES[setup.dtype], setup.device)
    breakdown = {
        "base_weights": sum(base.values()),
        "lora_params": (4 + copy) * n_lora,  # float32, and in 16-bit the copies the forward reads
        "lora_grads": (4 + copy) * n_lora,  # the same for their gradients (model/compute_copies.py)
        "optimizer_state": weights.optimizer_state_bytes(shapes, setup.optimizer),
        "activations": activations,
        "peak_phase": max(layer_phase, logits_phase, weights.embedding_gather_bytes(arch, setup) - activations),
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
    logits_phase = (n_seq * seq_len + m) * arch.hidden * s + head_tile_bytes(arch, m, s, setup.device)  # one tile
    breakdown = {"base_weights": sum(base.values()), "lora_params": 0, "lora_grads": 0, "optimizer_state": 0,
                 "activations": 0, "peak_phase": max(layer_phase, logits_phase, weights.embedding_gather_bytes(arch, setup, True))}
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
