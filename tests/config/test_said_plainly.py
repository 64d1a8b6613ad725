"""Nothing a user wrote is silently read another way, nor run twice at once: a key set twice in a recipe,
max_steps=0, a value or a key one typo away from a real one, a second train into a running run's folder. Each is
exit 2 with one line that says what to do instead."""

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from lowmem_dpo import train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime import folders
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


HOLD = """import sys, time
from pathlib import Path
from lowmem_dpo.runtime import folders
with folders.locked(Path(sys.argv[1]), "output_dir"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_train_into_a_running_runs_folder_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path, capsys):
    """Another process holds output_dir's lock (as a running train does): train exits 2 naming it, before
    anything loads. Killed (kill -9), it leaves no stale lock: the folder can be taken at once."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = run_cli(train.main, ["lowmem_dpo:tiny-cpu", f"output_dir={out}"], "train", "")
        err = capsys.readouterr().err
        assert code == 2 and f"is in use by another run (pid {holder.pid}" in err and "Traceback" not in err
        assert [p.name for p in Path(out).iterdir()] == [folders.LOCK]  # nothing else written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folders.locked(out, "output_dir"):
        pass


@pytest.mark.parametrize("lr, says", [(1e-1, "far above"), (5e-3, None), (1e-4, None), (5e-6, None),
                                      (1e-6, "far below")])
def test_a_learning_rate_ten_times_outside_loras_range_is_warned_about(lr, says):
    from lowmem_dpo.config.schedule import learning_rate_warning

    warning = learning_rate_warning(lr)
    assert (warning is None) if says is None else (says in warning and "5e-5 to 5e-4" in warning)
