"""Every module imports on a CPU-only machine, and every stage answers --help."""

import importlib
import pkgutil
import subprocess
import sys

import pytest

import lowmem_dpo

MODULES = [m.name for m in pkgutil.iter_modules(lowmem_dpo.__path__, "lowmem_dpo.")]


@pytest.mark.parametrize("name", MODULES)
def test_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("stage", ["precompute", "train", "preflight", "sft"])
def test_stage_help_shows_command(stage):
    p = subprocess.run([sys.executable, "-m", f"lowmem_dpo.{stage}", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0
    assert f"python -m lowmem_dpo.{stage}" in p.stdout


def test_no_arguments_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "lowmem_dpo.train"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "usage:" in p.stdout
