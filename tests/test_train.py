"""Training: cached equals live reference, ln 2 at step 1, accumulation, schedules, adapter round trip, demo."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_DATA, cached
from safetensors.torch import load_file

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model
from lowmem_dpo.objectives.metrics import LOSS
from lowmem_dpo.runtime import devices
from lowmem_dpo.training import guards, policy
from lowmem_dpo.training.step import accumulate, next_items, optimizer_step, pair_stream


def metrics(cfg):
    with open(f"{cfg.output_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def adapter(cfg):
    return load_file(f"{cfg.output_dir}/adapter_model.safetensors")


def test_cached_training_equals_live_reference(make_cfg, tmp_path):
    cached = make_cfg(output_dir=str(tmp_path / "cached"))
    precompute.run(cached, progress=False)
    train.run(cached, progress=False)
    live = make_cfg(output_dir=str(tmp_path / "live"), ref_source="live")
    train.run(live, progress=False)
    mc, ml = metrics(cached), metrics(live)
    assert [m["step"] for m in mc] == [1, 2, 3]
    for a, b in zip(mc, ml):
        for k in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"):
            assert a[k] == pytest.approx(b[k], abs=1e-5), k
    assert mc[-1]["loss"] != pytest.approx(mc[0]["loss"], abs=1e-4)  # it did learn something
    wa, wb = adapter(cached), adapter(live)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k


def test_first_step_is_ln2_and_metric_keys(make_cfg):
    cfg = make_cfg(max_steps=1)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    (m,) = metrics(cfg)
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert m["rewards/accuracies"] == 0.0 and abs(m["rewards/margins"]) < 1e-5
    expected = {"step", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "grad_norm", "learning_rate", "step_time_s", "tokens_per_s"}
    assert expected <= set(m)
    assert m["step_time_s"] > 0 and m["tokens_per_s"] > 0
    saved = build_config(__import__("yaml").safe_load(open(f"{cfg.output_dir}/config.yaml")))
    assert saved == cfg


def test_sft_term_adds_the_reference_chosen_nll_at_step_1(make_cfg, tmp_path, tokenizer):
    """loss_type [sigmoid, sft], weights [1, 1] (TRL 1.16's RPO spelling): step 1 logs ln 2 plus the reference's
    mean NLL per chosen token over the step's pairs, read from the cache; loss_weights scale the term, and a
    step split into micro-batches gives the same loss and gradient (the term is the step's token mean)."""
    from lowmem_dpo.training import inputs

    cfg = make_cfg(max_steps=1, loss_type="sigmoid,sft", loss_weights="1,1", per_device_train_batch_size=8)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    (m,) = metrics(cfg)
    ref = cached(cfg)[0]
    pairs = inputs.tokenized(cfg, tokenizer, progress=False).pairs
    first = next_items(pair_stream(pairs, cfg.seed), 8)  # step 1's pairs, as the run draws them
    rows = torch.tensor([p.row for p in first])
    nll = -ref.chosen[rows].sum().item() / sum(len(p.chosen_ids) for p in first)
    assert m["nll_loss"] == pytest.approx(nll, abs=1e-5)
    assert m["loss"] == pytest.approx(math.log(2) + nll, abs=1e-5)
    runs = []
    for batch, accumulation in ((8, 1), (2, 4)):  # 8 pairs a step: one micro-batch, or four
        half = make_cfg(max_steps=1, loss_type="sigmoid,sft", loss_weights="1,0.5", per_device_train_batch_size=batch,
                        gradient_accumulation_steps=accumulation, output_dir=str(tmp_path / f"half{batch}"))
        train.run(half, progress=False)
        runs.append(metrics(half)[0])
    one, split = runs
    assert one["loss"] == pytest.approx(math.log(2) + 0.5 * nll, abs=1e-5)
    assert one["nll_loss"] == pytest.approx(nll, abs=1e-5) and split["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert split["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert one["grad_norm"] != pytest.approx(m["grad_norm"], rel=1e-3)  # the weight reaches the gradient


def test_gradient_accumulation_matches_a_big_batch(make_cfg, tmp_path):
    big = make_cfg(output_dir=str(tmp_path / "big"), per_device_train_batch_size=8, max_steps=2)
    precompute.run(big, progress=False)
    train.run(big, progress=False)
    acc = make_cfg(output_dir=str(tmp_path / "acc"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                   max_steps=2)
    train.run(acc, progress=False)
    for a, b in zip(metrics(big), metrics(acc)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for k, v in adapter(big).items():
        # Adam turns fp32-noise gradients (~1e-9, where the true value is 0) into steps of up to lr; a few
        # such elements differ by up to lr=1e-2 while the losses above agree to 1e-5.
        assert (v - adapter(acc)[k]).abs().max() < 2e-2 and (v - adapter(acc)[k]).abs().mean() < 1e-3


def test_adapter_round_trips_through_peft(make_cfg, tiny_path, tokenizer):
    from peft import PeftModel

    cfg = make_cfg(max_steps=4)
    precompute.run(cfg, progress=False)
    result = train.run(cfg, progress=False)
    files = {p.name for p in __import__("pathlib").Path(cfg.output_dir).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.yaml", "metrics.jsonl"} <= files
    weights = adapter(cfg)
    assert weights and all("lora_" in k for k in weights)  # the adapter only, never a copy of the model
    loaded = PeftModel.from_pretrained(load_model(tiny_path, torch.device("cpu"), torch.float32), cfg.output_dir)
    pairs = data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(4)), tokenizer, 64, None,
                               progress=False).pairs
    b = data.collate(pairs, 0)
    with torch.no_grad():
        want = completion_logps(result.model, b).logps
        got = completion_logps(loaded, b).logps
        with loaded.disable_adapter():
            base = completion_logps(loaded, b).logps
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, base, atol=1e-3)  # the adapter changes the model


def hf_rates(name: str, total: int, warmup: int, kwargs: dict | None = None, lr: float = 1.0) -> list[float]:
    """The rate each of `total` optimizer steps applies under transformers' own get_scheduler, stepped as HF
    Trainer steps it (optimizer.step, then scheduler.step): step k uses the schedule at k - 1."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(total):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("name, keys, warmup", [
    ("linear", {"warmup_steps": 3}, 3),
    ("linear", {"warmup_ratio": 0.3}, 3),  # ceil(0.3 x 8) = 3, as transformers 4's warmup_ratio
    ("linear", {"warmup_steps": 0.3}, 3),  # transformers 5 spells the ratio as warmup_steps below 1
    ("cosine", {"warmup_steps": 2}, 2),
    ("cosine_with_restarts", {"warmup_steps": 1, "lr_scheduler_kwargs": {"num_cycles": 2}}, 1),
    ("polynomial", {"warmup_steps": 1, "lr_scheduler_kwargs": {"power": 2.0}}, 1),
    ("constant", {"warmup_steps": 3}, 3),  # transformers' constant ignores warmup
    ("constant_with_warmup", {"warmup_steps": 3}, 3),
    ("inverse_sqrt", {"warmup_steps": 2}, 2),
    ("cosine_with_min_lr", {"warmup_steps": 2, "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}, 2),
    ("cosine_warmup_with_min_lr", {"warmup_steps": 2, "lr_scheduler_kwargs": {"min_lr": 1e-3}}, 2),
    ("warmup_stable_decay", {"warmup_steps": 2, "lr_scheduler_kwargs": {"num_decay_steps": 3}}, 2),
])
def test_the_schedule_is_transformers(name, keys, warmup):
    """Every rate equals transformers' get_scheduler's for the same settings (warmup from 0 included)."""
    cfg = build_config({"lr_scheduler_type": name, "learning_rate": 0.5, **keys})
    opt, sched, _ = policy.setup_optimizer(cfg, torch.nn.Linear(2, 2), 8, devices.resolve(build_config(
        {"device": "cpu"})))
    got = []
    for _ in range(8):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert got == pytest.approx(hf_rates(name, 8, warmup, keys.get("lr_scheduler_kwargs"), lr=0.5), abs=1e-12)
    if name == "linear":
        assert got[0] == 0.0  # warmup starts from 0


def test_metrics_log_the_rate_each_step_used(make_cfg):
    """metrics.jsonl's learning_rate is the rate its step applied (HF Trainer logs the next step's)."""
    cfg = make_cfg(max_steps=6, lr_scheduler_type="cosine_with_min_lr", warmup_steps=2, learning_rate=1e-2,
                   lr_scheduler_kwargs={"min_lr_rate": 0.1}, eval_fraction=0.0)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    lines = [json.loads(x) for x in open(Path(cfg.output_dir) / "metrics.jsonl")]
    rates = {line["step"]: line["learning_rate"] for line in lines if "loss" in line}
    want = hf_rates("cosine_with_min_lr", 6, 2, {"min_lr_rate": 0.1}, lr=1e-2)
    assert rates == {step: pytest.approx(want[step - 1], abs=1e-15) for step in range(1, 7)}
    assert rates[1] == 0.0


def test_the_schedules_built_without_arguments_are_the_ones_transformers_builds_so():
    """config.schedule.NO_ARGUMENTS (the check at load builds none of them without kwargs): transformers builds each
    of them with no lr_scheduler_kwargs, and refuses every other schedule so."""
    from types import SimpleNamespace

    from lowmem_dpo.config.schedule import NO_ARGUMENTS, SCHEDULERS, make_schedule, throwaway_optimizer

    built = []
    for name in SCHEDULERS:
        try:
            make_schedule(SimpleNamespace(lr_scheduler_type=name, lr_scheduler_kwargs=None, warmup_steps=2),
                          throwaway_optimizer(), 10)
            built.append(name)
        except (TypeError, ValueError):
            pass
    assert tuple(built) == NO_ARGUMENTS


@pytest.mark.parametrize("keys, fragment", [
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "lr_scheduler_type=cosine_with_min_lr with lr_scheduler_kwargs=None"),
    ({"lr_scheduler_type": "linear", "lr_scheduler_kwargs": {"power": 2}}, "lr_scheduler_kwargs={'power': 2}"),
    ({"warmup_steps": 2, "warmup_ratio": 0.1}, "set one"),
    ({"warmup_steps": 2.5}, "a number of steps is whole"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "expected one of linear, cosine"),
])
def test_a_schedule_transformers_refuses_is_refused_at_load(keys, fragment):
    from lowmem_dpo.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(fragment)):
        build_config(keys)


def test_bfloat16_cache_and_policy_agree_at_step_1(make_cfg):
    """Precompute and train run the forward under the same autocast, so a bf16 run also starts at ln 2."""
    cfg = make_cfg(dtype="bfloat16", max_steps=1)
    precompute.run(cfg, progress=False)
    (m,) = [train.run(cfg, progress=False).metrics]
    assert m["loss"] == pytest.approx(math.log(2), abs=2e-3)
    assert abs(m["rewards/margins"]) < 1e-2


class LayoutRounding:
    """What a CPU with native bf16 (AVX512-BF16, AMX) or a GPU does and this CPU cannot: round a bf16 forward by
    its batch's shape (this CPU's bf16 goes through float32, whatever the shape: the numbers are alike). Simulated:
    the final norm's output gets a perturbation drawn from a generator seeded by the batch's shape, `scale` times
    the hidden states' size, as blocked kernels round; `fixed`: one perturbation for every shape (a cache of another
    model's forward)."""

    def __init__(self, monkeypatch, scale: float, fixed: bool = False):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        forward = LlamaRMSNorm.forward

        def rounded(norm, hidden):
            out = forward(norm, hidden)
            if hidden.dim() != 3:
                return out
            g = torch.Generator().manual_seed(0 if fixed else hash(tuple(hidden.shape)) % 2**31)
            noise = torch.randn(hidden.shape, generator=g).to(out.dtype)  # (B, T, H)
            return out + scale * noise * out.abs().mean()

        monkeypatch.setattr(LlamaRMSNorm, "forward", rounded)


def test_bf16_rounding_by_batch_layout_is_named_and_a_wrong_cache_still_warns(make_cfg, capsys, monkeypatch):
    """In a 16-bit dtype step 1 forwards its pairs one at a time beside train's batch: this device's rounding
    between two layouts. With layout rounding simulated (LayoutRounding) in train alone, the cache (precompute's
    layout, unperturbed) is off train's forward past the bound, and within 3 times the device's own rounding: a
    note naming bf16 rounding on this device and float32 as the check, no warning. A cache of another forward
    (perturbed the same for every shape in precompute, 50 times more) still warns, saying the rounding is less."""
    cfg = make_cfg(dtype="bfloat16", max_steps=1)
    precompute.run(cfg, progress=False)
    with monkeypatch.context() as m:
        LayoutRounding(m, 0.02)
        train.run(cfg, progress=False)
    err = capsys.readouterr().err
    (per_token, _), = guards.DRIFT_LINE.findall(err)
    assert float(per_token) > guards.DRIFT_TOKEN_BOUND and "warning: step 1" not in err, err
    (note,) = [x for x in err.splitlines() if x.startswith("note: step 1: bfloat16 rounding on this cpu")]
    assert "the cache is this model's" in note and "precompute and train with dtype=float32 check it" in note
    other = make_cfg(dtype="bfloat16", max_steps=1, output_dir=str(Path(cfg.output_dir).parent / "other"),
                     ref_cache_dir=str(Path(cfg.ref_cache_dir).parent / "other-cache"))
    with monkeypatch.context() as m:
        LayoutRounding(m, 1.0, fixed=True)
        precompute.run(other, progress=False)
    with monkeypatch.context() as m:
        LayoutRounding(m, 0.02)
        train.run(other, progress=False)
    err = capsys.readouterr().err
    (warning,) = [x for x in err.splitlines() if x.startswith("warning: step 1: reference cache off this policy's")]
    assert "this device's own bfloat16 rounding between two batch layouts is" in warning
    assert "precompute_batch_size at train's per_device_train_batch_size" in warning and "rerun precompute" in warning


@pytest.mark.parametrize("settings, warned", [
    ({}, False),  # the cache of this very run
    ({"dtype": "bfloat16", "quantization": "4bit"}, False),
    ({"quantization": "4bit", "ref_quantization": "none"}, True),  # a reference of another quantization
    ({"ref_dtype": "bfloat16"}, True),  # and of another dtype, against a float32 policy
])
def test_step_1_measures_the_cache_against_the_policy_and_warns_past_the_bound(make_cfg, capsys, settings, warned):
    """At step 1 the policy is the reference, so the cache should hold its forward's values: train says how far they
    are (nats per token, and the loss offset), and warns when a cache of another model's forward is served, as a
    user brings one with ref_dtype or ref_quantization. A matching float32 cache is exactly this forward's: 0 (in
    bfloat16 too on this CPU; a CPU with native bf16 may round by batch shape, within the bounds)."""
    cfg = make_cfg(max_steps=1, **settings)
    precompute.run(cfg, progress=False)
    capsys.readouterr()
    (m,) = [train.run(cfg, progress=False).metrics]
    err = capsys.readouterr().err
    (per_token, offset), = guards.DRIFT_LINE.findall(err)
    # chosen on purpose (ref_dtype, ref_quantization): a note with its cost, no warning
    assert ("note: step 1: reference cache off this policy's forward" in err) == warned, err
    assert "warning: step 1" not in err
    if warned:
        assert float(per_token) > guards.DRIFT_TOKEN_BOUND and "else set them null and rerun precompute" in err
        assert ("ref_quantization=none against the policy's 4bit" in err) == ("ref_quantization" in settings)
        assert ("ref_dtype=bfloat16 against the policy's float32" in err) == ("ref_dtype" in settings)
    else:
        assert float(per_token) <= guards.DRIFT_TOKEN_BOUND and abs(float(offset)) <= guards.DRIFT_LOSS_BOUND
    if not settings:
        assert float(per_token) == float(offset) == 0 and m["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # sigmoid's start is ln 2; the line prints 3 significant digits
    assert float(offset) == pytest.approx(m["loss"] - math.log(2), rel=5e-3, abs=1e-6)


def test_auto_checkpointing_comes_from_the_planner(make_cfg):
    """With a budget the run exceeds without checkpointing even at 1 pair per micro-batch (the cheaper knob,
    tried first), the planner turns checkpointing on; with the machine's RAM it stays off (the CPU rule). Both
    runs train."""
    roomy = make_cfg(max_steps=1, gradient_checkpointing="auto")
    precompute.run(roomy, progress=False)
    assert train.setup(roomy, progress=False).run.resolved.gradient_checkpointing is False
    from lowmem_dpo.memory.arch import load_arch
    from lowmem_dpo.memory.model import predict

    arch = load_arch("lowmem_dpo:tiny-llama")
    no_ckpt = predict(arch, make_cfg(per_device_train_batch_size=1)).train.peak_bytes
    with_ckpt = predict(arch, make_cfg(gradient_checkpointing="true", per_device_train_batch_size=1)).train.peak_bytes
    assert with_ckpt < no_ckpt
    tight = make_cfg(max_steps=1, gradient_checkpointing="auto", memory_budget=str((no_ckpt + with_ckpt) // 2))
    session = train.setup(tight, progress=False)
    assert session.run.resolved.gradient_checkpointing is True
    assert any("planner" in r for r in session.run.resolved.reasons)
    step = optimizer_step(session)
    assert step.stats.means()["loss"] == pytest.approx(math.log(2), abs=1e-5) and step.grad_norm > 0


def test_16bit_runs_skip_peft_s_float32_input_copy_with_the_same_numbers(make_cfg):
    """Under the bf16 autocast, peft's cast of each adapted layer's input to float32 is turned off (the autocast
    casts it straight back): the log-probs and LoRA gradients are the same bit for bit without lora_dropout."""
    cfg = make_cfg(dtype="bfloat16", lora_dropout=0.0)
    precompute.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)
    lora_layers = [m for m in session.trainee.model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert lora_layers and not any(m.cast_input_dtype_enabled for m in lora_layers)
    with torch.no_grad():  # a non-zero adapter, as after some steps
        for p in session.trainee.params:
            p.normal_(0, 0.05)
    session.trainee.copies.refresh()  # the forward reads the adapter's bf16 copies
    pairs = next_items(session.progress.stream, 4)

    def grads():
        session.trainee.zero_grad()
        stats = accumulate(session, pairs, len(pairs))
        return stats.totals[LOSS.name], [p.grad.clone() for p in session.trainee.params]

    loss_off, grads_off = grads()
    for m in lora_layers:
        m.cast_input_dtype_enabled = True
    loss_on, grads_on = grads()
    assert loss_off == loss_on
    assert all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
