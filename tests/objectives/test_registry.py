"""The objectives are declared once and read from there: the config's choices and keys, the guards' limits, the
docs' table; a loss name is spelled nowhere else in the package."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import lowmem_dpo
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.config.schema import FIELDS, Config
from lowmem_dpo.objectives import KEYS, OBJECTIVES, REFUSED, Settings, Terms
from lowmem_dpo.runtime.errors import ConfigError
from lowmem_dpo.training import guards, signs

PACKAGE = Path(lowmem_dpo.__file__).parent
DOC = PACKAGE.parent / "docs" / "objectives.md"
# Where a loss name may still be spelled outside lowmem_dpo/objectives/: the config's default, and the migration
# of a checkpoint written when sigmoid with label_smoothing was today's cdpo. ("sft" is also a stage's name.)
ALLOWED = {("config/schema.py", "sigmoid"), ("training/resuming.py", "sigmoid"), ("training/resuming.py", "cdpo")}


def test_a_loss_name_is_declared_in_one_place_only():
    declared = re.findall(r'Objective\("(\w+)"', "".join(p.read_text() for p in (PACKAGE / "objectives").glob("*.py")))
    assert sorted(declared) == sorted(OBJECTIVES)  # each entry once
    spelled = set()
    for path in PACKAGE.rglob("*.py"):
        if "objectives" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        for name in set(OBJECTIVES) - {"sft"}:
            if re.search(rf"""["']{name}["']""", text):
                spelled.add((path.relative_to(PACKAGE).as_posix(), name))
    assert spelled == ALLOWED


def test_the_config_reads_the_registry():
    assert FIELDS["loss_type"].metadata["choices"] == tuple(OBJECTIVES)
    for key, k in KEYS.items():
        assert FIELDS[key].default == k.default and FIELDS[key].metadata["doc"] == k.doc
    assert {f.name for f in dataclasses.fields(Settings)} == {"beta", "label_smoothing", *KEYS}
    cfg = build_config({"loss_type": ["discopop"], "discopop_tau": 0.2, "beta": 0.05})
    assert cfg.loss_settings == Settings(beta=0.05, discopop_tau=0.2)


@pytest.mark.parametrize("values, message", [
    ({"loss_type": ["bco_pair"], "f_divergence_type": "js_divergence"}, "f_divergence_type=js_divergence with "
                                                                         "loss_type=bco_pair"),
    ({"loss_type": ["exo_pair"]}, "loss_type=exo_pair needs label_smoothing above 0"),
    ({"loss_type": ["robust"], "label_smoothing": 0.5}, "loss_type=robust needs label_smoothing below 0.5"),
    ({"loss_type": ["simpo_x"]}, "loss_type"),
    ({"sync_ref_model": True}, "a fixed cache computed once before training"),
])
def test_what_cannot_be_computed_is_refused_with_why(values, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(values)


def test_a_trl_key_left_off_is_accepted_and_the_refused_keys_are_trl_s():
    assert build_config({"sync_ref_model": False}).loss_type == ["sigmoid"]
    assert build_config({"sync_ref_model": "null"}).loss_type == ["sigmoid"]
    with pytest.raises(ConfigError, match="sync_ref_model=yes"):
        build_config({"sync_ref_model": "yes"})
    from trl import DPOConfig

    assert set(REFUSED) <= {f.name for f in dataclasses.fields(DPOConfig)}
    assert build_config({"f_divergence_type": "js_divergence", "loss_type": ["hinge", "sft"]}).loss_type


def test_settings_that_change_nothing_are_named():
    notes = build_config({"loss_type": ["sigmoid"], "discopop_tau": 0.2, "label_smoothing": 0.1}).no_effect()
    assert any("discopop_tau=0.2 changes only loss_type=discopop" in n for n in notes)
    assert any("label_smoothing=0.1 does not change" in n for n in notes)
    assert not build_config({"loss_type": ["aot"], "label_smoothing": 0.1}).no_effect()


def test_the_limits_a_run_is_judged_by():
    def judged(*types):
        return signs.judged_limits(Terms.of(Config(loss_type=list(types))))

    assert judged("sigmoid") == (OBJECTIVES["sigmoid"].limits, 1.0, "sigmoid")
    assert judged("sigmoid", "sft") == (OBJECTIVES["sigmoid"].limits, 1.0, "sigmoid")  # sft is per token: not judged
    assert judged("sigmoid", "hinge") == (guards.SEVERAL, 1.0, None)
    assert judged("apo_zero") == (None, 1.0, "apo_zero")  # declares none: unguarded, and the log says so
    assert judged("sft", "apo_zero") == (None, 1.0, "apo_zero")  # the log names the judged term, not the first
    assert guards.thresholds(None, 0.1, 0.0, 20.0) == guards.UNGUARDED


def test_the_docs_table_is_the_registry():
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*?) \| (needed|none) \| (changes it|-) \| (yes|none) \| (.*?) \| "
                      r"(.*?) \|$", DOC.read_text(encoding="utf-8"), re.M)
    assert [r[0] for r in rows] == list(OBJECTIVES)
    for name, summary, paper, reference, smoothing, limits, beta, trl in rows:
        o = OBJECTIVES[name]
        assert (summary, paper, beta) == (o.summary, o.paper, o.usual_beta), name
        assert trl == (f"DPOTrainer `{name}`" if o.trl == "DPOTrainer" else o.trl), name
        assert (reference == "needed", smoothing == "changes it", limits == "yes") == (
            o.needs_reference, o.smoothing, o.limits is not None), name
