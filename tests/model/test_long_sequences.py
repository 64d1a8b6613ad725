"""Long sequences: the MLP in tiles, the saved tensors offloaded, no padding mask, the attention kernel said, and the
planner's terms for each (activation_offloading, tiles, masks, shared rows, the longest max_length per micro-batch).

Offloading moves tensors to host memory on CUDA only; here, where they are in host memory already, the tests force
the copies through the same bookkeeping (Offloader(force=True)): what a GPU adds is the side stream."""

import contextlib
import dataclasses
import math

import pytest
import torch
from conftest import REPO, TINY_DATA, build_tiny_model

from lowmem_dpo import data, train
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.model import OFFLOAD_WINDOW, predict
from lowmem_dpo.memory.search import LENGTH_STEP, TRAIN_KNOBS, choose, longest_max_length
from lowmem_dpo.memory.setup import setup_from_config, with_prompts
from lowmem_dpo.model import activations, headcheck, logps, sdpa
from lowmem_dpo.model.models import load_model
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.units import GiB
from lowmem_dpo.training.step import optimizer_step

LLAMA_12GB = REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml"


def as_batch(ids, mask, completion) -> data.Batch:
    """The tensors as a collated batch (completion_logps reads its input_ids, masks and position_ids)."""
    return data.Batch(torch.arange(ids.shape[0]), ids, mask, completion, int(mask.sum()))


def logps_and_grads(model, ids, mask, completion):
    """(the completion log-probs (N,), every parameter's gradient) of one forward and backward."""
    for p in model.parameters():
        p.grad = None
    out = logps.completion_logps(model, as_batch(ids, mask, completion))
    out.logps.sum().backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def batch(vocab: int, t: int = 40):
    ids = torch.randint(3, vocab - 1, (2, t), generator=torch.Generator().manual_seed(0))  # (2, T)
    mask = torch.ones_like(ids)
    mask[1, t - 8:] = 0  # right padding: row 1 is shorter
    completion = torch.zeros_like(ids)
    completion[:, t // 2:] = 1
    return ids, mask, completion * mask


def lora_model(path, dropout: float = 0.0):
    """A float32 model of `path` with LoRA on every Linear (each B random: every adapter path carries a gradient),
    checkpointed as train checkpoints it (policy.enable_checkpointing)."""
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.training.policy import enable_checkpointing

    torch.manual_seed(0)
    base = load_model(path, torch.device("cpu"), torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    enable_checkpointing(base)
    model.train()
    return model


def counted(tiled: list) -> list[int]:
    """Each tiled MLP's forward counting the rows it runs: [rows so far] (its own list, read by the caller)."""
    rows = [0]
    for t in tiled:
        def forward(x, f=t.forward):
            rows[0] += x.shape[0] * x.shape[1]
            return f(x)
        t.forward = forward
    return rows


ARCHS = {"gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
         "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16))}


@pytest.mark.parametrize("arch, stops", [("llama", True), ("gpt2", True), ("gemma2", False)])
def test_tiled_mlp_runs_twice_per_step_and_equals_the_whole_one(arch, stops, tiny_path, tokenizer, tmp_path):
    """The MLP in tiles of 16 rows (of 2 sequences' 80 tokens) in a checkpointed layer gives the untiled log-probs
    and LoRA gradients to float32 rounding, on a gated MLP (Llama), GPT-2's and Gemma2's. The forward and its
    backward run the MLP over 2 x 80 rows per layer: once in the forward, once in the backward's recompute, skipped
    in the layer's recompute, where nothing after the MLP saves a tensor (the probe says so). Gemma2 normalizes
    the MLP's output (post_feedforward_layernorm): the probe says no, and the MLP runs a third time."""
    path = tiny_path if arch == "llama" else build_tiny_model(*ARCHS[arch], tmp_path / arch, tokenizer)
    spec = load_arch(str(path))
    ids, mask, completion = batch(len(tokenizer))
    runs = []
    for tiled in (False, True):
        model = lora_model(path)
        if tiled:
            mlps = activations.tile_mlps(model, spec.mlp_block, spec.layers_prefix, tokens=16)
            assert len(mlps) == spec.layers
            model.eval()  # as policy.setup_model has it when it probes: the probe trains the layers it asks
            assert activations.probe_recompute_stop(model, mlps, contextlib.nullcontext()) is stops
            assert not model.training and all(p.grad is None for p in model.parameters())
            model.train()
            rows = counted(mlps)
        with torch.no_grad():
            plain = logps.completion_logps(model, as_batch(ids, mask, completion)).logps
        if tiled:
            assert rows[0] == spec.layers * ids.numel()  # without gradients: once
            rows[0] = 0
        runs.append((plain, *logps_and_grads(model, ids, mask, completion)))
    assert rows[0] == (2 if stops else 3) * spec.layers * ids.numel()
    (plain_a, logps_a, grads_a), (plain_b, logps_b, grads_b) = runs
    assert torch.allclose(plain_a, plain_b, atol=1e-5, rtol=0) and torch.allclose(logps_a, logps_b, atol=1e-5, rtol=0)
    lora = [name for name in grads_a if "lora_" in name]
    assert len(lora) == 2 * spec.layers * len(spec.layer_linears)
    for name in lora:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5, rtol=1e-4), name


def test_tiled_mlp_backward_draws_the_forward_dropout(tiny_path, tokenizer):
    """With lora_dropout 0.3, the checkpointed tiles' gradients are those of the very forward that ran: equal to
    the tiles run with gradients kept (no recompute at all), the same RNG stream."""
    spec = load_arch(str(tiny_path))
    ids, mask, completion = batch(len(tokenizer))
    runs = []
    for recomputed in (False, True):
        model = lora_model(tiny_path, dropout=0.3)
        mlps = activations.tile_mlps(model, spec.mlp_block, spec.layers_prefix, tokens=16)
        if recomputed:
            activations.probe_recompute_stop(model, mlps, contextlib.nullcontext())
        else:
            model.base_model.model.gradient_checkpointing_disable()
            for t in mlps:
                t.mlp.forward = t.run  # the tiles with gradients, kept for backward
        torch.manual_seed(1)
        runs.append(logps_and_grads(model, ids, mask, completion))
    (logps_a, grads_a), (logps_b, grads_b) = runs
    assert torch.equal(logps_a, logps_b)
    for name, g in grads_a.items():
        if "lora_" in name:
            assert torch.allclose(g, grads_b[name], atol=1e-6, rtol=1e-5), name


def test_no_padding_mask_and_the_kernel_said(tiny_path, tokenizer):
    """A right-padded batch runs causal SDPA with no mask (its real tokens' log-probs as with the padding mask),
    and the stage says which kernel: flash on this CPU; a shared batch passes its (B, 1, T, T) mask."""
    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    ids, mask, completion = batch(len(tokenizer))
    with sdpa.sdpa_calls() as calls, torch.no_grad():
        ours = logps.completion_logps(model, as_batch(ids, mask, completion)).logps
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # the model's own, with its padding mask
    assert calls[0]["attn_mask"] is None and calls[0]["is_causal"]
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]  # (2, T-1)
    assert torch.allclose(ours, (token * completion[:, 1:]).sum(1).double(), atol=1e-4)
    pairs = data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(2)), tokenizer,
                               64, None, progress=False).pairs
    plain = headcheck.attention_kernel(model, data.collate(pairs[:1], 0), torch.float32, 64)
    shared = headcheck.attention_kernel(model, data.collate_shared(pairs[:1], 0), torch.float32, 64)
    assert plain == "attention: SDPA's flash kernel, causal, no mask (never the (T, T) scores)"
    t = data.collate_shared(pairs[:1], 0).input_ids.shape[1]
    assert shared.startswith(f"attention: SDPA's flash kernel, with the shared rows mask (1, 1, {t}, {t}) as a bias")


def test_offloaded_activations_train_the_same_adapter(make_cfg, tmp_path):
    """Three optimizer steps with every saved tensor of the backbone copied out and back (forced here: on a GPU
    they go to pinned host memory) give the adapter of a plain run to 1e-6 in float32; each backward fetched what
    its forward packed, and nothing is left over."""
    from lowmem_dpo import precompute

    adapters = []
    for offload in (False, True):
        cfg = make_cfg(max_steps=3, gradient_checkpointing="true", output_dir=str(tmp_path / str(offload)))
        if not offload:
            precompute.run(cfg, progress=False)
        session = train.setup(cfg, progress=False)
        if offload:
            offloader = activations.offload_activations(session.trainee.model, torch.device("cpu"), force=True)
            offloader.min_bytes = 1  # every saved tensor of the tiny model
        for _ in range(3):
            optimizer_step(session)
        adapters.append([p.detach().clone() for p in session.trainee.params])
    assert offloader.packed >= 3 * 2 and offloader.saved == {}  # each step: at least the 2 layers' inputs
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(*adapters))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloader_copies_each_saved_tensor_once_and_recovers_from_a_failed_backward(checkpointing, tiny_path,
                                                                                      tokenizer):
    """Offloaded (forced), the log-probs and gradients are the plain ones; each tensor goes out once however many
    ops save it (a norm's input: pow and mul) and comes back once. A backward that raises (simulated out-of-memory:
    it cannot happen here) leaves nothing behind the next forward, which starts clean."""
    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    model.requires_grad_(True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask, completion = batch(len(tokenizer))
    want = logps_and_grads(model, ids, mask, completion)
    offloader = activations.offload_activations(model, torch.device("cpu"), force=True)
    offloader.min_bytes = 1
    got = logps_and_grads(model, ids, mask, completion)
    assert torch.equal(want[0], got[0]) and all(torch.equal(want[1][n], got[1][n]) for n in want[1])
    per_step = offloader.packed
    assert per_step > 0 and offloader.fetched == per_step and offloader.saved == {}

    def fail(*_):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    def on_layer0(module, args, out):  # layer 0's backward comes after every layer above it
        (out if isinstance(out, torch.Tensor) else out[0]).register_hook(fail)

    first = model.model.layers[0].register_forward_hook(on_layer0)
    with pytest.raises(torch.OutOfMemoryError):
        logps_and_grads(model, ids, mask, completion)
    first.remove()
    left = len(offloader.saved)
    assert left > 0  # what the failed backward did not reach
    for _ in range(2):
        packed, fetched = offloader.packed, offloader.fetched
        got = logps_and_grads(model, ids, mask, completion)
        assert offloader.saved == {} and offloader.packed - packed == per_step == offloader.fetched - fetched
    assert torch.equal(want[0], got[0]) and all(torch.equal(want[1][n], got[1][n]) for n in want[1])


def test_activation_offloading_true_on_a_cpu_moves_nothing_and_says_so(make_cfg):
    resolved = devices.resolve(make_cfg(activation_offloading="true"))
    assert not resolved.activation_offloading
    assert any("activation_offloading=true: nothing to move on cpu" in r for r in resolved.reasons)


def cuda_setup(length: int, **changes):
    cfg = load_config(LLAMA_12GB, [f"max_length={length}"])
    return dataclasses.replace(setup_from_config(cfg, int(11.25 * GiB)), **changes)


def test_offloading_keeps_a_window_of_layer_inputs_on_the_device():
    """With activation offloading the layer inputs and the final norm's input are host bytes, and the device keeps
    OFFLOAD_WINDOW layers' inputs of them; everything else is unchanged."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    on = predict(arch, cuda_setup(8192, micro_batch=1, share_prompt=False, activation_offloading=True)).train
    off = predict(arch, cuda_setup(8192, micro_batch=1, share_prompt=False)).train
    kept = {k.split(".")[1]: v for k, v in off.details.items() if k.startswith("kept.")}
    assert on.details["offload.host_bytes"] == kept["layer_inputs"] + kept["final_norm"]
    assert on.breakdown["activations"] == (kept["completion"] + kept["mask"] + kept["int8_inputs"]
                                           + OFFLOAD_WINDOW * kept["layer_inputs"] // arch.layers)
    assert on.breakdown["peak_phase"] == off.breakdown["peak_phase"]
    assert off.breakdown["activations"] - on.breakdown["activations"] > 3 * GiB  # 8k tokens x 2 x 32 layers


def test_the_masks_and_tiles_the_planner_counts():
    """Unshared rows carry no mask (SDPA causal); shared rows their (B, 1, T, T) mask; Mistral's sliding window
    makes transformers build one past 4096 tokens. The MLP's terms count one tile in a checkpointed layer."""
    llama, mistral = load_arch("meta-llama/Llama-3.1-8B"), load_arch("mistralai/Mistral-7B-v0.1")
    unshared = predict(llama, cuda_setup(8192, share_prompt=False, micro_batch=1)).train.details
    shared = predict(llama, cuda_setup(8192, share_prompt=True, share_forced=True, micro_batch=1)).train.details
    assert unshared["kept.mask"] == 0 and shared["kept.mask"] == (2 * 8192 - 1) ** 2
    window = dataclasses.replace(cuda_setup(8192, share_prompt=False, micro_batch=1))
    assert predict(mistral, window).train.details["kept.mask"] == 2 * 8192 ** 2
    assert predict(mistral, dataclasses.replace(window, max_length=4096)).train.details["kept.mask"] == 0
    tile_tokens = 2 * (activations.MLP_TILE_TOKENS // 2)
    assert unshared["layer.mlp"] == tile_tokens * 3 * llama.intermediate * 2  # 3 I-wide bf16 tensors per token
    untiled = predict(llama, cuda_setup(8192, share_prompt=False, micro_batch=1, gradient_checkpointing=False))
    assert untiled.train.details["layer.mlp"] == 2 * 8192 * 3 * llama.intermediate * 2


def test_shared_rows_are_planned_at_the_data_s_prompts():
    """share_prompt=auto without the data's prompts plans the larger of its shared worst case (a one-token prompt:
    auto decides over all the prompts, so one row may have it) and unshared rows; with --prompt-tokens, a long
    prompt and short answers make one row of prompt + 2 answers."""
    arch = load_arch("meta-llama/Llama-3.1-8B")
    auto = cuda_setup(16384, micro_batch=1)
    assert auto.share_prompt and not auto.share_forced and auto.shapes("train")[0] == 2 * 16384 - 1
    worst = predict(arch, auto).train
    both = [predict(arch, dataclasses.replace(auto, share_prompt=s, prompt_tokens=1)).train for s in (True, False)]
    assert worst.peak_bytes == max(p.peak_bytes for p in both)
    rag = with_prompts(auto, 15872)
    assert rag.share_prompt and rag.shapes("train") == (15872 + 2 * 512, 2 * 512)
    assert predict(arch, rag).train.peak_bytes < worst.peak_bytes
    short = with_prompts(auto, 2000)  # whether auto shares depends on every prompt: the shared row is planned
    assert short.share_prompt and short.shapes("train")[0] == 2 * 16384 - 2000


def test_the_longest_max_length_per_micro_batch_is_the_edge_of_the_fit():
    """The 12 GB Llama recipe at 11.25 GiB: the longest max_length train fits (with the knobs it turns itself)
    halves as the pairs per micro-batch double, and one step longer does not fit. At 1 pair it reaches the issue's
    bar of 8192 tokens per sequence (16384 in this plan)."""
    budget = int(11.25 * GiB)
    arch, setup = load_arch("meta-llama/Llama-3.1-8B"), cuda_setup(1024)
    lengths = []
    for b in (1, 2, 4):
        length, plan = longest_max_length(arch, setup, budget, b)
        assert plan.fits and plan.prediction.train.peak_bytes <= budget
        longer = dataclasses.replace(setup, micro_batch=b, max_length=length + LENGTH_STEP)
        assert not choose(arch, longer, budget, TRAIN_KNOBS, stages=("train",)).fits
        lengths.append(length)
    assert lengths[0] >= 16384 and lengths[0] > lengths[1] > lengths[2]
    assert math.isclose(lengths[0] / lengths[1], 2, rel_tol=0.15)


def test_the_search_offloads_before_quantizing_and_unshares_long_shared_rows():
    arch = load_arch("meta-llama/Llama-3.1-8B")
    budget = int(11.25 * GiB)
    plan = choose(arch, cuda_setup(8192, micro_batch=1, share_prompt=False), budget, stages=("train",))
    assert plan.fits and plan.overrides == {"activation_offloading": "true"}
    plan = choose(arch, cuda_setup(16384, micro_batch=1), budget, TRAIN_KNOBS, stages=("train",))
    assert plan.fits and plan.overrides == {"activation_offloading": "true", "share_prompt": "false"}


def test_train_s_advice_names_only_what_train_turns():
    """At 32,256 tokens a batch of 4 pairs' reference forward does not fit 11.25 GiB: the plan of both stages halves
    precompute_batch_size, and train's own advice (stages=("train",), the warning train prints) does not name it: a
    run whose precompute already went at 1 was told to set it to 1."""
    arch, budget = load_arch("meta-llama/Llama-3.1-8B"), int(11.25 * GiB)
    setup = cuda_setup(32256, micro_batch=1, precompute_batch=4)
    assert choose(arch, setup, budget).overrides["precompute_batch_size"] == "1"
    assert "precompute_batch_size" not in choose(arch, setup, budget, stages=("train",)).overrides


def test_the_plan_matches_a_measured_long_step(tmp_path):
    """tiny-llama at 4096 tokens per sequence (rows cut to max_length: a 2048-token prompt and completions to the
    end), checkpointing on so the MLP runs in tiles: the predicted peaks of precompute and of a train step are
    within 20% of the live tensors measured (measure.PeakMeter)."""
    import json

    from lowmem_dpo.config.recipe import build_config
    from lowmem_dpo.measure import at_measured_shapes, measure
    from lowmem_dpo.model.tiny import preference_rows

    texts = [r["chosen"] for r in preference_rows(800)]
    rows = [{"prompt": " ".join(texts[:400]), "chosen": " ".join(texts[400:]), "rejected": " ".join(texts[::-1])}
            for _ in range(4)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(path), device="cpu",
                            dtype="float32", gradient_checkpointing="true", share_prompt="false", max_length=4096,
                            max_prompt_length=2048, per_device_train_batch_size=1, precompute_batch_size=1,
                            eval_fraction=0, output_dir=str(tmp_path / "out"), ref_cache_dir=str(tmp_path / "c")))
    measured = measure(cfg, steps=1)
    assert measured["train"]["seq_len"] == 4096
    pred = predict(load_arch(cfg.model_name_or_path), at_measured_shapes(setup_from_config(cfg), measured))
    for stage in ("train", "precompute"):
        assert getattr(pred, stage).tensor_peak_bytes == pytest.approx(measured[stage]["measured_peak_bytes"],
                                                                        rel=0.2), stage


@pytest.mark.parametrize("config_class, kwargs, block", [
    ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4), "mlp"),
    ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4), "mlp"),
    ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4), ""),  # BloomMLP(hidden, residual): run whole
])
def test_only_mlps_of_the_hidden_states_alone_are_tiled(config_class, kwargs, block):
    """The planner counts tiles only for the MLPs activations.tile_mlps tiles: those whose forward takes the hidden
    states alone (built on the meta device: shapes only)."""
    import transformers

    from lowmem_dpo.memory.arch import arch_from_model

    config = getattr(transformers, config_class)(vocab_size=128, bos_token_id=1, eos_token_id=2, **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert arch_from_model(model, config_class).mlp_block == block


def test_a_tokenizer_shorter_than_the_model_s_positions_takes_the_model_s(make_cfg, tiny_path, tmp_path, capfd):
    """A tokenizer saved with a model_max_length below the model's positions (4096 here) is raised to them, so a long
    row tokenizes without transformers' "indexing errors" line; one above them is left as it is."""
    import json
    import shutil

    from lowmem_dpo.training import inputs

    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 16}))
    cfg = make_cfg(model_name_or_path=str(model), max_length=64, max_prompt_length=32)
    tok = inputs.prepare(cfg, devices.resolve(cfg)).tokenizer
    assert tok.model_max_length == json.loads((model / "config.json").read_text())["max_position_embeddings"] == 4096
    capfd.readouterr()
    n = len(tok("the lamp is on the chair " * 20)["input_ids"])
    assert n > 16 and "indexing errors" not in capfd.readouterr().err
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 10**6}))
    assert inputs.prepare(cfg, devices.resolve(cfg)).tokenizer.model_max_length == 10**6
