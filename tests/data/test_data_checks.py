"""Bad input: every structural problem stops with one line naming the file and the line or row; unusable rows
are skipped and counted (refused with strict=true); a failing run leaves a good cache and adapter as they were."""

import json

import pytest
import torch
from conftest import TINY_DATA, TINY_RECIPE, cached, write_jsonl

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.data import cache
from lowmem_dpo.runtime.errors import UserError

GOOD = json.dumps({"prompt": "Write a positive review of the lamp.\n", "chosen": "The lamp is great.",
                   "rejected": "The lamp is dull."})


def user_error(path, tokenizer, strict=False) -> str:
    with pytest.raises(UserError) as e:
        rows = data.load_rows(str(path))
        data.tokenize_rows(rows, tokenizer, 64, None, spec=str(path), progress=False, strict=strict)
    message = str(e.value)
    assert str(path) in message and "\n" not in message  # one line, naming the file
    return message


@pytest.mark.parametrize("name, content, fragment", [
    ("missing.jsonl", None, "not found"),
    ("empty.jsonl", b"", "is empty"),
    ("blank.jsonl", b"\n  \n\n", "has no rows"),
    ("notjson.jsonl", f"{GOOD}\n\n{{'prompt': 'a'}}\n".encode(), "line 3, column 2: not JSON"),
    ("scalar.jsonl", f"{GOOD}\n[1, 2]\n".encode(), "line 2: a list, not an object"),
    ("noprompt.jsonl", f'{GOOD}\n{{"chosen": "b", "rejected": "c"}}\n'.encode(), "line 2: lacks prompt"),
    ("number.jsonl", f'{GOOD}\n{{"prompt": "a", "chosen": 5, "rejected": "c"}}\n'.encode(),
     "line 2: chosen is a number"),
    ("dict.jsonl", f'{GOOD}\n{{"prompt": "a", "chosen": "b", "rejected": {{"text": "c"}}}}\n'.encode(),
     "line 2: rejected is an object"),
    ("mixed.jsonl", f'{GOOD}\n{{"prompt": [{{"role": "user", "content": "a"}}], '
     f'"chosen": [{{"role": "assistant", "content": "b"}}], "rejected": [{{"role": "assistant", "content": "c"}}]}}\n'
     .encode(), "line 2: is a conversation row but the rows before it are text rows"),
    ("latin1.jsonl", f"{GOOD}\n".encode() + '{"prompt": "café", "chosen": "b", "rejected": "c"}\n'.encode("latin-1"),
     "line 2: not UTF-8 text (byte 0xe9"),
    ("latin1.csv", "prompt,chosen,rejected\na,b,c\n".encode() + "café,b,c\n".encode("latin-1"),
     "line 3: not UTF-8 text"),
    ("header.csv", b"prompt,chosen,rejected\n\n", "has no rows under its header line: it needs rows with prompt"),
    ("rows.json", json.dumps([json.loads(GOOD), {"prompt": "a", "chosen": "b"}]).encode(),
     "row 1: lacks rejected"),
])
def test_structural_problems_refuse_with_file_and_line(tmp_path, tokenizer, name, content, fragment):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    assert fragment in user_error(path, tokenizer)


def test_the_caller_names_the_required_columns(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}])
    assert len(data.load_rows(str(path), required=("prompt",))) == 1
    with pytest.raises(UserError, match="line 1: lacks chosen, rejected"):
        data.load_rows(str(path))


def test_non_text_values_in_other_formats_name_the_row(tmp_path, tokenizer):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_dict({"prompt": ["a", "b"], "chosen": [1, 2], "rejected": ["c", "d"]}).to_parquet(str(path))
    assert "row 0: chosen is a number" in user_error(path, tokenizer)


def skip_rows(tmp_path):
    """Rows 1 (line 3) and 4 (line 6) empty, row 2 identical, row 5 a prompt reaching max_length; blank lines
    between, which the line numbers count and the row numbers do not."""
    good = json.loads(GOOD)
    rows = [good, dict(good, chosen="   "), dict(good, rejected=good["chosen"]), good, dict(good, prompt=None),
            dict(good, prompt="Write a positive review of the lamp. " * 20), good]
    path = tmp_path / "skips.jsonl"
    lines = [json.dumps(r) for r in rows]
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")
    return path, {"empty": [1, 4], "identical": [2], "prompt_too_long": [5]}


def test_unusable_rows_are_skipped_counted_and_refused_with_strict(tmp_path, tokenizer, capsys):
    path, expected = skip_rows(tmp_path)
    tok = data.tokenize_rows(data.load_rows(str(path)), tokenizer, 64, None, spec=str(path), progress=False)
    assert tok.skipped == expected and tok.num_rows == 7
    assert [p.row for p in tok.pairs] == [r for r in range(7) if r not in tok.dropped]
    logged = capsys.readouterr().err
    assert "skipped 4 of 7 rows: 2 because prompt, chosen or rejected is empty (row 1 at line 3, row 4 at line 6)" \
        in logged and "1 because the prompt alone reaches max_length=64 (row 5 at line 7)" in logged

    message = user_error(path, tokenizer, strict=True)  # the first offending row, and what to do
    assert "row 1 at line 3: prompt, chosen or rejected is empty" in message and "3 more" in message
    assert "set strict=false" in message


def test_identical_tokens_within_max_length_are_skipped(tmp_path, tokenizer):
    good = json.loads(GOOD)
    path = write_jsonl(tmp_path / "d.jsonl", [good, dict(good, chosen="The lamp is great and bright.",
                                                         rejected="The lamp is great and dull.")])
    common = len(tokenizer(good["prompt"] + "The lamp is great and")["input_ids"])
    tok = data.tokenize_rows(data.load_rows(str(path)), tokenizer, common, None, progress=False)
    assert tok.skipped == {"identical_tokens": [1]}  # row 0 differs within the first `common` tokens
    tok = data.tokenize_rows(data.load_rows(str(path)), tokenizer, common + 1, None, progress=False)
    assert tok.skipped == {} and len(tok.pairs) == 2


def test_every_row_skipped_is_refused(tmp_path, tokenizer):
    good = json.loads(GOOD)
    path = write_jsonl(tmp_path / "d.jsonl", [dict(good, chosen=""), dict(good, rejected=good["chosen"])])
    message = user_error(path, tokenizer)
    assert "all 2 rows were skipped" in message and "first: row 0 at line 1; fill in or remove the row" in message


def test_cache_and_train_agree_on_skipped_rows_and_strict_refuses_an_up_to_date_cache(make_cfg, tmp_path):
    path, expected = skip_rows(tmp_path)
    cfg = make_cfg(dataset=str(path))
    precompute.run(cfg, progress=False)
    ref = cached(cfg)[0]
    assert ref.counts["skipped"] == expected and ref.counts["dropped_rows"] == [1, 2, 4, 5]
    assert torch.isnan(ref.chosen).nonzero().flatten().tolist() == ref.counts["dropped_rows"]
    session = train.setup(cfg, progress=False)  # checks the cache covers every row it trains on
    assert sorted(p.row for p in session.run.items) == [0, 3, 6]

    before = {p: p.stat().st_mtime_ns for p in cache.Path(cfg.ref_cache_dir).rglob("*")}
    with pytest.raises(UserError, match="row 1 at line 3.*strict=true refuses"):
        precompute.run(make_cfg(dataset=str(path), strict=True), progress=False)
    with pytest.raises(UserError, match="row 1 at line 3.*strict=true refuses"):
        train.setup(make_cfg(dataset=str(path), strict=True), progress=False)
    assert {p: p.stat().st_mtime_ns for p in cache.Path(cfg.ref_cache_dir).rglob("*")} == before


def test_a_failing_run_keeps_the_good_cache_and_adapter(make_cfg, tmp_path, capsys):
    cfg = make_cfg(max_steps=1)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    out, ref = cache.Path(cfg.output_dir), cache.Path(cfg.ref_cache_dir)
    before = {p: p.read_bytes() for p in [*out.rglob("*"), *ref.rglob("*")] if p.is_file()}

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(TINY_DATA.read_bytes() + b'{"prompt": "a", "chosen": "\xff", "rejected": "c"}\n')
    line = len(TINY_DATA.read_text().splitlines()) + 1
    args = [str(TINY_RECIPE), f"dataset={bad}", f"ref_cache_dir={ref}", f"output_dir={out}",
            "device=cpu", "dtype=float32", "max_length=64"]
    capsys.readouterr()
    # train with ref_source=live: no cache check comes first (with the cache, the changed dataset is refused
    # by its fingerprint before the data is read); resume=never: the run's checkpoint has the other dataset
    for stage, main, extra in (("precompute", precompute.main, []),
                               ("train", train.main, ["ref_source=live", "resume=never"])):
        assert run_cli(main, args + extra, stage, "") == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        (message,) = [m for m in err.splitlines() if m.startswith("lowmem_dpo.")]  # one line
        assert message.startswith(f"lowmem_dpo.{stage}: error: dataset '{bad}' line {line}: not UTF-8")
    after = {p: p.read_bytes() for p in [*out.rglob("*"), *ref.rglob("*")] if p.is_file()}
    assert after == before
