"""Which CUDA kernel torch's scaled_dot_product_attention runs for a decoder's attention call, and the memory that
kernel holds beyond q, k, v and its output: pure functions of numbers (no torch, no device), so that the planner
counts the (batch, heads, T, T) scores where, and only where, they exist.

    sdpa_kernel(Card((7, 5)), "float16", gqa=True, mask=False, head_dim=128, length=1024, grad=True)  # "math"
    expand_kv(Card((7, 5)), "float16", gqa=True, mask=False, head_dim=128)                          # True
    attention_scores_bytes("math", AttentionShape(batch=4, heads=32, length=1024, dtype_bytes=2, head_dim=128,
                                                  kv_heads=8), grad=True)                          # 1.69 GiB

The rules follow torch's CUDA dispatcher, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend,
can_use_{cudnn,flash,mem_efficient}_attention) and sdp_utils_cpp.h, as in torch 2.11-2.13: dense tensors, dropout 0
(LoRA DPO trains without attention dropout), square causal attention (q and k of one length). sdp_utils_cpp.h as the
2.13 wheel ships it; sdp_utils.cpp read at a 2.11-era copy and at main (2.13's own .cpp was not found). Per kernel:

    flash             sm80-sm121; float16/bfloat16; no attn_mask; q, k, v head_dim equal and <= 256; with gradients
                      on sm86-sm89 and sm120-sm121 not head_dim in (192, 224]; GQA (enable_gqa) yes.
    memory-efficient  sm50-sm121; float16/float32, and bfloat16 from sm80 on; attn_mask yes; head_dim a multiple of
                      the GEMM alignment (8 for 16-bit dtypes from sm70, 4 for float32 from sm80, else 1), no upper
                      bound; GQA no: check_batch_size_and_num_heads_dense<false> wants equal head counts (main has
                      GQA since pytorch#191085, not in 2.13: its sdp_utils_cpp.h lacks that change's supports_mqa).
    cuDNN             sm80-sm121; float16/bfloat16; attn_mask yes (2-D or 4-D); GQA yes; head_dim a multiple of 8
                      and <= 128 (<= 256 on sm90 with cuDNN >= 9.10; main: sm90/sm10x from cuDNN 9.22, and its
                      backward then takes 256 but not 129-255); key length != 1; not under
                      torch.use_deterministic_algorithms (not modelled).
    math              anything.

Order: torch's default [flash, memory-efficient, math, cuDNN] (Context.h sdp_priority_order) never reaches cuDNN
while math is enabled; check_prefer_cudnn_attention puts cuDNN first on sm90, sm100 and sm103 when the runtime cuDNN is
newer than 9.15.0 (seen on an H200 with torch 2.11: "SDPA's cuDNN kernel, causal, no mask" for Mistral-7B).

Memory. flash, memory-efficient and cuDNN keep a float32 logsumexp per (sequence, head, query): O(N*H*T). The math
kernel (_scaled_dot_product_attention_math in aten/src/ATen/native/transformers/attention.cpp) is composite: it copies
float16/bfloat16 q, k, v to float32 ("Keep query, key, value in high precision", unless
torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp), repeat_interleaves k and v to every query head for GQA,
builds float32 (N, H, T, T) scores and their _safe_softmax, and autograd keeps the softmax for backward: measured op
by op with torch 2.13 on a CPU (tests/memory/test_attention_kernel.py), the same composite code CUDA runs.

transformers (integrations/sdpa_attention.py, 5.24): use_gqa_in_sdpa passes enable_gqa=True on CUDA whenever a GQA
layer gets no mask and head_dim <= 256, whatever the card or dtype; with a mask it repeats k and v (repeat_kv) to
every head first. expand_kv says when the project should make it take the repeat_kv branch without a mask too.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_dpo.memory.arch import Arch
from lowmem_dpo.memory.setup import DTYPE_BYTES, Setup

KERNELS = ("flash", "memory-efficient", "cuDNN", "math")
DTYPES = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float32": "float32", "fp32": "float32", "float": "float32"}
HALF = ("float16", "bfloat16")
SCORE_BYTES = 4  # the math kernel's scores and softmax: float32 (16-bit q, k, v are upcast first)
PREFER_CUDNN_AFTER = 91500  # check_prefer_cudnn_attention: cudnn_version > 91500 (cuDNN 9.15.0)
CUDNN_D256_FROM = 91000  # check_cudnn_tensor_shapes: head_dim <= 256 on sm90 from cuDNN 9.10.0, else <= 128
LSE_ROWS_MEM_EFFICIENT = 32  # memory-efficient's logsumexp rows: ceil(T / 32) * 32
ROWS_FLASH_BACKWARD = 128  # flash's backward rounds the query rows of its float32 buffers up to 128


@dataclass(frozen=True)
class Card:
    """A CUDA card as torch's SDPA dispatcher sees it: its (major, minor) capability (torch.cuda.get_device_capability:
    T4 (7, 5), A100 (8, 0), H100/H200 (9, 0)), the runtime cuDNN (cudnn_first; None: assumed new enough), and whether
    the torch has pytorch#191085, the memory-efficient kernel's GQA (main after 2.13)."""

    capability: tuple[int, int]
    cudnn: int | None = None
    mem_efficient_gqa: bool = False


@dataclass(frozen=True)
class AttentionShape:
    """One SDPA call's numbers: `batch` sequences (a DPO micro-batch of 2 pairs unshared is 4), `heads` query heads,
    `length` tokens per sequence, `dtype_bytes` bytes per element of q, k and v; head_dim (0: the terms it scales
    left out) and kv_heads, the k/v heads (None: as many as query heads)."""

    batch: int
    heads: int
    length: int
    dtype_bytes: int
    head_dim: int = 0
    kv_heads: int | None = None

    @property
    def kv(self) -> int:  # the k/v heads
        return self.heads if self.kv_heads is None else self.kv_heads


def _dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _within(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    """check_sm_version<low, high>: low <= (major, minor) <= high."""
    return low <= tuple(capability) <= high


def gemm_alignment(capability: tuple[int, int], dtype: str) -> int:
    """minimum_gemm_alignment: the head_dim multiple the memory-efficient kernel needs. Tensor cores (sm80 on, or
    sm70 on with 16-bit dtypes) want 128 bits (8 halves, 4 floats); sm80 on at least 4."""
    half = _dtype(dtype) in HALF
    tensor_cores = tuple(capability) >= (8, 0) or (tuple(capability) >= (7, 0) and half)
    least = 4 if tuple(capability) >= (8, 0) else 1
    return max(least, 128 // (16 if half else 32)) if tensor_cores else least


def cudnn_first(capability: tuple[int, int], cudnn: int | None = None) -> bool:
    """check_prefer_cudnn_attention: cuDNN goes ahead of flash on sm90, sm100 and sm103 when the runtime cuDNN
    (torch.backends.cudnn.version(), e.g. 91501) is newer than 9.15.0 (main's CUDA 13 builds: any sm9x/sm10x minor, not
    modelled). cudnn None: assumed new enough, as on the H200 run above; TORCH_CUDNN_SDPA_DEPRIORITIZED=1 turns it
    off."""
    major, minor = capability
    return (cudnn is None or cudnn > PREFER_CUDNN_AFTER) and major in (9, 10) and minor in (0, 3)


def _flash_ok(cap, dtype: str, mask: bool, head_dim: int, length: int, grad: bool) -> bool:
    if mask or not _within(cap, (8, 0), (12, 1)) or dtype not in HALF or not 0 < head_dim <= 256 or length < 1:
        return False  # check_for_attn_mask, check_flash_attention_hardware_support, check_head_dim_size_flash
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120 (dropout 0: (224, 256] is allowed)
    small_smem = _within(cap, (8, 6), (8, 9)) or _within(cap, (12, 0), (12, 1))
    return not (grad and small_smem and 192 < head_dim <= 224)


def _mem_efficient_ok(cap, dtype: str, gqa: bool, head_dim: int, length: int, gqa_ok: bool) -> bool:
    if not _within(cap, (5, 0), (12, 1)) or length < 1 or (gqa and not gqa_ok):
        return False  # check_mem_efficient_hardware_support, nonzero lengths, check_batch_size_and_num_heads_dense
    allowed = ("float16", "float32", "bfloat16") if tuple(cap) >= (8, 0) else ("float16", "float32")
    return dtype in allowed and head_dim > 0 and head_dim % gemm_alignment(cap, dtype) == 0


def _cudnn_ok(cap, dtype: str, head_dim: int, length: int, cudnn: int | None) -> bool:
    if not _within(cap, (8, 0), (12, 1)) or dtype not in HALF or length < 2:
        return False  # check_cudnn_hardware_support, check_dtypes_low_precision, "key/value sequence length 1"
    limit = 256 if tuple(cap) == (9, 0) and (cudnn is None or cudnn >= CUDNN_D256_FROM) else 128
    return 0 < head_dim <= limit and head_dim % 8 == 0  # check_cudnn_tensor_shapes


def sdpa_kernel(card: Card, dtype: str, gqa: bool, mask: bool, head_dim: int, length: int, grad: bool) -> str:
    """The kernel torch's CUDA scaled_dot_product_attention picks on `card`: "flash", "memory-efficient", "cuDNN" or
    "math". dtype: of q, k, v; gqa: enable_gqa with fewer k/v heads than q heads; mask: an attn_mask is passed (else
    is_causal); head_dim: of q, k and v alike; length: tokens per sequence; grad: q, k or v need gradients (train)."""
    capability, cudnn, mem_efficient_gqa = card.capability, card.cudnn, card.mem_efficient_gqa
    dt = _dtype(dtype)
    order = ("cuDNN", "flash", "memory-efficient") if cudnn_first(capability, cudnn) else ("flash", "memory-efficient")
    for kernel in order:  # select_sdp_backend: the first kernel whose filters all pass; math, enabled, after these
        if kernel == "cuDNN" and _cudnn_ok(capability, dt, head_dim, length, cudnn):
            return kernel
        if kernel == "flash" and _flash_ok(capability, dt, mask, head_dim, length, grad):
            return kernel
        if kernel == "memory-efficient" and _mem_efficient_ok(capability, dt, gqa, head_dim, length,
                                                              mem_efficient_gqa):
            return kernel
    return "math"


def expand_kv(card: Card, dtype: str, gqa: bool, mask: bool, head_dim: int, *, grad: bool = True,
              length: int = 1024) -> bool:
    """Whether repeating the k/v heads to every query head before SDPA (transformers' repeat_kv, so that enable_gqa
    is off) gets a fused kernel where GQA as is falls to math: a T4 (sm75) in float16, where flash and cuDNN need sm80
    and the memory-efficient kernel takes no GQA; any card in float32; head_dim > 256. The cost: k and v at every
    head (repeat_kv_bytes) instead of the (N, H, T, T) scores. False where GQA as is already gets a fused kernel,
    and where the expanded call falls to math too (bfloat16 on a T4: the memory-efficient kernel wants sm80)."""
    if not gqa:
        return False
    as_is = sdpa_kernel(card, dtype, True, mask, head_dim, length, grad)
    expanded = sdpa_kernel(card, dtype, False, mask, head_dim, length, grad)
    return as_is == "math" and expanded != "math"


def repeat_kv_bytes(batch: int, heads: int, kv_heads: int, length: int, head_dim: int, dtype_bytes: int) -> int:
    """What repeat_kv adds: k and v at every query head instead of kv_heads, (N, H - KV, T, D) each, in the dtype;
    SDPA keeps them for backward (the KV-head originals go: rotary and the projections keep nothing of them)."""
    return 2 * batch * (heads - kv_heads) * length * head_dim * dtype_bytes


def _math_bytes(shape: AttentionShape, grad: bool, causal: bool) -> tuple[int, int, int]:
    """(forward peak, kept for backward, backward peak) of _scaled_dot_product_attention_math, beyond q, k, v, the
    output and their gradients. Each term measured by allocation on a CPU with torch 2.13 (the test)."""
    batch, heads, kv_heads, length = shape.batch, shape.heads, shape.kv, shape.length
    head_dim, dtype_bytes = shape.head_dim, shape.dtype_bytes
    c = SCORE_BYTES
    e = batch * heads * length * length  # elements of one (N, H, T, T) tensor
    f = batch * heads * length * head_dim  # elements of one (N, H, T, D) tensor: q's heads
    g = batch * kv_heads * length * head_dim  # elements of k or v as they come: (N, KV, T, D)
    upcast = dtype_bytes != c  # 16-bit q, k, v: query_acc, key_acc, value_acc are float32 copies
    gqa = kv_heads != heads  # k, v repeat_interleave'd to every query head (pre_process_group_query_attention_input)
    copies = upcast * (f + 2 * g) * c  # query_acc (N, H, T, D), key_acc and value_acc (N, KV, T, D)
    scaled = (1 + grad) * f * c  # query * sqrt(scale); key^T * sqrt(scale), freed before the softmax without grad
    expanded = gqa * 2 * f * c  # key_expanded, value_expanded: (N, H, T, D) each
    bias = causal * length * length * c  # is_causal: a (T, T) float32 bias from a bool tril (the tril is freed)
    # at _safe_softmax: the scores S = q k^T, its softmax P (float32 (N, H, T, T) each) and S == -inf (1 byte)
    forward = copies + scaled + expanded + bias + e * (2 * c + 1)
    kept_v = f * c if gqa else (g * c if upcast else 0)  # the v the second matmul keeps, when a copy
    kept = (e * c + 2 * f * c + kept_v) if grad else 0  # P (N, H, T, T), scaled q and k^T, that v
    # backward: dV (N, H, T, D) float32; dP = dO v^T and dS = softmax_backward(dP, P), (N, H, T, T) float32 each,
    # beside P; the second matmul's kept v goes once its backward ran
    backward = (kept - kept_v + f * c + 2 * e * c) if grad else 0
    return forward, kept, backward


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _fused_bytes(kernel: str, shape: AttentionShape, grad: bool) -> tuple[int, int, int]:
    """(forward peak, kept for backward, backward peak) of flash, memory-efficient or cuDNN beyond q, k, v, the
    output and their gradients. Forward: the float32 logsumexp, (N, H, T) (memory-efficient: rows rounded up to 32;
    memory-efficient and cuDNN only compute it with gradients). Backward (flash-attention's mha_bwd; the others
    assumed alike): a float32 (N, H, T) softmax_d and, with head_dim, a float32 (N, T, H, D) dQ accumulator, rows
    rounded up to 128; flash with GQA also dK, dV at every query head, in the dtype, before it sums them per group."""
    batch, heads, kv_heads, length = shape.batch, shape.heads, shape.kv, shape.length
    head_dim, dtype_bytes = shape.head_dim, shape.dtype_bytes
    rows = _round_up(length, LSE_ROWS_MEM_EFFICIENT) if kernel == "memory-efficient" else length
    lse = batch * heads * rows * 4 if (grad or kernel == "flash") else 0  # float32 (N, H, T)
    if not grad:
        return lse, 0, 0
    r = _round_up(length, ROWS_FLASH_BACKWARD)
    work = batch * heads * r * 4 + batch * r * heads * head_dim * 4  # softmax_d (N, H, T), dQ accumulator
    if kernel == "flash" and kv_heads != heads:
        work += 2 * batch * length * heads * head_dim * dtype_bytes  # dk_expanded, dv_expanded (N, T, H, D)
    return lse, lse, lse + work


def _bytes(kernel: str, shape: AttentionShape, grad: bool, causal: bool) -> tuple[int, int, int]:
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r}: one of {', '.join(KERNELS)}")
    if kernel == "math":
        return _math_bytes(shape, grad, causal)
    return _fused_bytes(kernel, shape, grad)


def attention_scores_bytes(kernel: str, shape: AttentionShape, grad: bool, causal: bool = True) -> int:
    """The most bytes one SDPA call of `kernel` and `shape` holds at once beyond q, k, v and its output (and in
    backward beyond their gradients): its forward's peak, and with grad the larger of that and its backward's.

    math: float32 (N, H, T, T) scores, softmax and a bool (9 bytes an element) in forward; with grad, in backward
    the kept softmax and two float32 gradients of it (12 bytes an element). head_dim (0: left out) adds the
    O(N*H*T*D) float32 copies of q, k, v (kv_heads: k/v heads, default heads); causal the (T, T) float32 bias.
    flash, memory-efficient, cuDNN: O(N*H*T) float32 rows (and, with head_dim, backward's float32 dQ)."""
    forward, _, backward = _bytes(kernel, shape, grad, causal)
    return max(forward, backward)


def attention_saved_bytes(kernel: str, shape: AttentionShape) -> int:
    """What one SDPA call with gradients keeps for backward beyond q, k, v and its output, once its forward returned
    (each layer's, until its backward; with checkpointing, the recomputed layer's): math its float32 softmax
    (N, H, T, T), with head_dim its float32 scaled q and k^T and, for GQA or a 16-bit dtype, a float32 v at every
    head; the others their float32 logsumexp (N, H, T)."""
    return _bytes(kernel, shape, True, False)[1]


# -- the planner's view (memory/activations.py): the kernel of a run's attention -----------------------------------
def cuda_attention(arch: Arch, setup: Setup, seq_len: int, masked: bool, grad: bool) -> tuple[str | None, bool]:
    """(the SDPA kernel, whether k and v are repeated to every query head) of one attention call. On CUDA from
    the rules above for the card the rule's kind implies (a -bf16 kind: Ampere or later, as an A100 (8, 0);
    else Turing/Volta, as a T4 (7, 5)), with the k/v heads repeated where that avoids the math kernel
    (expand_kv: model.models.expand_kv_heads does it at run time). Elsewhere (None, GQA with a mask:
    transformers repeats them for a mask)."""
    gqa = arch.kv_heads < arch.heads
    if setup.device != "cuda" or arch.eager_attention:
        return None, gqa and masked
    card = (8, 0) if setup.kind.endswith("-bf16") else (7, 5)
    card = Card(card)
    expand = gqa and (masked or expand_kv(card, setup.dtype, gqa, masked, arch.head_dim, grad=grad, length=seq_len))
    return sdpa_kernel(card, setup.dtype, gqa and not expand, masked, arch.head_dim, seq_len, grad), expand


def math_kept(arch: Arch, setup: Setup, n_seq: int, seq_len: int, masked: bool) -> tuple[int, int]:
    """(kept for backward, transient beyond it) of a train layer's attention when its kernel is math (a card or a
    dtype no fused kernel takes): the float32 (N, heads, T, T) softmax and its gradients; (0, 0) otherwise."""
    kernel, expand = cuda_attention(arch, setup, seq_len, masked, grad=True)
    if kernel != "math":
        return 0, 0
    s = DTYPE_BYTES[setup.dtype]
    kv = arch.heads if expand else arch.kv_heads
    shape = AttentionShape(n_seq, arch.heads, seq_len, s, head_dim=arch.head_dim, kv_heads=kv)
    kept = attention_saved_bytes("math", shape)
    return kept, attention_scores_bytes("math", shape, True) - kept
