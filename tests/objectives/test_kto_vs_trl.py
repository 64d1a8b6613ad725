"""KTO as TRL 1.16's KTOTrainer computes it, on conversational rows rendered by the built-in tokenizer's chat
template: after 2 steps of ours, the train-mode metrics of a step over the training rows (KTOTrainer's
compute_loss, block by block) and evaluate() on held-out rows equal ours on the same adapter within 1e-4, for
kto and apo_zero_unpaired, balanced and weighted classes. TRL's reference is the base model (ref_model), ours the
cache of the same base."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import precompute, train
from lowmem_dpo.training import evaluation, kto
from lowmem_dpo.training.step import accumulate

BLOCK = 4
KEYS = ("loss", "kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")


def conversations(rows: list[dict], desirable: int) -> list[dict]:
    """Unpaired conversational rows: every `desirable`-th row's completion the rejected one, labelled false (the
    others desirable: KTO then raises the likelihood overall, and its KL estimate is positive)."""
    return [{"prompt": [{"role": "user", "content": r["prompt"].strip()}],
             "completion": [{"role": "assistant", "content": r["rejected" if i % desirable == 0 else "chosen"]}],
             "label": i % desirable != 0} for i, r in enumerate(rows)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of ours on the tiny model in float32 (loss kto), its eval rows cached with the training rows; the
    session set up again from its last checkpoint (the trained adapter)."""
    from lowmem_dpo.config.recipe import build_config

    root = tmp_path_factory.mktemp("kto_vs_trl")
    rows = [json.loads(x) for x in open(TINY_DATA)]
    train_rows, eval_rows = conversations(rows[:24], 6), conversations(rows[200:216], 4)
    cfg = build_config(dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(write_jsonl(
        root / "train.jsonl", train_rows)), eval_dataset=str(write_jsonl(root / "eval.jsonl", eval_rows)),
        device="cpu", dtype="float32", max_length=64, per_device_train_batch_size=BLOCK, max_steps=2, save_steps=2,
        learning_rate=2e-2, seed=0, eval_generations=0, lora_dropout=0.0, loss_type=["kto"],
        output_dir=str(root / "out"), ref_cache_dir=str(root / "cache"), beta=0.1))
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)  # resumes at step 2: the trained adapter, nothing more to train
    return root, train_rows, eval_rows, session


def trl(root, tiny_path, train_rows, eval_rows, **args):
    """TRL 1.16's KTOTrainer on the same base, the same saved adapter and the same rows."""
    import datasets
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                      root / "out", is_trainable=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    config = KTOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=BLOCK,
                       per_device_eval_batch_size=BLOCK, max_length=64, report_to="none", use_cpu=True, bf16=False,
                       disable_tqdm=True, **args)
    return KTOTrainer(model=model, ref_model=base, args=config, train_dataset=datasets.Dataset.from_list(train_rows),
                      eval_dataset=datasets.Dataset.from_list(eval_rows),
                      processing_class=AutoTokenizer.from_pretrained(tiny_path))


def trl_train_metrics(trainer) -> dict:
    """KTOTrainer's train-mode loss and metrics over its training rows, block by block (its sequential batches),
    averaged as its log() averages them."""
    trainer.model.train()
    losses = []
    for batch in trainer.get_train_dataloader():
        with torch.no_grad():
            losses.append(trainer.compute_loss(trainer.model, batch).item())
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}
    return {**metrics, "loss": sum(losses) / len(losses)}


@pytest.mark.parametrize("loss_type, weights", [("kto", (1.0, 1.0)), ("kto", (1.0, 1.5)),
                                                ("apo_zero_unpaired", (1.0, 1.0))])
def test_train_and_eval_metrics_equal_trls(trained, tiny_path, loss_type, weights):
    root, train_rows, eval_rows, session = trained
    cfg = dataclasses.replace(session.run.cfg, loss_type=[loss_type], desirable_weight=weights[0],
                              undesirable_weight=weights[1])
    run = session.run
    entry = kto.Blocks.of(cfg, run.objective.batching, run.objective.ref, run.objective.eval_ref)
    session.run = dataclasses.replace(run, cfg=cfg, objective=entry)  # RunSetup is frozen
    got_eval, _ = evaluation.evaluate(session)
    # the training blocks' sums with no gradient, as an eval over them (their reference values) would sum them
    session.run = dataclasses.replace(session.run, objective=dataclasses.replace(entry, eval_ref=entry.ref))
    ordered = sorted(session.run.items, key=lambda block: block[0].row)  # data order: TRL's sequential batches
    got_train = accumulate(session, ordered, BLOCK, grad=False)
    session.run = run  # the next case starts from the trained run's own entry
    trainer = trl(root, tiny_path, train_rows, eval_rows, loss_type=loss_type, desirable_weight=weights[0],
                  undesirable_weight=weights[1])
    want_eval = trainer.evaluate()
    want_train = trl_train_metrics(trainer)
    assert got_eval["eval_pairs"] == len(eval_rows) and got_train.items == len(train_rows)
    assert 0.01 < abs(got_eval["eval_rewards/margins"])  # a trained adapter: the classes apart
    assert loss_type != "kto" or min(got_eval["eval_kl"], got_train.means()["kl"]) > 1.0  # z0 not clamped to 0
    for key in KEYS:
        if loss_type == "apo_zero_unpaired" and key == "kl":
            continue
        assert got_eval[f"eval_{key}"] == pytest.approx(want_eval[f"eval_{key}"], abs=1e-4), key
        assert got_train.means()[key] == pytest.approx(want_train[key], abs=1e-4), key

