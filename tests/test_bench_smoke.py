"""The benchmarks of the reference cache, of long sequences and of the README's recipe run end to end (--smoke: the
tiny model, a few rows, seconds), so they still work when it is time to run them for real (bench/README.md has
those numbers)."""

import json
import math
import sys

import pytest
from conftest import REPO


@pytest.fixture
def bench_path():
    sys.path.insert(0, str(REPO / "bench"))
    yield
    sys.path.remove(str(REPO / "bench"))


def test_cache_reuse_smoke(bench_path, capsys):
    """Each change computes what the content keys say: nothing for a reorder or a subset, only new rows else."""
    import cache_reuse

    assert cache_reuse.main(["--smoke", "--no-trl"]) == 0
    table = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ") and "change" not in line}
    # sequences: the smoke's 40 rows hold 79 distinct ones (one completion answers two rows), its 4 new rows 8
    assert [int(table[k][3]) for k in ("full", "10% new rows", "reordered", "subset", "mixture 20%")] == [79, 8, 0, 0,
                                                                                                          8]


def test_long_context_smoke(bench_path, capsys):
    import long_context

    assert long_context.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| 512 |" in out and "longest max_length at 11.25 GiB" in out


def test_readme_recipe_smoke(bench_path, tiny_path, tmp_path, capsys):
    """The README's recipe, read from README.md, runs precompute and train as a user runs them; its step-0 eval is
    the reference (eval_loss ln 2, plus the sft term's NLL where the recipe's loss_type has one) and later evals
    follow it; the run's answers, what it trained and its warnings are reported."""
    import readme_recipe

    out = tmp_path / "rr.json"
    assert readme_recipe.main(["--smoke", "--no-old", "--json", str(out)]) == 0
    evals = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
             if line.startswith("| readme |") and len(line.split("|")) == 7]
    assert [int(e[1]) for e in evals] == [0, 2, 4]  # eval_on_start, then eval_steps=2 of 4 steps
    first = json.loads(out.read_text())["runs"]["readme"]["evals"][0]
    assert abs(first["eval_loss"] - first.get("eval_nll_loss", 0.0) - math.log(2)) < 1e-3
    assert float(evals[0][4]) == 0.0 and all(0.0 <= float(e[3]) <= 1.0 for e in evals)
    run = json.loads(out.read_text())["runs"]["readme"]
    assert run["trained"]["steps"] == 4 and run["trained"]["tokens_trained"] > 0 and run["warnings"] == []


def test_own_columns_smoke(bench_path, tmp_path, capsys):
    """A question/good/bad CSV of plain text on the tiny model (a chat template): with apply_chat_template every
    held-out sample is an answer; the trap's max_length exits 2 naming one that keeps 95% of the rows, which runs."""
    import own_columns

    out = tmp_path / "own_columns.json"
    assert own_columns.main(["--smoke", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    template = got["runs"]["template"]
    assert abs(template["eval_loss_first"] - template["eval_nll_loss_first"] - math.log(2)) < 1e-3  # the DPO part
    assert template["samples"]["of"] > 0
    assert template["samples"]["empty"] == 0
    trap = got["trap"]
    assert trap["exit_code"] == 2 and "keeps 95% of the rows whole" in trap["message"]
    assert trap["advised"]["exit_code"] == 0 and trap["advised"]["max_length"] > trap["max_length"]


def test_repairing_smoke(bench_path, capsys):
    """12 prompts of 4 completions: best-vs-worst computes its 24, best-vs-each only the 24 it adds, every pair and
    a subset nothing, KTO on the same completions only KL sequences (its 48 own completions reused)."""
    import repairing

    assert repairing.main(["--smoke", "--no-trl"]) == 0
    table = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| ") and "scenario" not in line}
    computed = [int(table[k][4]) for k in ("best vs worst", "best vs each", "every pair", "a subset")]
    assert computed == [24, 24, 0, 0]
    assert 0 < int(table["kto"][4]) <= 48 and int(table["kto"][5]) == 48
