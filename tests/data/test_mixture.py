"""`dataset` as a mixture of sources (sources.py, data/mix.py; README, Mixtures): every form coerces and writes
back, bad entries are refused naming them, the rows taken follow the stated rule (sha256 of seed and row, lowest
first; round half up), the fingerprint covers the selection and keeps a plain recipe's as it was, and the mixed
rows run through precompute and train (ln 2 at step 1), messages naming each source's file and line."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest
from conftest import TINY_DATA, TINY_RECIPE, cached, write_jsonl

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.cli import help_text, run_cli
from lowmem_dpo.config.recipe import build_config, load_config, require
from lowmem_dpo.config.sources import Source
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import ConfigError, UserError
from lowmem_dpo.runtime.files import files_digest
from lowmem_dpo.training import checkpoint, inputs, resuming

ROWS = [json.loads(line) for line in TINY_DATA.read_text().splitlines() if line.strip()]


def taken(rows: list[dict], seed: int, k: int) -> list[int]:
    """The rule as README states it, written out here: the k rows with the lowest sha256(seed, row JSON)."""
    def score(row):
        text = json.dumps({k: v for k, v in row.items() if v is not None}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(f"{seed}\n{text}".encode()).digest()[:8]

    return sorted(sorted(range(len(rows)), key=lambda i: (score(rows[i]), i))[:k])


@pytest.fixture
def two(tmp_path):
    """Two sources: a.jsonl (30 rows) and b.jsonl (20 other rows, after a blank first line)."""
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:30])
    b = tmp_path / "b.jsonl"
    b.write_text("\n" + "".join(json.dumps(r) + "\n" for r in ROWS[30:50]), encoding="utf-8")
    return a, b


def mixture(sources, seed=0, cap=None, split="train"):
    return data.load_mixture(build_config({"dataset": sources}).dataset, split, seed, cap, data.load_rows)


# -- the config ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, want", [
    ("data/x.jsonl", [Source("data/x.jsonl")]),
    ({"path": "x.jsonl", "split": "test", "fraction": 0.5}, [Source("x.jsonl", "test", 0.5)]),
    (["a.jsonl", {"path": "org/hub", "rows": 10}], [Source("a.jsonl"), Source("org/hub", rows=10)]),
    ("[a.jsonl, {path: b.jsonl, fraction: 0.1}]", [Source("a.jsonl"), Source("b.jsonl", fraction=0.1)]),  # override
    ([{"path": "a.jsonl", "fraction": 1}], [Source("a.jsonl", fraction=1.0)]),
])
def test_every_form_coerces_and_writes_back(raw, want, tmp_path):
    cfg = build_config({"dataset": raw, "max_train_samples": 7})
    assert cfg.dataset == want and cfg.max_train_samples == 7
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())  # output_dir/config.yaml: reloaded as it was written
    assert load_config(path).dataset == want


def test_a_single_source_stays_a_plain_override_and_path(tmp_path):
    cfg = load_config(TINY_RECIPE, ["dataset=data/x.jsonl"])
    assert cfg.dataset == [Source("data/x.jsonl")]
    assert "\ndataset: data/x.jsonl\n" in cfg.to_yaml()  # as config.yaml always read
    assert build_config({}).max_train_samples is None
    text = help_text("train", "doc")
    assert "dataset (a path or hub name, or a list of sources" in text and "list of sources: each a path or {path, split, fraction | rows}, required)" in text
    assert "max_train_samples (int or null, default null" in text


@pytest.mark.parametrize("raw, message", [
    ([{"path": "a.jsonl", "fraction": 0}], "dataset[0].fraction=0.0: out of range, expected a share in (0, 1]"),
    (["a.jsonl", {"path": "b.jsonl", "fraction": 1.5}], "dataset[1].fraction=1.5: out of range"),
    (["a.jsonl", {"path": "b.jsonl", "fraction": 0.5, "rows": 3}], "dataset[1]: fraction=0.5 and rows=3; set one"),
    ([{"path": "a.jsonl", "rows": 0}], "dataset[0].rows=0: out of range, expected >= 1"),
    ([{"path": "a.jsonl", "rows": 2.5}], "dataset[0].rows=2.5: expected an integer"),
    (["a.jsonl", {"path": "b.jsonl", "fracton": 0.5}], "dataset[1]: unknown key 'fracton' (did you mean fraction?)"),
    (["a.jsonl", {"fraction": 0.5}], "dataset[1]: needs a path"),
    ([], "dataset=[]: name at least one source"),
    (5, "dataset=5: expected a path, or a mapping"),
    (["a.jsonl", "b.jsonl", {"path": "a.jsonl", "rows": 2}], "dataset[2]: 'a.jsonl' (split train) is "
                                                             "already dataset[0]"),
    (["a.jsonl", {"path": "a.jsonl", "split": "train"}], "dataset[1]: 'a.jsonl' (split train) is already dataset[0]"),
    ("[a.jsonl, {path: b", "dataset='[a.jsonl, {path: b': not valid YAML"),
])
def test_bad_entries_are_refused_naming_them(raw, message):
    with pytest.raises(ConfigError) as e:
        build_config({"dataset": raw})
    assert message in str(e.value)


def test_a_null_dataset_is_not_set_and_a_stage_refuses_it():
    cfg = build_config({"dataset": None, "model_name_or_path": "m", "ref_cache_dir": "c"})
    assert cfg.dataset is None
    with pytest.raises(ConfigError, match=r"^dataset is not set: name the preference rows.*\(precompute needs "
                                          r"dataset\)$"):
        require(cfg, "precompute")


def test_max_train_samples_bounds_and_a_bad_entry_exits_2_from_a_stage(capsys):
    with pytest.raises(ConfigError, match="max_train_samples=0: out of range"):
        build_config({"max_train_samples": 0})
    args = ["lowmem_dpo:tiny-cpu", "dataset=[data/tiny-prefs.jsonl, {path: data/tiny-prefs.jsonl, split: x, "
            "fraction: 2}]"]
    assert run_cli(precompute.main, args, "precompute", "") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "dataset[1].fraction=2.0: out of range" in err


def test_a_checkpoint_whose_config_has_dataset_as_a_string_resumes(make_cfg, tmp_path):
    """Checkpoints and config.yaml written before mixtures say `dataset: PATH`: the same setting."""
    cfg = make_cfg(max_steps=1, save_steps=1)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    (step, folder), = checkpoint.complete(cfg.output_dir)
    state = json.loads((folder / checkpoint.STATE).read_text())
    assert state["config"]["dataset"] == [{"path": str(TINY_DATA), "split": None, "fraction": None, "rows": None}]
    state["config"]["dataset"] = str(TINY_DATA)  # as an older lowmem_dpo wrote it
    (folder / checkpoint.STATE).write_text(json.dumps(state))
    more = dataclasses.replace(cfg, max_steps=2)
    assert resuming.find_resume(more)[0] == folder  # no refusal: the values compare as declared
    other = dataclasses.replace(more, dataset=[Source(str(TINY_DATA), fraction=0.5)])
    with pytest.raises(UserError, match="dataset"):
        resuming.find_resume(other)


# -- which rows ----------------------------------------------------------------------------------------------------
def test_rows_taken_follow_the_rule_and_the_same_recipe_takes_the_same_rows(two):
    a, b = two
    sources = [str(a), {"path": str(b), "fraction": 0.25}]
    mix = mixture(sources, seed=3)
    assert [p.indices for p in mix.parts] == [None, taken(ROWS[30:50], 3, 5)]  # 0.25 x 20 = 5
    assert [p.indices for p in mixture(sources, seed=3).parts] == [p.indices for p in mix.parts]
    assert [mix.row(i) for i in range(len(mix))] == ROWS[:30] + [ROWS[30 + i] for i in taken(ROWS[30:50], 3, 5)]
    assert mixture(sources, seed=4).parts[1].indices != mix.parts[1].indices  # another seed, other rows


@pytest.mark.parametrize("entry, n, k", [
    ({"fraction": 0.25}, 10, 3),  # 2.5 rounds half up
    ({"fraction": 0.24}, 10, 2),  # 2.4 rounds down
    ({"fraction": 0.01}, 10, 1),  # at least one row
    ({"fraction": 1.0}, 10, 10),
    ({"rows": 4}, 10, 4),
])
def test_fraction_rounds_half_up_and_rows_is_a_count(entry, n, k, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:n])
    (part,) = mixture([{"path": str(path), **entry}], seed=0).parts
    assert len(part) == k and (part.indices is None or part.indices == taken(ROWS[:n], 0, k))


def test_more_rows_than_the_source_has_is_refused(two):
    with pytest.raises(UserError, match=r"dataset\[1\] '.*b.jsonl': rows=21, but it has 20 rows"):
        mixture([str(two[0]), {"path": str(two[1]), "rows": 21}])


def test_rows_added_to_one_source_leave_the_others_rows(two, tmp_path):
    a, b = two
    before = mixture([{"path": str(a), "fraction": 0.3}, {"path": str(b), "rows": 6}], seed=1)
    with open(b, "a", encoding="utf-8") as f:  # new rows at the end of b
        f.write("".join(json.dumps(r) + "\n" for r in ROWS[50:70]))
    after = mixture([{"path": str(a), "fraction": 0.3}, {"path": str(b), "rows": 6}], seed=1)
    assert after.parts[0].indices == before.parts[0].indices == taken(ROWS[:30], 1, 9)
    assert after.parts[1].indices == taken(ROWS[30:70], 1, 6)
    # b's taken rows change only where a new row scores lower: the old ones kept are the old ones still lowest
    kept = set(before.parts[1].indices) & set(after.parts[1].indices)
    assert kept and all(i < 20 for i in kept) and len(kept) >= 6 - sum(i >= 20 for i in after.parts[1].indices)


def test_max_train_samples_keeps_the_lowest_scored_rows_of_the_mixture(two):
    a, b = two
    mix = mixture([str(a), {"path": str(b), "fraction": 0.5}], seed=2, cap=12)
    first = [(i, r) for i, r in enumerate(ROWS[:30])] + [(30 + i, ROWS[30 + i]) for i in taken(ROWS[30:50], 2, 10)]
    best = taken([r for _, r in first], 2, 12)
    assert len(mix) == 12
    assert [mix.row(i) for i in range(12)] == [first[j][1] for j in best]
    assert mixture([str(a)], cap=100).parts[0].indices is None  # a cap above the rows takes every row


# -- the fingerprint -----------------------------------------------------------------------------------------------
def test_the_fingerprint_covers_the_selection_and_a_plain_recipe_keeps_its_own(make_cfg, tiny_path, two):
    a, b = two

    def dataset_fp(**keys):
        return inputs.file_components(make_cfg(**keys), tiny_path, None, tiny_path)["dataset"]

    # As the committed code wrote it before mixtures: the file's digest and no split, nothing else.
    assert dataset_fp() == {"files": files_digest([TINY_DATA]), "split": None}
    assert dataset_fp(seed=7) == dataset_fp(seed=8)  # seed: no selection depends on it
    full = inputs.fingerprint_components(make_cfg(), devices.resolve(make_cfg()), tiny_path)
    assert "max_train_samples" not in full and "seed" not in full
    mix = [str(a), {"path": str(b), "fraction": 0.5}]
    variants = [dict(dataset=mix), dict(dataset=mix, seed=1), dict(dataset=[str(a), {"path": str(b), "fraction": 0.6}]),
                dict(dataset=mix, max_train_samples=10), dict(dataset=mix, max_train_samples=11),
                dict(dataset=[str(a), str(b)]), dict(dataset=[str(a)], max_train_samples=10),
                dict(dataset=[str(a), {"path": str(b), "rows": 10}])]
    fps = [json.dumps(dataset_fp(**v), sort_keys=True) for v in variants]
    assert len(set(fps)) == len(fps)
    assert dataset_fp(dataset=[str(a), str(b)], seed=1) == dataset_fp(dataset=[str(a), str(b)], seed=2)
    before = dataset_fp(dataset=mix)
    b.write_text(b.read_text() + json.dumps(ROWS[60]) + "\n")  # a source's content
    assert dataset_fp(dataset=mix) != before
    assert before != dataset_fp()


# -- the stages ----------------------------------------------------------------------------------------------------
def test_precompute_and_train_on_a_mixture_start_at_ln2(make_cfg, two):
    a, b = two
    cfg = make_cfg(dataset=[str(a), {"path": str(b), "fraction": 0.5}], max_train_samples=36, max_steps=1)
    precompute.run(cfg, progress=False)
    ref = cached(cfg)[0]
    assert ref.counts["num_rows"] == 36 and ref.chosen.shape == (36,) and not ref.chosen.isnan().any()
    first = train.run(cfg, progress=False).metrics
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    # another selection of the same rows: served from the same values, none computed again
    fewer = dataclasses.replace(cfg, max_train_samples=30, resume="never")
    assert len(train.setup(fewer, progress=False).run.items) == 30


def test_a_bad_row_in_the_second_source_names_its_file_and_line(make_cfg, tokenizer, tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS[:10])
    rows = [dict(r) for r in ROWS[10:30]]
    for i in range(0, 20, 3):  # several unusable rows, so a half of b takes some of them
        rows[i]["rejected"] = rows[i]["chosen"]
    b = tmp_path / "b.jsonl"
    b.write_text("\n\n" + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")  # line = row + 3
    sources = [str(a), {"path": str(b), "fraction": 0.5}]
    picked = taken(rows, 0, 10)
    bad = [i for i in picked if i % 3 == 0]
    assert bad, "the rule takes none of the bad rows: change the data"
    cfg = make_cfg(dataset=sources)
    tok = inputs.tokenized(cfg, tokenizer, progress=False)  # skipped and counted, in the mixture's row order
    assert tok.dropped == [10 + picked.index(i) for i in bad]
    log = capsys.readouterr().err
    assert f"skipped {len(bad)} of 10 rows" in log and f"row {bad[0]} at line {bad[0] + 3}" in log
    args = ["lowmem_dpo:tiny-cpu", f"dataset=[{a}, {{path: {b}, fraction: 0.5}}]", "strict=true", "seed=0",
            f"ref_cache_dir={tmp_path / 'c'}", "device=cpu", "max_length=64"]
    assert run_cli(precompute.main, args, "precompute", "") == 2
    err = capsys.readouterr().err
    assert f"error: dataset '{b}' row {bad[0]} at line {bad[0] + 3}: chosen is identical to rejected" in err
    b.write_text(b.read_text() + '{"prompt": "p", "chosen": 5, "rejected": "r"}\n')  # broken: refused by line
    assert run_cli(precompute.main, args, "precompute", "") == 2
    assert f"error: dataset '{b}' line 23: chosen is a number" in capsys.readouterr().err


def test_eval_fraction_holds_out_prompts_of_the_mixture_and_sft_reads_it(make_cfg, tokenizer, two, tmp_path):
    a, b = two
    cfg = make_cfg(dataset=[str(a), {"path": str(b), "rows": 8}], eval_fraction=0.3, seed=5)
    d = inputs.load_data(cfg, tokenizer, progress=False)
    rows = [d.mixture.row(i) for i in range(len(d.mixture))]
    held = data.held_out([data.split.prompt_key(r["prompt"]) for r in rows], 0.3)
    assert held and {p.row for p in d.eval} == held and {p.row for p in d.train} == set(range(38)) - held
    completions = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]}
                                                       for r in ROWS[60:70]])
    s = inputs.load_data(make_cfg(dataset=[str(a), str(completions)]), tokenizer, progress=False, sft=True)
    assert len(s.train) == 40 and {p.row for p in s.train} == set(range(40))


def test_sources_in_different_formats(make_cfg, tokenizer, tmp_path):
    """Each source is tokenized in its own format; one TRL dataset of both is refused with a message."""
    chats = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in ROWS[:6]])
    cfg = make_cfg(dataset=[str(TINY_DATA), str(chats)])
    if tokenizer.chat_template is None:
        pytest.skip("the tiny tokenizer has no chat template")
    assert len(inputs.tokenized(cfg, tokenizer, progress=False).pairs) == len(ROWS) + 6
    with pytest.raises(UserError, match="differ in format"):
        inputs.mixture(cfg).dataset(data.REQUIRED)
