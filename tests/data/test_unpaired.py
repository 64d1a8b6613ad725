"""KTO's rows tokenized as TRL 1.16's KTOTrainer prepares them (its own _prepare_dataset run here on the same
rows): prompt and completion ids, the order of unpaired preference rows, the KL sequences' completions, each cut
to max_length as TRL's collator cuts it; and the refusals of rows KTO cannot read."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import data
from lowmem_dpo.data import unpaired
from lowmem_dpo.runtime.errors import UserError

MAX_LENGTH = 20  # some completions are cut: the KL sequences cut their own


LONGER = " It is, truly, every single day of the year."  # past MAX_LENGTH


def demo_rows(n: int) -> list[dict]:
    rows = [json.loads(x) for x in open(TINY_DATA)]
    return [dict(rows[i % len(rows)], rejected=rows[i % len(rows)]["rejected"] + LONGER * (i % 3 == 0))
            for i in range(n)]


def unpaired_rows(n: int, conversational: bool = False) -> list[dict]:
    out = []
    for i, r in enumerate(demo_rows(n)):
        completion = r["chosen"] if i % 3 else r["rejected"]
        row = {"prompt": r["prompt"], "completion": completion, "label": bool(i % 3)}
        if conversational:
            row = {"prompt": [{"role": "user", "content": r["prompt"]}],
                   "completion": [{"role": "assistant", "content": completion}], "label": row["label"]}
        out.append(row)
    return out


def trl_prepared(rows: list[dict], tokenizer, block: int):
    """TRL 1.16's KTOTrainer._prepare_dataset of `rows` (its tokenization, unpairing, KL completions)."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    trainer = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=True, desirable_weight=1.0, undesirable_weight=1.0)
    args = KTOConfig(output_dir="/tmp/unused", max_length=MAX_LENGTH, per_device_train_batch_size=block,
                     report_to="none", use_cpu=True)
    return KTOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(rows), tokenizer, args, "train")


def ours(rows: list[dict], tokenizer, block: int, tmp_path) -> list:
    path = str(write_jsonl(tmp_path / "rows.jsonl", rows))
    tok = unpaired.tokenize_unpaired(data.load_rows(path, required=("prompt",)), tokenizer, MAX_LENGTH, None, path,
                                     progress=False)
    return unpaired.with_kl(tok.pairs, block, MAX_LENGTH)


@pytest.mark.parametrize("kind", ["text", "conversational", "paired"])
def test_rows_and_kl_sequences_equal_trls(kind, tokenizer, tmp_path):
    rows = demo_rows(1100) if kind == "paired" else unpaired_rows(60, kind == "conversational")
    if kind != "conversational":  # an empty completion: a row of EOS alone, in TRL's order
        rows[5]["chosen" if kind == "paired" else "completion"] = ""
    block = 4
    want = trl_prepared(rows, tokenizer, block)
    got = ours(rows, tokenizer, block, tmp_path)
    assert len(got) == len(want) == (2200 if kind == "paired" else 60)
    cut = [max(0, MAX_LENGTH - len(p)) for p in want["prompt_ids"]]
    assert [it.prompt_ids for it in got] == want["prompt_ids"]
    assert [it.completion_ids for it in got] == [c[:n] for c, n in zip(want["completion_ids"], cut)]
    assert [it.kl_completion_ids for it in got] == [c[:n] for c, n in zip(want["KL_completion_ids"], cut)]
    assert [it.desirable for it in got] == want["label"]
    assert any(len(c) > n for c, n in zip(want["completion_ids"], cut))  # the cut is exercised
    if kind == "paired":  # per 1000 rows every chosen, then every rejected; a completion keeps its pair's ids
        assert [it.row for it in got[:3]] == [0, 1, 2] and got[1000].row == 0 and not got[1000].desirable
        pair = data.tokenize_rows(data.load_rows(str(write_jsonl(tmp_path / "p.jsonl", rows[:50]))), tokenizer,
                                  MAX_LENGTH, None, progress=False).pairs
        kto_chosen = {it.row: (it.prompt_ids, it.completion_ids) for it in got[:50]}
        assert len(pair) == 49 and all(kto_chosen[p.row] == (p.prompt_ids, p.chosen_ids) for p in pair)  # DPO skips 5


def test_rows_kto_cannot_read_are_refused(tokenizer, tmp_path):
    rows = unpaired_rows(4)
    rows[2]["label"] = "yes"
    with pytest.raises(UserError, match=r"row 2 at line 3: label is 'yes'; expected true .* or false"):
        ours(rows, tokenizer, 2, tmp_path)
    with pytest.raises(UserError, match="KTO needs rows with prompt, completion and label .* the data has prompt, "
                                        "completion"):
        ours([{k: v for k, v in r.items() if k != "label"} for r in unpaired_rows(4)], tokenizer, 2, tmp_path)


def test_kl_partners_rotate_within_blocks():
    from lowmem_dpo.objectives.kto import kl_partners

    assert kl_partners(7, 3) == [2, 0, 1, 5, 3, 4, 6]


def test_blocks_of_one_prompt_are_warned_of(tokenizer, tmp_path):
    """Four answers of each prompt in a row: every KL sequence in blocks of 4 is a matched pair, and preflight
    says so; the same rows shuffled pair across prompts."""
    import random

    from lowmem_dpo import preflight
    from lowmem_dpo.objectives import Settings

    demo = demo_rows(40)
    ordered = [{"prompt": demo[i]["prompt"], "completion": c, "label": k < 2} for i in range(0, 40, 4)
               for k, c in enumerate([demo[i]["chosen"], demo[i + 1]["chosen"], demo[i + 1]["rejected"] + " No.",
                                      demo[i]["rejected"]])]
    got = ours(ordered, tokenizer, 4, tmp_path)
    assert all(it.kl_matched for it in got)
    assert "warning: 40 of the 40 KL sequences pair a row with a completion of its own prompt" in "\n".join(
        preflight.unpaired_lines(got, Settings(), True))
    random.Random(0).shuffle(ordered)
    got = ours(ordered, tokenizer, 4, tmp_path)
    assert sum(it.kl_matched for it in got) < 10
    assert not any("KL sequences" in line for line in preflight.unpaired_lines(got, Settings(), True))
