"""padding_free: a micro-batch's sequences in one row (data.Packed), each attending only to itself
(model/packing.py). Real tiny models of several families, real peft and bitsandbytes: the packed row gives the
padded batch's log-probs and gradients, a model that cannot is refused or falls back, and a whole run's adapter is
the padded run's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_RECIPE, build_tiny_model

from lowmem_dpo import data, train
from lowmem_dpo.model import headcheck, logps, packing
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.runtime.errors import UserError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3)
ARCHS = {
    "llama": ("LlamaConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "gemma": ("GemmaConfig", dict(SMALL, head_dim=8)),
    "phi3": ("Phi3Config", SMALL),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, rotary_pct=0.5)),
}


def forced(batch: data.Batch) -> data.Batch:
    """The batch with its packed row, whatever its padding."""
    return dataclasses.replace(batch, packed=data.pack(batch))


def model_of(arch, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    config_class, kwargs = ARCHS[arch]
    path = build_tiny_model(config_class, kwargs, tmp_path / arch, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert packing.problem(model, 64, shared=True) is None
    packing.enable(model)
    return model


def test_pack_lays_the_real_tokens_out_in_one_row_with_their_own_positions():
    """Two right-padded rows [5 6 7 pad] and [8 9 pad pad], by hand: one row [5 6 7 8 9], positions restarting, the
    bounds and starts of each; a shared row's positions and splits as collate_shared wrote them."""
    b = data.Batch(torch.tensor([0, 1]), torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
                   torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]), torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]]), 5)
    p = data.pack(b)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9]] and p.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert p.bounds == (0, 3, 5) and p.starts.tolist() == [0, 3] and p.splits is None
    shared = data.collate_shared([data.TokenizedPair(0, [1, 2], [3], [4, 5]), data.TokenizedPair(1, [1], [3], [4])],
                                 0, packed=True)
    assert shared.packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 3, 4]]
    assert shared.packed.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 1]]
    assert shared.packed.splits == ((2, 3), (1, 2)) and shared.computed_tokens == 8
    assert data.collate([data.TokenizedPair(0, [1, 2], [3], [4])], 0, packed=True).packed is None  # no padding


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_equals_padded_log_probs(arch, tokenizer, pairs, tmp_path):
    """Sums and token counts per completion in float32, plain pairs and shared rows, on tiny random models of five
    families; the packed forward computes no padding."""
    model = model_of(arch, tokenizer, tmp_path)
    for collate in (data.collate, data.collate_shared):
        plain = collate(pairs, 0)
        with torch.no_grad():
            a, b = completion_logps(model, plain), completion_logps(model, forced(plain))
        assert torch.equal(a.n_tokens, b.n_tokens)
        assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5), (a.logps - b.logps).abs().max()
        assert a.logps.abs().min() > 1  # real sums, not zeros
        assert forced(plain).computed_tokens == plain.num_tokens < plain.computed_tokens


def test_a_sequence_sees_nothing_of_the_others_in_its_row(tokenizer, pairs, tmp_path):
    """Other tokens in the second sequence leave the first sequence's hidden states as they were, bit for bit."""
    model = model_of("llama", tokenizer, tmp_path)
    lm = logps.lm_of(model)
    a = data.collate(pairs[:1], 0)
    other = data.TokenizedPair(0, pairs[0].prompt_ids, pairs[0].chosen_ids, pairs[5].chosen_ids * 3)
    b = data.collate([other], 0)
    with torch.no_grad():
        ha, hb = logps.last_hidden(lm, forced(a)), logps.last_hidden(lm, forced(b))
    first = len(pairs[0].prompt_ids) + len(pairs[0].chosen_ids)
    assert torch.equal(ha[0, :first], hb[0, :first]) and ha.shape != hb.shape


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_equal_padded(tiny_path, pairs, checkpointing):
    """The LoRA gradients of the summed log-probs, packed and padded, with a non-zero adapter and gradient
    checkpointing on and off (the recompute runs the packed attention again: the implementation is the model's)."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.model.models import load_model

    m = load_model(tiny_path, torch.device("cpu"), torch.float32)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
    packing.enable(m)
    torch.manual_seed(0)
    m = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    plain = data.collate(pairs, 0)
    weights = torch.arange(1.0, 13.0, dtype=torch.float64)
    ga = torch.autograd.grad((completion_logps(m, plain).logps * weights).sum(), params)
    gb = torch.autograd.grad((completion_logps(m, forced(plain)).logps * weights).sum(), params)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(y, x, atol=1e-5 * float(x.abs().max()), rtol=1e-4)
    assert any(float(g.abs().max()) > 0 for g in ga)


def test_a_4bit_base_packs_within_noise(tiny_path, pairs):
    """A bitsandbytes NF4 base on the CPU, float32 compute: the same log-probs packed or padded."""
    from lowmem_dpo.model.models import load_model

    m = load_model(tiny_path, torch.device("cpu"), torch.float32, quantization="4bit")
    packing.enable(m)
    plain = data.collate(pairs, 0)
    with torch.no_grad():
        a, b = completion_logps(m, plain), completion_logps(m, forced(plain))
    assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5), (a.logps - b.logps).abs().max()


def test_a_model_that_cannot_pack_is_refused_or_falls_back(tiny_path, pairs, capsys):
    """Eager attention: padding_free=true exits 2 naming why; auto pads and says so; false never asks. With SDPA
    the check passes, logs its line, and the model's attention is the packed one."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="eager")
    args = (data.collate(pairs[:headcheck.CHECK_ROWS], 0), torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match="padding_free=true: this model cannot run packed rows: its attention "
                                        "implementation is 'eager'"):
        headcheck.decide_packing(eager, *args, True, 64, False)
    assert headcheck.decide_packing(eager, *args, "auto", 64, False) is False
    assert "padding_free: padded micro-batches: its attention implementation is 'eager'" in capsys.readouterr().err
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="sdpa")
    assert headcheck.decide_packing(sdpa, *args, False, 64, False) is False
    assert sdpa.config._attn_implementation == "sdpa"
    assert headcheck.decide_packing(sdpa, *args, "auto", 64, False) is True
    assert sdpa.config._attn_implementation == logps.PACKED_ATTENTION
    assert "padding_free: a micro-batch whose padding is 6% of its positions or more" in capsys.readouterr().err


def test_a_window_shorter_than_a_sequence_cannot_pack(tokenizer, tmp_path):
    """Mistral's sliding window below max_length (2 x max_length for shared rows): refused by the structure."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model("MistralConfig", dict(SMALL, sliding_window=48), tmp_path / "mistral", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    assert packing.problem(model, 32) is None
    assert "attention window (48 tokens) is shorter than a sequence can be (64)" in packing.problem(model, 32, True)


def test_the_check_catches_what_the_structure_cannot(tiny_path, pairs):
    """A packed forward that mixes sequences (as a layer mixing tokens outside attention would): its first two
    sequences attend across each other. The first rows' log-probs differ from the padded ones, and the check says
    so; the right packed row passes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="sdpa")
    packing.enable(model)
    plain = data.collate(pairs[:2], 0)
    mixed = forced(plain)
    mixed.packed.bounds = (0, *mixed.packed.bounds[2:])  # sequences 0 and 1 as one
    problem = headcheck.checked(model, plain, mixed, torch.float32, "packed")
    assert problem.startswith("on the first rows its packed log-probs differ from the padded ones by up to ")
    assert headcheck.checked(model, plain, forced(plain), torch.float32, "packed") is None


def test_every_option_of_the_log_probs_packs(tiny_path, pairs):
    """ORPO's prompt sums, WPO's aligned log-probs, LD-DPO's weights and the per-token log-probs, and a pair with an
    empty prompt, shared and not: packed as padded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    packing.enable(model)
    rows = [*pairs[:3], data.TokenizedPair(9, [], pairs[4].chosen_ids, pairs[4].rejected_ids)]
    for collate, options in ((data.collate, dict(prompts=True, weighting=True)), (data.collate, dict(ld_alpha=0.5)),
                             (data.collate, dict(per_token=True)), (data.collate_shared, dict(weighting=True))):
        plain = collate(rows, 0)
        with torch.no_grad():
            a, b = completion_logps(model, plain, **options), completion_logps(model, forced(plain), **options)
        for x, y in ((a.logps, b.logps), (a.prompt_logps, b.prompt_logps), (a.aligned, b.aligned)):
            assert (x is None) == (y is None) and (x is None or torch.allclose(x, y, atol=1e-4, rtol=1e-5))
        assert a.tokens is None or all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.tokens, b.tokens))


def test_grouped_query_heads_repeated_where_transformers_repeats_them(tiny_path, pairs, monkeypatch):
    """On a card where SDPA would run its math kernel with enable_gqa, transformers repeats k and v to every query
    head (models.repeat_kv_heads sets it, here as on such a card): the packed attention does the same, and gives
    the same log-probs."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    from lowmem_dpo.model import models, sdpa

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    packing.enable(model)
    plain = data.collate(pairs, 0)
    with torch.no_grad():
        want = completion_logps(model, plain).logps
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", sdpa_attention.use_gqa_in_sdpa)  # restored after
    models.repeat_kv_heads()
    with torch.no_grad(), sdpa.sdpa_calls() as calls:
        got = completion_logps(model, forced(plain)).logps
    assert calls and all(not c["enable_gqa"] and c["key"].shape[1] == c["query"].shape[1] == 4 for c in calls)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)


def test_the_demo_packed_has_the_padded_demos_adapter(tmp_path, monkeypatch):
    """The demo's recipe (float32), whole, with gradient checkpointing (each layer's recompute runs the packed
    attention again), padding_free auto against false, each with its own reference cache: with every micro-batch
    packed (PACK_MIN_PADDING 0: the demo's rows are of nearly one length, so auto alone would pack few), precompute
    and train ran packed rows, and the two adapters agree within 1e-6."""
    from safetensors.torch import load_file

    from lowmem_dpo import precompute
    from lowmem_dpo.config.recipe import load_config
    from lowmem_dpo.data import batch

    monkeypatch.setattr(batch, "PACK_MIN_PADDING", 0.0)
    seen = []
    for setting in ("auto", "false"):
        cfg = load_config(TINY_RECIPE, [f"padding_free={setting}", f"output_dir={tmp_path / setting}",
                                        f"ref_cache_dir={tmp_path / setting}-cache", "gradient_checkpointing=true",
                                        "eval_generations=0"])  # the samples change no weight
        precompute.run(cfg, progress=False)
        session = train.setup(cfg, progress=False)
        session.trainee.model.get_base_model().model.register_forward_pre_hook(  # the log-probs' forwards (not
            lambda module, args, kwargs: seen.append((setting, kwargs.get("sequence_bounds") is not None))  # the
            if kwargs.get("use_cache") is False else None, with_kwargs=True)  # samples' generation, with a cache)
        train.loop.run(session, progress=False)
    assert ("auto", True) in seen and ("auto", False) not in seen and ("false", True) not in seen
    a, b = (load_file(tmp_path / s / "adapter_model.safetensors") for s in ("auto", "false"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert max(float(a[k].abs().max()) for k in a) > 1e-3  # trained
