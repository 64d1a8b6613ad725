"""Config: typed coercion, null handling, every error path, --help, and every shipped recipe."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem_dpo.config.recipe import build_config, load_config
from lowmem_dpo.config.schema import FIELDS, HINTS, Config, keys_where
from lowmem_dpo.objectives import KEYS
from lowmem_dpo.runtime.errors import ConfigError
from lowmem_dpo.training.inputs import cache_settings

REPO = Path(__file__).resolve().parents[2]


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


BOUNDS = ("choices", "min", "max", "min_exclusive")  # a field's metadata and a Key's fields alike


def test_the_objective_keys_are_fields_as_the_registry_declares_them():
    """Config declares each objective key by name and type (a type checker sees them), in objectives.KEYS' order
    after label_smoothing; each field's type, default, doc and bounds are its Key's. A key declared in the registry
    alone, or a field whose type is not its Key's, fails here."""
    names = list(FIELDS)
    start = names.index("label_smoothing") + 1
    assert names[start:start + len(KEYS)] == list(KEYS)
    for name, declared in KEYS.items():
        meta = FIELDS[name].metadata
        assert HINTS[name] == declared.kind, name
        assert FIELDS[name].default == declared.default and meta["doc"] == declared.doc, name
        assert [meta[b] for b in BOUNDS] == [getattr(declared, b) for b in BOUNDS], name
    assert Config().ld_alpha is None and Config().f_divergence_type == "reverse_kl"


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
    ("loss_type=ppo", "loss_type='ppo': expected one of sigmoid, cdpo, hinge, ipo, exo_pair"),
    ("device=tpu", "expected one of auto, cpu, cuda"),
    ("max_length=null", "max_length=null: expected int, and this key cannot be null"),
    ("learnin_rate=1e-4", "learnin_rate: unknown key"),
    ("max_steps", "expected key=value"),
    ("quantization=2bit", "quantization='2bit': expected one of none, 8bit, 4bit"),
    ("ref_dtype=float8", "ref_dtype='float8': expected one of auto, float32, bfloat16, float16"),
    ("max_prompt_length=64", "must be below max_length"),
    ("lora_target_modules=(q_proj", "lora_target_modules='(q_proj' is not a valid regex (missing ), unterminated"),
    ("lora_target_modules=(q|k)_proj,v_proj", "'(q|k)_proj' is a regex, which must be the only entry"),
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
    assert keys == {"ref_dtype", "ref_quantization", "max_length", "max_prompt_length", "apply_chat_template",
                    "system_prompt"}
    # null ref settings are the policy's; set, they make the policy's dtype and quantization training knobs
    assert cache_settings(Config(quantization="4bit", dtype="bfloat16")) == {
        **cache_settings(Config()), "ref_quantization": "4bit", "ref_dtype": "bfloat16"}
    pinned = Config(ref_quantization="none", ref_dtype="float32")
    assert cache_settings(pinned) == cache_settings(Config(quantization="8bit", dtype="bfloat16",
                                                           ref_quantization="none", ref_dtype="float32"))


SHIPPED = [*sorted((REPO / "recipes").glob("*.yaml")), *sorted((REPO / "bench" / "recipes").glob("*.yaml")),
           *sorted((REPO / "lowmem_dpo" / "demo").glob("*.yaml"))]  # the last: the built-ins, lowmem_dpo:NAME


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads(recipe):
    builtin = recipe.parent.name == "demo"
    cfg = load_config(f"lowmem_dpo:{recipe.stem}" if builtin else recipe)
    assert isinstance(cfg, Config) and cfg.model_name_or_path and cfg.dataset
    raw = yaml.safe_load(recipe.read_text())
    assert set(raw) <= set(FIELDS)


def test_the_built_in_recipes_are_the_demo_folders_files():
    from lowmem_dpo.runtime import builtins

    assert builtins.names("recipe") == sorted(f"lowmem_dpo:{p.stem}" for p in SHIPPED if p.parent.name == "demo")
    assert len(builtins.names("recipe")) == 3 and builtins.names("dataset") == ["lowmem_dpo:tiny-prefs"]


def test_config_roundtrips_through_yaml(tmp_path):
    cfg = load_config(None, ["max_prompt_length=null", "learning_rate=3e-5"])
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize("stage", ["precompute", "train", "sft"])
def test_cli_bad_override_exits_2_without_traceback(stage):
    p = _run(f"lowmem_dpo.{stage}", "lowmem_dpo:tiny-cpu", "max_steps=1.5", "learnin_rate=1")
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


def test_a_tri_state_key_is_auto_or_a_bool(tmp_path):
    """gradient_checkpointing, activation_offloading, share_prompt: auto, or true/false as bools, from a bare YAML
    bool, its string or an override; anything else is refused naming the three."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("gradient_checkpointing: true\nshare_prompt: 'false'\n")
    cfg = load_config(recipe)
    assert cfg.gradient_checkpointing is True and cfg.share_prompt is False and cfg.activation_offloading == "auto"
    assert load_config(recipe, ["gradient_checkpointing=auto"]).gradient_checkpointing == "auto"
    with pytest.raises(ConfigError, match="share_prompt='maybe': expected auto, true or false"):
        load_config(recipe, ["share_prompt=maybe"])


# One alternative value per key, each valid beside make_cfg's recipe with the reference's settings pinned: a new
# key must be added here, and with it the test below checks what its field declares.
ALTERNATIVES = {
    "model_name_or_path": "lowmem_dpo:llama-25m", "sft_adapter": "runs/some-sft", "dataset": "other.jsonl",
    "dataset_split": "test", "output_dir": "elsewhere", "ref_cache_dir": "elsewhere-cache", "device": "auto",
    "dtype": "bfloat16", "quantization": "4bit", "ref_quantization": "4bit", "ref_dtype": "bfloat16",
    "gradient_checkpointing": "true", "memory_budget": "12GiB", "max_length": 48, "max_prompt_length": 16,
    "strict": True, "apply_chat_template": True, "system_prompt": "Be brief.", "max_skipped_share": 0.5,
    "max_truncated_share": 0.5, "beta": 0.2, "loss_type": "ipo", "label_smoothing": 0.1, "f_divergence_type": "js_divergence", "f_alpha_divergence_coef": 0.5,
    "discopop_tau": 0.1, "simpo_gamma": 1.0, "alpha": 0.25, "use_weighting": True, "ld_alpha": 0.5, "desirable_weight": 1.3,
    "undesirable_weight": 0.7, "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine", "warmup_steps": 2, "weight_decay": 0.01, "max_grad_norm": None,
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 5, "num_train_epochs": 2.0,
    "seed": 1, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1, "lora_target_modules": ["q_proj"],
    "adapter_mode": "new_on_merged", "logging_steps": 5, "save_steps": 10, "save_total_limit": 3,
    "resume": "never", "max_nonfinite_steps": 5, "early_stop_on_divergence": True, "precompute_batch_size": 4,
    "cache_shard_rows": 32, "ref_source": "live", "eval_dataset": "held-out.jsonl", "eval_split": "validation",
    "eval_fraction": 0.1, "eval_steps": 5, "eval_max_pairs": 8, "metric_for_best_model": "eval_rewards/accuracies",
    "greater_is_better": True, "load_best_model_at_end": True, "eval_generations": 2, "max_new_tokens": 8,
    "report_to": "tensorboard", "run_name": "named", "share_prompt": "false", "padding_free": "false",
    "activation_offloading": "true", "loss_weights": [2.0], "max_train_samples": 5,
    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "memory_snapshot_on_oom": True,
    "lr_scheduler_kwargs": {"num_cycles": 2}, "overwrite_output_dir": True,
    "prompt_column": "question", "chosen_column": "good", "rejected_column": "bad", "eval_on_start": True,
    "fsdp": "true", "fsdp_offload_params": "true",
}


def test_each_key_declares_what_changing_it_changes(make_cfg, tiny_path):
    """The fingerprint and the resume check read only the fields' declarations: a key declared
    reference="value" changes the cache fingerprint and no other key does (with ref_dtype and ref_quantization
    pinned, dtype and quantization are the policy's alone; "files" keys enter by content, tested in test_cache
    and test_sft); a key declared resumable may change on resume and every other key is refused. It fails when
    the fingerprint or the resume check decides a key by a list of its own."""
    from dataclasses import asdict

    from lowmem_dpo.config.recipe import config_changes
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training import inputs

    def fingerprint(cfg):
        return inputs.fingerprint_components(cfg, devices.resolve(cfg), tiny_path)

    pinned = {"ref_dtype": "float32", "ref_quantization": "none"}
    needs = {"load_best_model_at_end": {"eval_fraction": 0.1},  # what a key's alternative is valid with
             "lr_scheduler_kwargs": {"lr_scheduler_type": "cosine_with_restarts"}}
    assert set(ALTERNATIVES) == set(FIELDS)
    for key, value in ALTERNATIVES.items():
        base = make_cfg(**pinned, **needs.get(key, {}))
        cfg = make_cfg(**{**pinned, **needs.get(key, {}), key: value})
        assert getattr(cfg, key) != getattr(base, key), key
        meta = FIELDS[key].metadata
        if meta["reference"] != "files":
            assert (fingerprint(cfg) != fingerprint(base)) == (meta["reference"] == "value"), key
        assert config_changes(asdict(base), asdict(cfg)) == ([] if meta["resumable"] else [key]), key
    # What the declarations say today: output places, logging, saving, guards and precompute's batching resume.
    assert keys_where(resumable=True) == {"output_dir", "ref_cache_dir", "logging_steps", "save_steps",
                                          "save_total_limit", "resume", "memory_budget", "precompute_batch_size",
                                          "cache_shard_rows", "early_stop_on_divergence", "max_nonfinite_steps",
                                          "strict", "eval_steps", "load_best_model_at_end", "eval_generations",
                                          "max_new_tokens", "report_to", "run_name", "memory_snapshot_on_oom",
                                          "overwrite_output_dir", "activation_offloading", "eval_on_start",
                                          "max_skipped_share", "max_truncated_share",
                                          "fsdp", "fsdp_offload_params"}  # sharded or not: the same numbers
    assert keys_where(resumable="length") == {"max_steps", "num_train_epochs"}  # the run continues to the new total
    assert keys_where(reference="files") == inputs.FILE_KEYS  # each has its digest in inputs.file_components


def test_warmup_ratio_is_read_as_the_warmup_steps_ratio(tmp_path):
    """warmup_ratio (transformers 4's key) folds into warmup_steps, transformers 5's ratio below 1: the same warmup,
    config.yaml writing warmup_steps; both set, or a ratio of 1 or more, is refused naming them."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("warmup_ratio: 0.3\n")
    cfg = load_config(recipe)
    assert cfg.warmup_steps == 0.3 and "warmup_ratio" not in cfg.to_yaml() and "warmup_steps: 0.3" in cfg.to_yaml()
    assert load_config(recipe, ["warmup_ratio=0"]).warmup_steps == 0
    with pytest.raises(ConfigError, match="warmup_steps=2 and warmup_ratio=0.3: set one"):
        load_config(recipe, ["warmup_steps=2"])
    with pytest.raises(ConfigError, match="warmup_ratio=1.0: a share of the run's steps"):
        load_config(recipe, ["warmup_ratio=1"])
