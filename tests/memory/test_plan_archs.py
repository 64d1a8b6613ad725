"""The planner on architectures other than Llama: module shapes read from the model transformers builds on the
meta device (GPT-2's Conv1D, GPT-NeoX's and Phi-3's fused projections, Gemma2's four norms), LoRA targets
resolved as peft resolves them (names, a regex, all-linear, lm_head: checked against peft's own injection),
predicted peaks against measured ones on GPT-2 and Phi-3, training with any targets, and a model the planner
cannot describe (mixture of experts), which warns and trains anyway."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_DATA, build_tiny_model
from safetensors.torch import load_file

from lowmem_dpo import precompute, train
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.measure import at_measured_shapes, measure
from lowmem_dpo.memory.arch import adapted, load_arch
from lowmem_dpo.memory.model import predict
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.memory.weights import lora_shapes
from lowmem_dpo.runtime.errors import UserError

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
MODELS = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gpt_neox": ("GPTNeoXConfig", dict(SMALL, num_key_value_heads=4)),
    "phi3": ("Phi3Config", SMALL),
    "gemma2": ("Gemma2Config", dict(SMALL, head_dim=16)),
    "qwen2": ("Qwen2Config", SMALL),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    built = {}

    def get(name):
        if name not in built:
            cls, kwargs = MODELS[name]
            built[name] = build_tiny_model(cls, kwargs, tmp_path_factory.mktemp(name), tokenizer)
        return built[name]

    return get


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("name", list(MODELS))
def test_arch_from_the_meta_model_counts_every_weight(name, model_dir):
    model = load(model_dir(name))
    arch = load_arch(str(model_dir(name)))
    assert arch.params() == sum(p.numel() for p in model.parameters())
    assert arch.layers == 2 and arch.hidden == 64
    # every Linear of a decoder layer, with its real shape (GPT-2's Conv1D stores (in, out))
    layer = dict(model.named_modules())[f"{arch.layers_prefix}.0"]
    shapes = {}
    for n, m in layer.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes[n] = (m.in_features, m.out_features)
        elif type(m).__name__ == "Conv1D":
            shapes[n] = tuple(m.weight.shape)
    assert arch.linears() == shapes


@pytest.mark.parametrize("name, targets", [
    ("gpt2", ["c_attn"]), ("gpt2", ["c_attn", "lm_head"]), ("gpt2", ["all-linear"]),
    ("gpt_neox", ["query_key_value", "dense_4h_to_h"]), ("phi3", ["qkv_proj", "lm_head"]),
    ("phi3", [r".*layers\.1\..*_proj"]), ("gemma2", ["all-linear"]), ("qwen2", [r".*\.(q|v)_proj"]),
    ("qwen2", ["q_proj", "embed_tokens"]),  # an embedding outside the layers
])
def test_lora_targets_resolve_as_peft_adapts_them(name, targets, model_dir):
    """The planner's LoRA parameter count equals what peft's get_peft_model creates for the same targets."""
    from peft import LoraConfig, get_peft_model

    cfg = build_config(dict(model_name_or_path=str(model_dir(name)), lora_target_modules=targets, lora_r=4))
    model = get_peft_model(load(model_dir(name)), LoraConfig(r=4, target_modules=cfg.peft_target_modules))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    arch = load_arch(cfg.model_name_or_path)
    assert sum(lora_shapes(arch, setup_from_config(cfg).lora_targets, 4)) == lora
    assert adapted(arch, setup_from_config(cfg).lora_targets).lm_head == ("lm_head" in targets)


def test_a_target_that_matches_nothing_is_named(model_dir):
    arch = load_arch(str(model_dir("gpt2")))
    with pytest.raises(UserError, match=r"matches no Linear of gpt2 .*attn\.c_attn"):
        adapted(arch, ("q_proj",))


@pytest.mark.parametrize("name, dtype, ckpt, quant, targets", [
    ("gpt2", "float32", "false", "none", "c_attn,lm_head"),
    ("phi3", "bfloat16", "true", "4bit", "all-linear"),
    ("gemma2", "float32", "false", "none", "all-linear"),  # eager attention, softcapped head
])
def test_prediction_within_20_percent_of_measured(name, dtype, ckpt, quant, targets, model_dir, tmp_path):

    cfg = build_config(dict(model_name_or_path=str(model_dir(name)), dataset=str(TINY_DATA), device="cpu",
                            dtype=dtype, gradient_checkpointing=ckpt, quantization=quant, max_length=64,
                            per_device_train_batch_size=4, precompute_batch_size=4, lora_target_modules=targets,
                            output_dir=str(tmp_path / "out"), ref_cache_dir=str(tmp_path / "cache")))
    measured = measure(cfg, 2)
    pred = predict(load_arch(cfg.model_name_or_path), at_measured_shapes(setup_from_config(cfg), measured))
    for stage in ("train", "precompute"):
        assert getattr(pred, stage).tensor_peak_bytes == pytest.approx(
            measured[stage]["measured_peak_bytes"], rel=0.2), stage


@pytest.mark.parametrize("name, targets", [("gpt2", "c_attn,lm_head"), ("phi3", "qkv_proj,lm_head")])
def test_train_with_any_targets(name, targets, model_dir, make_cfg, capsys):
    """Train plans and runs with targets outside the Llama names; the adapter holds the planned LoRA weights."""
    cfg = make_cfg(model_name_or_path=str(model_dir(name)), lora_target_modules=targets, max_steps=2, lora_r=4)
    precompute.run(cfg)
    train.run(cfg)
    out = Path(cfg.output_dir)
    err = capsys.readouterr().err
    assert "no memory plan" not in err and "# resolved planner: train peak" in (out / "config.yaml").read_text()
    weights = load_file(str(out / "adapter_model.safetensors"))
    arch = load_arch(cfg.model_name_or_path)
    lora = sum(t.numel() for k, t in weights.items() if "lora_" in k)  # peft also saves a tied LM head's embeddings
    assert lora == sum(lora_shapes(arch, setup_from_config(cfg).lora_targets, 4))
    assert any("lm_head" in k for k in weights)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4


def test_a_model_the_planner_cannot_describe_still_trains(make_cfg, tmp_path, tokenizer, capsys):
    """Mixtral keeps its experts as fused parameters, not Linear layers: the planner says so, and train falls
    back to the device rule instead of refusing."""
    folder = build_tiny_model("MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
                              tmp_path / "moe", tokenizer)
    with pytest.raises(UserError, match="outside Linear layers"):
        load_arch(str(folder))
    cfg = make_cfg(model_name_or_path=str(folder), max_steps=1)
    precompute.run(cfg)
    train.run(cfg)
    assert (Path(cfg.output_dir) / "adapter_model.safetensors").is_file()
    assert "no memory plan for this model" in capsys.readouterr().err


def test_a_hybrid_layer_is_not_planned_as_a_transformer_layer():
    """Falcon-H1's layers hold a Mamba mixer (in_proj, out_proj) beside the gated MLP: read as Linears reading H,
    it would count as MLP input (its SwiGLU taken for an fc MLP) and its own activations would be left out. The
    planner refuses it, so train falls back to the device rule instead of planning with a wrong number."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    from lowmem_dpo.memory.arch import arch_from_model

    config = FalconH1Config(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=96,
                            mamba_n_heads=4, mamba_d_head=24, mamba_d_state=8, mamba_n_groups=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserError, match=r"falcon_h1: its layers hold Linear layers in feed_forward, mamba beside"):
        arch_from_model(model, "falcon-h1")
