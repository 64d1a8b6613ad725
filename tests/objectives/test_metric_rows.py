"""Each metric is one row (objectives/metrics.py): the package names a metric by its row (LOSS.name, MARGIN.eval),
never by spelling it, and the loop's sums (step.Sums) average by what each row counts."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lowmem_dpo
from lowmem_dpo.objectives import metrics
from lowmem_dpo.training.step import Sums

PACKAGE = Path(lowmem_dpo.__file__).parent
NAMES = {m.name for m in metrics.METRICS} | {m.eval for m in metrics.METRICS}
# A key-like string that builds a metric's name from its family (the report's old test for a DPO line was one)
FAMILY = re.compile(r'^"?(eval_)?(rewards|logps|gen)/')
# Config keys that share a metric's name (TRL names both learning_rate), in a tuple of config keys
CONFIG_KEY_TUPLES = {"RUN_KEYS"}


def spelled(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string constant in `source` that is a metric's name, its eval name, or a key-like
    string of a metric family; docstrings and the tuples of config keys aside."""
    tree, skip, out = ast.parse(source), set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                skip.add(id(doc.value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) in CONFIG_KEY_TUPLES for t in node.targets):
            skip.update(id(n) for n in ast.walk(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if node.value in NAMES or FAMILY.match(node.value):
                out.append((node.lineno, node.value))
    return out


def test_no_metric_name_is_spelled_outside_its_row():
    found = {f"{path.relative_to(PACKAGE)}:{line}": text for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "objectives" / "metrics.py" for line, text in spelled(path.read_text())}
    assert found == {}


def test_the_spelling_check_can_fail():
    """A key spelled by hand, an eval name, a family prefix: each found; the docstring and the row's own use not."""
    source = '''"""The "rewards/margins" of a line."""
RUN_KEYS = ("learning_rate", "seed")
def f(line):
    a = line["rewards/margins"], line.get("eval_loss"), '"rewards/' in str(line)
    return a, line[MARGIN.name]
'''
    assert spelled(source) == [(4, "rewards/margins"), (4, "eval_loss"), (4, '"rewards/')]


def test_sums_average_each_metric_over_what_its_row_counts():
    """Pairs: each metric's total over its count; the NLL at its weight into the loss (not for the signs); a metric
    nothing counted is None; sums over micro-batches add totals and counts."""
    a = Sums.of((metrics.LOSS, metrics.MARGIN, metrics.NLL_LOSS), nll_weight=0.5)
    a.note(metrics.LOSS, 2.0, 4)
    a.note(metrics.NLL_LOSS, 6.0, 3)
    b = Sums.of((metrics.LOSS, metrics.MARGIN, metrics.NLL_LOSS), nll_weight=0.5)
    b.note(metrics.LOSS, 1.0, 2)
    b.note(metrics.NLL_LOSS, 2.0, 1)
    b.items = 2
    a.add(b)
    assert a.means() == {"loss": pytest.approx(0.5 + 0.5 * 2.0), "rewards/margins": None, "nll_loss": 2.0}
    assert a.means(preference=True)["loss"] == pytest.approx(0.5)
    assert a.items == 2 and not a.empty and Sums.of((metrics.LOSS,)).empty


def test_rows_say_how_they_sum_and_show():
    """Summed rows add over micro-batches and ranks; the step's own and the samples' are not summed; the bar's
    rows have a label, the closing line shows them by name."""
    assert {m.name for m in metrics.METRICS if not m.summed} == {
        "grad_norm", "learning_rate", *(m.name for m in metrics.SAMPLE_METRICS)}
    line = {"loss": 0.69314, "rewards/accuracies": 0.5, "rewards/margins": 0.01, "kl": None}
    assert metrics.bar_numbers(line) == {"loss": "0.6931", "acc": "0.50", "margin": "0.010"}
    assert metrics.bar_numbers({"eval_loss": 0.5}, "eval_") == {"eval_loss": "0.5000"}
    assert metrics.closing_note(line) == ": loss 0.6931, rewards/accuracies 0.50, rewards/margins 0.010"
    assert metrics.closing_note({}) == ""
