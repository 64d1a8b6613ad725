"""Eval data: the hold-out by prompt (eval_fraction), load_data's split, eval_dataset's rows cached beside the
training rows (one build, one fingerprint), and the errors."""

import hashlib
import json
import math

import datasets
import pytest
import torch
from conftest import TINY_DATA, TINY_RECIPE, cached, sequences_of, write_jsonl

from lowmem_dpo import data, precompute, preflight
from lowmem_dpo.data import cache
from lowmem_dpo.model import models
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.runtime import devices
from lowmem_dpo.training import inputs


def tiny_rows() -> list[dict]:
    return [json.loads(line) for line in TINY_DATA.read_text().splitlines()]


def score(prompt: str) -> float:
    """The hold-out score as the README states it, recomputed here: sha256 of the prompt, as a number in [0, 1)."""
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:16], 16) / 2 ** 64


def pref_rows(n: int, start: int = 0) -> list[dict]:
    """n rows over n // 2 + 1 prompts (pairs of rows share one), numbered from `start`."""
    return [{"prompt": f"question {(start + i) // 2}", "chosen": f"yes {i}", "rejected": f"no {i}"}
            for i in range(n)]


def test_holdout_by_prompt_is_stable_when_rows_are_appended():
    rows = pref_rows(400)
    held = data.holdout_rows(datasets.Dataset.from_list(rows), 0.2)
    assert held == {i for i, r in enumerate(rows) if score(r["prompt"]) < 0.2}  # the hash, in any process
    by_prompt = {}
    for i, r in enumerate(rows):
        by_prompt.setdefault(r["prompt"], set()).add(i in held)
    assert all(len(sides) == 1 for sides in by_prompt.values())  # both pairs of a prompt on one side
    share = sum(True in s for s in by_prompt.values()) / len(by_prompt)
    assert 0.12 < share < 0.28  # 200 prompts at 0.2: sd 0.028

    more = datasets.Dataset.from_list(pref_rows(150, 400)[::-1] + rows[::-1])  # new rows first, all reordered
    held_more = data.holdout_rows(more, 0.2)
    old_sides = {r["prompt"]: i in held for i, r in enumerate(rows)}
    for i, r in enumerate(more):
        if r["prompt"] in old_sides:
            assert (i in held_more) == old_sides[r["prompt"]]
    assert data.holdout_rows(more, 0.0) == set()


def test_conversation_prompt_keys_ignore_key_order_and_filled_nulls():
    msgs = [{"role": "user", "content": "Hi é"}]
    alone = datasets.Dataset.from_list([{"prompt": msgs, "chosen": "a", "rejected": "b"}])
    # another row's message has a "name": datasets fills it with null in every message of the column
    mixed = datasets.Dataset.from_list([{"prompt": [{"content": "x", "role": "user", "name": "n"}], "chosen": "a",
                                         "rejected": "b"}, {"prompt": msgs, "chosen": "a", "rejected": "b"}])
    assert mixed[1]["prompt"][0].get("name", "absent") is None
    assert data.prompt_keys(alone)[0] == data.prompt_keys(mixed)[1] == json.dumps(msgs, sort_keys=True, ensure_ascii=False)


def test_load_data_holds_out_by_eval_fraction(make_cfg, tokenizer, tmp_path):
    rows = tiny_rows()[:96]
    rows[3]["chosen"] = rows[3]["rejected"]  # skipped: on neither side
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    d = inputs.load_data(make_cfg(dataset=str(path), eval_fraction=0.3), tokenizer, progress=False)
    expected = {i for i, r in enumerate(rows) if score(r["prompt"]) < 0.3 and i != 3}
    assert d.eval_part == "train" and d.eval_tok is None and len(d.tok.pairs) == 95
    assert {p.row for p in d.eval} == expected and {p.row for p in d.train} == set(range(96)) - expected - {3}
    assert [p.row for p in d.eval] == sorted(expected)  # data order

    capped = inputs.load_data(make_cfg(dataset=str(path), eval_fraction=0.3, eval_max_pairs=4), tokenizer,
                              progress=False)
    assert capped.eval == d.eval[:4] and capped.train == d.train
    sft = inputs.load_data(make_cfg(dataset=str(path), eval_fraction=0.3), tokenizer, progress=False, sft=True)
    assert [p.row for p in sft.eval] == [p.row for p in d.eval]  # SFT holds out the same rows
    assert isinstance(sft.eval[0], data.TokenizedCompletion)
    none = inputs.load_data(make_cfg(dataset=str(path)), tokenizer, progress=False)
    assert none.eval == [] and none.eval_part is None and none.train == none.tok.pairs


def one_forward_logps(model, pair) -> tuple[float, float]:
    b = data.collate([pair], 0)
    with torch.no_grad():
        c, r = completion_logps(model, b).split()
    return c.logps.item(), r.logps.item()


def test_precompute_caches_eval_dataset_in_the_same_build(make_cfg, tiny_path, tokenizer, tmp_path, capsys):
    rows = tiny_rows()
    train_path = write_jsonl(tmp_path / "train.jsonl", rows[:10])
    eval_rows = rows[200:207]
    eval_rows[2]["prompt"] = "Write a positive review of the lamp. " * 20  # skipped: prompt reaches max_length
    eval_path = write_jsonl(tmp_path / "eval.jsonl", eval_rows)
    cfg = make_cfg(dataset=str(train_path), eval_dataset=str(eval_path), cache_shard_rows=4,
                   precompute_batch_size=3)
    precompute.run(cfg, progress=False)
    total = len(sequences_of(cfg))  # 10 + 6 rows' sequences, in one build
    assert f"computed {total} sequences, reused 0" in capsys.readouterr().err and total > 16

    model = models.load_model(tiny_path, torch.device("cpu"), torch.float32)
    train_ref, ref = cached(cfg)
    assert ref.chosen.shape == (7,) and math.isnan(ref.chosen[2]) and ref.counts["num_rows"] == 7
    assert (ref.counts["num_pairs"], ref.counts["dropped_rows"]) == (6, [2])
    for p in data.tokenize_rows(data.load_rows(str(eval_path)), tokenizer, 64, None, progress=False).pairs:
        c, r = one_forward_logps(model, p)
        assert ref.chosen[p.row].item() == pytest.approx(c, abs=1e-4)
        assert ref.rejected[p.row].item() == pytest.approx(r, abs=1e-4)
    assert train_ref.chosen.shape == (10,) and torch.isfinite(train_ref.chosen).all()
    p = data.tokenize_rows(data.load_rows(str(train_path)), tokenizer, 64, None, progress=False).pairs[9]
    assert train_ref.chosen[9].item() == pytest.approx(one_forward_logps(model, p)[0], abs=1e-4)

    d = inputs.load_data(cfg, tokenizer, progress=False)
    assert d.eval_part == "eval" and [p.row for p in d.eval] == [0, 1, 3, 4, 5, 6] and d.train == d.tok.pairs
    rep = preflight.run(cfg)
    assert rep["eval"] == {"rows": 7, "pairs": 6, "skipped": 1} and rep["rows"] == 10
    assert "eval: 6 pairs of 7 rows" in preflight.summary_lines(rep)[0]

    precompute.run(make_cfg(dataset=str(train_path), eval_dataset=str(eval_path), eval_max_pairs=2), progress=False)
    assert f"computed 0 sequences, reused {total}" in capsys.readouterr().err


def components(cfg) -> dict:
    return inputs.fingerprint_components(cfg, devices.resolve(cfg),
                                         cache.Path(models.resolve_model_path(cfg.model_name_or_path)))


def test_fingerprint_has_eval_dataset_only_when_set(make_cfg, tmp_path):
    plain = components(make_cfg())
    assert "eval_dataset" not in plain and "eval_split" not in plain
    # eval_fraction and eval_max_pairs select among rows the cache holds anyway: the same cache
    assert components(make_cfg(eval_fraction=0.2, eval_max_pairs=5, eval_split="validation")) == plain

    eval_path = write_jsonl(tmp_path / "eval.jsonl", tiny_rows()[:5])
    with_eval = components(make_cfg(eval_dataset=str(eval_path)))
    assert {k: v for k, v in with_eval.items() if k != "eval_dataset"} == plain
    assert with_eval["eval_dataset"] == inputs.data_component(str(eval_path), "test")
    write_jsonl(eval_path, tiny_rows()[:6])
    changed = components(make_cfg(eval_dataset=str(eval_path)))
    assert changed["eval_dataset"] != with_eval["eval_dataset"]


def run_precompute(tmp_path, capsys, *overrides: str):
    """python -m lowmem_dpo.precompute, in this process (its entry point, run_cli): exit code and stderr."""
    from types import SimpleNamespace

    from lowmem_dpo.config.cli import run_cli

    capsys.readouterr()
    code = run_cli(precompute.main, [str(TINY_RECIPE), f"ref_cache_dir={tmp_path / 'cache'}",
                                     "load_best_model_at_end=false", "eval_fraction=0", *overrides], "precompute", "")
    return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


@pytest.mark.parametrize("case", ["none_held", "all_held", "eval_all_skipped"])
def test_eval_data_errors_exit_2_from_precompute(tmp_path, case, capsys):
    rows = tiny_rows()
    if case == "none_held":
        fraction = min(score(r["prompt"]) for r in rows) / 2
        args = [f"eval_fraction={fraction}"]
        expect = f"selects none of its {len({r['prompt'] for r in rows})} distinct prompts"
    elif case == "all_held":
        low = write_jsonl(tmp_path / "low.jsonl", [r for r in rows if score(r["prompt"]) < 0.4])
        args, expect = [f"dataset={low}", "eval_fraction=0.4"], "leaving none to train on"
    else:
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "same", "rejected": "same"}] * 2)
        args, expect = [f"eval_dataset={bad}"], f"dataset '{bad}': all 2 rows were skipped"
    p = run_precompute(tmp_path, capsys, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert expect in p.stderr
    assert not (tmp_path / "cache" / "index.sqlite").exists()  # refused before anything was written


def test_eval_rows_without_values_are_refused_naming_eval_dataset(make_cfg, tmp_path, capsys):
    """A cache built without eval_dataset serves train's rows; a run that adds eval_dataset is refused, naming its
    file's rows and the command; that command computes only the eval rows."""
    from lowmem_dpo import train
    from lowmem_dpo.runtime.errors import UserError

    rows = tiny_rows()
    eval_path = write_jsonl(tmp_path / "e.jsonl", rows[300:306])
    plain = make_cfg(dataset=str(write_jsonl(tmp_path / "t.jsonl", rows[:6])))
    precompute.run(plain, progress=False)
    cfg = make_cfg(dataset=plain.dataset, eval_dataset=str(eval_path))
    with pytest.raises(UserError, match=f"no reference values for 6 of the 6 rows this run uses \\({eval_path} row 0 "
                                        "at line 1; .*lowmem-dpo precompute"):
        train.run(cfg, progress=False)
    capsys.readouterr()
    precompute.run(cfg, progress=False)
    new = len(sequences_of(cfg) - sequences_of(plain))
    assert f"computed {new} sequences, reused {len(sequences_of(cfg)) - new}" in capsys.readouterr().err
    assert torch.isfinite(cached(cfg)[1].chosen).all()
