"""lowmem-dpo chat on a plain-text DPO run (the demo's rows, one step): it answers in plain text because the run
records that its rows were plain text (a run without that record: the template, as before, and says so), and its
answers are sampled with --temperature, --top-p and --seed (the same seed, the same answers; temperature 0 is
greedy). A mixture records the format of each source's rows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import chat, data, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.config.sources import Source
from lowmem_dpo.training import checkpoint, samples

PROMPTS = [json.loads(line)["prompt"] for line in TINY_DATA.read_text(encoding="utf-8").splitlines()[:4]]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, lowmem_home):
    """The demo's setting in one step: DPO of the tiny model on plain-text rows (8 of the demo's), reference live
    (no precompute)."""
    out = tmp_path_factory.mktemp("chat_modes") / "run"
    train.run(build_config(dict(
        model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), output_dir=str(out), device="cpu",
        dtype="float32", max_length=64, per_device_train_batch_size=4, max_steps=1, max_train_samples=8, seed=0,
        learning_rate=1e-4, ref_source="live", max_new_tokens=10, max_skipped_share=1, max_truncated_share=1)),
        progress=False)
    return out


def run(*argv) -> int:
    return run_cli(chat.main, [str(a) for a in argv], "chat", chat.__doc__, usage=chat.USAGE)


def test_a_plain_text_run_is_chatted_with_in_plain_text(demo_run, tmp_path, capsys):
    """The run records its rows' format; chat gives its prompts as plain text (what --plain does) and says why;
    --template still forces the template. A run without the record goes through the template, saying so."""
    assert json.loads((demo_run / checkpoint.STATE).read_text())["row_formats"] == ["text"]
    assert run(demo_run, "--prompt", PROMPTS[0]) == 0
    out, err = capsys.readouterr()
    assert "greedy, at most 10 new tokens; plain text, each prompt on its own (the run trained on plain-text " \
           "prompts)" in err.splitlines()[-1]
    assert run(demo_run, "--prompt", PROMPTS[0], "--plain") == 0 and capsys.readouterr().out == out
    assert run(demo_run, "--prompt", PROMPTS[0], "--template") == 0
    assert "through the chat template (--template), no system prompt" in capsys.readouterr().err
    older = tmp_path / "older"
    shutil.copytree(demo_run, older, ignore=shutil.ignore_patterns("checkpoints"))
    state = json.loads((older / checkpoint.STATE).read_text())
    del state["row_formats"]
    (older / checkpoint.STATE).write_text(json.dumps(state))
    assert run(older, "--prompt", PROMPTS[0]) == 0
    assert "through the chat template (the run, trained by an older lowmem_dpo, does not record its prompts' " \
           "format, and the tokenizer has one; --plain gives plain text)" in capsys.readouterr().err


def test_sampled_answers_follow_the_seed(demo_run, capsys):
    """A seed draws the same answers again, which differ from the greedy ones on some prompt; temperature 0 is
    greedy whatever top_p; a seeded draw leaves torch's random state as it was. The CLI says how it draws."""
    loaded = chat.load(demo_run, "cpu")
    turns = [[{"role": "user", "content": p}] for p in PROMPTS]
    greedy = [loaded.answer(t) for t in turns]
    loaded.drawing = chat.Drawing(1.0, 0.95, seed=7)
    state = torch.get_rng_state()
    drawn = [loaded.answer(t) for t in turns]
    assert torch.equal(torch.get_rng_state(), state)
    assert [loaded.answer(t) for t in turns] == drawn and drawn != greedy
    loaded.drawing = chat.Drawing(0.0, 0.5, seed=7)
    assert [loaded.answer(t) for t in turns] == greedy
    ids = loaded.prompt(turns[0])
    args = (loaded.model, [ids], 10, loaded.tokenizer.eos_token_id, data.pad_token_id(loaded.tokenizer),
            samples.Placement(torch.device("cpu"), torch.float32))
    assert samples.sample(*args, samples.Drawing(temperature=0, top_p=0.5)) == samples.greedy(*args)
    capsys.readouterr()
    for _ in range(2):
        assert run(demo_run, "--prompt", PROMPTS[0], "--temperature", "1.0", "--top-p", "0.95", "--seed", "7") == 0
    out, err = capsys.readouterr()
    assert out == 2 * (drawn[0] + "\n")
    assert "; sampling at temperature 1, top_p 0.95, seed 7, at most 10 new tokens; plain text" in err


def test_a_mixture_records_each_source_s_format(tokenizer, tmp_path):
    """Plain-text and conversational sources in one mixture: both formats, sorted; one source: its own."""
    row = json.loads(TINY_DATA.read_text(encoding="utf-8").splitlines()[0])
    text = write_jsonl(tmp_path / "text.jsonl", [row])
    turns = write_jsonl(tmp_path / "turns.jsonl", [{"prompt": [{"role": "user", "content": row["prompt"]}],
                                                    "chosen": [{"role": "assistant", "content": row["chosen"]}],
                                                    "rejected": [{"role": "assistant", "content": row["rejected"]}]}])

    def formats(*paths) -> list[str]:
        mix = data.load_mixture([Source(str(p)) for p in paths], "train", 0, None, data.load_rows)
        return data.tokenize_mixture(mix, lambda rows, spec, where: data.tokenize_rows(
            rows, tokenizer, 64, None, spec=data.Named(spec, where), progress=False)).formats

    assert formats(text) == ["text"] and formats(turns) == ["conversation"]
    assert formats(turns, text) == ["conversation", "text"]
