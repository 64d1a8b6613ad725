"""An SFT adapter on a model with a decoder layer offloaded (the disk stand-in of test_offload): precompute's
reference (base + adapter), adapter_mode=continue and adapter_mode=new_on_merged compute what they compute with
the model resident, and the continued adapter is the saved one, never re-initialised."""

import hashlib
import json
import math

import pytest
import torch
from conftest import TINY_DATA, write_jsonl
from safetensors.torch import load_file
from test_offload import one_layer_on_disk, some_batch, some_pairs

from lowmem_dpo import adapters, cache, data, devices, policy, precompute, train
from lowmem_dpo.errors import UserError
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.models import load_model, model_source

CPU, F32 = torch.device("cpu"), torch.float32


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


def is_offloaded(model) -> bool:
    layer = model.get_base_model().model.layers[1] if hasattr(model, "get_base_model") else model.model.layers[1]
    return layer.self_attn.q_proj.weight.device.type == "meta"


def test_precompute_and_train_with_a_layer_on_disk(make_cfg, sft_adapter, rows32, tmp_path, monkeypatch, capsys):
    """precompute.run with the disk map (offload_plan and apply_plan pick maps on CUDA only): the cached reference
    is base + adapter, as precompute computes it with the model resident; train.run continuing the adapter with
    the same map starts from ln 2 (its policy is that reference)."""
    def cached(name, device_map, **keys):
        monkeypatch.setattr(precompute, "offload_plan", lambda *args: device_map)
        cfg = make_cfg(dataset=str(rows32), ref_cache_dir=str(tmp_path / name), **keys)
        precompute.run(cfg, progress=False)
        return torch.stack(cache.load_ref_logps(tmp_path / name))  # (2, rows)

    off = cached("off", one_layer_on_disk(), sft_adapter=str(sft_adapter))
    assert "offload: 1 of 2 decoder layers" in capsys.readouterr().err
    whole = cached("whole", None, sft_adapter=str(sft_adapter))
    base = cached("base", None)
    assert off.shape == (2, 32) and torch.isfinite(off).all()
    assert torch.allclose(off, whole, atol=1e-5, rtol=0)
    assert (off - base).abs().max() > 0.1  # the adapter is in the reference
    monkeypatch.setattr(policy, "apply_plan", lambda *args: one_layer_on_disk())
    cfg = make_cfg(dataset=str(rows32), ref_cache_dir=str(tmp_path / "off"), sft_adapter=str(sft_adapter), max_steps=1)
    train.run(cfg, progress=False)
    assert "offload: 1 of 2 decoder layers" in capsys.readouterr().err
    (line,) = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    assert line["loss"] == pytest.approx(math.log(2), abs=1e-5)


def policies(make_cfg, tiny_path, sft_adapter, mode, tmp_path):
    """policy.setup_model for `mode`, with layer 1 on disk and fully resident: {name: (cfg, resolved, model)}."""
    out = {}
    for name, device_map in (("off", one_layer_on_disk()), ("whole", None)):
        cfg = make_cfg(sft_adapter=str(sft_adapter), adapter_mode=mode)
        resolved = devices.resolve(cfg)
        source = model_source(cfg.model_name_or_path, cfg.sft_adapter)
        model = policy.setup_model(cfg, resolved, tiny_path, device_map, tmp_path / "offload", source=source)
        assert is_offloaded(model) == (name == "off")
        out[name] = cfg, resolved, model
    return out


def logps_and_grads(cfg, resolved, model, tokenizer):
    """The policy's log-probs of a batch, then the LoRA gradients of one train step (live reference)."""
    batch = some_batch(tokenizer)
    with torch.no_grad():
        logps = completion_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask).logps
    train.train_step(model, cfg, [some_pairs(tokenizer)], None, data.pad_token_id(tokenizer), resolved)
    return logps, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def layer1_lora(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".layers.1." in n and ".lora_" in n}


def assert_same_steps(runs, tokenizer):
    (want_logps, want), (got_logps, got) = (logps_and_grads(*runs[k], tokenizer) for k in ("whole", "off"))
    assert torch.allclose(got_logps, want_logps, atol=1e-5, rtol=0)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    for n, g in want.items():
        assert got[n] is not None and got[n].device.type == "cpu", n
        assert torch.allclose(got[n], g, atol=1e-5, rtol=1e-4), n
    return got


def test_continue_loads_the_saved_adapter_on_the_offloaded_layer(make_cfg, tiny_path, tokenizer, sft_adapter,
                                                                 tmp_path):
    runs = policies(make_cfg, tiny_path, sft_adapter, "continue", tmp_path)
    saved = load_file(sft_adapter / "adapter_model.safetensors")
    loaded = layer1_lora(runs["off"][2])
    assert len(loaded) == 7 * 2
    for name, p in loaded.items():  # peft names the saved tensors without the adapter name
        assert p.device.type == "cpu" and torch.equal(p.detach(), saved[name.replace(".default.", ".")]), name
    grads = assert_same_steps(runs, tokenizer)
    assert all(grads[n].abs().sum() > 0 for n in loaded)  # the offloaded layer's adapter trains


def test_new_on_merged_with_a_layer_on_disk(make_cfg, tiny_path, tokenizer, sft_adapter, tmp_path):
    """The SFT adapter merged into the offloaded layer too (its weights stay off the device, the model's own weight
    file untouched), then a fresh adapter (B = 0): the policy equals base + SFT adapter, as resident."""
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
        want = completion_logps(reference, batch.input_ids, batch.attention_mask, batch.completion_mask).logps
        got = completion_logps(runs["off"][2], batch.input_ids, batch.attention_mask, batch.completion_mask).logps
    assert torch.allclose(got, want, atol=1e-4, rtol=0)  # merged vs unmerged: rounding only
    with torch.no_grad():  # the fresh A of an offloaded layer is drawn later than a resident one's: the same weights
        whole = dict(runs["whole"][2].named_parameters())
        for n, p in runs["off"][2].named_parameters():
            if p.requires_grad:
                p.copy_(whole[n])
    grads = assert_same_steps(runs, tokenizer)
    assert all(grads[n].abs().sum() > 0 for n in fresh if ".lora_B." in n)  # (B = 0: A gets none at step 1)


def test_an_adapter_with_more_than_a_and_b_on_an_offloaded_layer_is_refused(tiny_path, tmp_path):
    """DoRA's magnitude vector is not placed for an offloaded layer: a clear message, not a meta tensor error."""
    dora = save_adapter(tiny_path, tmp_path / "dora", use_dora=True)
    base = load_model(tiny_path, CPU, F32, device_map=one_layer_on_disk())
    with pytest.raises(UserError, match="lora_magnitude_vector.*merge the adapter into its base"):
        adapters.load_adapter(base, dora, trainable=False)
