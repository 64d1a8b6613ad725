"""The architecture table (logps.HEADS): on tiny random models of many transformers families, the chunked
log-probs equal the model's own forward, the cache holds them and train starts at ln 2; an architecture the
table does not know is checked against its own forward on the first batch and refused when they differ."""

import json
import math

import pytest
import torch
from conftest import TINY_DATA, build_tiny_model, cached, stored_sequences

from lowmem_dpo import data, precompute, sft, train
from lowmem_dpo.model import headcheck, logps
from lowmem_dpo.model.head import Tile
from lowmem_dpo.model.logps import Head, completion_logps, head_of
from lowmem_dpo.model.models import load_model
from lowmem_dpo.runtime.errors import UserError

# Small enough to build in a fraction of a second. initializer_range 0.3 (not 0.02) gives logits of a few units,
# where a scale or a softcap of 2 changes every log-prob visibly.
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3)
# name -> (transformers config class, its arguments); the head transforms are set to values far from 1.
ARCHS = {
    "llama": ("LlamaConfig", SMALL),
    "mistral": ("MistralConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "gemma2": ("Gemma2Config", dict(SMALL, head_dim=8, final_logit_softcapping=2.0)),
    "phi3": ("Phi3Config", SMALL),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, initializer_range=0.3)),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, rotary_pct=0.5)),
    "granite": ("GraniteConfig", dict(SMALL, logits_scaling=8.0)),
    "stablelm": ("StableLmConfig", SMALL),
    "cohere": ("CohereConfig", dict(SMALL, logit_scale=0.25)),
    "falcon_h1": ("FalconH1Config", dict(SMALL, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                         mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                                         lm_head_multiplier=0.25)),
    "hyperclovax": ("HyperCLOVAXConfig", dict(SMALL, logits_scaling=4.0)),
}
TRANSFORMED = {"gemma2", "granite", "cohere", "falcon_h1", "hyperclovax"}


def build(name: str, out, tokenizer):
    """A seeded tiny model of ARCHS[name] with the tiny tokenizer, saved as a local model folder."""
    return build_tiny_model(*ARCHS[name], out, tokenizer)


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory, tokenizer):
    built = {}

    def get(name):
        if name not in built:
            built[name] = build(name, tmp_path_factory.mktemp(name), tokenizer)
        return built[name]

    return get


def own_logps(model, batch) -> torch.Tensor:
    """Independently of logps.py: the model's own full logits, log_softmax, shifted, summed on completions."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # (N, T, V)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, T-1)
    return (logp * batch.completion_mask[:, 1:]).sum(-1).double()  # (N,), compared with our float64 sums


def tiny_rows(tmp_path, n: int = 4):
    from conftest import write_jsonl

    rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:n]]
    return str(write_jsonl(tmp_path / "rows.jsonl", rows))


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_logps_equal_the_models_own_forward(name, arch_dir, tokenizer, monkeypatch):
    model = load_model(arch_dir(name), torch.device("cpu"), torch.float32)
    assert model.config.model_type == name and head_of(model.config)[1]  # known: no check at run time

    pairs = data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(3)), tokenizer, 64, None,
                               progress=False).pairs
    batch = data.collate(pairs, data.pad_token_id(tokenizer))
    with torch.no_grad():
        want = own_logps(model, batch)
        got = completion_logps(model, batch, tile=Tile(7, 100))  # the head's tiles: 7 tokens x 100 entries of the 461
        assert torch.allclose(got.logps, want, atol=1e-4, rtol=0), (got.logps - want).abs().max()
        if name in TRANSFORMED:  # the transform matters: a plain head would be off by far more than 1e-4
            monkeypatch.setitem(logps.HEADS, name, logps._plain)
            plain = completion_logps(model, batch)
            assert (plain.logps - want).abs().max() > 0.1


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere", "gpt2"])
def test_cache_holds_own_logps_and_train_starts_at_ln2(name, arch_dir, make_cfg, tmp_path, tokenizer):
    cfg = make_cfg(model_name_or_path=str(arch_dir(name)), dataset=tiny_rows(tmp_path), max_steps=1)
    precompute.run(cfg, progress=False)
    ref = cached(cfg)[0]
    pairs = data.tokenize_rows(data.load_rows(cfg.dataset[0].path), tokenizer, 64, None, progress=False).pairs
    batch = data.collate(pairs, data.pad_token_id(tokenizer))
    with torch.no_grad():
        want = own_logps(load_model(arch_dir(name), torch.device("cpu"), torch.float32), batch)
    n = len(pairs)
    assert torch.allclose(ref.chosen[batch.rows], want[:n], atol=1e-4, rtol=0)
    assert torch.allclose(ref.rejected[batch.rows], want[n:], atol=1e-4, rtol=0)
    first = train.run(cfg, progress=False).metrics
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_unknown_architecture_that_differs_is_refused(arch_dir, make_cfg, tmp_path, monkeypatch):
    """HyperCLOVAX multiplies by logits_scaling where Granite divides: out of the table, the generic reading
    (Granite's) is wrong, and precompute, train and sft stop before computing anything, naming it."""
    monkeypatch.delitem(logps.HEADS, "hyperclovax")
    run = dict(model_name_or_path=str(arch_dir("hyperclovax")), dataset=tiny_rows(tmp_path), max_steps=1)
    cfg = make_cfg(**run)
    with pytest.raises(UserError, match=r"model_type 'hyperclovax' is not in .* differ .* by up to \d"):
        precompute.run(cfg, progress=False)
    assert stored_sequences(cfg.ref_cache_dir) == 0
    with pytest.raises(UserError, match="'hyperclovax'"):
        train.run(make_cfg(**run, ref_source="live"), progress=False)
    with pytest.raises(UserError, match="'hyperclovax'"):
        sft.run(cfg, progress=False)


@pytest.mark.parametrize("name", ["llama", "granite"])
def test_unknown_architecture_that_matches_runs(name, arch_dir, make_cfg, tmp_path, monkeypatch, capsys):
    """Out of the table, a plain Llama and a Granite (whose logits_scaling the generic reading knows) pass the
    check, say so once per stage, and train starts at ln 2."""
    monkeypatch.delitem(logps.HEADS, name)
    cfg = make_cfg(model_name_or_path=str(arch_dir(name)), dataset=tiny_rows(tmp_path), max_steps=1)
    precompute.run(cfg, progress=False)
    assert train.run(cfg, progress=False).metrics["loss"] == pytest.approx(math.log(2), abs=1e-5)
    notes = [line for line in capsys.readouterr().err.splitlines() if "is not in logps.HEADS" in line]
    assert len(notes) == 2 and all(f"'{name}'" in line for line in notes)


def test_check_head_compares_only_the_head(arch_dir, tokenizer, monkeypatch):
    """check_head is None for a known type; for an unknown one it reports the head's difference (0 for the
    right head, in float32 and in bfloat16 alike, where the model's forward runs the same lm_head call) and the
    plain head's difference."""
    model = load_model(arch_dir("granite"), torch.device("cpu"), torch.float32)

    pairs = data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(1)), tokenizer, 64, None,
                               progress=False).pairs
    batch = data.collate(pairs, data.pad_token_id(tokenizer))
    assert headcheck.check_head(model, batch.input_ids, batch.attention_mask) is None
    monkeypatch.delitem(logps.HEADS, "granite")
    check = headcheck.check_head(model, batch.input_ids, batch.attention_mask)
    assert check.head == Head(scale=1 / 8) and check.ok and check.difference < 1e-5
    assert check.plain_difference > 0.1 and check.tolerance == headcheck.TOLERANCE[torch.float32]
    assert check.positions == int(batch.attention_mask[:, 1:headcheck.CHECK_TOKENS].sum())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = headcheck.check_head(model, batch.input_ids, batch.attention_mask)
    assert low.tolerance == headcheck.TOLERANCE[torch.bfloat16] and low.ok and low.plain_difference > low.tolerance


def test_head_of_reads_the_table_then_the_config():
    from transformers import Gemma3Config, GraniteConfig, HyperCLOVAXConfig, LlamaConfig

    assert head_of(LlamaConfig()) == (Head(), True)
    assert head_of(GraniteConfig(logits_scaling=16.0)) == (Head(scale=1 / 16), True)
    assert head_of(HyperCLOVAXConfig(logits_scaling=4.0)) == (Head(scale=4.0), True)
    # A multimodal config is not in the table: its head is read from the nested text_config.
    multimodal = Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    assert head_of(multimodal) == (Head(softcap=30.0), False)
    x = torch.tensor([[-90.0, 0.0, 3.0]])
    assert torch.allclose(Head(scale=0.5, softcap=30.0).apply(x), 30 * torch.tanh(0.5 * x / 30))


# Every other model_type of the table, built by AutoConfig.for_model from GENERIC plus what its config needs to be
# this small (or valid); the transform attributes that a type reads are set far from 1.
GENERIC = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, initializer_range=0.3)
TRANSFORMS = dict(final_logit_softcapping=2.0, logits_soft_cap=2.0, logits_scaling=8.0, logit_scale=0.25,
                  lm_head_multiplier=0.25)
MOE = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
OVERRIDES = {
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=1e4),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=2, moe_top_k=1)),
    "deepseek_v2": dict(MLA, **MOE, q_lora_rank=None, n_shared_experts=1),
    "deepseek_v3": dict(MLA, **MOE, q_lora_rank=16, n_group=1, topk_group=1),
    "falcon": dict(head_dim=None), "gpt_neo": dict(num_heads=4, num_layers=2, window_size=8,
                                                    attention_types=[[["global", "local"], 1]]),
    "falcon_h1": ARCHS["falcon_h1"][1],
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                             layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
                             shared_intermediate_size=32),
    "recurrent_gemma": dict(num_key_value_heads=1, lru_width=32, attention_window_size=16,
                            block_types=["recurrent", "attention"]),
}


@pytest.mark.parametrize("model_type", sorted(set(logps.HEADS) - set(ARCHS)))
def test_every_type_in_the_table_matches_its_own_forward(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{k: v for k, v in {**GENERIC, **OVERRIDES.get(model_type, {})}.items()
                                                 if v is not None})
    for k, v in TRANSFORMS.items():
        if hasattr(config, k):
            setattr(config, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 128, (2, 12))  # (2, 12); row 1 right-padded after 9 tokens, completions from token 4
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    batch = data.Batch(torch.arange(1), ids, mask, torch.cat([torch.zeros(2, 4), torch.ones(2, 8)], 1).long() * mask,
                       int(mask.sum()))
    with torch.no_grad():
        got = completion_logps(model, batch)
        assert torch.allclose(got.logps, own_logps(model, batch), atol=1e-4, rtol=0)
