"""share_prompt: each pair's prompt through the model once, in one row [prompt, chosen, rejected] with a mask that
hides chosen and rejected from each other. The log-probs and their LoRA gradients equal the unshared forward's
in float32 on several architectures, both attention implementations, checkpointing and a 4-bit base; train starts
at ln 2; a model that cannot share is refused (share_prompt=true) or falls back (auto)."""

import json
import math

import pytest
import torch
from conftest import build_tiny_model

from lowmem_dpo import data, precompute, train
from lowmem_dpo.model import headcheck
from lowmem_dpo.model.logps import completion_logps, shared_prefix_mask
from lowmem_dpo.runtime import devices, rules
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training.step import item_tokens

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3)
ARCHS = {
    "llama": ("LlamaConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "gemma2": ("Gemma2Config", dict(SMALL, head_dim=8, final_logit_softcapping=2.0, sliding_window=4096)),
    "phi3": ("Phi3Config", SMALL),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3)),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, rotary_pct=0.5)),
}


def both(model, pairs):
    plain, shared = data.collate(pairs, 0), data.collate_shared(pairs, 0)
    a = completion_logps(model, plain)
    b = completion_logps(model, shared)
    return a, b


def test_the_mask_hides_chosen_and_rejected_from_each_other():
    """One row [p p c c r r pad]: hand-written visibility."""
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    completion = torch.tensor([[0, 0, 1, 1, 2, 2, 0]])
    want = torch.tensor([[1, 0, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0, 0],
                         [1, 1, 0, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(shared_prefix_mask(attention, completion, "bool")[0, 0], want)
    additive = shared_prefix_mask(attention, completion, "additive")[0, 0]
    assert torch.equal(additive == 0, want) and (additive[~want] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("arch,impl", [(a, i) for a in sorted(ARCHS) for i in ("sdpa", "eager")
                                       if (a, i) != ("gemma2", "sdpa")])  # transformers: Gemma2 is eager-only
def test_shared_equals_unshared_log_probs(arch, impl, tokenizer, pairs, tmp_path):
    """Sums and token counts per completion, in float32, on tiny random models of six families."""
    from transformers import AutoModelForCausalLM

    config_class, kwargs = ARCHS[arch]
    path = build_tiny_model(config_class, kwargs, tmp_path / arch, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()
    with torch.no_grad():
        a, b = both(model, pairs)
    assert torch.equal(a.n_tokens, b.n_tokens)
    assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5), (a.logps - b.logps).abs().max()
    assert a.logps.abs().min() > 1  # real sums, not zeros


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_equal_unshared(tiny_path, pairs, checkpointing):
    """The LoRA gradients of the summed log-probs, shared and not, with a non-zero adapter (as after some steps)
    and gradient checkpointing on and off."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.model.models import load_model

    m = load_model(tiny_path, torch.device("cpu"), torch.float32)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
    torch.manual_seed(0)
    m = get_peft_model(m, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    m.train()
    params = [p for p in m.parameters() if p.requires_grad]
    a, b = both(m, pairs)
    ga = torch.autograd.grad((a.logps * torch.arange(1.0, 13.0)).sum(), params)
    gb = torch.autograd.grad((b.logps * torch.arange(1.0, 13.0)).sum(), params)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(y, x, atol=1e-5 * float(x.abs().max()), rtol=1e-4)
    assert any(float(g.abs().max()) > 0 for g in ga)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantized_base_shares_within_noise(tiny_path, pairs, quantization):
    """A bitsandbytes NF4 or LLM.int8 base on the CPU, float32 compute: the same log-probs shared or not."""
    from lowmem_dpo.model.models import load_model

    model = load_model(tiny_path, torch.device("cpu"), torch.float32, quantization)
    with torch.no_grad():
        a, b = both(model, pairs)
    assert torch.equal(a.n_tokens, b.n_tokens)
    assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5)


def test_train_shares_starts_at_ln2_and_matches_the_unshared_run(make_cfg, tmp_path, capsys):
    """share_prompt=true through precompute and train: step 1 is ln 2 and the run's metrics equal an unshared
    run's within float32 noise; the log says the prompts go once."""
    runs = {}
    for share in ("true", "false"):
        cfg = make_cfg(share_prompt=share, output_dir=str(tmp_path / share), ref_cache_dir=str(tmp_path / "c"),
                       max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=3)
        precompute.run(cfg, progress=False)
        train.run(cfg, progress=False)
        runs[share] = [json.loads(line) for line in open(tmp_path / share / "metrics.jsonl")]
    assert "prompts: once per pair (share_prompt)" in capsys.readouterr().err
    assert runs["true"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for x, y in zip(runs["true"], runs["false"]):
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), (x["step"], key)
    assert runs["true"][-1]["tokens_per_s"] > 0


def test_the_sft_adapter_reference_shares(tmp_path, tiny_path, pairs):
    """The reference of a stacked run is base + the SFT adapter (adapters.reference_model): shared equals
    unshared with a trained-looking (non-zero) adapter loaded from disk."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.model import adapters, models

    torch.manual_seed(0)
    sft = get_peft_model(models.load_model(tiny_path, torch.device("cpu"), torch.float32),
                         LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    sft.save_pretrained(tmp_path / "sft")
    source = models.model_source(str(tiny_path), str(tmp_path / "sft"))
    reference = adapters.reference_model(models.load_model(tiny_path, torch.device("cpu"), torch.float32), source)
    with torch.no_grad():
        a, b = both(reference, pairs)
    assert torch.allclose(a.logps, b.logps, atol=1e-4, rtol=1e-5)


def test_a_model_that_cannot_share_is_refused_or_falls_back(tokenizer, tmp_path, pairs, capsys):
    """A Mistral whose sliding window (16) is shorter than a shared row could be: share_prompt=true exits 2 with
    the reason; auto logs it and uses the unshared forward."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model("MistralConfig", dict(SMALL, sliding_window=16), tmp_path / "m", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    resolved = devices.Resolved(torch.device("cpu"), "cpu", torch.float32, False, rules.ADAMW_TORCH,
                                share_prompt=True)
    with pytest.raises(UserError, match="sliding window"):
        headcheck.decide_sharing(model, pairs, 0, resolved, torch.float32, True, 64)
    assert headcheck.decide_sharing(model, pairs, 0, resolved, torch.float32, "auto", 64) is False
    assert "share_prompt: the unshared forward" in capsys.readouterr().err
    wide = build_tiny_model("MistralConfig", dict(SMALL, sliding_window=4096), tmp_path / "w", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32)
    assert headcheck.decide_sharing(model, pairs, 0, resolved, torch.float32, "auto", 64) is True


def test_by_length_sorts_a_step_longest_first_and_keeps_its_items(pairs):
    ordered = data.by_length(pairs, item_tokens)
    sizes = [len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in ordered]
    assert sizes == sorted(sizes, reverse=True)
    assert sorted(p.row for p in ordered) == sorted(p.row for p in pairs)
    step = [data.TokenizedPair(5, [1], [2], [3])] + [data.TokenizedPair(row, [1], [2, 3], [4]) for row in (2, 0, 1)]
    assert [p.row for p in data.by_length(step, item_tokens)] == [2, 0, 1, 5]  # ties keep the step's order


def test_auto_shares_only_when_the_prompts_are_a_large_share(tiny_path, pairs, capsys):
    """share_prompt=auto leaves data whose repeated prompts are under SHARE_MIN_PROMPT_SHARE of the tokens
    unshared (measured slower there); true shares them anyway."""
    import copy

    from lowmem_dpo.model.models import load_model

    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    resolved = devices.Resolved(torch.device("cpu"), "cpu", torch.float32, False, rules.ADAMW_TORCH,
                                share_prompt=True)
    short = copy.deepcopy(pairs)
    for p in short:
        p.prompt_ids = p.prompt_ids[:1]
    share = headcheck.prompt_share(short)
    assert share == sum(len(p.prompt_ids) for p in short) / sum(
        2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in short) < 0.25
    assert headcheck.decide_sharing(model, short, 0, resolved, torch.float32, "auto", 64) is False
    assert "of the tokens, below the 25%" in capsys.readouterr().err
    assert headcheck.decide_sharing(model, short, 0, resolved, torch.float32, True, 64) is True
    assert headcheck.prompt_share(pairs) >= 0.25
    assert headcheck.decide_sharing(model, pairs, 0, resolved, torch.float32, "auto", 64) is True


def test_the_sharing_check_sees_no_dropout_noise(tiny_path, pairs):
    """A continued SFT adapter (B != 0) with lora_dropout 0.5, the policy in train mode: in train mode its two
    forwards would differ by dropout noise alone (far above the float32 tolerance); the check runs in eval mode,
    so share_prompt=true is taken, and the policy is left in train mode."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.model.models import load_model

    torch.manual_seed(0)
    model = get_peft_model(load_model(tiny_path, torch.device("cpu"), torch.float32),
                           LoraConfig(r=8, lora_alpha=64, lora_dropout=0.5, target_modules="all-linear",
                                      init_lora_weights=False))
    model.train()
    with torch.no_grad():  # what the check would see in train mode: two dropout draws
        train_mode = (logps_of(model, data.collate(pairs[:2], 0)) - logps_of(model, data.collate(pairs[:2], 0)))
    assert train_mode.abs().max() > 1e-2
    resolved = devices.Resolved(torch.device("cpu"), "cpu", torch.float32, True, rules.ADAMW_TORCH,
                                share_prompt=True)
    assert headcheck.layout_difference(model, data.collate(pairs[:2], 0), data.collate_shared(pairs[:2], 0),
                                       torch.float32) < 1e-4
    assert headcheck.decide_sharing(model, pairs, 0, resolved, torch.float32, True, 64) is True
    assert model.training and all(m.training for m in model.modules())


def logps_of(model, batch):
    return completion_logps(model, batch).logps
