"""CPU offload of whole decoder layers: the device_map rule (hand-computed cases, and the planner's k), and the
mechanism on a CPU: a decoder layer kept on disk by accelerate's hooks gives the same log-probs as the model
loaded whole, and LoRA on the resident layers gets gradients through it."""

import dataclasses
import math

import pytest
import torch

from lowmem_dpo import data, devices, policy
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.memory import search
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.model import layer_weight_bytes, predict, streamed_layer_bytes
from lowmem_dpo.memory.search import _offload, offload_map
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.models import load_model
from lowmem_dpo.units import fmt

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
    assert search.layers_on_device(layers, layer, other, budget) == want


@pytest.mark.parametrize("buffer, want", [
    (10, 2),  # the default buffer: one layer
    (25, 1),  # 20 + 1*10 + 25 = 55 <= 59 < 20 + 2*10 + 25
    (39, 0),  # 20 + 39 = 59: the buffer alone fits, no resident layer beside it
    (40, 0),
])
def test_layers_on_device_with_a_larger_stream_buffer(buffer, want):
    """Quantized resident layers (10 bytes) with an unquantized offloaded one streaming through `buffer`."""
    assert search.layers_on_device(4, 10, 20, 59, buffer) == want


def test_quantized_offload_streams_unquantized_layers(make_cfg):
    """4-bit Mistral on a tiny budget: each layer moved saves its 4-bit bytes, while the CPU holds (and the GPU
    streams) it in bf16, as bitsandbytes leaves CPU-mapped modules unquantized."""
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   quantization="4bit", gradient_checkpointing="true", max_length=512, per_device_train_batch_size=1)
    budget = 4 * devices.GiB
    setup = setup_from_config(cfg, budget)
    q4, bf16 = layer_weight_bytes(arch, "bfloat16", "4bit"), layer_weight_bytes(arch, "bfloat16", "none")
    assert streamed_layer_bytes(arch, "bfloat16", "4bit") == bf16 > 3 * q4
    peak = predict(arch, setup).train.peak_bytes
    k, cpu_bytes = _offload(peak, budget, q4, arch.layers, bf16)
    assert k > 0 and cpu_bytes == k * bf16
    assert peak - k * q4 + bf16 <= budget < peak - (k - 1) * q4 + bf16  # the fewest layers that fit
    device_map = offload_map(arch, setup, budget, "train")
    assert len(devices.offloaded_layers(device_map)) == k


def test_offload_device_map_keeps_head_and_leading_layers():
    got = search.offload_device_map(4, 10, 20, 59)
    assert got == {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": "cpu",
                   "model.layers.3": "cpu", "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    assert list(got)[0] == "model.embed_tokens" and list(got)[-1] == "lm_head"
    assert devices.offloaded_layers(got) == ["model.layers.2", "model.layers.3"]
    everything = search.offload_device_map(2, 10, 0, 1000, device="cuda:1")
    assert set(everything.values()) == {"cuda:1"} and devices.offloaded_layers(everything) == []


@pytest.mark.parametrize("budget_gib", [4, 4.5, 5])
def test_offload_map_moves_the_planners_k_layers(make_cfg, budget_gib):
    """Mistral-7B in bf16 on a small card: the map offloads exactly the layers _offload counts."""
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    budget = int(budget_gib * devices.GiB)
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   precompute_batch_size=1, max_length=512)
    setup = setup_from_config(cfg, budget)
    pred = predict(arch, setup)
    per_layer = layer_weight_bytes(arch, setup.ref_dtype, setup.ref_quantization)
    k, _ = _offload(pred.precompute.peak_bytes, budget, per_layer, arch.layers)
    device_map = offload_map(arch, setup, budget, "precompute")
    assert k > 0
    assert len(devices.offloaded_layers(device_map)) == k
    assert device_map["lm_head"] == 0 and device_map["model.layers.0"] == 0


def test_offload_map_none_when_it_fits(make_cfg):
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16")
    budget = 80 * devices.GiB
    assert offload_map(arch, setup_from_config(cfg, budget), budget, "precompute") is None


# -- the mechanism, on a CPU -------------------------------------------------------------------------------------
def one_layer_on_disk():
    """The tiny model (2 layers) with its last layer kept on disk: what a CUDA map's "cpu" entries do, with the
    CPU as the execution device (weights on the meta device, copied in by a hook for each forward)."""
    m = {k: "cpu" for k in search.offload_device_map(2, 1, 0, 100)}  # the map's keys cover the whole model
    m["model.layers.1"] = "disk"  # (with 2 layers the rule never offloads: one layer + its buffer = both)
    return m


def some_pairs(tokenizer, n=4) -> list[data.TokenizedPair]:
    from conftest import TINY_DATA

    ds = data.load_rows(str(TINY_DATA)).select(range(n))
    return data.tokenize_rows(ds, tokenizer, 64, None, progress=False).pairs


def some_batch(tokenizer, n=4):
    return data.collate(some_pairs(tokenizer, n), 0)


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


def lora_grads(model, batch) -> tuple[torch.Tensor, dict]:
    out = completion_logps(model, batch.input_ids, batch.attention_mask, batch.completion_mask)
    out.logps.sum().backward()
    return out.logps.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [True, False])
def test_lora_on_an_offloaded_layer_trains_like_a_resident_one(tiny_path, tokenizer, tmp_path, checkpointing):
    """LoRA on every layer, the offloaded one included: its adapter gets real storage (place_offloaded_adapters),
    and with the same LoRA weights, log-probs and every LoRA gradient equal the model loaded whole."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.models import place_offloaded_adapters

    batch = some_batch(tokenizer)
    lora = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    results, whole_params = {}, {}
    for name, kwargs in (("whole", {}), ("off", {"device_map": one_layer_on_disk(),
                                                 "offload_folder": tmp_path / "offload"})):
        base = load_model(tiny_path, torch.device("cpu"), torch.float32, **kwargs)
        torch.manual_seed(0)
        model = get_peft_model(base, lora)
        placed = place_offloaded_adapters(model, torch.device("cpu"))
        if name == "off":
            assert len(placed) == 7 and all(".layers.1." in p for p in placed)  # q k v o gate up down
            # the whole model's weights, so the two compute the same function
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(whole_params[n])
        else:
            assert placed == []
            whole_params.update((n, p.detach().clone()) for n, p in model.named_parameters() if p.requires_grad)
        if checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        model.train()
        results[name] = lora_grads(model, batch)
    (want_logps, want), (got_logps, got) = results["whole"], results["off"]
    assert len(got) == 2 * 7 * 2  # A and B, 7 modules, 2 layers: none missing
    assert torch.allclose(got_logps, want_logps, atol=1e-5, rtol=0)
    for n, g in want.items():
        assert g.abs().sum() > 0, n
        assert got[n].device.type == "cpu" and torch.allclose(got[n], g, atol=1e-5, rtol=1e-4), n


def test_train_steps_with_an_offloaded_layer(make_cfg, tiny_path, tokenizer, tmp_path, capsys):
    """policy.setup_model with a device_map, then a real train_step (live reference: the adapter switched off)
    and optimizer steps: finite loss, and every LoRA weight moves, the offloaded layer's too."""
    from lowmem_dpo import train

    cfg = make_cfg(gradient_checkpointing="true", learning_rate=1e-2, ref_source="live")
    resolved = devices.resolve(cfg)
    model = policy.setup_model(cfg, resolved, tiny_path, one_layer_on_disk(), tmp_path / "offload")
    assert "the LoRA weights of 7 adapted modules on offloaded layers stay on cpu" in capsys.readouterr().err
    opt, _, params = policy.setup_optimizer(cfg, model, 1, resolved)
    before = [p.detach().clone() for p in params]
    for _ in range(2):  # B starts at zero, so A gets a gradient from the second step on
        stats = train.train_step(model, cfg, [some_pairs(tokenizer, 4)], None, 0, resolved)
        opt.step()
        opt.zero_grad()
        assert stats.pairs == 4 and math.isfinite(stats.sums["loss"])
    assert len(params) == 2 * 7 * 2
    assert all(not torch.equal(b, p) for b, p in zip(before, params))


def test_offloaded_layers_on_an_all_cpu_map():
    """With no accelerator in the map the CPU computes: only "disk" entries are off the device."""
    assert devices.offloaded_layers(one_layer_on_disk()) == ["model.layers.1"]
    assert devices.offloaded_layers({"model.layers.0": "cpu"}) == []
    assert devices.offloaded_layers(None) == []


def test_offload_message_says_what_moves_and_what_it_costs(tiny_path):
    """A CUDA-style map (layer 1 in CPU RAM) read against the tiny model's real parameter bytes."""
    from lowmem_dpo.models import PCIE_BYTES_PER_S, offload_message, offloaded_bytes

    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    device_map = {k: 0 for k in search.offload_device_map(2, 1, 0, 100)}
    device_map["model.layers.1"] = "cpu"
    moved = sum(p.numel() * 4 for p in model.model.layers[1].parameters())
    assert offloaded_bytes(model, ["model.layers.1"]) == moved
    msg = offload_message(model, device_map)
    assert msg.startswith(f"offload: 1 of 2 decoder layers ({fmt(moved)}) in CPU RAM; ")
    assert f"~{moved / PCIE_BYTES_PER_S:.2f} s per forward at 12 GB/s" in msg
    assert offload_message(model, {k: 0 for k in device_map}) is None


def test_train_plans_offload_on_cuda_when_the_recipe_does_not_fit(make_cfg, capsys):
    """policy.apply_plan for a 4-bit Mistral on a 4 GiB card (planned here, no GPU needed): it returns the
    planner's device_map for the run as configured and turns checkpointing on, which offload needs."""
    from lowmem_dpo.models import resolve_model_path

    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   quantization="4bit", gradient_checkpointing="false", max_length=512,
                   per_device_train_batch_size=1, memory_budget="4GiB")
    cuda = devices.Resolved(torch.device("cuda"), "cuda-12gb-bf16", torch.bfloat16, False, devices.ADAMW_TORCH,
                            quantization="4bit")
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    device_map = policy.apply_plan(cfg, cuda, "lowmem_dpo:arch/mistral-7b-v0.1")  # the planner reads config.json
    setup = dataclasses.replace(setup_from_config(cfg, 4 * devices.GiB), gradient_checkpointing=True)
    want = offload_map(arch, setup, 4 * devices.GiB, "train")
    assert device_map == want and 0 < len(devices.offloaded_layers(device_map)) < arch.layers
    assert cuda.gradient_checkpointing and any("CPU offload" in r for r in cuda.reasons)
    cpu = devices.resolve(make_cfg(memory_budget="1KiB"))
    assert policy.apply_plan(make_cfg(memory_budget="1KiB"), cpu, resolve_model_path("lowmem_dpo:tiny-llama")) is None
