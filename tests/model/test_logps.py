"""Completion log-probs: the LM head in (token, vocabulary) tiles equals the plain full log-softmax, values and
gradients, TRL's fused kernel gives the same, each sequence's sum is float64 in a fixed order, and a row's result
does not depend on its batch-mates."""

import pytest
import torch

from lowmem_dpo import data
from lowmem_dpo.model.head import Tile
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, torch.device("cpu"), torch.float32)


def naive_logps(model, batch):
    """Reference implementation: full [N, T, V] log-softmax, shifted, masked, summed."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # (N, T, V)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (N, T-1, V)
    tok = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, T-1)
    return (tok * batch.completion_mask[:, 1:]).sum(-1)  # (N,)


def some_pairs(tokenizer, n=6):
    from conftest import TINY_DATA

    ds = data.load_rows(str(TINY_DATA)).select(range(n))
    return data.tokenize_rows(ds, tokenizer, 64, None, progress=False).pairs


@pytest.mark.parametrize("chunk, entries", [(None, None), (1, None), (7, 100)])
def test_chunked_equals_full_log_softmax(model, tokenizer, chunk, entries):
    """Tiles of `chunk` rows x `entries` vocabulary entries (the tiny vocabulary is 461: 100 makes 5 tiles, the
    online logsumexp across them): the full log-softmax's sums, in float64."""
    batch = data.collate(some_pairs(tokenizer), 0)
    got = completion_logps(model, batch, tile=Tile(chunk, entries))
    want = naive_logps(model, batch)
    assert got.logps.dtype == torch.float64
    assert torch.allclose(got.logps, want.double(), atol=1e-4, rtol=1e-5)
    assert got.n_tokens.tolist() == batch.completion_mask.sum(-1).tolist()
    assert (got.logps < 0).all()


@pytest.mark.parametrize("chunk, entries", [(5, None), (5, 64)])
def test_gradients_match_unchunked(tiny_path, tokenizer, chunk, entries):
    from peft import LoraConfig, get_peft_model

    m = load_model(tiny_path, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    m = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    batch = data.collate(some_pairs(tokenizer, 4), 0)
    params = [p for p in m.parameters() if p.requires_grad]
    got = completion_logps(m, batch, tile=Tile(chunk, entries))
    g1 = torch.autograd.grad(got.logps.sum(), params)
    want = naive_logps(m, batch)
    g2 = torch.autograd.grad(want.sum(), params)
    for a, b in zip(g1, g2):  # float32 sums in another order: tolerance relative to the gradient's scale
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("weighting", [False, True])
def test_trl_fused_head_equals_ours(model, tokenizer, weighting):
    """TRL 1.16's chunked log-prob function (the CUDA path where Triton is: kernels.fused_head; here its torch
    fold, the same tiles and arguments) gives our tiled head's log-probs, WPO's aligned ones and the hidden
    states' gradient, through a scaled and softcapped head."""
    from lowmem_dpo.model.logps import Head, chunked_head
    from lowmem_dpo.runtime import kernels

    kernel = kernels.trl_head_kernel()
    assert kernel is not None  # trl==1.16.0 is in the test extra
    head, lm_head = Head(scale=0.5, softcap=3.0), model.get_output_embeddings()
    h = torch.randn(300, lm_head.in_features, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.randint(0, lm_head.out_features, (300,), generator=torch.Generator().manual_seed(1))
    ours, ours_aligned = chunked_head(lm_head, head, h, labels, Tile(128, 200), weighting)
    theirs, theirs_aligned = kernel(h, lm_head.weight, None, labels, head.scale, head.softcap, weighting)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    if weighting:
        assert torch.allclose(ours_aligned, theirs_aligned, atol=1e-5, rtol=1e-5)
    g = torch.linspace(-1, 1, 300)
    assert torch.allclose(*(torch.autograd.grad((x * g).sum(), h)[0] for x in (ours, theirs)), atol=1e-6, rtol=1e-4)


def test_sequence_sums_are_float64_in_a_fixed_order():
    """Each output's values (contiguous, outputs in any order) summed in float64: a float64 sum of 30,000 float32
    log-probs exactly, the same bits on every call, where float32 accumulation drifts."""
    from lowmem_dpo.model.logps import sequence_sums

    g = torch.Generator().manual_seed(0)
    values = -torch.rand(30000, generator=g) * 8  # (M,) float32 log-probs
    out = torch.cat([torch.full((20000,), 2), torch.full((9000,), 0), torch.full((1000,), 1)])  # (M,)
    got = sequence_sums(out, values, 4)
    want = torch.stack([values[20000:29000].double().sum(), values[29000:].double().sum(),
                        values[:20000].double().sum(), torch.zeros((), dtype=torch.float64)])
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=1e-12, atol=1e-9)
    assert torch.equal(got, sequence_sums(out, values, 4))
    float32 = torch.zeros(4).index_add(0, out, values)
    assert (float32.double() - want).abs().max() > 1e-4  # what float32 accumulation loses at this length


def test_row_alone_equals_row_in_padded_batch(model, tokenizer):
    pairs = some_pairs(tokenizer, 6)
    short = min(pairs, key=lambda p: len(p.prompt_ids) + len(p.chosen_ids))
    # A much longer batch-mate forces padding on `short`.
    long = data.TokenizedPair(99, short.prompt_ids * 3, short.chosen_ids * 2, short.rejected_ids * 3)
    alone = data.collate([short], 0)
    mixed = data.collate([long, short] + pairs[:2], 0)
    assert mixed.input_ids.shape[1] > alone.input_ids.shape[1]
    a_c, a_r = completion_logps(model, alone).split()
    m_c, m_r = completion_logps(model, mixed).split()
    assert torch.allclose(a_c.logps[0], m_c.logps[1], atol=1e-5)
    assert torch.allclose(a_r.logps[0], m_r.logps[1], atol=1e-5)
    assert a_c.n_tokens[0] == m_c.n_tokens[1]


@pytest.mark.parametrize("shared", [False, True])
def test_wpo_aligned_sums_equal_the_full_distribution_s(model, tokenizer, shared):
    """weighting=True: each completion's sum of log p(token) - log sum_v p(v)^2 (WPO's, as TRL's log_sum_sq_probs),
    from the full log-softmax by hand; the log-probs themselves unchanged. Shared rows give the same (2B,)."""
    pairs = some_pairs(tokenizer, 4)
    plain = data.collate(pairs, 0)
    logits = model(input_ids=plain.input_ids).logits.float()  # (N, T, V)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (N, T-1, V)
    tok = logp.gather(-1, plain.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, T-1)
    want = ((tok - torch.logsumexp(2 * logp, dim=-1)) * plain.completion_mask[:, 1:]).sum(-1)  # (N,)
    batch = data.collate_shared(pairs, 0) if shared else plain
    got = completion_logps(model, batch, tile=Tile(7), weighting=True)
    assert torch.allclose(got.aligned, want.double(), atol=1e-4, rtol=1e-5) and not got.aligned.requires_grad
    assert torch.allclose(got.logps, naive_logps(model, plain).double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_ld_alpha_weights_the_tokens_beyond_the_shorter_completion(model, tokenizer, shared):
    """LD-DPO's sums: each completion's tokens up to its pair's shorter completion's count at 1, the rest at
    ld_alpha, from the full log-softmax by hand; shared rows give the same (2B,)."""
    import dataclasses

    # the demo's completions are near one length: cut some rejected ones, lengthen a chosen one, so they differ
    pairs = [dataclasses.replace(p, rejected_ids=p.rejected_ids[:-(i % 3) or None],
                                 chosen_ids=p.chosen_ids + p.chosen_ids[:2] * (i == 4))
             for i, p in enumerate(some_pairs(tokenizer, 6))]
    plain = data.collate(pairs, 0)
    logits = model(input_ids=plain.input_ids).logits.float()  # (N, T, V)
    tok = torch.log_softmax(logits[:, :-1], -1).gather(-1, plain.input_ids[:, 1:, None])[..., 0]  # (N, T-1)
    on = plain.completion_mask[:, 1:].float()  # (N, T-1)
    counts = on.sum(1)  # (N,)
    b = len(pairs)
    shorter = torch.minimum(counts[:b], counts[b:]).repeat(2)  # (N,)
    beyond = (on.cumsum(1) > shorter[:, None]).float() * on
    want = (tok * (on - beyond)).sum(1) + 0.25 * (tok * beyond).sum(1)  # (N,)
    assert beyond.sum() > 0 and not torch.allclose(want, (tok * on).sum(1))
    batch = data.collate_shared(pairs, 0) if shared else plain
    got = completion_logps(model, batch, tile=Tile(7), ld_alpha=0.25)
    assert torch.allclose(got.logps, want.double(), atol=1e-4, rtol=1e-5)
    assert got.n_tokens.tolist() == counts.long().tolist()


def test_ld_alpha_shared_equals_unshared_with_empty_prompts(model, tokenizer):
    """With an empty prompt nothing predicts a completion's first token, in either layout: the shared row drops
    rejected's first token as the unshared one does, and each token keeps its rank in its own completion."""
    import dataclasses

    pairs = [dataclasses.replace(p, prompt_ids=[], rejected_ids=p.rejected_ids[:-1 - i])
             for i, p in enumerate(some_pairs(tokenizer, 3))]
    plain, shared = data.collate(pairs, 0), data.collate_shared(pairs, 0)
    a = completion_logps(model, plain, ld_alpha=0.25)
    b = completion_logps(model, shared, ld_alpha=0.25)
    assert a.n_tokens.tolist() == b.n_tokens.tolist()
    assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5)


def test_the_fused_heads_probe_passes_a_right_kernel_and_names_a_wrong_one():
    """The probe run before the first step (kernels.probe): TRL's kernel (its torch fold on this CPU) gives torch's
    log-probs and gradient; a kernel off by a constant, or one that raises, is refused with the reason."""
    from lowmem_dpo.runtime import kernels

    kernel = kernels.trl_head_kernel()
    cpu = torch.device("cpu")
    assert kernels.probe(kernel, cpu) is None

    def shifted(h, weight, bias, labels, scale, softcap, weighting):
        logp, aligned = kernel(h, weight, bias, labels, scale, softcap, weighting)
        return logp + 0.01, aligned

    def failing(*args):
        raise RuntimeError("no kernel image is available for execution on the device")

    assert kernels.probe(shifted, cpu).startswith("its probe is 0.01 off torch's log-probs")
    assert kernels.probe(failing, cpu) == "it fails here (RuntimeError: no kernel image is available for " \
                                          "execution on the device)"
    assert kernels.fused_head(cpu) == (None, None)  # off CUDA: the torch tiles, nothing said


def test_the_float32_product_needs_torch_2_8_on_cuda():
    """torch.addmm's out_dtype came with torch 2.8 (setup.cfg allows 2.4): the head's backward calls it only where
    the running torch's version says it has it (head.OUT_DTYPE), else sums its 16-bit products in float32 copies.
    (No torch before 2.8 runs here: the gate's reading of version strings is what is checked.)"""
    from lowmem_dpo.model import head

    assert [head.out_dtype_matmuls(v) for v in ("2.4.1", "2.7.1+cu126", "2.8.0", "2.13.0+cpu", "3.0.0")] == [
        False, False, True, True, True]
    assert head.OUT_DTYPE is head.out_dtype_matmuls(torch.__version__)
