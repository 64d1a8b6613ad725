"""The paths a first run on a small GPU meets, exercised on this CPU with real components: float16 training with
dynamic loss scaling (torch.amp.GradScaler runs on a CPU too), the planner's micro-batch applied by train,
out-of-memory anywhere as exit 2, precompute halving its batch. CUDA's out-of-memory error cannot happen here: the
tests that need one raise torch.OutOfMemoryError (or cuBLAS' allocation error) from a forward hook, and say so."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import TINY_DATA, TINY_RECIPE, cached, sequences_of
from safetensors.torch import load_file

from lowmem_dpo import precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import build_config, load_config
from lowmem_dpo.memory.arch import load_arch
from lowmem_dpo.memory.model import predict
from lowmem_dpo.memory.setup import setup_from_config
from lowmem_dpo.model import compute_copies
from lowmem_dpo.runtime import devices, oom
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import checkpoint, loop
from lowmem_dpo.training.step import optimizer_step

RUN = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), device="cpu", max_length=64,
           per_device_train_batch_size=4, max_steps=6, save_steps=3, logging_steps=1, learning_rate=3e-3, seed=7,
           precompute_batch_size=32, eval_generations=0, share_prompt="false", padding_free="false")
# padding_free=false: the simulated out-of-memory errors (_too_big) count a forward's sequences by its rows, which a
# packed forward (one row) does not show; the back-off itself is the same for either layout


TIMING = {"step_time_s": 0, "tokens_per_s": 0}


def config(tmp_path, **overrides):
    return build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "out"),
                         **overrides})


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fp16_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp16")
    precompute.run(config(folder, dtype="float16"), progress=False)
    return folder


# -- float16: the loss scaler ------------------------------------------------------------------------------------
def test_float16_trains_from_ln2_with_a_loss_scale_and_resumes_exactly(fp16_cache, tmp_path):
    """dtype=float16 (what a T4 gets): step 1 at ln 2, every line has the loss scale, the scaler's state is in
    each checkpoint, and a run resumed from step 3 ends with the uninterrupted run's adapter bit for bit."""
    whole = config(tmp_path, dtype="float16", ref_cache_dir=str(fp16_cache / "cache"),
                   output_dir=str(tmp_path / "whole"))
    train.run(whole, progress=False)
    lines = metrics(tmp_path / "whole")
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert all(line["loss_scale"] == 65536.0 and line["scaler_skips"] == 0 for line in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]  # it learns
    saved = tmp_path / "whole" / "checkpoints" / "checkpoint-3"
    scaler_state = torch.load(saved / checkpoint.SCALER, weights_only=True)
    assert scaler_state["scale"] == 65536.0 and scaler_state["_growth_tracker"] == 3  # 3 clean steps so far
    # the run as if killed after step 3: its checkpoint alone in a fresh output_dir, the same command again
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / "checkpoint-3")
    train.run(config(tmp_path, dtype="float16", ref_cache_dir=str(fp16_cache / "cache"),
                     output_dir=str(tmp_path / "resumed")), progress=False)
    want = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert metrics(tmp_path / "resumed")[-1] | TIMING == metrics(tmp_path / "whole")[-1] | TIMING


def test_an_overflowing_scale_is_a_scaler_skip_not_divergence(fp16_cache, tmp_path, capsys):
    """A loss scale of 2^40 overflows the float16 gradients: the scaler skips those updates and halves the scale
    until it fits, more times in a row than max_nonfinite_steps allows, without a divergence stop; the weights
    move from the first clean step on."""
    session = train.setup(config(tmp_path, dtype="float16", ref_cache_dir=str(fp16_cache / "cache"), max_steps=40,
                                 max_nonfinite_steps=2), progress=False)
    assert isinstance(session.trainee.scaler, torch.amp.GradScaler)
    session.trainee.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    before = [p.detach().clone() for p in session.trainee.params]
    while session.progress.step < 40 and all(torch.equal(b, p) for b, p in zip(before, session.trainee.params)):
        optimizer_step(session)
    progress = session.progress
    assert progress.scaler_skips > 2 and progress.skipped_steps == 0 and progress.step == progress.scaler_skips + 1
    assert session.trainee.scaler.get_scale() <= 2.0 ** (40 - progress.scaler_skips)
    err = capsys.readouterr().err
    assert "the float16 gradients overflowed at loss scale 1.09951e+12; update skipped and the scale halved " \
           "(scaler skip 1; not divergence)" in err
    assert "diverged" not in err


def test_gradients_that_overflow_unscaled_are_divergence(fp16_cache, tmp_path):
    """At a loss scale of 1 an infinite gradient is not the scaler's: the non-finite guard counts it and stops."""
    session = train.setup(config(tmp_path, dtype="float16", ref_cache_dir=str(fp16_cache / "cache"), max_steps=10,
                                 max_nonfinite_steps=2), progress=False)
    session.trainee.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    # on the tensor the float16 forward reads: the weight's compute copy (model/compute_copies.py)
    compute_copies.read_by_forward(session.trainee.params[0]).register_hook(lambda g: g * float("inf"))
    optimizer_step(session)
    assert session.progress.skipped_steps == 1 and session.progress.scaler_skips == 0
    optimizer_step(session)
    with pytest.raises(UserError, match="diverged: 2 steps in a row"):
        loop.stop_if_diverged(session)  # what the loop checks after each update


# -- the planner's micro-batch, applied ---------------------------------------------------------------------------
def test_train_takes_the_planners_micro_batch_with_the_same_numbers(tmp_path, capsys):
    """A memory_budget between the planner's train peaks at 2 and at 4 pairs per micro-batch: train runs 2 x 2
    instead of 4 x 1 and logs why; float32 metrics equal those of a run configured 2 x 2."""
    cfg = config(tmp_path, dtype="float32", max_steps=2, save_steps=0)
    arch = load_arch("lowmem_dpo:tiny-llama")
    at = {b: predict(arch, setup_from_config(build_config({**RUN, "per_device_train_batch_size": b}))).train.peak_bytes
          for b in (2, 4)}
    assert at[2] < at[4]
    precompute.run(cfg, progress=False)
    budget = (at[2] + at[4]) // 2
    planned = config(tmp_path, dtype="float32", max_steps=2, save_steps=0, memory_budget=str(budget),
                     output_dir=str(tmp_path / "planned"))
    session = train.setup(planned, progress=False)
    assert (session.progress.micro_batch, session.progress.grad_accum) == (2, 2)
    assert any(r.startswith("per_device_train_batch_size=2 gradient_accumulation_steps=2 (the planner: 4 pairs per "
                            "micro-batch do not fit") for r in session.run.resolved.reasons)
    loop.run(session, progress=False)
    train.run(config(tmp_path, dtype="float32", max_steps=2, save_steps=0, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, output_dir=str(tmp_path / "asked")), progress=False)
    for got, want in zip(metrics(tmp_path / "planned"), metrics(tmp_path / "asked")):
        for key in ("loss", "rewards/margins", "grad_norm", "logps/chosen"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


# -- out of memory ---------------------------------------------------------------------------------------------
def _on_embeddings(check):
    """A global forward pre-hook on every embedding lookup (the first op of a model's forward: its input ids as
    args[0]), calling check(module, ids); the handle removes it."""
    def hook(module, args):
        if isinstance(module, torch.nn.Embedding):
            check(module, args[0])

    return torch.nn.modules.module.register_module_forward_pre_hook(hook)


def _too_big(limit: int, after_calls: int = 0):
    """CUDA's out-of-memory error (simulated: it cannot happen on this CPU) when a forward gets more than `limit`
    sequences, or on any forward after `after_calls` of them (0: never)."""
    calls = [0]

    def check(module, ids):
        calls[0] += 1
        if ids.shape[0] > limit or (after_calls and calls[0] > after_calls):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    return _on_embeddings(check)


def test_precompute_halves_its_batch_on_out_of_memory(tmp_path, capsys):
    """More than 4 sequences run out of memory: precompute retries the shard at 4 then 2 pairs per forward and
    writes the cache an unlimited build writes."""
    plain = config(tmp_path, dtype="float32", ref_cache_dir=str(tmp_path / "plain"), precompute_batch_size=8)
    precompute.run(plain, progress=False)
    handle = _too_big(4)
    try:
        precompute.run(config(tmp_path, dtype="float32", ref_cache_dir=str(tmp_path / "limited"),
                              precompute_batch_size=8), progress=False)
    finally:
        handle.remove()
    err = capsys.readouterr().err
    # what torch failed to allocate, before each retry: the one-line error after it does not say
    assert err.count("out of memory: CUDA out of memory. Tried to allocate 2.00 GiB (simulated)\n") == 2
    assert "out of memory in precompute: retrying with precompute_batch_size=4" in err
    assert "retrying with precompute_batch_size=2" in err
    want, got = cached(plain)[0], cached(config(tmp_path, dtype="float32", ref_cache_dir=str(tmp_path / "limited")))[0]
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in ((want.chosen, got.chosen),
                                                                    (want.rejected, got.rejected)))


def test_precompute_out_of_memory_at_one_pair_exits_2_and_resumes(tmp_path, capsys):
    """Out of memory even at 1 pair after a few batches: exit 2 naming what to lower, the committed sequences kept;
    the rerun (memory back) computes only the rest."""
    args = [str(TINY_RECIPE), f"dataset={TINY_DATA}", f"ref_cache_dir={tmp_path / 'c'}",
            "cache_shard_rows=64", "precompute_batch_size=64", "dtype=float32", "share_prompt=false",
            "padding_free=false"]  # the calls counted below: bring_up's probe, then the batches
    handle = _too_big(10_000, after_calls=4)  # the attention-kernel probe's forward (it stops early), 3 batches
    try:
        assert run_cli(precompute.main, args, "precompute", precompute.__doc__) == 2
    finally:
        handle.remove()
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lowmem_dpo.precompute: error: out of memory in precompute with 1 pair per forward: "
                              "lower max_length, or set ref_quantization=4bit")
    assert "the sequences computed so far are kept" in err[-1] and "Traceback" not in "".join(err)
    assert run_cli(precompute.main, args, "precompute", precompute.__doc__) == 0
    total = len(sequences_of(load_config(args[0], args[1:])))
    # 3 chunks of 64 sequences were committed
    assert f"computed {total - 192} sequences, reused 192" in capsys.readouterr().err


def test_out_of_memory_loading_the_model_exits_2(tmp_path, monkeypatch, capsys):
    """The weights alone do not fit (simulated: the load raises CUDA's out-of-memory error after loading)."""
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained

    def load_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 112.00 MiB (simulated)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_then_fail)
    args = [str(TINY_RECIPE), f"dataset={TINY_DATA}", f"ref_cache_dir={tmp_path / 'c'}"]
    assert run_cli(precompute.main, args, "precompute", precompute.__doc__) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("lowmem_dpo.precompute: error: out of memory loading the model's weights onto the device: they "
                       "alone do not fit. Set quantization=4bit (lowmem-dpo plan RECIPE.yaml shows what fits "
                       "the budget), or free the GPU (nvidia-smi shows what else holds it)")


def test_cublas_allocation_failure_in_train_is_out_of_memory(tmp_path, capsys):
    """cuBLAS' workspace allocation failing on a full card (simulated) is out of memory: the step halves down to 1
    pair, then exit 2 with what to lower."""
    args = [str(TINY_RECIPE), f"dataset={TINY_DATA}", f"ref_cache_dir={tmp_path / 'c'}",
            f"output_dir={tmp_path / 'o'}", "dtype=float32", "share_prompt=false"]
    assert run_cli(precompute.main, args[:3] + args[4:], "precompute", precompute.__doc__) == 0

    def fail(module, ids):
        if module.training:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    handle = _on_embeddings(fail)
    try:
        assert run_cli(train.main, args, "train", train.__doc__) == 2
    finally:
        handle.remove()
    err = capsys.readouterr().err
    assert "out of memory at step 1: retrying with per_device_train_batch_size=2" in err
    assert err.strip().splitlines()[-1].startswith("lowmem_dpo.train: error: out of memory at step 1 with 1 pair per "
                                                   "micro-batch; lower max_length")


def test_out_of_memory_anywhere_else_is_exit_2_in_one_line(capsys):
    def main(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (simulated)")

    assert run_cli(main, ["recipe.yaml"], "train", "doc") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lowmem_dpo.train: error: out of memory: ")
    assert "lowmem-dpo plan RECIPE.yaml shows what fits (torch: CUDA out of memory. Tried to allocate " \
           "20.00 MiB (simulated))" in err[0]


def test_memory_snapshot_is_cuda_only(tmp_path):
    assert oom.record_snapshots(torch.device("cpu"), tmp_path) == \
        "memory_snapshot_on_oom: CUDA only; nothing is recorded on cpu"
    assert oom.dump_snapshot() is None  # nothing recorded: nothing written
    assert not (tmp_path / oom.SNAPSHOT).exists()


def test_the_allocator_setting_is_the_users_when_they_set_it(monkeypatch):
    for name in devices.ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices, "_ours", {})
    ours = "CUDA allocator: expandable_segments:True (set by lowmem_dpo; set PYTORCH_CUDA_ALLOC_CONF to choose another)"
    assert devices.configure_allocator() == ours
    assert devices.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert devices.configure_allocator() == ours  # the next stage in the same process: still ours, not the user's
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert devices.configure_allocator() == "CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128 (from the " \
                                            "environment)"
    assert devices.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_the_allocator_is_set_through_the_environment_only(monkeypatch):
    """CUDA started before the tool (a notebook): the environment is read once, at CUDA's start, so nothing is set
    and the log says how to have it. CUDA's start is simulated (no GPU here): torch.cuda's two answers."""
    for name in devices.ALLOC_CONF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices, "_ours", {})
    monkeypatch.setattr(devices.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(devices.torch.cuda, "is_initialized", lambda: True)
    assert devices.configure_allocator() == (
        "CUDA allocator: torch's defaults (CUDA had started before lowmem_dpo could set expandable_segments:True: set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python to have it)")
    assert not any(name in devices.os.environ for name in devices.ALLOC_CONF)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_budget_is_enforced_on_cuda(tmp_path):
    """On a GPU: memory_budget caps torch's allocator (an allocation beyond it fails), picks the rule of its tier,
    and each metrics line carries the window's peaks."""
    cfg = config(tmp_path, device="cuda", memory_budget="1GiB", max_steps=2, save_steps=0)
    r = devices.resolve(cfg)
    assert r.budget <= 1 << 30 and r.kind.startswith("cuda-12gb")
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    for line in metrics(tmp_path / "out"):
        if "loss" in line:
            assert 0 < line["peak_allocated_bytes"] <= line["peak_reserved_bytes"] <= 1 << 30
            assert line["device_used_bytes"] >= line["peak_reserved_bytes"]
    torch.cuda.set_per_process_memory_fraction(1.0)
