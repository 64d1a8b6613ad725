"""Decoder layers streamed from CPU RAM (streaming.py), the planner's last knob, and how many it streams.

The mechanism runs on this CPU as on a GPU, without the pinned memory and the side stream: a streamed layer's
weights are copied into its own (emptied) tensors for each forward and freed after, and again for the backward. So
the tests here check what streaming must never change (log-probs and every LoRA gradient equal the resident
model's, with and without gradient checkpointing, a 16-bit and a 4-bit base, GPT-2's Conv1D layers) and what it
must do (nothing of a streamed layer stays allocated between forwards; a 4-bit layer is held as 4-bit bytes)."""

import math

import pytest
import torch
from conftest import TINY_DATA, backward_pairs, build_tiny_model

from lowmem_dpo import data
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.model import predict
from lowmem_dpo.memory.search import STREAM_BUFFERS, choose, stage_stream, streamed_layers
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.memory.weights import layer_weight_bytes, linear_weight_bytes
from lowmem_dpo.model import streaming
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model
from lowmem_dpo.objectives.metrics import LOSS
from lowmem_dpo.runtime import devices, rules
from lowmem_dpo.runtime.units import GiB
from lowmem_dpo.training import policy

CPU = torch.device("cpu")


def some_pairs(tokenizer, n=4) -> list[data.TokenizedPair]:
    ds = data.load_rows(str(TINY_DATA)).select(range(n))
    return data.tokenize_rows(ds, tokenizer, 64, None, progress=False).pairs


def some_batch(tokenizer, n=4):
    return data.collate(some_pairs(tokenizer, n), 0)


def lora_policy(path, quantization="none", streamed=0, checkpointing=False, prefix="model.layers"):
    """The model with a random LoRA adapter (seeded, B != 0) on every linear layer, its last `streamed` layers
    streamed; returns (model, streamer)."""
    from peft import LoraConfig, get_peft_model

    base = load_model(path, CPU, torch.float32, quantization)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    streamer = streaming.stream_layers(model, streaming.Plan(streamed, prefix), CPU)
    if checkpointing:
        policy.enable_checkpointing(base)
    model.train()
    return model, streamer


def logps_and_grads(model, batch):
    out = completion_logps(model, batch)
    out.logps.sum().backward()
    return out.logps.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def allocated(streamer, layer: int) -> int:
    return sum(slot.tensor.untyped_storage().nbytes() for slot in streamer.slots[layer])


@pytest.mark.parametrize("quantization", ["none", "4bit"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_streamed_layer_gives_the_same_logps_and_lora_gradients(tiny_path, tokenizer, quantization, checkpointing):
    batch = some_batch(tokenizer)
    want_logps, want = logps_and_grads(lora_policy(tiny_path, quantization, 0, checkpointing)[0], batch)
    model, streamer = lora_policy(tiny_path, quantization, 1, checkpointing)
    seen = []  # what layer 1 holds while it computes (a hook inside it)
    model.get_base_model().model.layers[1].mlp.register_forward_pre_hook(
        lambda module, args: seen.append(allocated(streamer, 1)))
    assert list(streamer.slots) == [1] and allocated(streamer, 1) == 0  # nothing of it on the device yet
    got_logps, got = logps_and_grads(model, batch)
    assert torch.allclose(got_logps, want_logps, atol=1e-6, rtol=0)
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 2  # A and B, 7 modules, 2 layers
    for n, g in want.items():
        assert g.abs().sum() > 0, n
        assert torch.allclose(got[n], g, atol=1e-6, rtol=1e-5), n
    # the forward, and with checkpointing its recompute in backward, saw the weights; they are gone again
    assert seen and all(n > 0 for n in seen) and len(seen) == 1 + checkpointing
    assert allocated(streamer, 1) == 0 and streamer.ready == {}


def test_a_4bit_layer_streams_its_4bit_bytes(tiny_path):
    """The host copies of a streamed 4-bit layer are bitsandbytes' packed weights and scales: the planner's 4-bit
    layer bytes (linear_weight_bytes), not a 16-bit copy."""
    model, streamer = lora_policy(tiny_path, "4bit", 1)
    arch = load_arch(str(tiny_path))
    weights = [s.host for s in streamer.slots[1] if s.host.dtype == torch.uint8 and s.host.dim() == 2]
    assert len(weights) == 7  # q k v o gate up down, packed
    packed = sum(s.host.numel() for s in streamer.slots[1] if s.host.dtype == torch.uint8)
    # per Linear: n/2 bytes of packed weights and one uint8 scale per 64-weight block; the planner's
    # linear_weight_bytes adds the code tables and second-level scales, which are small and stay on the device
    assert packed == sum(math.ceil(i * o / 2) + math.ceil(i * o / 64) for i, o in arch.linears().values())
    assert packed < sum(linear_weight_bytes(i, o, "4bit", 4) for i, o in arch.linears().values())
    buffer = streamer.slots[1][0].host.untyped_storage()  # the layer's one host buffer, every copy a view into it
    assert all(s.host.untyped_storage().data_ptr() == buffer.data_ptr() for s in streamer.slots[1])
    assert sum(s.host.numel() * s.host.element_size() for s in streamer.slots[1]) <= buffer.nbytes() < \
        layer_weight_bytes(arch, "bfloat16", "none") / 3


def test_inference_frees_each_layer_after_its_forward(tiny_path, tokenizer):
    """Precompute's path (inference_mode): the same log-probs, nothing left on the device."""
    batch = some_batch(tokenizer)
    resident = load_model(tiny_path, CPU, torch.float32)
    streamed = load_model(tiny_path, CPU, torch.float32)
    streamer = streaming.stream_layers(streamed, streaming.Plan(2, "model.layers"), CPU)
    with torch.inference_mode():
        want = completion_logps(resident, batch).logps
        got = completion_logps(streamed, batch).logps
    assert torch.equal(got, want)
    assert list(streamer.slots) == [0, 1] and allocated(streamer, 0) == allocated(streamer, 1) == 0


def test_gpt2_streams_its_own_layers(model_dir, tokenizer):
    """GPT-2: layers under transformer.h (the planner's arch.layers_prefix), Conv1D weights."""
    path = model_dir("gpt2")
    prefix = load_arch(str(path)).layers_prefix
    assert prefix == "transformer.h"
    batch = some_batch(tokenizer)
    want_logps, want = logps_and_grads(lora_policy(path, prefix=prefix)[0], batch)
    got_logps, got = logps_and_grads(lora_policy(path, streamed=1, checkpointing=True, prefix=prefix)[0], batch)
    assert torch.allclose(got_logps, want_logps, atol=1e-6, rtol=0)
    for n, g in want.items():
        assert torch.allclose(got[n], g, atol=1e-6, rtol=1e-5), n


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    folders = {}

    def get(name: str):
        if name not in folders:
            folders[name] = build_tiny_model("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
                                             tmp_path_factory.mktemp(name), tokenizer)
        return folders[name]

    return get


def test_train_steps_with_a_streamed_layer(make_cfg, tiny_path, tokenizer, capsys):
    """policy.setup_model streaming layer 1, a real forward and backward (live reference: the adapter off) and
    optimizer steps: finite loss, and every LoRA weight moves, the streamed layer's too."""
    cfg = make_cfg(gradient_checkpointing="true", learning_rate=1e-2, ref_source="live")
    resolved = devices.resolve(cfg)
    model = policy.setup_model(cfg, resolved, tiny_path, streaming.Plan(1, "model.layers"))
    assert "stream: decoder layers 1-1 (1 of 2, " in capsys.readouterr().err
    trainee = policy.trainee(cfg, model, 1, resolved)
    params = trainee.params
    before = [p.detach().clone() for p in params]
    for _ in range(2):  # B starts at zero, so A gets a gradient from the second step on
        stats = backward_pairs(trainee, cfg, some_pairs(tokenizer, 4), 0, resolved)
        trainee.optimizer.step()
        trainee.optimizer.zero_grad()
        assert stats.items == 4 and math.isfinite(stats.means()[LOSS.name])
    assert len(params) == 2 * 7 * 2
    assert all(not torch.equal(b, p) for b, p in zip(before, params))


# -- how many layers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("peak, budget, per_layer, layers, want", [
    (100, 100, 10, 8, 0),  # fits
    (101, 100, 10, 8, 3),  # ceil((1 + 2*10) / 10): one layer saved, two buffers on the device
    (130, 100, 10, 8, 5),  # 130 - 5*10 + 2*10 = 100
    (131, 100, 10, 8, 6),
    (500, 100, 10, 8, 8),  # all of them, still over
])
def test_streamed_layers(peak, budget, per_layer, layers, want):
    k = streamed_layers(peak, budget, per_layer, layers)
    assert k == want
    if 0 < k < layers:
        assert peak - k * per_layer + STREAM_BUFFERS * per_layer <= budget  # the fewest that fit
        assert peak - (k - 1) * per_layer + STREAM_BUFFERS * per_layer > budget


def test_a_4bit_model_streams_4bit_layers_and_the_plan_says_what_they_cost(make_cfg):
    """4-bit Mistral on a 4 GiB budget: each streamed layer saves and copies its 4-bit bytes (~4x fewer than
    bf16's), twice per micro-batch in train; the plan's step says the bytes and their time."""
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   quantization="4bit", gradient_checkpointing="true", max_length=512, per_device_train_batch_size=1,
                   gradient_accumulation_steps=4)
    budget = 4 * GiB
    setup = setup_from_config(cfg, budget)
    q4, bf16 = layer_weight_bytes(arch, "bfloat16", "4bit"), layer_weight_bytes(arch, "bfloat16", "none")
    assert bf16 > 3 * q4
    plan = choose(arch, setup, budget)
    assert plan.setup.activation_offloading  # the cheaper knob first: the activations to host memory
    s = stage_stream(arch, plan.setup, predict(arch, plan.setup), "train", budget)
    assert s.layer_bytes == q4 and s.layers > 0 and s.device_peak <= budget
    assert s.copies_per_step == 2 * 4 and s.bytes_per_step == s.layers * q4 * 8
    assert plan.fits and plan.streams["train"] == s and plan.offload_bytes == s.cpu_bytes
    step = next(x for x in plan.steps if x.startswith("train: stream"))
    assert f"stream {s.layers} of 32 decoder layers" in step and "copied per optimizer step" in step
    assert f"~{s.seconds_per_step:.2f} s at 20 GB/s" in step


def test_train_streams_only_when_nothing_cheaper_fits(make_cfg, capsys):
    """policy.apply_plan for a 4-bit Mistral on a 4 GiB CUDA budget (planned here: apply_plan plans, it loads
    nothing): the micro-batch first (1), activation offloading, then the layers the planner counts, checkpointing
    turned on."""
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   quantization="4bit", gradient_checkpointing="false", max_length=512,
                   per_device_train_batch_size=2, gradient_accumulation_steps=2)
    cuda = devices.Resolved(torch.device("cuda"), "cuda-12gb-bf16", torch.bfloat16, False, rules.ADAMW_TORCH,
                            quantization="4bit", budget=4 * GiB)
    plan = policy.apply_plan(cfg, cuda, "lowmem_dpo:arch/mistral-7b-v0.1")  # the planner reads config.json
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    setup = setup_from_config(cfg, 4 * GiB)
    want = choose(arch, setup, 4 * GiB, ("micro_batch", "offloading", "unshare", "stream"), stages=("train",))
    assert want.setup.micro_batch == 1 and want.setup.grad_accum == 4 and want.setup.activation_offloading
    assert plan == streaming.Plan(want.streams["train"].layers, "model.layers") and 0 < plan.layers < 32
    assert cuda.micro_batch == 1 and cuda.gradient_checkpointing and cuda.activation_offloading
    assert any(r.startswith("gradient_checkpointing=true (streamed layers") for r in cuda.reasons)
    assert any(r.startswith("per_device_train_batch_size=1 gradient_accumulation_steps=4 (the planner") for r in
               cuda.reasons)
    cpu = devices.resolve(make_cfg(memory_budget="1KiB"))
    from lowmem_dpo.model.models import resolve_model_path

    assert policy.apply_plan(make_cfg(memory_budget="1KiB"), cpu, resolve_model_path("lowmem_dpo:tiny-llama")) is None
    assert cpu.micro_batch == 1  # on a CPU too the micro-batch comes first; nothing streams there


def test_an_8bit_base_is_not_streamed(make_cfg):
    """LLM.int8 keeps a second reference to each weight (Int8Params.CB) that would stay on the device: the planner
    streams no 8-bit layer and says what would."""
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    cfg = make_cfg(model_name_or_path="lowmem_dpo:arch/mistral-7b-v0.1", device="cuda", dtype="bfloat16",
                   quantization="8bit", gradient_checkpointing="true", max_length=512, per_device_train_batch_size=1)
    plan = choose(arch, setup_from_config(cfg, 4 * GiB), 4 * GiB, ("micro_batch", "stream"))
    assert not plan.fits and plan.streams == {}
    assert any("no streamed layers with an 8-bit base" in step and "quantization=4bit streams" in step
               for step in plan.steps)
