"""Config: typed coercion, null handling, every error path, --help, and every shipped recipe."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem_dpo.config import FIELDS, Config, ConfigError, build_config, cache_settings, load_config

REPO = Path(__file__).resolve().parents[1]


def test_override_coercion_by_declared_type(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\nmax_prompt_length: 16\nlora_target_modules: [q_proj, v_proj]\n")
    # YAML 1.1 reads 1e-4 as a string; the declared float type decides.
    assert yaml.safe_load(recipe.read_text())["learning_rate"] == "1e-4"
    cfg = load_config(recipe, ["max_steps=7", "beta=0.25", "max_prompt_length=null", "seed=3"])
    assert cfg.learning_rate == 1e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.max_steps == 7 and cfg.beta == 0.25 and cfg.seed == 3
    assert cfg.max_prompt_length is None
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("null", ["null", "None", "none", "~", ""])
def test_null_spellings_are_none_for_optional(null):
    cfg = load_config(None, [f"max_prompt_length={null}", f"max_grad_norm={null}"])
    assert cfg.max_prompt_length is None and cfg.max_grad_norm is None


def test_yaml_null_and_string_none_in_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_prompt_length: null\nmax_grad_norm: None\n")
    cfg = load_config(recipe)
    assert cfg.max_prompt_length is None and cfg.max_grad_norm is None


def test_comma_separated_list():
    assert load_config(None, ["lora_target_modules=q_proj, k_proj"]).lora_target_modules == ["q_proj", "k_proj"]


@pytest.mark.parametrize("override, fragment", [
    ("max_steps=1.5", "max_steps=1.5: expected an integer, got a fraction"),
    ("max_steps=abc", "max_steps='abc': expected an integer"),
    ("learning_rate=fast", "learning_rate='fast': expected a number"),
    ("learning_rate=nan", "expected a finite number"),
    ("beta=0", "beta=0.0: out of range, expected > 0.0"),
    ("label_smoothing=0.7", "label_smoothing=0.7: out of range, expected <= 0.5"),
    ("per_device_train_batch_size=0", "expected >= 1"),
    ("loss_type=kto", "loss_type='kto': expected one of sigmoid, hinge, ipo, robust"),
    ("device=tpu", "expected one of auto, cpu, cuda"),
    ("max_length=null", "max_length=null: expected int, and this key cannot be null"),
    ("learnin_rate=1e-4", "learnin_rate: unknown key"),
    ("max_steps", "expected key=value"),
    ("quantization=2bit", "quantization='2bit': expected one of none, 8bit, 4bit"),
    ("ref_dtype=float8", "ref_dtype='float8': expected one of auto, float32, bfloat16, float16"),
    ("max_prompt_length=64", "must be below max_length"),
])
def test_errors_name_key_value_and_expectation(override, fragment):
    args = [override, "max_length=64"] if "max_prompt_length" in override else [override]
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert fragment in str(e.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        build_config({"max_steps": 1.5, "bogus": 1, "beta": -1})
    msg = str(e.value)
    assert "max_steps" in msg and "bogus" in msg and "beta" in msg


def test_recipe_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_training_knobs_are_not_cache_keys():
    keys = set(cache_settings(Config()))
    assert keys == {"ref_dtype", "ref_quantization", "max_length", "max_prompt_length"}
    # null ref settings are the policy's; set, they make the policy's dtype and quantization training knobs
    assert cache_settings(Config(quantization="4bit", dtype="bfloat16")) == {
        **cache_settings(Config()), "ref_quantization": "4bit", "ref_dtype": "bfloat16"}
    pinned = Config(ref_quantization="none", ref_dtype="float32")
    assert cache_settings(pinned) == cache_settings(Config(quantization="8bit", dtype="bfloat16",
                                                           ref_quantization="none", ref_dtype="float32"))


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")) + sorted((REPO / "bench").rglob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    cfg = load_config(recipe)
    assert isinstance(cfg, Config)
    raw = yaml.safe_load(recipe.read_text())
    assert set(raw) <= set(FIELDS)


def test_config_roundtrips_through_yaml(tmp_path):
    cfg = load_config(None, ["max_prompt_length=null", "learning_rate=3e-5"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("stage", ["precompute", "train", "sft"])
def test_cli_bad_override_exits_2_without_traceback(stage):
    p = _run(f"lowmem_dpo.{stage}", "recipes/tiny-cpu.yaml", "max_steps=1.5", "learnin_rate=1")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert "max_steps=1.5" in p.stderr and "learnin_rate" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_help_lists_every_key():
    p = _run("lowmem_dpo.train", "--help")
    assert p.returncode == 0
    for name in FIELDS:
        assert f"  {name} (" in p.stdout
    assert "learning_rate (float, default 5.0e-05" in p.stdout
    assert "max_prompt_length (int or null, default null" in p.stdout


def test_bare_yaml_bool_for_a_choice_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("gradient_checkpointing: true\n")
    assert load_config(recipe).gradient_checkpointing == "true"
    recipe.write_text("gradient_checkpointing: false\n")
    assert load_config(recipe).gradient_checkpointing == "false"
