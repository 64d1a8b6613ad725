"""Never lose work: checkpoints are complete or absent, a killed run resumes to the same adapter bit for bit,
a full disk stops with exit 2 and keeps the last checkpoint, non-finite steps are skipped and stop the run,
out-of-memory halves the micro-batch, and the DPO warning signs are logged (and can stop the run)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, TINY_DATA, forward_sequences, write_jsonl
from safetensors.torch import load_file

from lowmem_dpo import precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import build_config, config_changes
from lowmem_dpo.data import cache
from lowmem_dpo.objectives.metrics import BLOCK_METRICS, LOSS, MARGIN, NLL_LOSS
from lowmem_dpo.runtime import devices, files
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import checkpoint, guards, inputs, loop, output, resuming
from lowmem_dpo.training.session import checkpoint_state
from lowmem_dpo.training.step import Sums, backward_with_backoff, next_items, optimizer_step

# lora_dropout > 0: the resumed run must restore the RNG too, not only the weights and the optimizer.
RUN = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), device="cpu", dtype="float32",
           max_length=64, per_device_train_batch_size=4, max_steps=40, save_steps=5, save_total_limit=2,
           logging_steps=3, learning_rate=3e-3, lora_dropout=0.1, seed=7, precompute_batch_size=32)
TIMING = ("step_time_s", "tokens_per_s")


def recipe(tmp_path: Path, **overrides) -> Path:
    values = {**RUN, "ref_cache_dir": str(tmp_path / "cache"), **overrides}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def command(path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "lowmem_dpo.train", str(path), *args]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timing(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k not in TIMING} for line in lines]


def adapter(folder: Path) -> dict:
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture
def built(tmp_path):
    """The recipe and its reference cache, built once for the test."""
    path = recipe(tmp_path)
    precompute.run(build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache")}), progress=False)
    return path


def test_a_killed_run_resumes_to_the_same_adapter(built, tmp_path):
    """kill -9 after a few checkpoints, rerun the same command: the final adapter equals an uninterrupted
    run's bit for bit and metrics.jsonl has each logged step once, with the same numbers. (The uninterrupted run
    runs in this process, with the same torch threads as the command's: its environment is this one's.)"""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    train.run(build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache"), "output_dir": str(whole),
                            "max_steps": 20}), progress=False)

    proc = subprocess.Popen(command(built, f"output_dir={killed}", "max_steps=20"), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = killed / "checkpoints" / "checkpoint-10" / checkpoint.STATE
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "adapter_model.safetensors").exists()
    done = checkpoint.complete(killed)
    assert done and done[-1][0] >= 10 and len(done) <= 2  # save_total_limit
    for step, folder in done:
        assert checkpoint.read_state(folder).step == step and (folder / "adapter_model.safetensors").is_file()

    resumed = subprocess.run(command(built, f"output_dir={killed}", "max_steps=20"), cwd=REPO, env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {done[-1][1]} (step {done[-1][0]} of 20)" in resumed.stderr
    want, got = adapter(whole), adapter(killed)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    steps = [m["step"] for m in metrics(killed)]
    assert steps == [1, *range(3, 20, 3), 20]  # no step twice, none missing
    assert without_timing(metrics(killed)) == without_timing(metrics(whole))
    assert [s for s, _ in checkpoint.complete(killed)] == [15, 20]


def test_rerun_with_other_settings_is_refused_until_resume_never(built, tmp_path):
    out = tmp_path / "out"
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=10"], "train", "") == 0
    first = adapter(out)
    code = run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=10", "learning_rate=1e-3"], "train", "")
    assert code == 2 and torch.equal(adapter(out)["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                                     first["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    # logging_steps does not change the numbers: it resumes (at the final checkpoint: nothing left to train)
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=10", "logging_steps=5"], "train", "") == 0
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=10", "learning_rate=1e-3",
                                "resume=never"], "train", "") == 0
    assert [s for s, _ in checkpoint.complete(out)] == [5, 10]
    assert not torch.equal(adapter(out)["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
                           first["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])


def test_error_message_for_changed_settings(built, tmp_path, capsys):
    out = tmp_path / "out"
    run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=5"], "train", "")
    capsys.readouterr()
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=5", "beta=0.2"], "train", "") == 2
    err = capsys.readouterr().err
    assert "checkpoint-5 was written by a run with other settings (beta: 0.1 -> 0.2)" in err
    assert f"start a new run in a new folder, output_dir={out}-2 ({out} stays as it is)" in err
    assert "resume=never" not in err and "Traceback" not in err


def test_an_interrupted_checkpoint_write_leaves_no_checkpoint(built, tmp_path, monkeypatch):
    """A crash while the optimizer state is being written (simulated: the process cannot be killed inside a
    test at that exact point): no checkpoint-10, the older one intact, and the next save clears the litter."""
    session = train.setup(build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "o")}),
                          progress=False)
    for _ in range(5):
        optimizer_step(session)
    checkpoint.save(session.run.cfg.output_dir, checkpoint_state(session), session.trainee, [], 2)
    for _ in range(5):
        optimizer_step(session)
    real_save = torch.save

    def crash(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        if str(path).endswith("optimizer.pt"):
            raise KeyboardInterrupt  # what a kill at this point leaves: the adapter and the optimizer written

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(session.run.cfg.output_dir, checkpoint_state(session), session.trainee, [], 2)
    root = checkpoint.root(session.run.cfg.output_dir)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-5"]  # the temp folder is gone too
    assert checkpoint.read_state(root / "checkpoint-5").step == 5
    monkeypatch.setattr(torch, "save", real_save)
    (root / ".checkpoint-10-leftover").mkdir()  # what a real kill -9 would leave
    checkpoint.save(session.run.cfg.output_dir, checkpoint_state(session), session.trainee, [], 2)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-10", "checkpoint-5"]


def test_full_disk_while_checkpointing_exits_2_and_keeps_the_last_checkpoint(built, tmp_path, monkeypatch, capsys):
    """A disk that fills up during the write (simulated: fsync raising ENOSPC, as a full filesystem does)."""
    out = tmp_path / "out"
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync(fd):
        calls["n"] += 1
        if (out / checkpoint.STATE).exists():  # the first checkpoint and its record got through; full from then on
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code = run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=12"], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and calls["n"] > 0
    assert "disk full while writing checkpoint-10 in" in err and "resumes from checkpoint-5 (step 5), which is intact" in err
    assert "Traceback" not in err
    assert [s for s, _ in checkpoint.complete(out)] == [5]
    assert [p.name for p in checkpoint.root(out).iterdir()] == ["checkpoint-5"]


def test_full_disk_at_the_final_adapter_points_to_the_final_checkpoint(built, tmp_path, monkeypatch, capsys):
    """The disk fills up after the last checkpoint, as the adapter is written (simulated: ENOSPC from the
    save): exit 2, and the message says the rerun resumes from that checkpoint."""
    def full(model, out_dir, tokenizer=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "save_adapter", full)
    out = tmp_path / "out"
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=5"], "train", "") == 2
    err = capsys.readouterr().err
    assert "disk full while writing the adapter in" in err and "Traceback" not in err
    assert "The run resumes from checkpoint-5 (step 5), which is intact." in err
    assert [s for s, _ in checkpoint.complete(out)] == [5]


def test_not_enough_free_space_is_refused_before_writing(built, tmp_path, monkeypatch, capsys):
    """The check before the write, against what shutil.disk_usage reports (simulated: 1 KiB free)."""
    monkeypatch.setattr(files, "free_bytes", lambda folder: 1024)
    out = tmp_path / "out"
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=5"], "train", "") == 2
    err = capsys.readouterr().err
    assert "not enough disk space for checkpoint-5 in" in err and "1.0 KiB free" in err
    assert "No checkpoint was written yet." in err
    assert checkpoint.complete(out) == []


def _mount_namespace(folder: Path) -> list[str] | None:
    """A command prefix that runs its command in a private mount namespace where a tmpfs can be mounted on
    `folder` (unshare -m as root, unshare -rm in a user namespace otherwise): the mount disappears with the
    command. None when neither works here."""
    if shutil.which("unshare") is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {folder}"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_a_real_small_filesystem_fills_up(built, tmp_path):
    """A 2 MiB tmpfs as output_dir (a real full disk, where this machine lets the test mount one): the run
    stops with exit 2 and a message, and the newest checkpoint on it is complete."""
    disk = tmp_path / "disk"
    prefix = _mount_namespace(disk)
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces)")
    out = disk / "out"
    script = (f"mount -t tmpfs -o size=2m tmpfs {disk} && "
              f"{' '.join(command(built, f'output_dir={out}', 'save_steps=1', 'save_total_limit=0'))}; "
              f"echo rc=$?; for c in {out}/checkpoints/*; do echo found $c; "
              f"{sys.executable} -c \"import json,sys; print('step', json.load(open(sys.argv[1]))['step'])\" "
              f"$c/{checkpoint.STATE}; done")
    proc = subprocess.run([*prefix, "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "rc=2" in proc.stdout, proc.stdout + proc.stderr
    assert "not enough disk space for checkpoint-" in proc.stderr or "disk full while writing" in proc.stderr
    assert "Traceback" not in proc.stderr
    found = [line for line in proc.stdout.splitlines() if line.startswith("found ")]
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert found and len(steps) == len(found)  # every checkpoint on the full disk is complete
    assert steps == list(range(1, len(steps) + 1))


def test_nonfinite_steps_are_skipped_then_stop_the_run(built, tmp_path):
    """A reference cache whose values are NaN (as a corrupt cache would be): every loss is NaN, the updates
    are skipped, the weights stay, and max_nonfinite_steps in a row stop the run as diverged, counted across a
    checkpoint and a resume."""
    cfg = build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "o"),
                        "max_nonfinite_steps": 3})
    session = train.setup(cfg, progress=False)
    before = [p.detach().clone() for p in session.trainee.params]
    session.run.objective.ref.chosen[:] = float("nan")
    for _ in range(2):
        optimizer_step(session)
    assert session.progress.skipped_steps == 2 and session.progress.step == 2
    assert all(torch.equal(b, p) for b, p in zip(before, session.trainee.params))
    checkpoint.save(cfg.output_dir, checkpoint_state(session), session.trainee, [], 2)
    session = train.setup(cfg, progress=False)  # resumes at step 2, 2 non-finite steps in a row
    assert (session.progress.step, session.progress.nonfinite_in_a_row) == (2, 2)
    session.run.objective.ref.chosen[:] = float("nan")
    optimizer_step(session)
    with pytest.raises(UserError, match="diverged: 3 steps in a row with a non-finite loss or gradient"):
        loop.stop_if_diverged(session)  # what the loop checks after each update
    assert all(torch.equal(b, p) for b, p in zip(before, session.trainee.params))


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_gradient(built, tmp_path, capsys):
    """CUDA out-of-memory cannot happen on this CPU: a forward pre-hook on the backbone raises
    torch.OutOfMemoryError for batches above 2 pairs (4 sequences). The step's pairs are retried as 2 x 2 and
    give the gradient 4 x 1 gives; at 1 pair per micro-batch the run stops with a message."""
    cfg = build_config({**RUN, "ref_cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "o"),
                        "lora_dropout": 0.0, "share_prompt": "false"})  # the limits count 2 sequences per pair
    results = []
    for limit in (None, 4, 1):
        session = train.setup(cfg, progress=False)
        if limit is not None:
            def too_big(module, args, kwargs, limit=limit):
                if forward_sequences(kwargs) > limit:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            session.trainee.model.get_base_model().model.register_forward_pre_hook(too_big, with_kwargs=True)
        pairs = next_items(session.progress.stream, session.run.items_per_step)
        if limit == 1:
            with pytest.raises(UserError, match="out of memory at step 1 with 1 pair per micro-batch"):
                backward_with_backoff(session, pairs)
            continue
        stats, micro_batch, grad_accum = backward_with_backoff(session, pairs)
        results.append(((micro_batch, grad_accum), stats, [p.grad.clone() for p in session.trainee.params]))
    (plain, plain_stats, plain_grads), (halved, halved_stats, halved_grads) = results
    assert plain == (4, 1) and halved == (2, 2)  # the split that fit
    assert "out of memory at step 1: retrying with per_device_train_batch_size=2 gradient_accumulation_steps=2" \
        in capsys.readouterr().err
    assert halved_stats.items == plain_stats.items == 4
    assert halved_stats.means() == pytest.approx(plain_stats.means(), rel=1e-6)
    assert any(g.abs().sum() > 0 for g in plain_grads)
    for a, b in zip(plain_grads, halved_grads):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)


def test_warning_signs_hand_computed():
    t = guards.Thresholds()
    calm = {"rewards/margins": 0.5, "loss": 0.6, "rewards/chosen": -0.01}
    assert guards.warning_signs(calm, guards.At(1, 100), 0.1, 20.0) == [] == guards.context_signs(calm, 1, 100, 0.1)
    # context: margin 12 > 10; the loss 0.01 at step 20 of 100 (<= 20%): early; at step 21: not. No warning alone
    assert guards.context_signs({**calm, "rewards/margins": 12.0}, 50, 100, 0.1)[0].startswith(
        "reward margin exploding: rewards/margins 12.00 > 10")
    assert len(guards.context_signs({**calm, "loss": 0.01}, 20, 100, 0.1)) == 1
    assert guards.context_signs({**calm, "loss": 0.01}, 21, 100, 0.1) == []
    assert guards.warning_signs({**calm, "rewards/margins": 12.0, "loss": 0.01}, guards.At(20, 100), 0.1, 20.0) == []
    # rewards/chosen -1.2 at beta 0.1: the policy's chosen log-prob is 12 nats below the reference's; over 20
    # tokens that is -0.6 nats/token < -0.5; over 30 tokens -0.4: fine
    assert "-0.600 nats/token" in guards.warning_signs({**calm, "rewards/chosen": -1.2}, guards.At(50, 100), 0.1, 20.0)[0]
    assert guards.warning_signs({**calm, "rewards/chosen": -1.2}, guards.At(50, 100), 0.1, 30.0) == []
    assert t.margin == 10.0 and guards.nonfinite(1.0, float("nan")) and not guards.nonfinite(1.0, 2.0)


def test_a_wrong_reference_is_flagged_and_stops_with_early_stop(built, tmp_path, capsys):
    """A cache whose chosen log-probs are 200 nats too low (what a reference that is not the policy's start
    gives): step 1's drift line says the cache is not this policy's forward, a warning, with the margin 0.1 * 200 =
    20 and the loss of ~0 beside it as context. With early_stop_on_divergence=true the run stops there, exit 2."""
    _edit_store(tmp_path / "cache", "UPDATE sequences SET logps = logps - 200 WHERE key IN ({})", chosen_keys())
    out = tmp_path / "out"
    assert run_cli(train.main, [str(built), f"output_dir={out}", "max_steps=5"], "train", "") == 0
    err = capsys.readouterr().err
    (warning,) = [line for line in err.splitlines() if line.startswith("warning: step 1:")]
    assert warning.startswith("warning: step 1: reference cache off this policy's forward: ")
    assert "rerun precompute where train runs" in warning
    assert "beside it: reward margin exploding: rewards/margins 2" in warning
    assert "loss collapsing early: 0.0000 < 0.05 at step 1 of 5" in warning
    assert [x["warnings"][0][:40] for x in metrics(out) if "warnings" in x] == [warning[17:57]]  # the report's
    code = run_cli(train.main, [str(built), f"output_dir={tmp_path / 'stop'}", "max_steps=5",
                                "early_stop_on_divergence=true"], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and "stopped at step 1 (early_stop_on_divergence=true): reference cache off this" in err


def test_a_run_of_nonfinite_losses_logs_nulls_and_stops_as_diverged(built, tmp_path, capsys):
    """Reference values at float64's limits (finite, so the cache passes its checks) make every loss
    infinite: the log lines of the skipped steps carry null metrics (not 0, which would read as a perfect
    loss), and the third in a row stops the run with exit 2 and no traceback; no adapter is saved."""
    _edit_store(tmp_path / "cache", "UPDATE sequences SET logps = -1.7e308")
    _edit_store(tmp_path / "cache", "UPDATE sequences SET logps = 1.7e308 WHERE key IN ({})", chosen_keys())
    out = tmp_path / "out"
    code = run_cli(train.main, [str(built), f"output_dir={out}", "logging_steps=1", "max_steps=10"], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "warning: step 1: non-finite loss (inf)" in err
    assert "diverged: 3 steps in a row with a non-finite loss or gradient (up to step 3)" in err
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2] and all(m["loss"] is None for m in lines)
    assert not (out / "adapter_model.safetensors").exists() and checkpoint.complete(out) == []


# -- resume checks what the run trains on ------------------------------------------------------------------------
def _train(path: Path, out: Path, *args: str) -> int:
    return run_cli(train.main, [str(path), f"output_dir={out}", *args], "train", "")


def _precompute(path: Path) -> int:
    return run_cli(precompute.main, [str(path)], "precompute", "")


def _first_rows(n: int) -> list[dict]:
    return [json.loads(line) for line in TINY_DATA.read_text().splitlines()[:n]]


def test_resume_refused_on_swapped_data_until_resume_never(tmp_path, capsys):
    """The issue's case: chosen and rejected swapped in the data and the cache rebuilt for it. The rerun refuses
    the checkpoint (exit 2) naming the data and what follows from it, nothing is touched; resume=never starts
    over on the swapped data, and its checkpoints record the new inputs."""
    rows = _first_rows(32)
    prefs = write_jsonl(tmp_path / "prefs.jsonl", rows)
    path = recipe(tmp_path, dataset=str(prefs), max_steps=5)
    out = tmp_path / "out"
    assert _precompute(path) == 0 and _train(path, out) == 0
    before, recorded = metrics(out), checkpoint.read_state(out / "checkpoints" / "checkpoint-5").inputs
    assert list(recorded) == ["data", "model weights", "adapter weights", "tokenizer", "tokenization",
                              "reference cache"]
    write_jsonl(prefs, [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows])
    assert _precompute(path) == 0
    capsys.readouterr()
    assert _train(path, out) == 2
    err = capsys.readouterr().err
    # the reference cache's model side is the same: its values are the swapped rows' own, under their new keys
    assert f"{out / 'checkpoints' / 'checkpoint-5'} was trained on other inputs: data, tokenization changed since" \
        in err
    assert f"Restore them to resume, or start a new run in a new folder, output_dir={out}-2" in err
    assert "resume=never" not in err and "Traceback" not in err
    assert metrics(out) == before
    assert _train(path, out, "resume=never") == 0
    assert "starting over (resume=never)" in capsys.readouterr().err
    after = checkpoint.read_state(out / "checkpoints" / "checkpoint-5").inputs
    assert [k for k in recorded if recorded[k] != after[k]] == ["data", "tokenization"]
    # the new run's step 1 scored the swapped pairs: its chosen log-prob is the old run's rejected one
    assert metrics(out)[0]["logps/chosen"] == pytest.approx(before[0]["logps/rejected"], rel=1e-5)


def test_raising_max_steps_continues_a_finished_run_on_the_new_schedule(built, tmp_path, capsys):
    """A finished run (final adapter saved) rerun with max_steps 20 -> 40 continues from checkpoint-20: the
    metrics lines continue after step 20, and from there the learning rate is the linear schedule over 40 steps
    (3e-3 * (1 - k / 40) for the step after k), not the finished one's (0 after 20). A total below the
    checkpoint's step is refused."""
    out = tmp_path / "out"
    assert _train(built, out, "max_steps=20") == 0
    finished, adapter20 = metrics(out), adapter(out)
    capsys.readouterr()
    assert _train(built, out, "max_steps=40") == 0
    err = capsys.readouterr().err
    assert "max_steps 20 -> 40: continuing from step 20 of 40 (was 20), the schedule follows the new total" in err
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-20'} (step 20 of 40)" in err
    lines = metrics(out)
    assert lines[:len(finished)] == finished
    assert [m["step"] for m in lines] == [1, *range(3, 20, 3), 20, *range(21, 40, 3), 40]
    for m in lines:  # linear decay from learning_rate=3e-3, no warmup; step s runs at the value after s - 1 steps
        total = 20 if m["step"] <= 20 else 40
        assert m["learning_rate"] == pytest.approx(3e-3 * (1 - (m["step"] - 1) / total), rel=1e-9), m["step"]
    assert [s for s, _ in checkpoint.complete(out)] == [35, 40]
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert not torch.equal(adapter(out)[key], adapter20[key])
    assert _train(built, out, "max_steps=30") == 2
    assert ("max_steps 40 -> 30: the run would end at step 30, before "
            f"{out / 'checkpoints' / 'checkpoint-40'}'s step 40") in capsys.readouterr().err


def test_raising_num_train_epochs_continues_the_run(tmp_path, capsys):
    """32 pairs, 4 per step: half an epoch is 4 steps; one epoch continues it to 8."""
    path = recipe(tmp_path, dataset=str(write_jsonl(tmp_path / "prefs.jsonl", _first_rows(32))), max_steps=-1,
                  num_train_epochs=0.5)
    out = tmp_path / "out"
    assert _precompute(path) == 0 and _train(path, out) == 0
    capsys.readouterr()
    assert _train(path, out, "num_train_epochs=1") == 0
    assert ("num_train_epochs 0.5 -> 1.0: continuing from step 4 of 8 (was 4), the schedule follows the new total"
            in capsys.readouterr().err)
    assert [m["step"] for m in metrics(out)] == [1, 3, 4, 6, 8]


def test_a_checkpoint_without_its_inputs_resumes_with_a_warning(built, tmp_path, capsys):
    """A checkpoint written before inputs were recorded (its trainer_state.json without them): resumed, with a
    warning that its inputs are not checked."""
    out = tmp_path / "out"
    assert _train(built, out, "max_steps=5") == 0
    state_file = out / "checkpoints" / "checkpoint-5" / checkpoint.STATE
    state = json.loads(state_file.read_text())
    del state["inputs"]
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert _train(built, out, "max_steps=5") == 0
    err = capsys.readouterr().err
    assert "checkpoint-5 does not record its inputs (written by an older lowmem_dpo): resuming without checking that" \
        " its data, model weights, adapter weights, tokenizer, tokenization, reference cache are" in err


def _edit_store(cache_dir: Path, sql: str, keys: list[bytes] = ()) -> None:
    """Change the values in a real cache's store (what a damaged file, or a wrong reference, would hold); `keys`
    fill the {} of `sql`."""
    with cache.open_store(cache_dir) as store:
        store.db.execute(sql.format(",".join("?" * len(keys))), list(keys))
        store.db.commit()


def chosen_keys() -> list[bytes]:
    """The sequence keys of RUN's chosen completions."""
    cfg = build_config({**RUN, "ref_cache_dir": "unused"})
    d = inputs.load_data(cfg, inputs.prepare(cfg, devices.resolve(cfg)).tokenizer, progress=False)
    return sorted({c for c, _ in d.keys()})


def test_values_that_disagree_with_their_token_counts_are_refused_then_computed_again(built, tmp_path, capsys):
    """A sequence's stored token count raised by 1 (a damaged store: a key is the sequence's token ids, so a true
    value cannot disagree with them): train stops with exit 2 before the model loads, in one line calling the cache
    damaged, naming its row and the precompute to rerun. That precompute drops the value, says so, computes it
    alone again, and train runs."""
    with cache.open_store(tmp_path / "cache") as store:
        key, tokens = store.db.execute("SELECT key, tokens FROM sequences LIMIT 1").fetchone()
        store.db.execute("UPDATE sequences SET tokens = tokens + 1 WHERE key = ?", (key,))
        store.db.commit()
    out = tmp_path / "out"
    assert _train(built, out) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"lowmem_dpo.train: error: the reference cache index {tmp_path / 'cache' / 'index.sqlite'} "
                           "is damaged (its values for 1 sequences, of ")
    assert ", disagree with their token counts): rerun precompute (it drops and computes them again): " in last
    assert " line " in last and last.endswith(f"): rerun precompute (it drops and computes them again): "
                                              f"lowmem-dpo precompute {built} output_dir={out}") and not out.exists()
    assert _precompute(built) == 0
    err = capsys.readouterr().err
    assert "held damaged values for 1 sequences (token counts that disagree with their sequences): dropped them" in err
    assert re.search(r"computed 1 sequences, reused \d+", err)
    with cache.open_store(tmp_path / "cache") as store:
        assert store.db.execute("SELECT tokens FROM sequences WHERE key = ?", (key,)).fetchone() == (tokens,)
    assert _train(built, out, "max_steps=1") == 0


def test_a_reference_that_gives_nonfinite_logps_is_refused(built, tmp_path, capsys):
    """A reference whose forward overflows (simulated: its embeddings' output times NaN, a real forward hook):
    precompute stops with exit 2 before storing anything for those rows, naming them."""
    def overflow(module, args, output):
        if isinstance(module, torch.nn.Embedding):
            return output * float("nan")

    handle = torch.nn.modules.module.register_module_forward_hook(overflow)
    try:
        code = run_cli(precompute.main, [str(built), f"ref_cache_dir={tmp_path / 'nan'}"], "precompute", "")
    finally:
        handle.remove()
    err = capsys.readouterr().err
    assert code == 2 and "non-finite reference log-probs for" in err and "Traceback" not in err


def test_a_checkpoint_from_before_the_transformers_schedules(tmp_path):
    """A checkpoint whose config has neither lr_scheduler_kwargs nor warmup_ratio (written before keys were added and
    before sigmoid ignored label_smoothing): keys it lacks ran at their defaults; its sigmoid with label_smoothing
    was conservative DPO, so it continues as loss_type=cdpo and is refused as sigmoid."""
    import dataclasses

    from lowmem_dpo.config.schema import keys_where
    from lowmem_dpo.training import resuming

    cfg = build_config({**RUN, "label_smoothing": 0.1, "ref_cache_dir": str(tmp_path / "c"),
                        "output_dir": str(tmp_path / "o")})
    old = dataclasses.asdict(cfg)
    for key in ("lr_scheduler_kwargs", "prompt_column", "overwrite_output_dir", "memory_snapshot_on_oom"):
        del old[key]
    saved = checkpoint.TrainerState(step=5, pairs_seen=20, micro_batch=4, grad_accum=1, skipped_steps=0, window={},
                                    config=old)
    with pytest.raises(UserError, match="set loss_type=cdpo"):
        resuming.check_older_semantics(cfg, tmp_path, saved)
    cdpo = dataclasses.replace(cfg, loss_type=["cdpo"])
    resuming.check_older_semantics(cdpo, tmp_path, saved)  # rewrites that run's sigmoid as today's cdpo
    assert config_changes(saved.config, dataclasses.asdict(cdpo)) == []
    assert "lr_scheduler_kwargs" in keys_where(resumable=False) - set(old)  # compared as its default: no change
    # a checkpoint of the keys as they were before warmup_ratio folded into warmup_steps: the same warmup resumes
    between = {**dataclasses.asdict(cfg), "warmup_ratio": 0.1, "warmup_steps": 0}
    assert config_changes(between, dataclasses.asdict(dataclasses.replace(cfg, warmup_steps=0.1))) == []
    assert config_changes(between, dataclasses.asdict(cfg)) == ["warmup_steps"]


def test_a_run_resumed_on_fewer_gpus_restores_the_states_of_the_gpus_it_has():
    """A checkpoint written on 2 GPUs (their states stand in for CUDA's: no GPU here) resumed on 1 restores GPU 0's
    state alone, where restoring all of them raised IndexError; on 3, the third GPU keeps its own."""
    saved = [torch.Generator().manual_seed(seed).get_state() for seed in (1, 2)]
    one = checkpoint.cuda_states(saved, 1)
    assert [i for i, _ in one] == [0] and torch.equal(one[0][1], saved[0])
    three = checkpoint.cuda_states(saved, 3)
    assert [i for i, _ in three] == [0, 1] and torch.equal(three[1][1], saved[1])
    assert checkpoint.cuda_states(saved, 0) == []


def test_windows_an_earlier_version_saved_resume_with_their_means():
    """A checkpoint's metric window as the earlier Stats classes saved it (DPO's StepStats, with and without the
    NLL's own token count; SFT's SFTStats; KTO's KtoStats) restores onto the run's Sums with the means those classes
    gave: the loss with the NLL at its weight, SFT's NLL per completion token, KTO's per-block means."""
    dpo = resuming.restored_window(Sums.of((LOSS, MARGIN, NLL_LOSS), nll_weight=0.5), {
        "sums": {"loss": 2.0, "rewards/margins": 1.0}, "pairs": 4, "tokens": 100, "chosen_tokens": 20,
        "rejected_tokens": 24, "nll": 6.0, "nll_tokens": 3, "nll_weight": 0.5, "ref_drift": 0.0, "ref_offset": 0.0})
    assert dpo.means() == {"loss": 0.5 + 0.5 * 2.0, "rewards/margins": 0.25, "nll_loss": 2.0}
    assert (dpo.items, dpo.tokens, dpo.chosen_tokens, dpo.rejected_tokens) == (4, 100, 20, 24)
    oldest = resuming.restored_window(Sums.of((LOSS, NLL_LOSS), nll_weight=1.0), {
        "sums": {"loss": 2.0}, "pairs": 4, "tokens": 100, "chosen_tokens": 20, "nll": 6.0, "sft_weight": 1.0})
    assert oldest.means() == {"loss": 0.5 + 6.0 / 20, "nll_loss": 6.0 / 20}  # the NLL was over the chosen tokens
    sft = resuming.restored_window(Sums.of((LOSS,)), {"nll": 9.0, "targets": 6, "tokens": 40})
    assert sft.means() == {"loss": 1.5} and not sft.empty
    kto = resuming.restored_window(Sums.of(BLOCK_METRICS), {
        "sums": dict.fromkeys((m.name for m in BLOCK_METRICS), 1.0) | {"loss": 1.2}, "rows": 8, "tokens": 50,
        "blocks": dict.fromkeys((m.name for m in BLOCK_METRICS), 2) | {"rewards/margins": 0}})
    assert kto.means()["loss"] == 0.6 and kto.means()["rewards/margins"] is None and kto.items == 8
