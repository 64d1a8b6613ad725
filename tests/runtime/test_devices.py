"""Per-device rules resolve `auto` through the table, with reasons."""

import os

import pytest
import torch

from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime import devices, ram, rules
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import MiB, fmt


def test_auto_on_cpu_follows_the_table():
    r = devices.resolve(load_config(None, ["device=cpu"]))
    kind = "cpu-bf16" if devices.cpu_has_native_bf16() else "cpu"
    assert r.kind == kind and r.device == torch.device("cpu")
    assert r.dtype == devices.DTYPES[rules.RULES[kind].dtype]
    assert r.gradient_checkpointing is False  # RAM is plentiful on a CPU: checkpointing only costs time
    assert any(reason.startswith("dtype=") and "auto" in reason for reason in r.reasons)


def test_explicit_values_win_over_the_table():
    r = devices.resolve(load_config(None, ["device=cpu", "dtype=float32", "gradient_checkpointing=true"]))
    assert r.dtype == torch.float32 and r.gradient_checkpointing is True
    assert "dtype=float32 (from the recipe)" in r.reasons


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when no GPU is present")
def test_cuda_requested_without_gpu_is_a_user_error():
    with pytest.raises(UserError, match="no CUDA GPU"):
        devices.resolve(load_config(None, ["device=cuda"]))
    assert devices.resolve(load_config(None, ["device=auto"])).device.type == "cpu"


def test_a_cpu_memory_budget_above_the_ram_there_is_planned_at_that_ram_and_said(capsys):
    """This machine's own MemAvailable (/proc/meminfo; its physical RAM where there is none): a budget a thousand
    times the RAM is planned at what is available, with one warning line; one within it is kept as given."""
    available, source = ram.available()
    assert 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    r = devices.resolve(load_config(None, ["device=cpu", f"memory_budget={available * 1000}"]))
    assert 0 < r.budget <= max(available, ram.available()[0])  # read again inside: it moves as the machine runs
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: memory_budget=")]
    assert len(warned) == 1 and f"of RAM {source} on this machine: planning for {fmt(r.budget)}" in warned[0]
    assert f"budget {fmt(r.budget)}: {warned[0].removeprefix('warning: ')}" in r.reasons
    r = devices.resolve(load_config(None, ["device=cpu", "memory_budget=1MiB"]))
    assert r.budget == MiB and "warning" not in capsys.readouterr().err
