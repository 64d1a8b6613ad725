"""python -m lowmem_dpo.export: the merged folder loads in transformers with every key in place and computes what
peft's merge_and_unload of the same base and adapter(s) computes; shards and index are transformers'; the
new_on_merged chain merges the SFT adapter first; what cannot be merged exactly is refused with exit 2."""

import json
import shutil

import pytest
import torch
import yaml
from conftest import build_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowmem_dpo import export
from lowmem_dpo.config.cli import run_cli

IDS = torch.tensor([[5, 17, 42, 8, 99, 3, 61, 27], [11, 2, 74, 30, 6, 48, 19, 88]])
TINY_GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3)
SMALL_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)


def run(*argv) -> int:
    return run_cli(export.main, [str(a) for a in argv] + ["--no-progress"], "export", export.__doc__,
                   usage=export.USAGE)


def make_adapter(base, out, seed=0, on=None, **lora):
    """A real peft LoRA adapter on `base` (or on the model `on`) with random A and B (init_lora_weights=False: B is
    not zero, so the merge changes the logits), saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = on if on is not None else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.setdefault("target_modules", "all-linear")
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=lora.pop("r", 4), lora_alpha=lora.pop("lora_alpha", 8),
                                                  init_lora_weights=False, **lora))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.mul_(0.5)  # random B of the init's size moves logits a lot; still far from zero
    peft_model.save_pretrained(out)
    return out


def peft_logits(base, adapters) -> torch.Tensor:
    """The reference: base in float32, each adapter loaded and merged with peft's merge_and_unload in turn."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for a in adapters:
        model = PeftModel.from_pretrained(model, a).merge_and_unload()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def merged_logits(folder) -> torch.Tensor:
    """MERGED_DIR loaded with transformers: no key missing or unexpected; its logits in float32."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] in (set(), []) and info["unexpected_keys"] in (set(), []), info
    with torch.no_grad():
        return model(input_ids=IDS).logits


def base_logits(base) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(input_ids=IDS).logits


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, tokenizer):
    return build_tiny_model("GPT2Config", TINY_GPT2, tmp_path_factory.mktemp("gpt2"), tokenizer)


@pytest.mark.parametrize("lora", [
    dict(target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"],
         rank_pattern={"v_proj": 2}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3}),
    dict(use_rslora=True, r=8, lora_alpha=4),
], ids=["patterns+embedding", "rslora"])
def test_llama_merge_equals_peft(tiny_path, tmp_path, lora, monkeypatch):
    monkeypatch.setattr(export, "BLOCK_ELEMENTS", 1000)  # ~15 rows a block: every weight merged in several blocks
    adapter = make_adapter(tiny_path, tmp_path / "adapter", **lora)
    assert run(adapter, tmp_path / "merged") == 0
    expected = peft_logits(tiny_path, [adapter])
    assert not torch.allclose(expected, base_logits(tiny_path), atol=1e-3)  # the adapter does change the model
    torch.testing.assert_close(merged_logits(tmp_path / "merged"), expected, atol=1e-5, rtol=1e-5)
    written = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= set(written)
    assert not any(n.startswith(".") for n in written) and [p.name for p in tmp_path.iterdir() if
                                                            p.name.startswith(".")] == []
    assert (tmp_path / "merged" / "generation_config.json").is_file() == (tiny_path / "generation_config.json").is_file()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float32"


def test_gpt2_conv1d_and_tied_embeddings(gpt2, tmp_path, monkeypatch):
    """GPT-2 stores its Conv1D weights (in, out) (peft's fan_in_fan_out) and ties lm_head to wte: the merged
    folder keeps the tie (no lm_head tensor, none missing)."""
    monkeypatch.setattr(export, "BLOCK_ELEMENTS", 500)
    adapter = make_adapter(gpt2, tmp_path / "adapter", target_modules=["c_attn", "c_proj", "c_fc"])
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    assert run(adapter, tmp_path / "merged") == 0
    torch.testing.assert_close(merged_logits(tmp_path / "merged"), peft_logits(gpt2, [adapter]), atol=1e-5,
                               rtol=1e-5)
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())


def test_sharded_base_to_several_shards(tiny_path, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(tiny_path).save_pretrained(base, max_shard_size="100KB")
    tokenizer.save_pretrained(base)
    assert (base / "model.safetensors.index.json").is_file()
    adapter = make_adapter(base, tmp_path / "adapter", seed=1)
    assert run(adapter, tmp_path / "merged", "--max-shard-size", "150KB") == 0
    merged = tmp_path / "merged"
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in merged.glob("*.safetensors"))
    assert len(shards) >= 3 and shards == sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for name in shards:
        state = load_file(str(merged / name))
        assert sorted(state) == sorted(k for k, v in index["weight_map"].items() if v == name)
        size = sum(t.numel() * t.element_size() for t in state.values())
        assert size <= 150_000 or len(state) == 1  # a tensor over the limit gets a shard of its own
        total += size
    assert index["metadata"]["total_size"] == total
    torch.testing.assert_close(merged_logits(merged), peft_logits(base, [adapter]), atol=1e-5, rtol=1e-5)


def run_folder(tmp_path, base, mode, record="config.yaml"):
    """A run's output_dir as train leaves it: a DPO adapter trained on base + an SFT adapter, and the run's record
    (config.yaml beside the final adapter, or a checkpoint's trainer_state.json). With new_on_merged the DPO
    adapter sits on the base with the SFT adapter merged; with continue it is the SFT adapter trained further."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sft = make_adapter(base, tmp_path / "sft", seed=2, target_modules=["q_proj", "up_proj"])
    out = tmp_path / "dpo"
    if mode == "new_on_merged":
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), sft).merge_and_unload()
        make_adapter(base, out, seed=3, on=merged, target_modules=["k_proj", "up_proj", "o_proj"])
    else:
        make_adapter(base, out, seed=3, target_modules=["q_proj", "up_proj"])
    config = {"model_name_or_path": str(base), "sft_adapter": str(sft), "adapter_mode": mode, "lora_r": 4}
    if record == "config.yaml":
        (out / "config.yaml").write_text(yaml.safe_dump(config))
    else:
        (out / "trainer_state.json").write_text(json.dumps({"step": 3, "config": config}))
    return sft, out


@pytest.mark.parametrize("mode,record", [("new_on_merged", "config.yaml"), ("new_on_merged", "checkpoint"),
                                         ("continue", "config.yaml")])
def test_new_on_merged_merges_the_sft_adapter_first(tiny_path, tmp_path, mode, record):
    sft, dpo = run_folder(tmp_path, tiny_path, mode, record)
    assert run(dpo, tmp_path / "merged") == 0
    chain = [sft, dpo] if mode == "new_on_merged" else [dpo]
    expected = peft_logits(tiny_path, chain)
    torch.testing.assert_close(merged_logits(tmp_path / "merged"), expected, atol=1e-5, rtol=1e-5)
    if mode == "new_on_merged":  # merging the DPO adapter alone would be another model
        assert not torch.allclose(peft_logits(tiny_path, [dpo]), expected, atol=1e-3)


def test_bfloat16_output(tiny_path, tmp_path):
    """--dtype bfloat16 writes every weight in bf16: the float32 merge (peft's) rounded once."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(tiny_path, tmp_path / "adapter", target_modules=["q_proj", "gate_proj"])
    assert run(adapter, tmp_path / "merged", "--dtype", "bfloat16") == 0
    written = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                           adapter).merge_and_unload()
    expected = {k: v.to(torch.bfloat16) for k, v in peft_model.state_dict().items()}
    assert written.keys() == expected.keys()
    for k in written:
        assert torch.equal(written[k], expected[k]), k


def test_a_users_folder_is_refused_even_with_overwrite_and_an_earlier_export_needs_it(tiny_path, tmp_path, capsys):
    """MERGED_DIR holding a user's file is refused, --overwrite or not, and the file stays; an earlier export (its
    marker) is replaced with --overwrite only; a train run's folder is never an export's."""
    adapter = make_adapter(tiny_path, tmp_path / "adapter", target_modules=["q_proj"])
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("mine")
    for flags in ([], ["--overwrite"]):
        assert run(adapter, merged, *flags) == 2
        err = capsys.readouterr().err
        assert "holds files this tool did not write (config.json)" in err and f"{merged}-2 is free" in err
        assert (merged / "config.json").read_text() == "mine"
    (merged / "config.json").unlink()
    assert run(adapter, merged) == 0 and json.loads((merged / "lowmem_dpo.json").read_text())["kind"] == "merged model"
    assert run(adapter, merged) == 2 and "holds an earlier export: pass --overwrite" in capsys.readouterr().err
    assert run(adapter, merged, "--overwrite") == 0 and (merged / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (merged / "notes.txt").write_text("mine")  # a file added to an earlier export: --overwrite would delete it
    assert run(adapter, merged, "--overwrite") == 2
    assert "holds an earlier export and files it did not write (notes.txt)" in capsys.readouterr().err
    clone = tmp_path / "hub-clone"  # hidden files count: the whole folder would be replaced
    (clone / ".git").mkdir(parents=True)
    assert run(adapter, clone) == 2 and "holds files this tool did not write (.git)" in capsys.readouterr().err
    assert (clone / ".git").is_dir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "lowmem_dpo.json").write_text(json.dumps({"written_by": "lowmem_dpo", "kind": "dpo run"}))
    assert run(adapter, run_dir, "--overwrite") == 2
    assert "holds this tool's dpo run (lowmem_dpo.json), not a merged model" in capsys.readouterr().err


def _quantized_base(tiny_path, tmp_path):
    """A real pre-quantized checkpoint: the tiny model loaded in 4-bit by bitsandbytes and saved."""
    from transformers import AutoModelForCausalLM

    from lowmem_dpo.model.models import quantization_config

    base = tmp_path / "quantized"
    model = AutoModelForCausalLM.from_pretrained(tiny_path, device_map={"": "cpu"},
                                                 quantization_config=quantization_config("4bit", torch.float32))
    model.save_pretrained(base)
    assert "quantization_config" in json.loads((base / "config.json").read_text())
    return base


def _bin_only_base(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bin"
    shutil.copytree(tiny_path, base)
    model = AutoModelForCausalLM.from_pretrained(base)
    (base / "model.safetensors").unlink()
    torch.save(model.state_dict(), base / "pytorch_model.bin")
    return base


def _extra_key(adapter, key):
    state = load_file(str(adapter / "adapter_model.safetensors"))
    state[key] = torch.ones(4, 64)
    if "lora_A" in key:  # a whole pair: only its module is wrong
        state[key.replace("lora_A", "lora_B")] = torch.ones(172, 4)
    save_file(state, str(adapter / "adapter_model.safetensors"))


REFUSALS = {
    "quantized base": ("base", _quantized_base, {}, "pre-quantized checkpoint (bitsandbytes)"),
    "bin-only base": ("base", _bin_only_base, {}, "holds only PyTorch .bin weights"),
    "dora": ("adapter", None, dict(use_dora=True), "DoRA"),
    "modules_to_save": ("adapter", None, dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "not a LoRA key": ("key", "base_model.model.model.norm.weight", {}, "is not a LoRA weight"),
    "no such module": ("key", "base_model.model.model.layers.7.mlp.up_proj.lora_A.weight", {},
                       "model.layers.7.mlp.up_proj, which the base model does not have"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_exit_2_with_a_message(tiny_path, tmp_path, capsys, case):
    kind, make, lora, message = REFUSALS[case]
    adapter = make_adapter(tiny_path, tmp_path / "adapter", target_modules=["q_proj", "v_proj"], **lora)
    if kind == "base":  # the same adapter, naming another form of its base
        config = json.loads((adapter / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(make(tiny_path, tmp_path))
        (adapter / "adapter_config.json").write_text(json.dumps(config))
    if kind == "key":
        _extra_key(adapter, make)
    capsys.readouterr()
    assert run(adapter, tmp_path / "merged") == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert message in last and last.startswith("lowmem_dpo.export: error:") and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir() if "merged" in p.name] == []


def test_lora_on_a_tied_head_is_refused(gpt2, tmp_path, capsys):
    """lm_head shares its weight with wte: merging LoRA into it would change the input embeddings too."""
    adapter = make_adapter(gpt2, tmp_path / "adapter", target_modules=["c_attn", "lm_head"])
    assert run(adapter, tmp_path / "merged") == 2
    assert "ties to transformer.wte" in capsys.readouterr().err


def test_run_record_naming_another_base_is_refused(tiny_path, tmp_path, tokenizer, capsys):
    other = build_tiny_model("LlamaConfig", SMALL_LLAMA, tmp_path / "other", tokenizer)
    adapter = make_adapter(other, tmp_path / "adapter", target_modules=["q_proj"])
    (adapter / "config.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(tiny_path)}))
    assert run(adapter, tmp_path / "merged") == 2
    assert "which base it belongs on is not certain" in capsys.readouterr().err


def test_a_base_or_sft_adapter_changed_since_training_is_refused(tiny_path, tmp_path, tokenizer, capsys):
    """A checkpoint records the digests of the base and the SFT adapter it trained on: an SFT stage rerun into the
    same folder (new weights, same path) is refused for a new_on_merged adapter; the same files export."""
    from lowmem_dpo.model import models
    from lowmem_dpo.runtime.files import files_digest

    base = build_tiny_model("LlamaConfig", SMALL_LLAMA, tmp_path / "base", tokenizer)
    sft = make_adapter(base, tmp_path / "sft", seed=1, target_modules=["q_proj"])
    ckpt = make_adapter(base, tmp_path / "run" / "checkpoint-4", seed=2, target_modules=["v_proj"])
    inputs = {"model weights": files_digest(models.weight_files(base)),
              "adapter weights": files_digest(models.adapter_files(sft))}
    config = {"model_name_or_path": str(base), "sft_adapter": str(sft), "adapter_mode": "new_on_merged"}
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": config, "inputs": inputs}))
    assert run(ckpt, tmp_path / "merged") == 0
    make_adapter(base, sft, seed=3, target_modules=["q_proj"])  # the SFT stage run again into the same folder
    assert run(ckpt, tmp_path / "merged-again") == 2
    err = capsys.readouterr().err
    assert "its files changed since the run trained on them (the adapter weights' digest" in err
    assert not (tmp_path / "merged-again").exists()


def test_a_checkpoint_export_carries_the_run_s_chat_template(tiny_path, tmp_path, tokenizer, capsys):
    """A checkpoint folder holds no tokenizer: the merged folder gets the base's tokenizer with the run's
    chat_template (the key's text), not the base's own template. The warning signs its run logged up to it are
    repeated."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    ckpt = make_adapter(tiny_path, tmp_path / "run" / "checkpoint-2", target_modules=["q_proj"])
    config = {"model_name_or_path": str(tiny_path), "chat_template": template}
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": config}))
    (ckpt / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.69}) + "\n" + json.dumps(
        {"step": 2, "warnings": ["generations collapsing into repetition: seq-rep-4 0.90 against 0.20 ..."]}) + "\n")
    assert run(ckpt, tmp_path / "merged") == 0
    assert (f"warning: export: the run that trained {ckpt} logged warning signs, so the adapter may be damaged: "
            "generations collapsing into repetition at step 2") in capsys.readouterr().err
    from transformers import AutoTokenizer

    merged = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert merged.chat_template == template != tokenizer.chat_template
    assert merged("a b").input_ids == tokenizer("a b").input_ids


def test_merged_dir_dot_and_a_corrupt_adapter(tiny_path, tmp_path, capsys, monkeypatch):
    """MERGED_DIR '.' (an empty current folder) is written in place; a cut adapter file is exit 2, one line."""
    adapter = make_adapter(tiny_path, tmp_path / "adapter", target_modules=["q_proj"])
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert run(adapter, ".") == 0
    assert (here / "model.safetensors").is_file() and [p.name for p in tmp_path.iterdir()
                                                        if p.name.startswith(".")] == []
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    capsys.readouterr()
    assert run(adapter, tmp_path / "other") == 2
    err = capsys.readouterr().err
    assert "not a readable safetensors file" in err and "Traceback" not in err
