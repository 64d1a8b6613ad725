"""KTO through the stages on the tiny model: a DPO cache of the same pairs serves KTO's rows (only the KL
sequences are computed; none for apo_zero_unpaired), in float32 and in bfloat16 where DPO's values are in the
shared layout; a run starts at the loss of a policy equal to its reference, resumes from a checkpoint to the same
adapter bit for bit, and scores its samples against desirable completions only; what KTO cannot take is refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import TINY_DATA, sequences_of, write_jsonl

from lowmem_dpo import precompute, train
from lowmem_dpo.runtime.errors import ConfigError, UserError


def rows(n: int) -> list[dict]:
    return [json.loads(x) for x in open(TINY_DATA)][:n]


def counted(err: str) -> tuple[int, int]:
    m = re.findall(r"computed (\d+) sequences, reused (\d+)", err)
    return int(m[-1][0]), int(m[-1][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dpo_cache_serves_kto_and_only_kl_sequences_are_computed(make_cfg, tmp_path, capsys, dtype):
    path = str(write_jsonl(tmp_path / "pairs.jsonl", rows(40)))
    dpo = make_cfg(dataset=path, dtype=dtype, share_prompt="true" if dtype == "bfloat16" else "auto")
    precompute.run(dpo, progress=False)
    kto = make_cfg(dataset=path, dtype=dtype, loss_type=["kto"])
    capsys.readouterr()
    precompute.run(kto, progress=False)
    new = len(sequences_of(kto) - sequences_of(dpo))  # the KL sequences no pair holds
    assert counted(capsys.readouterr().err) == (new, len(sequences_of(kto)) - new) and new > 20
    apo = make_cfg(dataset=path, dtype=dtype, loss_type=["apo_zero_unpaired"])
    precompute.run(apo, progress=False)
    assert counted(capsys.readouterr().err) == (0, len(sequences_of(apo)))
    assert sequences_of(apo) <= sequences_of(dpo)
    train.run(make_cfg(dataset=path, dtype=dtype, loss_type=["kto"], max_steps=1, eval_fraction=0.0),
              progress=False)
    first = json.loads(open(tmp_path / "out" / "metrics.jsonl").readline())
    # a policy equal to its reference: z0 = 0, every log-ratio 0, each row's loss 1 - s(0) = 0.5 (in bf16 the
    # shared layout's values are ~1e-3 from this unshared forward's)
    assert first["loss"] == pytest.approx(0.5, abs=1e-6 if dtype == "float32" else 2e-3)


def test_kto_resumes_to_the_same_adapter_and_samples_desirable_rows(make_cfg, tmp_path):
    cfg = make_cfg(loss_type=["kto"], max_steps=4, save_steps=2, eval_fraction=0.15, eval_generations=3,
                   max_new_tokens=6, learning_rate=3e-2)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    out = tmp_path / "out"
    whole = (out / "adapter_model.safetensors").read_bytes()
    lines = [json.loads(x) for x in open(out / "metrics.jsonl") if '"loss"' in x]
    assert lines[0]["step"] == 1 and lines[0]["loss"] == pytest.approx(0.5, abs=1e-6) and lines[0]["kl"] == 0.0
    assert lines[-1]["rewards/margins"] != 0 and "rewards/accuracies" not in lines[-1]
    session = train.setup(cfg, progress=False)  # the finished run, resumed at step 4: its eval rows and labels
    run = session.run
    views = [v for block in run.eval_items for v in block]  # KTO's items are blocks of rows
    desirable = {tuple(v.chosen_ids) for v in views if bool(run.objective.eval_ref.desirable[v.row])}
    assert run.objective.blocks and len(desirable) < len(views)
    tokenizer = run.tokenizer
    for sample in (json.loads(x) for x in open(out / "samples.jsonl")):
        assert any(tokenizer.decode(list(c), skip_special_tokens=True) == sample["chosen"] for c in desirable)
    shutil.rmtree(out / "checkpoints" / "checkpoint-4")  # the last checkpoint gone: resumes from step 2
    train.run(cfg, progress=False)
    assert (out / "adapter_model.safetensors").read_bytes() == whole


@pytest.mark.parametrize("values, message", [
    ({"loss_type": ["kto", "sigmoid"]}, "kto trains on unpaired rows, one loss per row; it cannot be summed"),
    ({"loss_type": ["kto"], "ld_alpha": 0.5}, "ld_alpha with loss_type=kto: it changes the pair losses only"),
    ({"loss_type": ["apo_zero_unpaired"], "use_weighting": True}, "use_weighting with loss_type=apo_zero_unpaired"),
])
def test_what_kto_cannot_take_is_refused(make_cfg, values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_cfg(**values)


def test_a_block_of_one_row_is_refused_for_kto(make_cfg):
    with pytest.raises(UserError, match="needs 2 rows at least .* or use loss_type=apo_zero_unpaired"):
        precompute.run(make_cfg(loss_type=["kto"], per_device_train_batch_size=1), progress=False)


def test_the_run_length_counts_rows_in_every_stage(make_cfg, tmp_path):
    """A shorter KTO run than its checkpoint is refused as a DPO one is (steps from rows, whatever the items);
    an SFT stage of a KTO recipe takes rows, not blocks."""
    from lowmem_dpo import sft

    cfg = make_cfg(loss_type=["kto"], max_steps=-1, num_train_epochs=0.05, save_steps=2, eval_fraction=0.0,
                   per_device_train_batch_size=8)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    steps = json.loads(open(tmp_path / "out" / "metrics.jsonl").readlines()[-1])["step"]
    assert steps == 5  # ceil(0.05 epochs * 768 rows / 8 rows a step), not counted in blocks
    with pytest.raises(UserError, match=r"num_train_epochs 0.05 -> 0.02: the run would end at step 2, before"):
        train.setup(make_cfg(loss_type=["kto"], max_steps=-1, num_train_epochs=0.02, save_steps=2,
                             eval_fraction=0.0, per_device_train_batch_size=8), progress=False)
    session = sft.setup(make_cfg(loss_type=["kto"], output_dir=str(tmp_path / "sft")), progress=False)
    assert session.run.items_per_step == 4


def test_a_block_s_metrics_and_gradient_do_not_depend_on_its_micro_batches(make_cfg, tmp_path):
    """Blocks of 3 rows (not a power of two) after a step that moved the adapter: a step's metrics are the same bit
    for bit, and its gradient within float32 rounding, whether the loop splits each block into micro-batches of 1
    or takes it whole (each block's metrics are means of the whole block, as TRL's)."""
    import torch

    from lowmem_dpo.training.step import accumulate, next_items, optimizer_step

    path = str(write_jsonl(tmp_path / "pairs.jsonl", rows(24)))
    cfg = make_cfg(dataset=path, loss_type=["kto"], per_device_train_batch_size=3, gradient_accumulation_steps=2,
                   learning_rate=1e-2, lora_dropout=0.0, eval_fraction=0.0)
    precompute.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)
    optimizer_step(session)  # a moved adapter: log-ratios and z0 away from 0
    items = next_items(session.progress.stream, session.run.items_per_step)
    seen = []
    for micro in (1, 3):
        session.trainee.zero_grad()
        sums = accumulate(session, items, micro)
        seen.append((sums.means(), [p.grad.clone() for p in session.trainee.params if p.grad is not None]))
    (split, split_grads), (whole, whole_grads) = seen
    assert split == whole and split["kl"] > 0 and split["loss"] != 0.5
    assert len(split_grads) == len(whole_grads) > 0
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(split_grads, whole_grads))
