"""CPU offload of whole decoder layers: the device_map rule (hand-computed cases, and the planner's k), and the
mechanism on a CPU: a decoder layer kept on disk by accelerate's hooks gives the same log-probs as the model
loaded whole, and LoRA on the resident layers gets gradients through it."""

import pytest
import torch

from lowmem_dpo import data, devices, plan
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.models import load_model

MiB = 1 << 20


@pytest.mark.parametrize("layers, layer, other, budget, want", [
    (4, 10, 20, 60, 4),  # 20 + 4*10 = 60: all fit, no buffer needed
    (4, 10, 20, 59, 2),  # 20 + (2 + 1)*10 = 50 <= 59 < 20 + (3 + 1)*10
    (4, 10, 20, 50, 2),  # exactly 2 + the buffer
    (4, 10, 20, 49, 1),
    (4, 10, 20, 39, 0),  # not even one layer beside its buffer
    (4, 10, 100, 50, 0),  # the rest alone is over
    (32, 100, 1000, 2950, 18),  # (2950 - 1000) // 100 - 1
    (0, 10, 5, 4, 0),
])
def test_layers_on_device(layers, layer, other, budget, want):
    assert devices.layers_on_device(layers, layer, other, budget) == want


def test_offload_device_map_keeps_head_and_leading_layers():
    got = devices.offload_device_map(4, 10, 20, 59)
    assert got == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": "cpu",
                   "model.layers.3": "cpu", "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    assert list(got)[0] == "model.embed_tokens" and list(got)[-1] == "lm_head"
    assert devices.offloaded_layers(got) == ["model.layers.2", "model.layers.3"]
    everything = devices.offload_device_map(2, 10, 0, 1000, device="cuda:1")
    assert set(everything.values()) == {"cuda:1"} and devices.offloaded_layers(everything) == []


@pytest.mark.parametrize("budget_gib", [4, 4.5, 5])
def test_offload_map_moves_the_planners_k_layers(make_cfg, budget_gib):
    """Mistral-7B in bf16 on a small card: the map offloads exactly the layers plan._offload counts."""
    arch = plan.load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    budget = int(budget_gib * devices.GiB)
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   precompute_batch_size=1, max_length=512)
    setup = plan.setup_from_config(cfg, budget)
    pred = plan.predict(arch, setup)
    per_layer = plan.layer_weight_bytes(arch, setup.ref_dtype, setup.ref_quantization)
    k, _ = plan._offload(pred.precompute.peak_bytes, budget, per_layer, arch.layers)
    device_map = plan.offload_map(arch, setup, budget, "precompute")
    assert k > 0
    assert len(devices.offloaded_layers(device_map)) == k
    assert device_map["lm_head"] == 0 and device_map["model.layers.0"] == 0


def test_offload_map_none_when_it_fits(make_cfg):
    arch = plan.load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16")
    budget = 80 * devices.GiB
    assert plan.offload_map(arch, plan.setup_from_config(cfg, budget), budget, "precompute") is None


# -- the mechanism, on a CPU -------------------------------------------------------------------------------------
def one_layer_on_disk():
    """The tiny model (2 layers) with its last layer kept on disk: what a CUDA map's "cpu" entries do, with the
    CPU as the execution device (weights on the meta device, copied in by a hook for each forward)."""
    m = {k: "cpu" for k in devices.offload_device_map(2, 1, 0, 100)}  # the map's keys cover the whole model
    m["model.layers.1"] = "disk"  # (with 2 layers the rule never offloads: one layer + its buffer = both)
    return m


def some_batch(tokenizer, n=4):
    from conftest import TINY_DATA

    ds = data.load_rows(str(TINY_DATA)).select(range(n))
    return data.collate(data.tokenize_rows(ds, tokenizer, 64, None, progress=False).pairs, 0)


def test_offloaded_layer_gives_the_same_logps(tiny_path, tokenizer, tmp_path, capsys):
    device_map = one_layer_on_disk()
    assert device_map["model.layers.1"] == "disk" and device_map["model.layers.0"] == "cpu"
    whole = load_model(tiny_path, torch.device("cpu"), torch.float32)
    off = load_model(tiny_path, torch.device("cpu"), torch.float32, device_map=device_map,
                     offload_folder=tmp_path / "offload")
    assert off.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really off
    assert off.model.layers[0].self_attn.q_proj.weight.device.type == "cpu"
    log = capsys.readouterr().err
    assert "offload: 1 of 2 decoder layers (" in log and " KiB) in disk; " in log and "expect slower steps" in log
    batch = some_batch(tokenizer)
    with torch.inference_mode():
        want = completion_logps(whole, batch.input_ids, batch.attention_mask, batch.completion_mask)
        got = completion_logps(off, batch.input_ids, batch.attention_mask, batch.completion_mask)
    assert torch.allclose(got.logps, want.logps, atol=1e-5, rtol=0)
    assert torch.equal(got.n_tokens, want.n_tokens)


def test_lora_on_resident_layers_gets_gradients_through_an_offloaded_layer(tiny_path, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    batch = some_batch(tokenizer)
    grads = {}
    for name, kwargs in (("whole", {}), ("off", {"device_map": one_layer_on_disk(),
                                                 "offload_folder": tmp_path / "offload"})):
        base = load_model(tiny_path, torch.device("cpu"), torch.float32, **kwargs)
        torch.manual_seed(0)
        # LoRA only where the weights are resident: peft gives an offloaded layer's adapter the meta device.
        model = get_peft_model(base, LoraConfig(r=4, target_modules=modules, layers_to_transform=[0],
                                                init_lora_weights=False))
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert len(params) == 2 * len(modules)
        out = completion_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
        out.logps.sum().backward()
        for n, p in params.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        grads[name] = {n: p.grad for n, p in params.items()}
    for n, g in grads["whole"].items():
        assert torch.allclose(grads["off"][n], g, atol=1e-5, rtol=1e-4), n


def test_offloaded_layers_on_an_all_cpu_map():
    """With no accelerator in the map the CPU computes: only "disk" entries are off the device."""
    assert devices.offloaded_layers(one_layer_on_disk()) == ["model.layers.1"]
    assert devices.offloaded_layers({"model.layers.0": "cpu"}) == []
    assert devices.offloaded_layers(None) == []
