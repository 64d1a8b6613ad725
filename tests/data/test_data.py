"""Loading every supported format and tokenizing as TRL 1.16's DPOTrainer does."""

import json

import pytest
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import data
from lowmem_dpo.runtime.errors import UserError

ROWS = [
    {"prompt": "Write a positive review of the lamp.\n", "chosen": "The lamp is great.", "rejected": "The lamp is dull."},
    {"prompt": "Write a negative review of the tea.\n", "chosen": "The tea is sour.</s>", "rejected": "The tea is warm."},
]


def test_standard_rows_follow_trl_conventions(tokenizer):
    ds = data.load_rows(str(write_jsonl_tmp(ROWS)))
    tok = data.tokenize_rows(ds, tokenizer, max_length=128, max_prompt_length=None, progress=False)
    for pair, row in zip(tok.pairs, ROWS):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        assert prompt_ids[0] == tokenizer.bos_token_id  # default special tokens: BOS in front
        assert pair.prompt_ids == prompt_ids
        chosen_text = row["chosen"] if row["chosen"].endswith("</s>") else row["chosen"] + "</s>"
        full = tokenizer(row["prompt"] + chosen_text)["input_ids"]
        assert pair.prompt_ids + pair.chosen_ids == full
        # EOS appended once, never twice
        assert pair.chosen_ids[-1] == tokenizer.eos_token_id and pair.chosen_ids[-2] != tokenizer.eos_token_id
        assert pair.rejected_ids[-1] == tokenizer.eos_token_id


def write_jsonl_tmp(rows, _counter=[0]):
    import tempfile
    from pathlib import Path

    _counter[0] += 1
    path = Path(tempfile.mkdtemp()) / f"rows{_counter[0]}.jsonl"
    return write_jsonl(path, rows)


def test_completion_starts_where_ids_diverge(tokenizer):
    """A prompt ending mid-word: the merged token belongs to the completion, as in TRL."""
    rows = [{"prompt": "The lam", "chosen": "p is great.", "rejected": "p is dull."}]
    tok = data.tokenize_rows(data.load_rows(str(write_jsonl_tmp(rows))), tokenizer, 128, None, progress=False)
    p = tok.pairs[0]
    full = tokenizer("The lamp is great.</s>")["input_ids"]
    assert p.prompt_ids + p.chosen_ids == full
    assert len(p.prompt_ids) < len(tokenizer("The lam")["input_ids"])


def test_truncation_and_dropped_rows(tokenizer):
    long_prompt = "Write a positive review of the lamp. " * 10
    # completions that differ from their first token, so a cut one is still a preference
    rows = [dict(r, chosen="Yes, " + r["chosen"], rejected="No, " + r["rejected"]) for r in ROWS]
    rows += [{"prompt": long_prompt, "chosen": "Yes.", "rejected": "No."}]
    ds = data.load_rows(str(write_jsonl_tmp(rows)))
    plen = len(tokenizer(ROWS[0]["prompt"])["input_ids"])
    tok = data.tokenize_rows(ds, tokenizer, max_length=plen + 2, max_prompt_length=None, progress=False)
    assert tok.dropped == [2] and tok.num_rows == 3 and tok.skipped == {"prompt_too_long": [2]}
    assert [p.row for p in tok.pairs] == [0, 1]
    assert tok.truncated == {"prompt": [], "chosen": [0, 1], "rejected": [0, 1]}
    for p in tok.pairs:
        assert len(p.prompt_ids) + len(p.chosen_ids) <= plen + 2
    assert len(tok.pairs[0].chosen_ids) == 2  # the first max_length tokens are kept
    # max_prompt_length cuts the prompt from the left first, so the long row survives
    tok2 = data.tokenize_rows(ds, tokenizer, max_length=24, max_prompt_length=8, progress=False)
    assert tok2.dropped == [] and len(tok2.pairs[2].prompt_ids) == 8 and 2 in tok2.truncated["prompt"]
    full_prompt = tokenizer(long_prompt)["input_ids"]
    assert tok2.pairs[2].prompt_ids == full_prompt[-8:]


def test_all_rows_dropped_is_a_user_error(tokenizer):
    ds = data.load_rows(str(write_jsonl_tmp(ROWS)))
    with pytest.raises(UserError, match="all 2 rows were skipped.*prompt alone reaches max_length=3"):
        data.tokenize_rows(ds, tokenizer, max_length=3, max_prompt_length=None, progress=False)


def test_conversational_rows_use_chat_template(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Review the lamp."}],
             "chosen": [{"role": "assistant", "content": "Great lamp."}],
             "rejected": [{"role": "assistant", "content": "Dull lamp."}]}]
    tok = data.tokenize_rows(data.load_rows(str(write_jsonl_tmp(rows))), tokenizer, 128, None, progress=False)
    p = tok.pairs[0]
    assert tokenizer.decode(p.prompt_ids) == "<|user|>\nReview the lamp.</s>\n<|assistant|>\n"
    assert tokenizer.decode(p.chosen_ids) == "Great lamp.</s>\n"
    assert tokenizer.decode(p.rejected_ids) == "Dull lamp.</s>\n"


def test_every_format_gives_the_same_pairs(tmp_path, tokenizer):
    import datasets

    base = data.load_rows(str(TINY_DATA)).select(range(20))
    rows = base.to_list()
    paths = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", rows),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "disk": tmp_path / "saved",
    }
    paths["json"].write_text(json.dumps(rows))
    base.to_parquet(str(paths["parquet"]))
    base.to_csv(str(paths["csv"]), index=False)
    datasets.DatasetDict({"train": base}).save_to_disk(str(paths["disk"]))
    want = data.tokenize_rows(base, tokenizer, 64, None, progress=False).pairs
    for kind, path in paths.items():
        got = data.tokenize_rows(data.load_rows(str(path)), tokenizer, 64, None, progress=False).pairs
        assert got == want, kind


@pytest.mark.parametrize("content, fragment", [
    ("", "is empty"),
    ('{"prompt": "a", "chosen": "b"}\n', "line 1: lacks rejected (has prompt, chosen)"),
    ('{"prompt": "a", "chosen": "", "rejected": "c"}\n', "all 1 rows were skipped"),
    ("not json\n", "line 1, column 1: not JSON (Expecting value) at >>>not json"),
])
def test_bad_files_are_user_errors(tmp_path, tokenizer, content, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError) as e:
        data.tokenize_rows(data.load_rows(str(path)), tokenizer, 64, None, spec=str(path), progress=False)
    assert fragment in str(e.value) and "bad.jsonl" in str(e.value)


def test_missing_dataset(tmp_path):
    with pytest.raises(UserError, match="not found"):
        data.load_rows(str(tmp_path / "nope.jsonl"))


def test_collate_concatenates_chosen_then_rejected(tokenizer):
    pairs = [data.TokenizedPair(7, [1, 10], [11, 12, 2], [13, 2]), data.TokenizedPair(3, [1], [14, 2], [15, 16, 17, 2])]
    b = data.collate(pairs, pad_token_id=0)
    assert b.rows.tolist() == [7, 3]
    assert b.input_ids.tolist() == [[1, 10, 11, 12, 2], [1, 14, 2, 0, 0], [1, 10, 13, 2, 0], [1, 15, 16, 17, 2]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert b.num_tokens == 5 + 3 + 4 + 5
