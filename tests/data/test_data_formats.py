"""Implicit prompts (rows with only chosen and rejected, TRL's format) and the chat_template key."""

import hashlib
import json
import math
import os

import pytest
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.data.implicit import shared_prefix, with_prompt
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import inputs

CONVERSATION = [{"role": "user", "content": "Review the lamp."}]


@pytest.mark.parametrize("chosen, rejected, prompt", [
    # the first difference is after a space: the space starts the completions
    ("The sky is blue.", "The sky is green.", "The sky is"),
    # inside a word: the cut stays there (tokenization then parts prompt and completion on token ids)
    ("The sky is blue", "The sky is black", "The sky is bl"),
    # one a prefix of the other: one character back, so that both completions keep something
    ("Yes", "Yes!", "Ye"),
    ("Hello", "Goodbye", ""),
])
def test_text_prompt_is_the_shared_start_cut_as_trl_does(chosen, rejected, prompt):
    row = with_prompt({"chosen": chosen, "rejected": rejected})
    assert row["prompt"] == prompt
    assert row["prompt"] + row["chosen"] == chosen and row["prompt"] + row["rejected"] == rejected


def test_conversation_prompt_is_the_shared_leading_messages():
    chosen = CONVERSATION + [{"role": "assistant", "content": "Great lamp."}]
    rejected = CONVERSATION + [{"role": "assistant", "content": "Dull lamp."}]
    assert with_prompt({"chosen": chosen, "rejected": rejected}) == {
        "prompt": CONVERSATION, "chosen": chosen[1:], "rejected": rejected[1:]}
    assert shared_prefix(chosen, chosen + chosen[1:]) == 1  # a prefix: the last shared message goes back


def _implicit(rows: list[dict]) -> list[dict]:
    """The tiny rows with their prompt folded into chosen and rejected (text: prompt + completion; conversations:
    the prompt's messages first)."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


def _explicit_by_hand(rows: list[dict]) -> list[dict]:
    """What the implicit rows should become, by os.path.commonprefix and TRL's space rule, not by the code."""
    out = []
    for r in _implicit(rows):
        n = len(os.path.commonprefix([r["chosen"], r["rejected"]]))
        n -= r["chosen"][n - 1] == " "
        out.append({"prompt": r["chosen"][:n], "chosen": r["chosen"][n:], "rejected": r["rejected"][n:]})
    return out


def test_implicit_text_rows_tokenize_as_their_explicit_form(tmp_path, tokenizer):
    rows = data.load_rows(str(TINY_DATA)).select(range(24)).to_list()
    implicit = data.load_rows(str(write_jsonl(tmp_path / "implicit.jsonl", _implicit(rows))))
    explicit = data.load_rows(str(write_jsonl(tmp_path / "explicit.jsonl", _explicit_by_hand(rows))))
    assert implicit.to_list() == explicit.to_list()
    a = data.tokenize_rows(implicit, tokenizer, 64, None, progress=False).pairs
    b = data.tokenize_rows(explicit, tokenizer, 64, None, progress=False).pairs
    assert [vars(p) for p in a] == [vars(p) for p in b] and len(a) == 24
    assert all(tokenizer.decode(p.prompt_ids).endswith(" is") for p in a)  # "...review of the lamp.\nThe lamp is"


def test_implicit_conversations_train_from_ln2_with_an_inline_chat_template(make_cfg, tmp_path, tokenizer):
    """Conversation rows without a prompt column, rendered with a chat_template given inline: the cache and the
    policy agree (step 1 at ln 2), the prompt tokens are the template's, and the final adapter folder keeps the
    tokenizer with that template."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}</s>{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    rows = [{"chosen": [{"role": "user", "content": r["prompt"].strip()}, {"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "user", "content": r["prompt"].strip()},
                          {"role": "assistant", "content": r["rejected"]}]}
            for r in data.load_rows(str(TINY_DATA)).select(range(16)).to_list()]
    cfg = make_cfg(dataset=str(write_jsonl(tmp_path / "conv.jsonl", rows)), chat_template=template, max_steps=1)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    (m,) = [json.loads(line) for line in open(f"{cfg.output_dir}/metrics.jsonl")]
    assert m["loss"] == pytest.approx(math.log(2), abs=1e-5)
    ins = inputs.prepare(cfg, devices.resolve(cfg))
    pair = inputs.tokenized(cfg, ins.tokenizer, progress=False).pairs[0]
    first = rows[0]["chosen"][0]["content"]
    assert ins.tokenizer.decode(pair.prompt_ids) == f"[user] {first}</s>[assistant] "
    default = tokenizer.apply_chat_template(rows[0]["chosen"][:1], add_generation_prompt=True, return_dict=True)
    assert tokenizer.decode(default["input_ids"]) == f"<|user|>\n{first}</s>\n<|assistant|>\n"  # its own template
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(cfg.output_dir).chat_template == template


def test_chat_template_file_enters_the_fingerprint_by_content(make_cfg, tmp_path, tiny_path):
    path = tmp_path / "t.jinja"

    def fingerprint(text):
        path.write_text(text, encoding="utf-8")
        cfg = make_cfg(chat_template=str(path))
        return inputs.fingerprint_components(cfg, devices.resolve(cfg), tiny_path)

    a, b = fingerprint("{{ messages }}"), fingerprint("{{ messages }}!")
    assert a["chat_template"] == hashlib.sha256(b"{{ messages }}").hexdigest() != b["chat_template"]
    assert "chat_template" not in inputs.fingerprint_components(make_cfg(), devices.resolve(make_cfg()), tiny_path)


def test_bad_chat_template_and_mixed_prompt_formats_exit_2(make_cfg, tmp_path, capsys):
    code = run_cli(precompute.main, ["lowmem_dpo:tiny-cpu", f"ref_cache_dir={tmp_path / 'c'}",
                                     f"chat_template={tmp_path / 'missing.jinja'}"], "precompute", "")
    err = capsys.readouterr().err
    assert code == 2 and "chat_template=" in err and "not a readable file" in err and "Traceback" not in err
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"chosen": "a b", "rejected": "a c"},
                                                   {"prompt": "a", "chosen": " b", "rejected": " c"}])
    with pytest.raises(UserError, match=r"mixed.jsonl' line 2: has a prompt, but the rows before it have none"):
        data.load_rows(str(mixed))
