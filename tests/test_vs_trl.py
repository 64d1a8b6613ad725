"""Numbers as TRL 1.16 gives them, where a key is spelled as TRL's: the eval metrics of a trained adapter equal
TRL's own DPOTrainer.evaluate() on the same adapter and rows (its reference: the base as ref_model, ours: the
cache of the same base), for sigmoid, sigmoid with label_smoothing (which TRL's sigmoid ignores, as ours now
does), robust (which uses it), sigmoid_norm, apo_zero and bco_pair (TRL 1.16's has no running mean: nothing
carries across batches); and, with no reference, SimPO and ORPO against TRL's experimental CPOTrainer and
ORPOTrainer evaluate()."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import precompute, train
from lowmem_dpo.training import evaluation, objective

KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")
ROWS = 16  # 4 eval batches of 4: TRL's mean over batches is the mean over rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_path):
    """2 steps of ours on the tiny model in float32, its eval rows cached with the training rows; the session
    set up again from its last checkpoint (the trained adapter), to evaluate under other loss settings."""
    from lowmem_dpo.config.recipe import build_config

    root = tmp_path_factory.mktemp("vs_trl")
    rows = [json.loads(x) for x in open(TINY_DATA)][100:100 + ROWS]
    eval_rows = write_jsonl(root / "eval.jsonl", rows)
    cfg = build_config(dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), device="cpu",
                            dtype="float32", max_length=64, per_device_train_batch_size=4, max_steps=2, save_steps=2,
                            learning_rate=3e-2, seed=0, eval_dataset=str(eval_rows), eval_generations=0,
                            output_dir=str(root / "out"), ref_cache_dir=str(root / "cache"), beta=0.1))
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)  # resumes at step 2: the trained adapter, nothing more to train
    return root, rows, session


def ours(session, **changes) -> dict:
    cfg = dataclasses.replace(session.run.cfg, **changes)
    run = session.run  # RunSetup is frozen; its objective is built from the changed config
    entry = objective.Pairs.of(cfg, run.objective.batching, run.objective.ref, run.objective.eval_ref)
    session.run = dataclasses.replace(run, cfg=cfg, objective=entry)
    return evaluation.evaluate(session)[0]


def trls(root, rows, tiny_path, **args) -> dict:
    """TRL 1.16's DPOTrainer.evaluate() on the same base, the same saved adapter and the same rows."""
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                      root / "out")
    # the reference is the base, as our cache's: given as ref_model (TRL would otherwise take a copy of the
    # loaded adapter as the reference, a DPO after SFT)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    config = DPOConfig(output_dir=str(root / "trl"), per_device_eval_batch_size=4, max_length=64, beta=0.1,
                       report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, **args)
    ds = datasets.Dataset.from_list(rows)
    trainer = DPOTrainer(model=model, ref_model=base, args=config, train_dataset=ds, eval_dataset=ds,
                         processing_class=AutoTokenizer.from_pretrained(tiny_path))
    return trainer.evaluate()


@pytest.mark.parametrize("loss_type, label_smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.2),
                                                        ("sigmoid_norm", 0.0), ("apo_zero", 0.0), ("bco_pair", 0.0)])
def test_eval_equals_trl_evaluate(trained, tiny_path, loss_type, label_smoothing):
    root, rows, session = trained
    got = ours(session, loss_type=[loss_type], label_smoothing=label_smoothing)
    want = trls(root, rows, tiny_path, loss_type=[loss_type], label_smoothing=label_smoothing)
    assert got["eval_pairs"] == ROWS
    assert 0.2 < got["eval_rewards/accuracies"] < 1.0  # a trained adapter: the pairs are not all alike
    for key in KEYS:
        assert got[f"eval_{key}"] == pytest.approx(want[f"eval_{key}"], abs=1e-4), key


def test_label_smoothing_leaves_sigmoid_alone_as_in_trl(trained, capsys):
    _, _, session = trained
    plain = ours(session, loss_type=["sigmoid"], label_smoothing=0.0)["eval_loss"]
    assert ours(session, loss_type=["sigmoid"], label_smoothing=0.2)["eval_loss"] == plain
    assert ours(session, loss_type=["cdpo"], label_smoothing=0.2)["eval_loss"] > plain  # conservative DPO: its own name
    assert any("label_smoothing=0.2 does not change loss_type=['sigmoid']" in note
               for note in dataclasses.replace(session.run.cfg, loss_type=["sigmoid"], label_smoothing=0.2).no_effect())


def reference_free_trls(root, rows, tiny_path, trainer: str, **args) -> dict:
    """TRL 1.16's experimental CPOTrainer or ORPOTrainer evaluate() on the same adapter and rows, in one batch of
    all of them (its nll_loss is a token mean per batch, ours over the eval's tokens: one batch makes them one)."""
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if trainer == "cpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                      root / "out")
    config = Config(output_dir=str(root / trainer), per_device_eval_batch_size=ROWS, max_length=64, report_to="none",
                    use_cpu=True, bf16=False, disable_tqdm=True, **args)
    ds = datasets.Dataset.from_list(rows)
    return Trainer(model=model, args=config, train_dataset=ds, eval_dataset=ds,
                   processing_class=AutoTokenizer.from_pretrained(tiny_path)).evaluate()


@pytest.mark.parametrize("loss_type, trainer, args", [
    ("simpo", "cpo", dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.5)),
    ("orpo", "orpo", dict(beta=0.5))])
def test_reference_free_eval_equals_trl_evaluate(trained, tiny_path, loss_type, trainer, args):
    root, rows, session = trained
    got = ours(session, loss_type=[loss_type], beta=args["beta"], simpo_gamma=args.get("simpo_gamma", 0.5),
               label_smoothing=0.0)  # (the session's config carries the last test's changes)
    want = reference_free_trls(root, rows, tiny_path, trainer, **args)
    assert got["eval_pairs"] == ROWS and 0.2 < got["eval_rewards/accuracies"] < 1.0
    extra = ("nll_loss", "log_odds_ratio", "log_odds_chosen") if loss_type == "orpo" else ()
    for key in (*KEYS, *extra):
        assert got[f"eval_{key}"] == pytest.approx(want[f"eval_{key}"], abs=1e-4), key
