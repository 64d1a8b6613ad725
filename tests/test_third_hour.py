"""A new user's third hour: data dropped or cut is never silent (precompute, train and sft stop past
max_skipped_share / max_truncated_share, naming the max_length that keeps 95% of the rows whole; preflight warns;
plan shows the lengths), and their own columns on a chat model (the three _column keys named in the error,
apply_chat_template and system_prompt). Each stage runs as the user runs it: its CLI, in this process."""

from __future__ import annotations

import csv
import json
import re

import pytest
from conftest import TINY_DATA, TINY_RECIPE, write_jsonl

from lowmem_dpo import data, plan, precompute, preflight, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.runtime.errors import UserError

ROWS = [json.loads(line) for line in open(TINY_DATA)][:40]


def stage(main, args, name, capsys) -> tuple[int, str]:
    code = run_cli(main, args, name, "doc")
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def whole_rows(tok: data.TokenizedData) -> int:
    """Rows kept with no completion cut."""
    cut = {r for part in ("chosen", "rejected") for r in tok.truncated[part]}
    return sum(p.row not in cut for p in tok.pairs)


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    """40 rows, 8 of them (20%) with a prompt six times as long: at max_length=40 those are skipped."""
    rows = [dict(r, prompt=r["prompt"] * 6) if i % 5 == 0 else r for i, r in enumerate(ROWS)]
    return write_jsonl(tmp_path_factory.mktemp("third_hour") / "long.jsonl", rows)


def test_rows_lost_past_the_limits_stop_the_run_with_the_max_length_that_keeps_them(long_prompts, tokenizer,
                                                                                     tmp_path, capsys):
    args = [TINY_RECIPE, f"dataset={long_prompts}", "max_length=40", "max_prompt_length=null", "dtype=float32",
            f"ref_cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}", "max_steps=1",
            "eval_fraction=0", "load_best_model_at_end=false"]
    tok = data.tokenize_rows(data.load_rows(str(long_prompts)), tokenizer, 40, None, progress=False)
    skipped = len(tok.dropped)
    assert skipped == 8 and tok.skipped == {"prompt_too_long": tok.dropped}
    code, out = stage(precompute.main, args, "precompute", capsys)
    last = out.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in out, out[-2000:]
    assert f"kept 32 of 40 rows ({skipped} skipped, 20%)" in out  # stated before the stop
    assert (f"{skipped} of 40 rows (20%) are skipped ({skipped} because the prompt alone reaches max_length=40), "
            "over max_skipped_share=0.1") in last
    assert "max_skipped_share=1 max_truncated_share=1 to go on" in last
    advised = int(re.search(r"max_length=(\d+) keeps 95% of the rows whole", last)[1])
    # the advised max_length keeps at least 95% of the rows whole, and one token less does not
    ds = data.load_rows(str(long_prompts))
    assert whole_rows(data.tokenize_rows(ds, tokenizer, advised, None, progress=False)) >= 0.95 * 40
    assert whole_rows(data.tokenize_rows(ds, tokenizer, advised - 1, None, progress=False)) < 0.95 * 40
    code, out = stage(train.main, args, "train", capsys)
    assert code == 2 and "over max_skipped_share=0.1" in out.strip().splitlines()[-1]
    # the explicit keys go on; preflight, at the default limits, still warns with the same numbers
    go_on = [*args, "max_skipped_share=1", "max_truncated_share=1"]
    code, out = stage(precompute.main, go_on, "precompute", capsys)
    assert code == 0 and "warning: dataset" not in out, out[-2000:]
    code, out = stage(preflight.main, args, "preflight", capsys)
    assert code == 0 and f"warning: dataset: {skipped} of 40 rows (20%) are skipped" in out, out[-2000:]
    assert "preflight: no warning" not in out
    code, out = stage(train.main, go_on, "train", capsys)
    assert code == 0, out[-2000:]


def test_completions_cut_past_the_limit_stop_the_run(tokenizer, tmp_path, capsys):
    """Completions cut (a max_length just past the prompts): stated, and refused past max_truncated_share."""
    rows = [dict(r, chosen="Yes, " + r["chosen"], rejected="No, " + r["rejected"]) for r in ROWS]  # differ at once
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    longest_prompt = max(len(tokenizer(r["prompt"])["input_ids"]) for r in ROWS)
    tok = data.tokenize_rows(data.load_rows(str(path)), tokenizer, longest_prompt + 2, None, progress=False)
    cut = len(tok.truncated["chosen"]) + len(tok.truncated["rejected"])
    assert cut > 0.25 * 2 * len(tok.pairs)
    code, out = stage(precompute.main, [TINY_RECIPE, f"dataset={path}", f"max_length={longest_prompt + 2}",
                                        "max_prompt_length=null", f"ref_cache_dir={tmp_path / 'c'}"],
                      "precompute", capsys)
    assert code == 2 and f"{cut} of {2 * len(tok.pairs)} completions kept" in out.strip().splitlines()[-1]
    assert "over max_truncated_share=0.25" in out


def test_every_stage_says_what_it_kept(tmp_path, capsys):
    code, out = stage(precompute.main, [TINY_RECIPE, f"dataset={write_jsonl(tmp_path / 'r.jsonl', ROWS)}",
                                        f"ref_cache_dir={tmp_path / 'c'}", "dtype=float32"], "precompute", capsys)
    assert code == 0 and "kept 40 of 40 rows, none skipped; no completion cut at max_length=64" in out


def test_plan_shows_the_lengths_of_the_data(long_prompts, tokenizer, capsys):
    code, out = stage(plan.main, [TINY_RECIPE, f"dataset={long_prompts}", "max_length=40", "max_prompt_length=null"],
                      "plan", capsys)
    line = next(x for x in out.splitlines() if x.startswith("data "))
    tok = data.tokenize_rows(data.load_rows(str(long_prompts)), tokenizer, 40, None, progress=False)
    whole = sum(n <= 40 for n in tok.whole)
    assert code == 0 and f"max_length=40 keeps {whole} of 40" in line and f"max {max(tok.whole)}" in line
    assert whole == whole_rows(tok)  # a row's whole length is what keeps it whole
    p95 = int(re.search(r"p95 (\d+)", line)[1])
    assert sum(n <= p95 for n in tok.whole) >= 0.95 * 40 > sum(n < p95 for n in tok.whole)
    code, out = stage(plan.main, ["recipes/mistral-7b-qlora-12gb.yaml", "--budget", "11.25GiB"], "plan", capsys)
    assert "data     lengths not shown: " in out and "architecture-only" in out


def test_a_missing_column_names_the_three_keys(tmp_path, capsys):
    rows = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in ROWS]
    with open(tmp_path / "q.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "good", "bad"])
        writer.writeheader()
        writer.writerows(rows)
    for path in (tmp_path / "q.csv", write_jsonl(tmp_path / "q.jsonl", rows)):
        code, out = stage(precompute.main, [TINY_RECIPE, f"dataset={path}", f"ref_cache_dir={tmp_path / 'c'}"],
                          "precompute", capsys)
        last = out.strip().splitlines()[-1]
        assert code == 2 and "prompt_column=question chosen_column=good rejected_column=bad" in last, last


def test_plain_text_as_chat_turns_is_the_conversation_written_by_hand(tokenizer, tmp_path):
    """apply_chat_template: each row's tokens are those of the same row written as a conversation (the user turn,
    the assistant's answers), with system_prompt as its first turn; plain text alone with system_prompt is
    refused."""
    rows = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in ROWS[:8]]
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    system = [{"role": "system", "content": "Be brief."}]
    by_hand = write_jsonl(tmp_path / "conv.jsonl", [
        {"prompt": system + [{"role": "user", "content": r["question"]}],
         "chosen": [{"role": "assistant", "content": r["good"]}],
         "rejected": [{"role": "assistant", "content": r["bad"]}]} for r in rows])
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    turned = data.load_rows(str(plain), columns=columns, turns=True, system_prompt="Be brief.")
    a = data.tokenize_rows(turned, tokenizer, 128, None, progress=False).pairs
    b = data.tokenize_rows(data.load_rows(str(by_hand)), tokenizer, 128, None, progress=False).pairs
    as_written = data.tokenize_rows(data.load_rows(str(plain), columns=columns), tokenizer, 128, None,
                                    progress=False).pairs
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in a] == \
        [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in b]
    assert a[0].prompt_ids != as_written[0].prompt_ids  # the template's tokens are there
    with pytest.raises(UserError, match="system_prompt is set but dataset .* is plain text.*apply_chat_template=true"):
        data.load_rows(str(plain), columns=columns, system_prompt="Be brief.")
