"""The activations' bytes in the memory model, term by term, as pure functions of an architecture (arch.Arch) and
a setup (setup.Setup): what a train layer keeps for backward and its working set, what train keeps across the
forward, the LM head's tiles and chunks, and precompute's layer. model.py adds them up into a stage's peak. Each
formula says what it counts and how it was measured.
"""

from __future__ import annotations

import dataclasses

from lowmem_dpo.memory import attention, weights
from lowmem_dpo.memory.arch import Arch, adapted
from lowmem_dpo.memory.setup import DTYPE_BYTES, Setup
from lowmem_dpo.model.activations import MLP_TILE_TOKENS
from lowmem_dpo.model.head import HEAD_TILE_ELEMENTS, OUT_DTYPE, head_tile
from lowmem_dpo.runtime.kernels import FUSED_HEAD_TILE


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
    tile = head_tile_bytes(arch, m, s, device)
    c, v = head_tile(m, arch.vocab)
    upcast = v * arch.hidden * 4 if s != 4 and (device != "cuda" or not OUT_DTYPE) and v < arch.vocab else 0
    return tile + c * arch.hidden * 4 + m * arch.hidden * s * (1 + (device == "cuda")) + upcast


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
