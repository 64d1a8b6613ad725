"""A new user's second hour: nothing of theirs is overwritten, no default points at the demo, and each message
says what is wrong, where, and what to do. Each case runs the stage's CLI in-process (run_cli: its exit code and
its message), as the user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_DATA, TINY_RECIPE, sequences_of, stored_sequences, write_jsonl

from lowmem_dpo import plan, precompute, sft, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime.folders import MARKER

ROWS = [json.loads(x) for x in open(TINY_DATA)]
FAST = ["dtype=float32", "max_steps=2", "eval_fraction=0", "load_best_model_at_end=false", "eval_generations=0"]


def stage(main, args, name, capsys) -> tuple[int, str]:
    code = run_cli(main, args, name, "doc")
    return code, capsys.readouterr().err


def snapshot(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The demo recipe's cache in float32, built once."""
    cache = tmp_path_factory.mktemp("second_hour") / "cache"
    assert run_cli(precompute.main, [TINY_RECIPE, f"ref_cache_dir={cache}", "dtype=float32"], "precompute", "") == 0
    return cache


def test_a_users_own_run_files_are_never_replaced(cache_dir, tmp_path, capsys):
    """output_dir holding the user's own config.yaml and metrics.jsonl (names this tool writes too, but not its
    marker): train and sft refuse, naming them, and the files stay byte for byte. overwrite_output_dir=true writes
    beside a user's files only when none has a name the run writes."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: settings\n")
    (out / "metrics.jsonl").write_text('{"my": 1}\n')
    before = snapshot(out)
    args = [TINY_RECIPE, f"ref_cache_dir={cache_dir}", f"output_dir={out}", *FAST]
    for main, name in ((train.main, "train"), (sft.main, "sft")):
        for extra in ([], ["overwrite_output_dir=true"]):
            code, err = stage(main, args + extra, name, capsys)
            assert code == 2 and "holds files this tool did not write (config.yaml, metrics.jsonl)" in err, err
            assert f"output_dir={out}-2 is free" in err and "Traceback" not in err
            assert snapshot(out) == before
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    code, err = stage(train.main, [*args[:2], f"output_dir={notes}", *FAST, "overwrite_output_dir=true"], "train",
                      capsys)
    assert code == 0 and "writing beside its 1 files (notes.txt), none of which it replaces" in err
    assert (notes / "notes.txt").read_text() == "mine" and (notes / "adapter_model.safetensors").is_file()


def test_a_folder_of_another_kind_is_refused(cache_dir, tmp_path, capsys):
    """A DPO run into an SFT run's folder (it would replace the SFT adapter the DPO stage starts from), and a cache
    into a run's folder: refused by the marker, whatever the files are called."""
    sft_out = tmp_path / "sft"
    assert run_cli(sft.main, [TINY_RECIPE, f"output_dir={sft_out}", *FAST], "sft", "") == 0
    assert json.loads((sft_out / MARKER).read_text())["kind"] == "sft run"
    before = snapshot(sft_out)
    code, err = stage(train.main, [TINY_RECIPE, f"ref_cache_dir={cache_dir}", f"output_dir={sft_out}", *FAST],
                      "train", capsys)
    assert code == 2 and f"holds this tool's sft run ({MARKER}), not a dpo run" in err
    code, err = stage(precompute.main, [TINY_RECIPE, f"ref_cache_dir={sft_out}"], "precompute", capsys)
    assert code == 2 and f"holds this tool's sft run ({MARKER}), not a reference cache" in err
    assert snapshot(sft_out) == before


def test_an_sft_run_from_before_the_marker_is_still_no_dpo_run(cache_dir, tmp_path, capsys):
    """Without its marker (written by an earlier lowmem_dpo), an SFT run's folder is told from a DPO run's by its
    metrics (no rewards): train refuses it, sft continues it."""
    sft_out = tmp_path / "old-sft"
    assert run_cli(sft.main, [TINY_RECIPE, f"output_dir={sft_out}", *FAST], "sft", "") == 0
    (sft_out / MARKER).unlink()
    code, err = stage(train.main, [TINY_RECIPE, f"ref_cache_dir={cache_dir}", f"output_dir={sft_out}", *FAST],
                      "train", capsys)
    assert code == 2 and "holds files this tool did not write" in err and not (sft_out / MARKER).exists()
    code, err = stage(sft.main, [TINY_RECIPE, f"output_dir={sft_out}", *FAST, "max_steps=3"], "sft", capsys)
    assert code == 0 and "resuming from" in err and json.loads((sft_out / MARKER).read_text())["kind"] == "sft run"


@pytest.mark.parametrize("where", ["file", "dot"])
def test_an_output_folder_that_cannot_be_one_is_refused_in_a_line(tmp_path, capsys, monkeypatch, where):
    """A file on the folder's path, or the working folder itself (holding a user's file): exit 2, one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    folder = "afile/cache" if where == "file" else "."
    code, err = stage(precompute.main, [TINY_RECIPE, f"ref_cache_dir={folder}"], "precompute", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (f"{tmp_path / 'afile'} is a file, so the folder cannot be made" if where == "file" else
            f"ref_cache_dir={tmp_path}-2 is free") in err
    assert (tmp_path / "afile").read_text() == "mine"


def test_report_replaces_no_picture_of_a_users_folder(tmp_path, capsys):
    from lowmem_dpo import report

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (folder / "curves.png").write_bytes(b"my picture")
    code, err = stage(report.main, [str(folder)], "report", capsys)
    assert code == 2 and "holds a curves.png and is not a run folder this tool wrote" in err
    assert (folder / "curves.png").read_bytes() == b"my picture"


def test_a_users_folder_is_no_reference_cache(tmp_path, capsys):
    cache = tmp_path / "my-folder"
    cache.mkdir()
    (cache / "preflight.json").write_text("{}")
    code, err = stage(precompute.main, [TINY_RECIPE, f"ref_cache_dir={cache}"], "precompute", capsys)
    assert code == 2 and "holds files this tool did not write (preflight.json)" in err
    assert [p.name for p in cache.iterdir()] == ["preflight.json"] and (cache / "preflight.json").read_text() == "{}"


def test_a_run_from_before_the_marker_is_recognised_by_its_content(cache_dir, tmp_path, capsys):
    """A run folder an earlier lowmem_dpo wrote (no marker: its config.yaml is one of ours) continues, and is marked;
    a config.yaml with a few of the same keys and one of the user's is not one of ours."""
    out = tmp_path / "run"
    args = [TINY_RECIPE, f"ref_cache_dir={cache_dir}", f"output_dir={out}", *FAST]
    assert run_cli(train.main, args, "train", "") == 0
    (out / MARKER).unlink()
    code, err = stage(train.main, [*args, "max_steps=3"], "train", capsys)
    assert code == 0 and "resuming from" in err and (out / MARKER).is_file()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.yaml").write_text("model_name_or_path: x\noutput_dir: y\nref_cache_dir: z\nloss_type: sigmoid\n"
                                        "learning_rate: 1\nlora_r: 8\nseed: 1\nmy_own_key: 1\n")
    code, err = stage(train.main, [*args[:2], f"output_dir={theirs}", *FAST], "train", capsys)
    assert code == 2 and "holds files this tool did not write (config.yaml)" in err


def test_advice_on_a_refused_resume_never_destroys_the_run(cache_dir, tmp_path, capsys):
    """output_dir holds a run with other settings: the refusal names a new folder (never resume=never, which would
    replace that run's checkpoints), and the command it gives runs while the old run stays byte for byte."""
    out = tmp_path / "demo-like"
    args = [TINY_RECIPE, f"ref_cache_dir={cache_dir}", f"output_dir={out}", *FAST, "save_steps=1"]
    assert run_cli(train.main, args, "train", "") == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = stage(train.main, [*args, "learning_rate=1e-4"], "train", capsys)
    assert code == 2 and "resume=never" not in err
    advice = f"output_dir={out}-2 ({out} stays as it is)"
    assert advice in err
    code, err = stage(train.main, [*args, "learning_rate=1e-4", f"output_dir={out}-2"], "train", capsys)
    assert code == 0, err[-2000:]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_no_default_points_at_the_demo(tmp_path, capsys, monkeypatch):
    """A recipe without output_dir or ref_cache_dir writes runs/NAME and runs/NAME-ref-cache under the working
    folder, named after the recipe, and the log says so; one without a model or dataset is refused naming the
    key (never the demo's model or rows)."""
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "my-run.yaml"
    recipe.write_text(f"model_name_or_path: lowmem_dpo:tiny-llama\ndataset: {TINY_DATA}\nmax_length: 64\n"
                      "dtype: float32\nmax_steps: 1\nsave_steps: 0\n")
    code, err = stage(precompute.main, [str(recipe)], "precompute", capsys)
    assert code == 0 and "reference cache: runs/my-run-ref-cache (ref_cache_dir, from the recipe's name)" in err
    code, err = stage(train.main, [str(recipe)], "train", capsys)
    assert code == 0 and "writing to runs/my-run (output_dir, from the recipe's name)" in err
    assert (tmp_path / "runs" / "my-run" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["my-run", "my-run-ref-cache"]
    bare = tmp_path / "bare.yaml"
    bare.write_text("max_length: 64\n")
    code, err = stage(train.main, [str(bare)], "train", capsys)
    assert code == 2 and "model_name_or_path is not set" in err and "dataset is not set" in err
    assert "(train needs model_name_or_path and dataset)" in err and len(err.strip().splitlines()) == 1


def test_the_builtin_recipe_and_rows_name_what_exists(capsys):
    code, err = stage(train.main, ["lowmem_dpo:tiny-gpu"], "train", capsys)
    assert code == 2 and "no built-in recipe of that name; the built-in recipes are lowmem_dpo:tiny-cpu" in err
    code, err = stage(precompute.main, [TINY_RECIPE, "dataset=lowmem_dpo:tiny"], "precompute", capsys)
    assert code == 2 and "dataset='lowmem_dpo:tiny': no built-in dataset of that name" in err
    assert "lowmem_dpo:tiny-prefs" in err


def test_a_yaml_error_names_its_line_and_column(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: lowmem_dpo:tiny-llama\nlearning_rate: 1e-4\nbeta: 0.1: 2\n")
    code, err = stage(train.main, [str(recipe)], "train", capsys)
    assert code == 2 and f"recipe '{recipe}' line 3, column 10: not valid YAML (mapping values are not allowed " \
                         "here): 'beta: 0.1: 2'" in err
    recipe.write_text('dataset: "rows.jsonl\nbeta: 0.1\n')
    code, err = stage(train.main, [str(recipe)], "train", capsys)
    assert code == 2 and "while scanning a quoted scalar that starts at line 1" in err


def test_a_malformed_jsonl_line_names_the_column_of_the_fault(tmp_path, capsys):
    """The fault at column 210 of line 2 (a missing comma after a long prompt): that column, and the text around
    it, not the line's start."""
    good = json.dumps(ROWS[0])
    bad = '{"prompt": "' + "a" * 180 + '", "chosen": "x" "rejected": "y"}'
    path = tmp_path / "rows.jsonl"
    path.write_text(good + "\n" + bad + "\n")
    code, err = stage(precompute.main, [TINY_RECIPE, f"dataset={path}", f"ref_cache_dir={tmp_path / 'c'}"],
                      "precompute", capsys)
    col = bad.index('"rejected"') + 1
    assert code == 2 and f"line 2, column {col}: not JSON (Expecting ',' delimiter)" in err
    assert '"chosen": "x" >>>"rejected": "y"}' in err and not (tmp_path / "c").exists()


def test_a_missing_model_folder_says_it_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("./models/mine", "models/mine"):
        code, err = stage(precompute.main, [TINY_RECIPE, f"model_name_or_path={name}",
                                            f"ref_cache_dir={tmp_path / 'c'}"], "precompute", capsys)
        assert code == 2 and f"no such folder ({tmp_path / 'models' / 'mine'} does not exist)" in err, err
        code, err = stage(plan.main, [TINY_RECIPE, f"model_name_or_path={name}"], "plan", capsys)
        assert code == 2 and f"no such folder ({tmp_path / 'models' / 'mine'} does not exist)" in err, err


def test_ctrl_c_in_precompute_says_how_many_rows_are_kept(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the third commit of sequences is computed (raised here from its forward: a signal's timing
    cannot be chosen in a test): the message says how many sequences are kept, the store holds exactly those, and
    the rerun computes only the rest."""
    real, calls = precompute.chunk_with_backoff, []

    def third_is_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(precompute, "chunk_with_backoff", third_is_interrupted)
    cache = tmp_path / "c"
    args = [TINY_RECIPE, f"ref_cache_dir={cache}", "cache_shard_rows=50", "dtype=float32"]
    code, err = stage(precompute.main, args, "precompute", capsys)
    total = len(sequences_of(load_config(TINY_RECIPE, args[1:])))
    kept = stored_sequences(cache)  # two commits of at most 50 (a shared row's two completions stay together)
    assert code == 130 and 96 <= kept <= 100
    assert f"interrupted: {kept} of the {total} sequences to compute are kept in the cache ({cache}); the same " \
           f"command computes only the other {total - kept}." in err
    monkeypatch.setattr(precompute, "chunk_with_backoff", real)
    code, err = stage(precompute.main, args, "precompute", capsys)
    assert code == 0 and f"computed {total - kept} sequences, reused {kept}" in err


def test_budget_units_are_stated_and_plan_stops_at_the_models_context(capsys):
    """12GB is 10^9-byte units and 12G is GiB: plan says which. The tiny model knows 4096 positions: the longest
    max_length plan offers is at most that, and a recipe past it is warned about."""
    code = run_cli(plan.main, [TINY_RECIPE, "--budget", "12GB"], "plan", "")
    out = capsys.readouterr().out
    assert code == 0 and "budget 11.18 GiB" in out and "note: budget 12GB = 12 x 10^9 bytes = 11.18 GiB" in out
    code = run_cli(plan.main, [TINY_RECIPE, "--budget", "12G", "max_length=8192"], "plan", "")
    out = capsys.readouterr().out
    assert code == 0 and "note: budget 12G = 12 GiB (G alone is binary" in out
    assert "warning: max_length=8192 is beyond the model's context, 4096 positions" in out
    lengths = [int(line.split()[1]) for line in out.splitlines() if line.startswith("  ") and line.split()[0]
               in ("1:", "2:", "4:", "8:")]
    assert lengths and max(lengths) == 4096 and "(the model's context)" in out


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory, tiny_path):
    """The tiny model, its tokenizer without a chat template (a base model's)."""
    folder = tmp_path_factory.mktemp("no_template") / "model"
    shutil.copytree(tiny_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def conversations(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "chosen": [{"role": "assistant",
                                                                               "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in ROWS[:n]]


def test_conversations_without_a_chat_template_name_the_key(no_template_model, tmp_path, capsys):
    data = write_jsonl(tmp_path / "conv.jsonl", conversations(8))
    args = [TINY_RECIPE, f"model_name_or_path={no_template_model}", f"dataset={data}",
            f"ref_cache_dir={tmp_path / 'c'}", "eval_fraction=0", "load_best_model_at_end=false"]
    code, err = stage(precompute.main, args, "precompute", capsys)
    assert code == 2 and "the model's tokenizer has no chat template to render them: set chat_template" in err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) < 400
    template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    assert run_cli(precompute.main, [*args, f"chat_template={template}"], "precompute", "") == 0


def test_plain_rows_on_a_chat_model_say_the_template_is_not_applied(tmp_path, capsys):
    """The tiny model has a chat template; its plain-text rows are tokenized as written (as TRL does), said in one
    line with the conversational form; conversations say nothing."""
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS[:8])
    no_eval = ["eval_fraction=0", "load_best_model_at_end=false"]
    code, err = stage(precompute.main, [TINY_RECIPE, f"dataset={plain}", f"ref_cache_dir={tmp_path / 'a'}", *no_eval],
                      "precompute", capsys)
    notes = [line for line in err.splitlines() if "chat template is not applied" in line]
    assert code == 0 and len(notes) == 1 and "set apply_chat_template=true" in notes[0]
    conv = write_jsonl(tmp_path / "conv.jsonl", conversations(8))
    code, err = stage(precompute.main, [TINY_RECIPE, f"dataset={conv}", f"ref_cache_dir={tmp_path / 'b'}", *no_eval],
                      "precompute", capsys)
    assert code == 0 and "chat template is not applied" not in err and stored_sequences(tmp_path / "b") == 16


def test_an_adapter_saved_twice_is_the_same_bytes(tiny_path, tmp_path):
    """peft writes target_modules, a set, in the order of the process's string hashes: re-saving a finished SFT run
    (its rerun) changed adapter_config.json's bytes, and the DPO stage after it refused its own cache and
    checkpoints as built on another adapter. Saved through adapters.save, any order gives the same file."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lowmem_dpo.model import adapters

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    adapters.save(model, tmp_path / "a")
    model.peft_config["default"].target_modules = ["v_proj", "up_proj", "q_proj", "down_proj"]  # another order
    adapters.save(model, tmp_path / "b")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"] == \
        ["down_proj", "q_proj", "up_proj", "v_proj"]
