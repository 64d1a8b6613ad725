"""One command for every stage (`lowmem-dpo STAGE`, `python -m lowmem_dpo STAGE`), TRL's `--key value`
overrides, the run folder's model card and the samples' rejected text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, TINY_DATA

from lowmem_dpo import __main__ as one
from lowmem_dpo import precompute, train
from lowmem_dpo.config.cli import flag_overrides
from lowmem_dpo.runtime.errors import ConfigError


def test_help_lists_the_stages_in_pipeline_order_with_their_docstrings(capsys):
    assert one.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == ["plan", "sft", "precompute", "preflight", "train", "report", "export", "chat"]
    assert "  train       Train a LoRA DPO policy against cached reference log-probs" in out
    assert one.main(["trian", "x"]) == 2 and "'trian' is not a stage; one of plan, sft" in capsys.readouterr().err


def test_the_console_command_runs_a_stage_as_python_m_does(tmp_path, capsys):
    """The installed console script (setup.cfg's entry point; `python -m lowmem_dpo` without one): a stage's exit
    code and its one-line error, its keys through TRL's --key value; the same in this process (test_doc_blocks.py
    runs the docs' commands so)."""
    script = [str(REPO / ".venv" / "bin" / "lowmem-dpo")] if (REPO / ".venv" / "bin" / "lowmem-dpo").exists() else [
        sys.executable, "-m", "lowmem_dpo"]
    got = subprocess.run([*script, "plan", "lowmem_dpo:tiny-cpu", "--max_length", "0", "--budget", "2GiB"],
                         capture_output=True, text=True, cwd=tmp_path)  # the key read: its bound refuses 0
    assert got.returncode == 2 and "max_length=0: out of range, expected >= " in got.stderr
    assert one.main(["plan", "lowmem_dpo:tiny-cpu", "--max_length", "128", "--budget", "2GiB"]) == 0
    assert "train peak" in capsys.readouterr().out
    assert one.main(["plan", "lowmem_dpo:tiny-cpu", "--learning_rate"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lowmem_dpo.plan: error: --learning_rate: expected a value after it (--learning_rate VALUE, or "
        "learning_rate=VALUE)")


def test_trl_style_flags_become_overrides_and_stage_flags_stay():
    assert flag_overrides(["r.yaml", "--learning_rate", "1e-5", "--max-length=32", "--eval_on_start", "--prune",
                           "beta=0.2", "--load_best_model_at_end", "false"]) == [
        "r.yaml", "learning_rate=1e-5", "max_length=32", "eval_on_start=true", "--prune", "beta=0.2",
        "load_best_model_at_end=false"]
    # a bare boolean leaves what follows alone (the recipe, a key=value); a value never starts with --
    assert flag_overrides(["--eval_on_start", "r.yaml", "--strict", "seed=3", "--strict", "no"]) == [
        "eval_on_start=true", "r.yaml", "strict=true", "seed=3", "strict=no"]
    with pytest.raises(ConfigError, match="--seed: expected a value after it"):
        flag_overrides(["r.yaml", "--seed"])
    with pytest.raises(ConfigError, match="--run_name: expected a value after it"):
        flag_overrides(["r.yaml", "--run_name", "--seed", "1"])


def test_the_model_card_and_the_samples_say_what_the_run_was(make_cfg, tmp_path):
    cfg = make_cfg(max_steps=4, save_steps=2, eval_fraction=0.15, eval_generations=2, max_new_tokens=4)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\nbase_model: lowmem_dpo:tiny-llama\nlibrary_name: peft\n")
    assert "More Information Needed" not in card and "trained by lowmem_dpo" in card
    last = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl") if '"eval_loss"' in x][-1]
    assert f"- **Last eval** (step 4): eval_loss {last['eval_loss']:.4g}," in card
    assert "- **Objective**: loss_type ['sigmoid'], beta 0.1" in card and "4 steps of 4 x 1 per device" in card
    rejected = {json.loads(x)["rejected"].strip() for x in open(TINY_DATA)}
    samples = [json.loads(x) for x in open(tmp_path / "out" / "samples.jsonl")]
    assert samples and all(sample["rejected"].strip() in rejected for sample in samples)
