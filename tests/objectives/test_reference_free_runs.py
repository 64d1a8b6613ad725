"""Objectives without a reference, run as a user runs them: recipes/tiny-simpo.yaml needs no precompute and no
cache (precompute says so and writes nothing, train loads none, plan shows none) and learns the demo's task; ORPO's
NLL covers the chosen prompt as TRL's does, checked against the model's own logits by hand."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO

from lowmem_dpo import plan, precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime.errors import ConfigError
from lowmem_dpo.training import loop
from lowmem_dpo.training.step import next_items

SIMPO = str(REPO / "recipes" / "tiny-simpo.yaml")


def test_tiny_simpo_trains_with_no_reference_anywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the recipe's folders (runs/tiny-simpo, runs/tiny-simpo-ref-cache) land here
    assert run_cli(precompute.main, [SIMPO], "precompute", "doc") == 0
    assert "loss_type=['simpo'] reads no reference: nothing to compute" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing written
    assert run_cli(plan.main, [SIMPO, "--budget", "1GiB"], "plan", "doc") == 0
    shown = capsys.readouterr().out
    assert "precomp. none: loss_type=['simpo'] reads no reference (no precompute, no cache)" in shown
    assert "precompute" not in shown.split("(no precompute, no cache)")[1]  # no precompute column, nor batch
    assert run_cli(train.main, [SIMPO, "dtype=float32"], "train", "doc") == 0
    err = capsys.readouterr().err
    assert "reference: none (loss_type=['simpo'] reads no reference: no cache, no precompute)" in err
    # likelihood displacement reads the log-ratio to a reference: off here, and the log says what still warns
    assert "likelihood displacement" not in err and "(the answers' signs still warn)" in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny-simpo"]  # no cache folder
    lines = [json.loads(x) for x in (tmp_path / "runs" / "tiny-simpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in lines if "eval_loss" in x]
    first, last = evals[0], evals[-1]
    # learned: held-out pairs ranked right, the loss down from its start, the samples as long as they were
    assert last["eval_rewards/accuracies"] >= 0.9 > first["eval_rewards/accuracies"]
    assert last["eval_loss"] < 0.5 * first["eval_loss"]
    assert last["eval_gen/length"] >= 0.75 * first["eval_gen/length"]
    # SimPO's rewards are beta times the per-token mean log-prob (TRL's CPOTrainer), logps/* per-token means
    step = [x for x in lines if "loss" in x][-1]  # the last train line (metrics.jsonl rounds to 6 digits)
    assert step["rewards/chosen"] == pytest.approx(4.0 * step["logps/chosen"], rel=1e-5)
    assert -10 < step["logps/chosen"] < 0 and "nll_loss" not in step and "log_odds_ratio" not in step


@pytest.mark.parametrize("share", ["false", "true"])
def test_orpo_s_nll_covers_the_chosen_prompt_as_trl_s(make_cfg, tmp_path, share):
    """Step 1's nll_loss (LoRA B = 0: the base model's) is the mean -log p over the chosen rows' prompt and
    completion tokens but the first, from the model's own full logits; the loss adds it to beta's odds term."""
    cfg = make_cfg(loss_type=["orpo"], beta=0.5, max_steps=1, share_prompt=share, eval_fraction=0.0)
    session = train.setup(cfg, progress=False)
    items = next_items(session.progress.stream, session.run.items_per_step)
    session.progress.stream = iter(items)
    nll, tokens = 0.0, 0
    with torch.no_grad(), session.trainee.model.disable_adapter():
        for p in items:
            ids = torch.tensor([p.prompt_ids + p.chosen_ids])  # (1, T)
            logp = torch.log_softmax(session.trainee.model(input_ids=ids).logits[0, :-1].float(), -1)  # (T-1, V)
            nll -= logp.gather(1, ids[0, 1:, None]).sum().item()
            tokens += ids.shape[1] - 1
    loop.run(session, progress=False)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["nll_loss"] == pytest.approx(nll / tokens, rel=1e-5)
    assert step["loss"] == pytest.approx(step["nll_loss"] - 0.5 * step["log_odds_ratio"], rel=1e-5)
    assert step["log_odds_ratio"] < 0 and "log_odds_chosen" in step


def test_what_a_reference_free_run_cannot_log_or_combine(tmp_path):
    recipe = str(REPO / "lowmem_dpo" / "demo" / "tiny-cpu.yaml")
    with pytest.raises(ConfigError, match=r"metric_for_best_model=eval_log_odds_ratio: loss_type=\['sigmoid'\] does "
                                          "not log it"):
        load_config(recipe, ["metric_for_best_model=eval_log_odds_ratio"])
    with pytest.raises(ConfigError, match="orpo has its own NLL of the chosen rows"):
        load_config(recipe, ["loss_type=[orpo, sft]"])
    assert load_config(recipe, ["loss_type=orpo", "metric_for_best_model=eval_nll_loss"]).best_is_greater is False
