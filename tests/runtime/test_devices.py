"""Per-device rules resolve `auto` through the table, with reasons."""

import pytest
import torch

from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime import devices, rules
from lowmem_dpo.runtime.errors import UserError


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
