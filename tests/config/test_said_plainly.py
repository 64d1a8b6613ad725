"""Nothing a user wrote is silently read another way: a key set twice in a recipe, max_steps=0, a value or a key
one typo away from a real one. Each is exit 2 with one line that says what to write instead."""

import re

import pytest

from lowmem_dpo import train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime.errors import ConfigError


def test_a_key_set_twice_in_a_recipe_is_refused_naming_both_lines(tmp_path, capsys):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("model_name_or_path: lowmem_dpo:tiny-llama\ndataset: lowmem_dpo:tiny-prefs\nbeta: 0.1\n"
                      "learning_rate: 1e-3\nbeta: 0.5\n", encoding="utf-8")
    code = run_cli(train.main, [str(recipe)], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and "beta is set twice, at line 3 and line 5" in err and "Traceback" not in err
    recipe.write_text("model_name_or_path: lowmem_dpo:tiny-llama\ndataset: lowmem_dpo:tiny-prefs\nbeta: 0.5\n",
                      encoding="utf-8")
    assert load_config(recipe).beta == 0.5  # once is fine


@pytest.mark.parametrize("override, says", [
    ("loss_type=sigmod", "did you mean sigmoid?"),
    ("dtype=bfloat", "did you mean bfloat16?"),
    ("--lerning-rate", "did you mean learning_rate=...?"),
    ("max_steps=0", "max_steps=0 trains nothing: -1 (the default) runs num_train_epochs"),
])
def test_a_value_or_key_one_typo_away_and_max_steps_0_are_refused_with_what_was_meant(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config("lowmem_dpo:tiny-cpu", [override])
