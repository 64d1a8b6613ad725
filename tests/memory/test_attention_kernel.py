"""memory/attention.py: the CUDA SDPA kernel torch 2.11-2.13 picks (T4, A100, RTX 30xx/40xx, H100/H200), the
transformers-level repeat_kv fix where GQA falls to math, and the bytes each kernel holds; the math kernel's bytes
checked against torch's own _scaled_dot_product_attention_math run on CPU tensors (the same composite code CUDA runs),
allocation by allocation with torch.profiler and saved tensor by saved tensor with saved_tensors_hooks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lowmem_dpo.memory.attention import (
    AttentionShape,
    Card,
    _math_bytes,
    attention_saved_bytes,
    attention_scores_bytes,
    cudnn_first,
    expand_kv,
    gemm_alignment,
    repeat_kv_bytes,
    sdpa_kernel,
)
from lowmem_dpo.runtime.units import GiB

T4, V100, A100, A10, RTX4090, H100, B200, RTX5090 = (7, 5), (7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)
OLD_CUDNN = 91002  # cuDNN 9.10.2: not preferred (check_prefer_cudnn_attention wants > 9.15.0)
# Mistral-7B: 32 query heads, 8 k/v heads, head_dim 128; a micro-batch of 2 pairs, unshared: 4 sequences
MISTRAL = dict(heads=32, kv_heads=8, head_dim=128)
PAIRS_2 = 4


def kernel(cap, dtype="bfloat16", gqa=True, mask=False, head_dim=128, length=1024, grad=True, **card):
    return sdpa_kernel(Card(cap, **card), dtype, gqa, mask, head_dim, length, grad)


# -- which kernel ---------------------------------------------------------------------------------------------------
def test_t4_gqa_without_a_mask_falls_to_math_and_repeat_kv_gets_memory_efficient():
    """The issue: a T4 has neither flash nor cuDNN (both sm80+), and torch 2.13's memory-efficient kernel takes no
    GQA; with k/v repeated to every head (enable_gqa off) the memory-efficient kernel runs, in float16."""
    assert kernel(T4, "float16") == "math"
    assert kernel(T4, "float16", gqa=False) == "memory-efficient"
    assert expand_kv(Card(T4), "float16", True, False, 128) is True
    assert expand_kv(Card(T4), "float16", False, False, 128) is False  # no GQA: nothing to repeat
    # bfloat16 on a T4 (the project trains float16 there): memory-efficient wants sm80 for bf16, so math either way
    assert kernel(T4, "bfloat16") == kernel(T4, "bfloat16", gqa=False) == "math"
    assert expand_kv(Card(T4), "bfloat16", True, False, 128) is False
    # a mask (shared prompts): transformers repeats k/v itself; the memory-efficient kernel takes the mask
    assert kernel(T4, "float16", gqa=False, mask=True) == "memory-efficient"
    assert kernel(V100, "float16", gqa=False) == "memory-efficient"


def test_a100_and_ampere_cards_run_flash_with_gqa():
    assert kernel(A100) == kernel(A100, "float16") == "flash"
    assert kernel(A100, grad=False) == kernel(RTX4090) == kernel(A10) == "flash"
    assert expand_kv(Card(A100), "bfloat16", True, False, 128) is False
    assert kernel(A100, cudnn=99999) == "flash"  # cuDNN is preferred on sm90/sm100/sm103 only


def test_h100_and_h200_prefer_cudnn_with_a_recent_cudnn():
    """torch 2.11-2.13 (check_prefer_cudnn_attention): sm90 with cuDNN newer than 9.15.0 tries cuDNN first, which
    takes GQA and a mask (the H200 run with torch 2.11 logged "SDPA's cuDNN kernel, causal, no mask" for Mistral-7B);
    an older cuDNN keeps flash first."""
    assert cudnn_first(H100) and cudnn_first(H100, 91501) and cudnn_first(B200) and cudnn_first((10, 3))
    assert not cudnn_first(H100, 91500) and not cudnn_first(A100) and not cudnn_first(RTX5090) and not cudnn_first((9, 1))
    assert kernel(H100) == kernel(H100, "float16") == kernel(B200) == "cuDNN"
    assert kernel(H100, mask=True) == "cuDNN"
    assert kernel(H100, cudnn=OLD_CUDNN) == "flash"
    assert kernel(H100, cudnn=OLD_CUDNN, mask=True) == "math"  # GQA with a mask: only cuDNN (and math) take it
    assert kernel(H100, cudnn=OLD_CUDNN, mask=True, gqa=False) == "memory-efficient"
    assert kernel(H100, "float32") == "math"  # cuDNN and flash want 16 bits, memory-efficient no GQA
    assert kernel(H100, length=1) == "flash"  # cuDNN: "key/value sequence length 1" is not supported


def test_float32_never_runs_flash():
    for cap in (A100, RTX4090, H100, RTX5090):
        assert kernel(cap, "float32", gqa=False) == "memory-efficient"
        assert kernel(cap, "float32") == "math"
        assert expand_kv(Card(cap), "float32", True, False, 128) is True
    assert kernel(T4, "float32", gqa=False) == "memory-efficient"


def test_head_dim_limits():
    assert kernel(A100, head_dim=256) == "flash"
    assert kernel(A100, head_dim=264) == "math"  # flash: <= 256; memory-efficient: no GQA
    assert kernel(A100, head_dim=512, gqa=False) == "memory-efficient"  # no upper bound, a multiple of 8
    assert expand_kv(Card(A100), "bfloat16", True, False, 512) is True
    # flash's backward on sm86-sm89 / sm120-121 refuses head_dim in (192, 224]; inference is fine
    assert kernel(A10, head_dim=200) == kernel(RTX5090, head_dim=200) == "math"
    assert kernel(A10, head_dim=200, grad=False) == kernel(A100, head_dim=200) == "flash"
    assert kernel(A10, head_dim=256) == "flash"  # (224, 256] passes without dropout
    assert expand_kv(Card(A10), "bfloat16", True, False, 200) is True
    # cuDNN: <= 128, <= 256 on sm90 from cuDNN 9.10; a multiple of 8
    assert kernel(H100, head_dim=256) == "cuDNN"
    assert kernel(H100, head_dim=256, cudnn=90800) == "flash"  # 9.8: cuDNN not preferred either
    assert kernel(B200, head_dim=256) == "flash"  # cuDNN's 256 is sm90's
    assert kernel(H100, head_dim=100) == "flash"  # not a multiple of 8: cuDNN refuses, flash pads
    # memory-efficient: a multiple of the GEMM alignment
    assert gemm_alignment(T4, "float16") == 8 and gemm_alignment(A100, "float32") == 4
    assert gemm_alignment(T4, "float32") == 1 and gemm_alignment((6, 1), "float16") == 1
    assert kernel(T4, "float16", gqa=False, head_dim=100) == "math"
    assert kernel(T4, "float32", gqa=False, head_dim=100) == "memory-efficient"


def test_a_mask_rules_out_flash():
    for cap in (A100, A10, RTX4090):
        assert kernel(cap, mask=True, gqa=False) == "memory-efficient"
        assert kernel(cap, mask=True) == "math"
        assert expand_kv(Card(cap), "bfloat16", True, True, 128) is True


def test_memory_efficient_gqa_as_on_torch_main():
    """pytorch#191085 (main, after 2.13) gives the memory-efficient kernel GQA: no repeat needed on a T4."""
    assert kernel(T4, "float16", mem_efficient_gqa=True) == "memory-efficient"
    assert expand_kv(Card(T4, mem_efficient_gqa=True), "float16", True, False, 128) is False


def test_the_installed_torch_is_the_one_the_rules_follow():
    """The rules are torch 2.11-2.13's: the installed torch's own sdp_utils_cpp.h (shipped in the wheel) has the
    two-argument check_batch_size_and_num_heads_dense, without the supports_mqa that came with memory-efficient GQA.
    A torch with it needs sdpa_kernel(Card(..., mem_efficient_gqa=True), ...) and this module's table read again."""
    header = Path(torch.__file__).parent / "include/ATen/native/transformers/sdp_utils_cpp.h"
    if not header.exists():
        pytest.skip("this torch ships no ATen headers")
    text = header.read_text(encoding="utf-8")
    assert re.search(r"template <bool supports_gqa, bool requires_same_num_heads=true>\s*"
                     r"inline bool check_batch_size_and_num_heads_dense", text)
    assert "supports_mqa" not in text


def test_unknown_arguments_are_refused():
    with pytest.raises(ValueError):
        kernel(A100, "int8")
    with pytest.raises(ValueError):
        attention_scores_bytes("eager", AttentionShape(1, 1, 8, 2), True)


# -- what each kernel holds -----------------------------------------------------------------------------------------
def test_math_bytes_for_mistral_at_1024_and_2048_tokens():
    """The issue's 1.5-2 GiB at 1,024 tokens (a micro-batch of 2 pairs: 4 sequences), the scores 4x at 2,048."""
    at_1k = attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2, head_dim=128, kv_heads=8), True)
    at_2k = attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 2048, 2, head_dim=128, kv_heads=8), True)
    assert 1.5 * GiB <= at_1k <= 2 * GiB
    assert at_1k == int(1.6875 * GiB)  # backward: float32 softmax, dP, dS (12 bytes an element) + O(T*D) copies
    assert 3.5 * at_1k < at_2k <= 4 * at_1k  # the O(T*D) float32 copies grow 2x
    scores_1k = attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2), True, causal=False)
    assert scores_1k == PAIRS_2 * 32 * 1024 * 1024 * 12 == int(1.5 * GiB)
    assert attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 2048, 2), True, causal=False) == 4 * scores_1k
    # forward alone (no gradients): scores, softmax, a bool: 9 bytes an element; 2 sequences: half
    assert attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2), False, causal=False) \
        == PAIRS_2 * 32 * 1024**2 * 9
    assert attention_scores_bytes("math", AttentionShape(2, 32, 1024, 2), True, causal=False) == scores_1k // 2
    # kept for backward per layer: the float32 softmax, and with head_dim float32 q, k^T and the repeated v
    assert attention_saved_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2)) == PAIRS_2 * 32 * 1024**2 * 4
    mistral = AttentionShape(PAIRS_2, 32, 1024, 2, **{k: MISTRAL[k] for k in ("head_dim", "kv_heads")})
    assert attention_saved_bytes("math", mistral) \
        == PAIRS_2 * 32 * 1024 * (1024 + 3 * 128) * 4


def test_fused_kernels_hold_rows_linear_in_length():
    for k in ("flash", "memory-efficient", "cuDNN"):
        for grad in (True, False):
            b1 = attention_scores_bytes(k, AttentionShape(PAIRS_2, 32, 1024, 2, head_dim=128, kv_heads=8), grad)
            b2 = attention_scores_bytes(k, AttentionShape(PAIRS_2, 32, 2048, 2, head_dim=128, kv_heads=8), grad)
            assert b2 == 2 * b1
            assert b1 < attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2), grad) / 10
    # the logsumexp: float32 (N, H, T); memory-efficient's rows rounded up to 32
    assert attention_saved_bytes("flash", AttentionShape(PAIRS_2, 32, 1024, 2)) == PAIRS_2 * 32 * 1024 * 4
    assert attention_saved_bytes("memory-efficient", AttentionShape(1, 1, 1000, 2)) == 1024 * 4
    assert attention_scores_bytes("flash", AttentionShape(PAIRS_2, 32, 1024, 2), False) == PAIRS_2 * 32 * 1024 * 4
    assert attention_scores_bytes("memory-efficient", AttentionShape(PAIRS_2, 32, 1024, 2), False) == 0


def test_repeat_kv_costs_k_and_v_at_every_head():
    assert repeat_kv_bytes(PAIRS_2, 32, 8, 1024, 128, 2) == 2 * PAIRS_2 * 24 * 1024 * 128 * 2  # 48 MiB
    scores = attention_scores_bytes("math", AttentionShape(PAIRS_2, 32, 1024, 2), True)
    assert repeat_kv_bytes(PAIRS_2, 32, 8, 1024, 128, 2) < scores / 20


# -- the math kernel's bytes, measured ------------------------------------------------------------------------------
def _timeline_peak(prof) -> tuple[int, int]:
    """(the highest, the last) sum of bytes allocated minus freed in the profiled block."""
    from torch.profiler._memory_profiler import MemoryProfile  # private, but torch's own allocation timeline

    cur = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action.name in ("CREATE", "DESTROY"):
            cur += size if action.name == "CREATE" else -size
            peak = max(peak, cur)
    return peak, cur


def _measure_math(dtype, n, h, kv, t, d, grad):
    """(forward peak, kept, backward peak) of torch's math kernel on CPU tensors, beyond q, k, v, out and grads."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(n, heads, t, d, dtype=dtype, requires_grad=grad) for heads in (h, kv, kv))
    inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
    saved = {}

    def pack(x):
        if x.untyped_storage().data_ptr() not in inputs:
            saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, None,
                                                                enable_gqa=kv != h)[0]
    forward, end = _timeline_peak(prof)
    kept = end - out.numel() * out.element_size()
    assert kept == (sum(saved.values()) if grad else 0)  # what is left is what autograd keeps
    if not grad:
        return forward, 0, 0
    grad_out = torch.randn_like(out)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out.backward(grad_out)
    return forward, kept, kept + _timeline_peak(prof)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv", [2, 8])
@pytest.mark.parametrize("grad", [True, False])
def test_math_bytes_match_torchs_math_kernel_on_cpu(dtype, kv, grad):
    n, h, t, d = 2, 8, 256, 64
    forward, kept, backward = _measure_math(dtype, n, h, kv, t, d, grad)
    s = torch.tensor([], dtype=dtype).element_size()
    slack = n * h * t + 1024  # _safe_softmax's (N, H, T, 1) bool row flags, 0-d scalars
    shape = AttentionShape(n, h, t, s, head_dim=d, kv_heads=kv)
    terms = _math_bytes(shape, grad, True)  # (forward peak, kept, backward peak), term by term
    assert all(abs(m - p) <= slack for m, p in zip((forward, kept, backward), terms)), ((forward, kept, backward), terms)
    predicted = attention_scores_bytes("math", shape, grad)
    assert abs(max(forward, backward) - predicted) <= slack
    if grad:
        assert kept == attention_saved_bytes("math", shape)
    assert forward > n * h * t * t * 9  # the (N, H, T, T) float32 scores and softmax and a bool, at once


# -- the planner and the run (memory/model.py, training/policy.py, model/models.py) -------------------------------
def mistral_setup(kind: str, dtype: str, length: int = 1024):
    import dataclasses

    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.memory.setup import setup_from_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "mistral-7b-qlora-12gb.yaml",
                      [f"max_length={length}", "max_prompt_length=null"])
    arch = load_arch(cfg.model_name_or_path)
    return arch, dataclasses.replace(setup_from_config(cfg, int(11.25 * GiB)), kind=kind, dtype=dtype,
                                     share_prompt=False, micro_batch=1)


@pytest.mark.parametrize("kind, dtype, want", [
    ("cuda-12gb-bf16", "bfloat16", ("flash", False)),  # Ampere or later: GQA as it is
    ("cuda-12gb", "float16", ("memory-efficient", True)),  # a T4: k and v repeated, so no math kernel
    ("cuda-12gb", "bfloat16", ("math", False)),  # refused at run time (rules.dtype_problem); the plan says why
])
def test_the_planner_counts_the_kernel_the_card_runs(kind, dtype, want):
    from lowmem_dpo.memory.activations import layer_saved_bytes
    from lowmem_dpo.memory.attention import cuda_attention, math_kept
    from lowmem_dpo.memory.model import predict

    arch, setup = mistral_setup(kind, dtype)
    t, _ = setup.shapes("train")
    n = setup.sequences("train")
    assert cuda_attention(arch, setup, t, masked=False, grad=True) == want
    kept, transient = math_kept(arch, setup, n, t, masked=False)
    attention = layer_saved_bytes(arch, setup, n, t)["attention"]
    s = 2
    fused = n * t * ((2 * arch.q_dim + 2 * (arch.q_dim if want[1] else arch.kv_dim)) * s + 4 * arch.heads)
    assert attention == fused + kept
    if want[0] == "math":  # the float32 softmax of 2 sequences x 32 heads x 1,024^2, and more in backward
        _, flash = mistral_setup("cuda-12gb-bf16", dtype)
        more = predict(arch, setup).train.peak_bytes - predict(arch, flash).train.peak_bytes
        assert kept >= 2 * 32 * t * t * 4 and transient > kept and more >= kept
    else:
        assert kept == transient == 0


def test_repeat_kv_heads_makes_transformers_pass_every_head_to_sdpa(monkeypatch, tmp_path, tokenizer):
    """The run-time side (models.repeat_kv_heads, applied on CUDA by policy.attention_path): a grouped-query model's
    unmasked forward calls SDPA with enable_gqa and 2 k/v heads as shipped, and with k/v at all 4 heads and no
    enable_gqa after it (on this CPU transformers takes the same branch it takes on CUDA: TRANSFORMERS_SDPA_FORCE_GQA
    stands in for the CUDA check)."""
    from conftest import build_tiny_model
    from transformers.integrations import sdpa_attention

    from lowmem_dpo.model import models, sdpa

    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)  # restored after
    path = build_tiny_model("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2), tmp_path / "m", tokenizer)
    model = models.load_model(path, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])

    def first_call():
        with sdpa.sdpa_calls(stop=True) as seen:
            try:
                model(input_ids=ids)
            except sdpa.FirstCall:
                pass
        return seen[0]

    before = first_call()
    assert before["enable_gqa"] and before["key"].shape[1] == 2 and before["attn_mask"] is None
    assert models.repeat_kv_heads().startswith("attention: k and v repeated to every query head")
    after = first_call()
    assert not after["enable_gqa"] and after["key"].shape[1] == after["query"].shape[1] == 4
    assert torch.equal(after["key"][:, ::2], before["key"])  # the same values, each head twice
