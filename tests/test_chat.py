"""lowmem-dpo chat on a real run (an SFT run of the tiny model on conversational rows, its checkpoint and its
export): --prompt answers what the run's own samples.jsonl says the adapter answers, through the template; a merged
folder answers the same; piped lines get one answer a line; a terminal keeps the conversation's history and ends
cleanly on Ctrl-C; the run's system_prompt is a system turn, --system replaces it; bad input is one line and exit
2. (A plain-text run and sampling: test_chat_modes.py.)"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import shutil
import signal
import sys
import time

import pytest
import torch
import yaml
from conftest import TINY_DATA, write_jsonl

from lowmem_dpo import chat, data, export, sft
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.runtime import folders
from lowmem_dpo.training import located, samples

CPU = torch.device("cpu")
MAX_NEW_TOKENS = 12
SYSTEM = "Answer as a careful shop reviewer."  # a system_prompt (test_system_replaces_the_run_s_system_turn)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, lowmem_home):
    """An SFT run on the demo's first 64 rows as conversations (each prompt one user turn), trained hard enough in
    4 steps that its answers differ from the base's; samples at steps 0 and 4, checkpoint-4; and its export."""
    root = tmp_path_factory.mktemp("chat")
    rows = [json.loads(line) for line in TINY_DATA.read_text(encoding="utf-8").splitlines()[:64]]
    conversations = [{"prompt": [{"role": "user", "content": r["prompt"].strip()}],
                      "chosen": [{"role": "assistant", "content": r["chosen"]}],
                      "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    cfg = build_config(dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(write_jsonl(
        root / "conversations.jsonl", conversations)), output_dir=str(root / "run"), device="cpu", dtype="float32",
        max_length=64, per_device_train_batch_size=8, max_steps=4, logging_steps=1, learning_rate=5e-2, seed=0,
        lora_r=4, lora_alpha=8, eval_fraction=0.25, eval_steps=4, save_steps=4, eval_generations=2,
        max_new_tokens=MAX_NEW_TOKENS, load_best_model_at_end=False))
    sft.run(cfg, progress=False)
    assert export.main([str(root / "run"), str(root / "merged"), "--no-progress"]) == 0
    return root


def said(trained, step: int) -> dict[str, str]:
    """The run's samples at `step`: prompt -> completion."""
    lines = [json.loads(line) for line in open(trained / "run" / "samples.jsonl", encoding="utf-8")]
    return {s["prompt"]: s["completion"] for s in lines if s["step"] == step}


def run(*argv) -> int:
    """python -m lowmem_dpo.chat ARGV, in this process (its exit code; its messages on stderr)."""
    return run_cli(chat.main, [str(a) for a in argv], "chat", chat.__doc__, usage=chat.USAGE)


def by_hand(trained, tiny_path, messages: list[dict], plain: bool = False) -> str:
    """The greedy answer of the run's adapter on its base, loaded with peft and transformers directly, to the
    conversation rendered by the run's tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained / "run")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                                      trained / "run")
    ids = (tokenizer(messages[-1]["content"])["input_ids"] if plain else tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    (out,) = samples.greedy(model, [list(ids)], MAX_NEW_TOKENS, tokenizer.eos_token_id,
                            data.pad_token_id(tokenizer), samples.Placement(CPU, torch.float32))
    return tokenizer.decode(out, skip_special_tokens=True)


def test_one_answer_is_what_the_run_sampled(trained, capsys):
    """The final adapter and checkpoint-4 answer each prompt as the run's step-4 samples say, through the run's
    template and max_new_tokens; the adapter is on (step 0, the base, answered otherwise). Both record the run's
    conversational rows, which the log line names."""
    last, first = said(trained, 4), said(trained, 0)
    assert len(last) == 2 and any(last[p] != first[p] for p in last) and all(last.values())
    prompt = next(p for p in last if last[p] != first[p])
    for folder in (trained / "run", trained / "run" / "checkpoints" / "checkpoint-4"):
        assert run(folder, "--prompt", prompt) == 0
        out, err = capsys.readouterr()
        assert out == last[prompt] + "\n"
        assert located.recorded_formats(folder) == ["conversation"]
        assert f"+ {folder} on cpu in float32; greedy, at most {MAX_NEW_TOKENS} new tokens; through the chat " \
               "template (the run trained on prompts rendered by the chat template), no system prompt" in err
        assert "Traceback" not in err
    assert run(trained / "run", "--prompt", prompt, "--max-new-tokens", "3") == 0
    short = capsys.readouterr().out.rstrip("\n")
    assert short and len(short) < len(last[prompt]) and last[prompt].startswith(short)


def test_the_merged_folder_answers_piped_lines_the_same(trained, capsys, monkeypatch):
    """The export answers as base + adapter: each non-empty piped line a prompt, one line per answer, its line
    breaks escaped. (A model folder has no run record: the run's max_new_tokens is given; it goes through its
    tokenizer's template, and says why.)"""
    last = said(trained, 4)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{p}\n\n" for p in last)))
    assert run(trained / "merged", "--max-new-tokens", MAX_NEW_TOKENS) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [chat.escaped(c) for c in last.values()]
    assert any("\n" in c for c in last.values())  # the escaping was needed
    assert f"chat: {trained / 'merged'} on cpu" in err and "through the chat template (a model folder does not " \
        "record how its prompts were trained, and the tokenizer has one; --plain gives plain text)" in err


def test_plain_and_a_tokenizer_without_template(trained, tiny_path, tmp_path, capsys):
    """--plain gives the prompt as plain text (as the demo's rows are); a model whose tokenizer has no template
    answers so too, and says why; --template there is exit 2."""
    prompt = next(iter(said(trained, 4)))
    expected = by_hand(trained, tiny_path, [{"role": "user", "content": prompt}], plain=True)
    assert expected != said(trained, 4)[prompt]
    assert run(trained / "run", "--prompt", prompt, "--plain") == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n" and "no chat template" not in err
    assert "; plain text, each prompt on its own (--plain)" in err
    bare = tmp_path / "bare"
    shutil.copytree(trained / "merged", bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    assert "chat_template" not in json.loads((bare / "tokenizer_config.json").read_text())
    assert run(bare, "--prompt", prompt) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n" and err.count(f"plain text, each prompt on its own (the tokenizer of {bare} has no "
                                                "chat template)") == 1
    assert run(bare, "--prompt", prompt, "--template") == 2
    assert "--template: the tokenizer of" in capsys.readouterr().err


def test_a_terminal_keeps_the_history_and_ctrl_c_ends_it(trained, tiny_path):
    """The console command on a terminal (a pty): the second turn is answered with the first in its history,
    `clear` starts over (then it answers as the samples), Ctrl-C ends with exit 0 and no traceback."""
    (p0, a0), (p1, a1) = said(trained, 4).items()
    second = by_hand(trained, tiny_path, [{"role": "user", "content": p0}, {"role": "assistant", "content": a0},
                                          {"role": "user", "content": p1}])
    assert second != a1  # the history changes the answer, so the check below sees it
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
        os.execv(sys.executable, [sys.executable, "-m", "lowmem_dpo", "chat", str(trained / "run")])
    shown, answers, code = Terminal(fd), [], None
    try:
        for line in (p0, p1, "clear", p1):
            shown.until("> ")
            os.write(fd, line.encode() + b"\n")
            if line != "clear":
                answers.append(shown.until("> ", keep=True))
        # A person's Ctrl-C comes once readline waits on the terminal; one sent the instant the prompt shows can
        # reach Python before readline's select() starts, and then waits for the next key. On a loaded machine a
        # second still can: as a person would, press it again while the terminal stays open.
        time.sleep(1)
        for _ in range(4):
            os.write(fd, b"\x03")
            shown.until(None, timeout=15)
            if shown.closed:
                break
    finally:  # the child never outlives the test
        code = exit_code(pid, timeout=60)
        os.close(fd)
    inherited = (f"this process: SIGINT {signal.getsignal(signal.SIGINT)}, blocked "
                 f"{signal.pthread_sigmask(signal.SIG_BLOCK, [])}")
    assert code == 0 and "Traceback" not in shown.text, shown.text + "\n" + inherited
    assert [a.split("\n", 1)[1].strip("\n") for a in answers] == [a.strip("\n") for a in (a0, second, a1)], shown.text


def exit_code(pid: int, timeout: float) -> int | None:
    """The child's exit code; None (and the child killed) when it has not ended within `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


class Terminal:
    """What a pty shows, read up to a marker."""

    def __init__(self, fd: int):
        self.fd, self.text, self.seen, self.closed = fd, "", 0, False  # closed: the child closed the terminal

    def until(self, marker: str | None, keep: bool = False, timeout: float = 180) -> str:
        """Read until `marker` shows after what was read before (None: until the child closes the terminal); the
        text in between (with `keep`, the marker stays unread for the next call), line ends as \\n."""
        end = time.monotonic() + timeout
        while (marker is None or marker not in self.text[self.seen:]) and time.monotonic() < end:
            if select.select([self.fd], [], [], 1)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed it
                    chunk = b""
                if not chunk:
                    self.closed = True
                    break
                self.text += chunk.decode(errors="replace").replace("\r\n", "\n")
        assert marker is None or marker in self.text[self.seen:], f"no {marker!r} on the terminal:\n{self.text}"
        stop = len(self.text) if marker is None else self.text.index(marker, self.seen)
        part, self.seen = self.text[self.seen:stop], stop if keep else stop + len(marker or "")
        return part


def test_quit_and_end_of_input_end_a_conversation(trained, capsys, monkeypatch):
    """On a terminal (a pty as stdin), `quit` ends the conversation, and so does Ctrl-D (end of input)."""
    prompt, answer = next(iter(said(trained, 4).items()))
    for end in (b"quit\n", b"\x04"):
        master, slave = pty.openpty()
        os.write(master, prompt.encode() + b"\n" + end)
        with open(slave, encoding="utf-8") as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            assert run(trained / "run") == 0
        os.close(master)
        out = capsys.readouterr().out
        assert out.startswith(f"> {answer}\n\n> ") and out.count("> ") == 2


def _run_without_adapter(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "r", ignore=shutil.ignore_patterns("adapter_*"))
    return tmp_path / "r", ("a run without its final adapter yet (train has not finished, or was stopped): chat "
                            f"with a checkpoint, e.g. {tmp_path / 'r' / 'checkpoints' / 'checkpoint-4'}")


def _base_gone(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "r", ignore=shutil.ignore_patterns("checkpoints"))
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump({**config, "model_name_or_path": "./my-model"}))
    return tmp_path / "r", (f"was trained (per the run's {tmp_path / 'r' / 'config.yaml'}) on "
                            "model_name_or_path='./my-model', which cannot be used from here")


def _cache(trained, tmp_path):
    folders.mark(tmp_path / "cache", "reference cache")
    return tmp_path / "cache", "this tool's reference cache, not a run or a model"


def _stray(trained, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    return tmp_path / "notes", "neither a run (no adapter_config.json) nor a model folder (no config.json)"


BAD = {
    "missing folder": (lambda trained, tmp_path: (tmp_path / "nope", "no such folder"), []),
    "a file": (lambda trained, tmp_path: (trained / "run" / "config.yaml", "is a file; pass a run's output_dir"), []),
    "a folder of other files": (_stray, []),
    "a reference cache": (_cache, []),
    "a run without its adapter": (_run_without_adapter, []),
    "a base that no longer exists": (_base_gone, []),
    "an empty --prompt": (lambda trained, tmp_path: (trained / "run", "--prompt is empty"), ["--prompt", " "]),
    "--max-new-tokens 0": (lambda trained, tmp_path: (trained / "run", "expected a number of tokens >= 1"),
                           ["--max-new-tokens", "0"]),
    "an unknown flag": (lambda trained, tmp_path: (trained / "run", "unrecognized arguments: --beams"),
                        ["--beams", "4"]),
    "a negative --temperature": (lambda trained, tmp_path: (trained / "run", "--temperature -0.5: expected a number "
                                                            ">= 0"), ["--temperature", "-0.5"]),
    "--temperature nan": (lambda trained, tmp_path: (trained / "run", "--temperature nan: expected"),
                          ["--temperature", "nan"]),
    "--top-p 0": (lambda trained, tmp_path: (trained / "run", "--top-p 0.0: expected a number above 0 and at most 1"),
                  ["--temperature", "1", "--top-p", "0"]),
    "--top-p 1.5": (lambda trained, tmp_path: (trained / "run", "--top-p 1.5: expected"), ["--top-p", "1.5"]),
    "a negative --seed": (lambda trained, tmp_path: (trained / "run", "--seed -1: expected a whole number >= 0"),
                          ["--seed", "-1"]),
    "--plain and --template": (lambda trained, tmp_path: (trained / "run", "argument --template: not allowed with "
                                                          "argument --plain"), ["--plain", "--template"]),
    "--system with plain text": (lambda trained, tmp_path: (trained / "run", "--system gives a system turn, which "
                                                            "only the chat template renders"),
                                 ["--plain", "--system", "Be brief."]),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, trained, tmp_path, capsys):
    make, flags = BAD[case]
    folder, expected = make(trained, tmp_path)
    assert run(folder, *flags) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lowmem_dpo.chat: error: ") and expected in last, err


def test_system_replaces_the_run_s_system_turn(trained, tmp_path, capsys):
    """The run's system_prompt (here written into its config.yaml) is in the prompt's ids, its tokens in a row;
    --system TEXT's in its place, --system "" leaves none; --plain leaves it out. The log line says which."""
    def tokens(text: str) -> list[int]:
        return loaded.tokenizer(text, add_special_tokens=False)["input_ids"]

    def holds(ids: list[int], part: list[int]) -> bool:
        return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))

    shutil.copytree(trained / "run", tmp_path / "r", ignore=shutil.ignore_patterns("checkpoints"))
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump({**config, "system_prompt": SYSTEM}))
    turn = [{"role": "user", "content": "Write a review of a lamp."}]
    loaded = chat.load(tmp_path / "r", "cpu")
    assert loaded.templated and loaded.system == SYSTEM and holds(loaded.prompt(turn), tokens(SYSTEM))
    assert f"system prompt {SYSTEM!r} (the run's system_prompt)" in capsys.readouterr().err
    other = "Reply in one short line."
    loaded = chat.load(tmp_path / "r", "cpu", system=other)
    ids = loaded.prompt(turn)
    assert holds(ids, tokens(other)) and not holds(ids, tokens(SYSTEM))
    assert f"system prompt {other!r} (--system)" in capsys.readouterr().err
    assert not holds(chat.load(tmp_path / "r", "cpu", system="").prompt(turn), tokens(SYSTEM))
    assert run(tmp_path / "r", "--prompt", turn[0]["content"], "--system", "") == 0
    assert 'through the chat template (the run trained on prompts rendered by the chat template), no system prompt ' \
           '(--system "")' in capsys.readouterr().err
    assert run(tmp_path / "r", "--prompt", turn[0]["content"], "--plain") == 0
    assert "(--plain); the run's system_prompt is left out: plain text has no system turn" in capsys.readouterr().err
    # a run that warned: chat repeats its signs
    with open(tmp_path / "r" / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": 4, "warnings": ["generations collapsing into repetition: seq-rep-4 0.9 ..."]}) + "\n")
    assert run(tmp_path / "r", "--prompt", turn[0]["content"]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: chat: ")]
    assert line.startswith(f"warning: chat: the run that trained {tmp_path / 'r'} logged warning signs, so the "
                           "adapter may be damaged: ") and "generations collapsing into repetition at step 4" in line


def test_no_prompt_on_a_piped_stdin_is_exit_2(trained, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    assert run(trained / "merged") == 2
    assert "no --prompt, and stdin held no prompt" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a run of device=cuda loads here")
def test_a_run_of_a_device_this_machine_lacks_names_the_override(trained, tmp_path, capsys):
    """A run trained with device=cuda, chatted with on a machine without CUDA: exit 2 naming --device; with
    --device cpu it answers as the samples."""
    shutil.copytree(trained / "run", tmp_path / "r", ignore=shutil.ignore_patterns("checkpoints"))
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump({**config, "device": "cuda"}))
    prompt, answer = next(iter(said(trained, 4).items()))
    assert run(tmp_path / "r", "--prompt", prompt) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "device=cuda but no CUDA GPU is visible" in last and "--device overrides it" in last
    assert run(tmp_path / "r", "--prompt", prompt, "--device", "cpu") == 0
    assert capsys.readouterr().out == answer + "\n"
