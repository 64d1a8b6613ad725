"""An SFT adapter on a model whose last decoder layer streams from CPU RAM (streaming.py, as on a GPU): precompute's
reference (base + adapter), adapter_mode=continue and adapter_mode=new_on_merged compute what they compute with
the model resident, and the continued adapter is the saved one, never re-initialised."""

import hashlib
import json
import math

import pytest
import torch
from conftest import TINY_DATA, backward_pairs, cached, write_jsonl
from safetensors.torch import load_file
from test_streaming import some_batch, some_pairs

from lowmem_dpo import data, precompute, train
from lowmem_dpo.model import adapters, streaming
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model, model_source
from lowmem_dpo.runtime import devices
from lowmem_dpo.training import policy

CPU, F32 = torch.device("cpu"), torch.float32
LAYER_1 = streaming.Plan(1, "model.layers")  # the tiny model's last layer


def save_adapter(tiny_path, out, **lora):
    """An adapter as peft saves one (save_pretrained), with LoRA on every linear layer of the tiny model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(load_model(tiny_path, CPU, F32), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                       **lora))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory, tiny_path):
    """Random A and B (an adapter with B = 0 would be the base itself): it changes every log-prob."""
    return save_adapter(tiny_path, tmp_path_factory.mktemp("sft") / "adapter", init_lora_weights=False)


@pytest.fixture(scope="module")
def rows32(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows32.jsonl",
                       data.load_rows(str(TINY_DATA)).select(range(32)).to_list())


def is_streamed(model) -> bool:
    """Whether layer 1's weights are off the device between forwards (their storage emptied)."""
    layer = model.get_base_model().model.layers[1] if hasattr(model, "get_base_model") else model.model.layers[1]
    return layer.self_attn.q_proj.base_layer.weight.untyped_storage().nbytes() == 0


def test_precompute_and_train_with_a_streamed_layer(make_cfg, sft_adapter, rows32, tmp_path, monkeypatch, capsys):
    """precompute.run streaming layer 1 (memory_plan streams on CUDA only: set here): the cached reference is base
    + adapter, as precompute computes it with the model resident; train.run continuing the adapter, streaming the
    same layer, starts from ln 2 (its policy is that reference)."""
    def built(name, stream, **keys):
        monkeypatch.setattr(precompute, "memory_plan", lambda cfg, *args: (cfg.precompute_batch_size, stream))
        cfg = make_cfg(dataset=str(rows32), ref_cache_dir=str(tmp_path / name), **keys)
        precompute.run(cfg, progress=False)
        ref = cached(cfg)[0]
        return torch.stack([ref.chosen, ref.rejected])  # (2, rows)

    off = built("off", LAYER_1, sft_adapter=str(sft_adapter))
    assert "stream: decoder layers 1-1 (1 of 2" in capsys.readouterr().err
    whole = built("whole", None, sft_adapter=str(sft_adapter))
    base = built("base", None)
    assert off.shape == (2, 32) and torch.isfinite(off).all()
    assert torch.allclose(off, whole, atol=1e-6, rtol=0)
    assert (off - base).abs().max() > 0.1  # the adapter is in the reference
    monkeypatch.setattr(policy, "apply_plan", lambda *args: LAYER_1)
    cfg = make_cfg(dataset=str(rows32), ref_cache_dir=str(tmp_path / "off"), sft_adapter=str(sft_adapter), max_steps=1)
    train.run(cfg, progress=False)
    assert "stream: decoder layers 1-1 (1 of 2" in capsys.readouterr().err
    (line,) = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert line["loss"] == pytest.approx(math.log(2), abs=1e-5)


def policies(make_cfg, tiny_path, sft_adapter, mode, tmp_path):
    """policy.setup_model for `mode`, with layer 1 streamed and fully resident: {name: (cfg, resolved, model)}."""
    out = {}
    for name, stream in (("off", LAYER_1), ("whole", None)):
        cfg = make_cfg(sft_adapter=str(sft_adapter), adapter_mode=mode)
        resolved = devices.resolve(cfg)
        source = model_source(cfg.model_name_or_path, cfg.sft_adapter)
        model = policy.setup_model(cfg, resolved, tiny_path, stream, source=source)
        assert is_streamed(model) == (name == "off")
        out[name] = cfg, resolved, model
    return out


def logps_and_grads(cfg, resolved, model, tokenizer):
    """The policy's log-probs of a batch, then the LoRA gradients of one train step (live reference)."""
    batch = some_batch(tokenizer)
    with torch.no_grad():
        logps = completion_logps(model, batch).logps
    backward_pairs(policy.trainee(cfg, model, 1, resolved), cfg, some_pairs(tokenizer), data.pad_token_id(tokenizer),
                   resolved)
    return logps, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def layer1_lora(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".layers.1." in n and ".lora_" in n}


def assert_same_steps(runs, tokenizer):
    (want_logps, want), (got_logps, got) = (logps_and_grads(*runs[k], tokenizer) for k in ("whole", "off"))
    assert torch.allclose(got_logps, want_logps, atol=1e-6, rtol=0)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    for n, g in want.items():
        assert got[n] is not None and got[n].device.type == "cpu", n
        assert torch.allclose(got[n], g, atol=1e-5, rtol=1e-4), n
    return got


def test_continue_loads_the_saved_adapter_on_the_streamed_layer(make_cfg, tiny_path, tokenizer, sft_adapter,
                                                                 tmp_path):
    runs = policies(make_cfg, tiny_path, sft_adapter, "continue", tmp_path)
    saved = load_file(sft_adapter / "adapter_model.safetensors")
    loaded = layer1_lora(runs["off"][2])
    assert len(loaded) == 7 * 2
    for name, p in loaded.items():  # peft names the saved tensors without the adapter name
        assert p.device.type == "cpu" and torch.equal(p.detach(), saved[name.replace(".default.", ".")]), name
    grads = assert_same_steps(runs, tokenizer)
    assert all(grads[n].abs().sum() > 0 for n in loaded)  # the streamed layer's adapter trains


def test_new_on_merged_with_a_streamed_layer(make_cfg, tiny_path, tokenizer, sft_adapter, tmp_path):
    """The SFT adapter merged into the streamed layer too (merged before it streams; the model's own weight file
    untouched), then a fresh adapter (B = 0): the policy equals base + SFT adapter, as resident."""
    weights = tiny_path / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    runs = policies(make_cfg, tiny_path, sft_adapter, "new_on_merged", tmp_path)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    fresh = layer1_lora(runs["off"][2])
    assert len(fresh) == 7 * 2 and all(not p.any() for n, p in fresh.items() if ".lora_B." in n)
    reference = adapters.reference_model(load_model(tiny_path, CPU, F32), model_source(str(tiny_path),
                                                                                       str(sft_adapter)))
    batch = some_batch(tokenizer)
    with torch.no_grad():
        want = completion_logps(reference, batch).logps
        got = completion_logps(runs["off"][2], batch).logps
    assert torch.allclose(got, want, atol=1e-4, rtol=0)  # merged vs unmerged: rounding only
    grads = assert_same_steps(runs, tokenizer)
    assert all(grads[n].abs().sum() > 0 for n in fresh if ".lora_B." in n)  # (B = 0: A gets none at step 1)
