"""A new user's first hour: the traps a fresh user fell into, each run as the user runs it (the stage's CLI,
in-process through run_cli: its exit code and its message)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY_DATA, TINY_RECIPE, sequences_of, write_jsonl

from lowmem_dpo import data, plan, precompute, train
from lowmem_dpo.config.cli import help_text, run_cli
from lowmem_dpo.config.recipe import load_config

RECIPE = str(TINY_RECIPE)


def stage(main, args, name, capsys) -> tuple[int, str]:
    code = run_cli(main, args, name, "doc")
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """The recipe's own cache (its dataset, max_length 64), in float32."""
    root = tmp_path_factory.mktemp("first_hour")
    args = [RECIPE, f"ref_cache_dir={root / 'cache'}", "dtype=float32"]
    assert run_cli(precompute.main, args, "precompute", "doc") == 0
    return root


def test_the_fill_command_keeps_the_overrides_and_names_the_rows(tmp_path, capsys):
    """train with the user's own data (one row edited) and max_length against the recipe's cache: the message
    names the rows without a value by file and line, and the command to copy keeps every override; copied, it
    computes only those rows, and train is content."""
    rows = [json.loads(x) for x in open(TINY_DATA)][:60]
    rows[7]["chosen"] += " Truly."
    mine = write_jsonl(tmp_path / "mine.jsonl", rows)
    cache = tmp_path / "cache"
    assert run_cli(precompute.main, [RECIPE, f"ref_cache_dir={cache}", "dtype=float32"], "precompute", "doc") == 0
    args = [RECIPE, f"dataset={mine}", "max_length=48", f"ref_cache_dir={cache}", "dtype=float32",
            f"output_dir={tmp_path / 'out'}", "max_steps=1", "eval_fraction=0", "load_best_model_at_end=false"]
    code, err = stage(train.main, args, "train", capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and f"{mine} row 7 at line 8" in last and "new, or changed since precompute ran" in last
    missing = int(re.search(r"has no reference values for (\d+) of the (\d+) rows", last)[1])
    command = last.split("Compute them (only them) with: ")[1]
    assert command == "lowmem-dpo precompute " + " ".join([RECIPE, *args[1:]])
    # copied: the rows and length the user asked for, only the missing rows' new sequences computed, and train is
    # content
    cfg = load_config(RECIPE, args[1:])
    new = len(sequences_of(cfg) - sequences_of(load_config(RECIPE, [f"ref_cache_dir={cache}", "dtype=float32"])))
    assert run_cli(precompute.main, command.split()[2:], "precompute", "doc") == 0
    assert f"computed {new} sequences, reused {len(sequences_of(cfg)) - new}" in capsys.readouterr().err
    assert 0 < new <= 2 * missing
    code, err = stage(train.main, args, "train", capsys)
    assert code == 0, err[-2000:]


def test_an_output_dir_of_other_files_is_refused(built_cache, tmp_path, capsys):
    """A folder holding a model: refused with exit 2 before anything is written, overwrite_output_dir or not (train
    would replace its tokenizer.json); a folder of the user's other files takes overwrite_output_dir; a run's own
    folder is written again (resumed)."""
    out = tmp_path / "a-model"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x")
    args = [RECIPE, f"ref_cache_dir={built_cache / 'cache'}", "dtype=float32", f"output_dir={out}", "max_steps=2",
            "eval_fraction=0", "load_best_model_at_end=false"]
    code, err = stage(train.main, args, "train", capsys)
    assert code == 2 and "holds files this tool did not write (model.safetensors, tokenizer.json)" in err
    assert "overwrite_output_dir" not in err and "Traceback" not in err  # it would not help: tokenizer.json
    code, err = stage(train.main, [*args, "overwrite_output_dir=true"], "train", capsys)
    assert code == 2 and "tokenizer.json would be replaced" in err
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]  # untouched
    assert (out / "tokenizer.json").read_text() == "{}"
    (out / "tokenizer.json").unlink()
    code, err = stage(train.main, args, "train", capsys)
    assert code == 2 and "or set overwrite_output_dir=true to write beside files whose names it does not use" in err
    code, err = stage(train.main, [*args, "overwrite_output_dir=true"], "train", capsys)
    assert code == 0 and (out / "model.safetensors").read_bytes() == b"x", err[-2000:]
    code, err = stage(train.main, [*args, "max_steps=3"], "train", capsys)  # our own run now: it continues
    assert code == 0 and "resuming from" in err


def test_an_unread_column_without_a_prompt_is_named(tmp_path, capsys):
    """Rows with question, chosen and rejected: the question column is named, with prompt_column as the way to
    use it; with prompt_column=question the prompts are the questions (not implicit prompts)."""
    rows = [{"question": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"], "id": i}
            for i, r in enumerate(json.loads(x) for x in open(TINY_DATA))][:40]
    data = write_jsonl(tmp_path / "q.jsonl", rows)
    args = [RECIPE, f"dataset={data}", f"ref_cache_dir={tmp_path / 'c'}", "dtype=float32"]
    code, err = stage(precompute.main, args, "precompute", capsys)
    last = err.strip().splitlines()[-1]
    assert code == 2 and "no prompt column, and a column this tool does not read: question." in last
    assert "set prompt_column=question" in last and "id" not in last.split("read: ")[1].split(".")[0]
    code, err = stage(precompute.main, [*args, "prompt_column=question"], "precompute", capsys)
    assert code == 0, err[-2000:]
    assert "implicit prompts" not in err and "40 rows" in err


def test_chosen_and_rejected_read_from_columns_named_otherwise(tmp_path, capsys):
    """Rows {question, good, bad} (and a stray `chosen` column, which good replaces): with the three _column keys
    the cache holds exactly what the same rows named prompt, chosen and rejected give; a column that is not there
    is named, in its file's line, with the columns that are."""
    plain = [json.loads(x) for x in open(TINY_DATA)][:20]
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "chosen": "x"} for r in plain]
    keys = ["prompt_column=question", "chosen_column=good", "rejected_column=bad", "dtype=float32"]
    a = load_config(RECIPE, [f"dataset={write_jsonl(tmp_path / 'r.jsonl', renamed)}", *keys])
    b = load_config(RECIPE, [f"dataset={write_jsonl(tmp_path / 'p.jsonl', plain)}", "dtype=float32"])
    assert sequences_of(a) == sequences_of(b) and len(sequences_of(a)) > 20
    swapped = data.load_rows(str(tmp_path / "p.jsonl"), columns={"chosen": "rejected", "rejected": "chosen"})
    assert swapped[0]["chosen"] == plain[0]["rejected"] and swapped[0]["rejected"] == plain[0]["chosen"]
    code, err = stage(precompute.main, [RECIPE, f"dataset={tmp_path / 'r.jsonl'}", *keys[:2], "rejected_column=worse",
                                        f"ref_cache_dir={tmp_path / 'c'}"], "precompute", capsys)
    assert code == 2 and "r.jsonl' line 1: lacks worse (has question, good, bad, chosen); every row needs question, " \
                         "good, worse" in err


@pytest.mark.parametrize("budget", ["12", "1000"])
def test_a_budget_without_a_unit_is_refused(budget, capsys):
    code, err = stage(plan.main, ["recipes/mistral-7b-qlora-12gb.yaml", "--budget", budget], "plan", capsys)
    assert code == 2 and f"--budget '{budget}': a size without a unit is a number of bytes" in err
    assert f"e.g. {budget}GiB" in err and len(err.strip().splitlines()) == 1


def test_help_shows_each_default_on_its_line():
    text = help_text("train", "doc")
    assert "\n...\n" not in text and not any(line.strip() == "..." for line in text.splitlines())
    assert "  max_length (int, default 512)" in text and "  loss_type (list of str, default [sigmoid] ;" in text


def test_samples_show_the_last_user_message_not_the_template(tmp_path, capsys):
    """Conversation rows with a chat template: the log's sample line and samples.jsonl show the user's question and
    the answer, not the rendered template with its roles glued to the text."""
    template = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}" \
               "{% if add_generation_prompt %}assistant {% endif %}"
    rows = []
    for r in (json.loads(x) for x in open(TINY_DATA)):
        question = r["prompt"].strip()
        rows.append({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
                     "chosen": [{"role": "assistant", "content": r["chosen"]}],
                     "rejected": [{"role": "assistant", "content": r["rejected"]}]})
    data = write_jsonl(tmp_path / "conv.jsonl", rows[:96])
    args = [RECIPE, f"dataset={data}", f"chat_template={template}", f"ref_cache_dir={tmp_path / 'c'}",
            f"output_dir={tmp_path / 'o'}", "dtype=float32", "max_steps=1", "eval_generations=2",
            "max_new_tokens=4", "eval_fraction=0.2"]
    assert run_cli(precompute.main, args, "precompute", "doc") == 0
    code, err = stage(train.main, args, "train", capsys)
    assert code == 0, err[-2000:]
    line = next(x for x in err.splitlines() if "sample at step 0: " in x)
    shown = line.split("sample at step 0: ")[1]
    assert shown.startswith("'Write a ") and "user" not in shown and "system" not in shown
    written = [json.loads(x) for x in open(tmp_path / "o" / "samples.jsonl")]
    assert all(s["prompt"].startswith("Write a ") and s["prompt"].endswith(".") for s in written)


def test_an_interrupt_is_said_on_its_own_line(built_cache, tmp_path, capsys):
    """Ctrl-C during train (raised here from the training forward): the progress bar is closed first, so the
    message stands on a line of its own, and the exit code is 130."""
    import torch

    def interrupt(module, args):
        if isinstance(module, torch.nn.Embedding) and module.training:
            raise KeyboardInterrupt

    handle = torch.nn.modules.module.register_module_forward_pre_hook(interrupt)
    try:
        code, err = stage(train.main, [RECIPE, f"ref_cache_dir={built_cache / 'cache'}", "dtype=float32",
                                       f"output_dir={tmp_path / 'o'}"], "train", capsys)
    finally:
        handle.remove()
    assert code == 130
    assert "\nlowmem_dpo.train: interrupted: no checkpoint was written yet (save_steps); the same command starts the run " \
           "again." in err
