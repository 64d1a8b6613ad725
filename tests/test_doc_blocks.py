"""Every code block of README.md and docs/ that a user would copy is run here, as written, or says on the line
before it why it cannot run here (`<!-- not run here: WHY -->`: it needs a GPU, the network, another program).

The blocks run in page order (docs/demo.md's first, which the others build on) in one folder laid out as the
pages assume a user's is: `recipes/` of the repository, the README's `my-run.yaml` (also as `RECIPE.yaml`),
`data/my-prefs.jsonl` (the demo's first 96 rows) and `my-model`, a tiny Llama with a tokenizer llama.cpp knows
(conftest.build_llama2_style), so that the GGUF export runs too. The stages' commands (`python -m lowmem_dpo.STAGE`, `lowmem-dpo STAGE`) run
in this process, as `lowmem-dpo` runs them, and must exit 0 without a warning about a tracker; `pip install` lines are
checked (the extra exists and its distributions are installed here), not run. By kind:

- bash: each command, as above;
- python: executed as a script, warnings of its libraries (PEFT's about unmatched keys) as errors;
- yaml: a recipe loads to the values written; lines of a recipe do so in place of the README recipe's own;
- jsonl: the rows load as one file and tokenize on my-model's tokenizer;
- text: output, listings and messages are not run, but a transcript (`$ COMMAND` then its output) is: each line
  it shows is a line of the command's output now, in order. A command anywhere else in a text block is refused,
  unless it is a synopsis (`[key=value ...]`).
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import REPO, TINY_DATA, TINY_RECIPE, build_llama2_style, sequences_of

from lowmem_dpo import __main__ as one
from lowmem_dpo.config.recipe import load_config

PAGES = [REPO / "docs" / "demo.md", REPO / "README.md",
         *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "demo.md")]
KINDS = ("bash", "python", "yaml", "jsonl", "text")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run here: (.+?) -->")
ENV_SETTING = re.compile(r"[A-Z_]+=\S*")  # a shell line's leading NAME=VALUE (WANDB_MODE=offline lowmem-dpo ...)
COMMAND_WORDS = {"python", "python3", "lowmem-dpo", "torchrun", "accelerate", "pip", "make", "hf", "huggingface-cli",
                 "vllm", "curl", "llama-cli", "llama-server", "ollama", "cd", "tensorboard", "trackio", "wandb"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    kind: str
    text: str
    not_run: str | None  # why, from the marker on the line before

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = [line for line in text[:m.start()].splitlines() if line.strip()]
        marker = NOT_RUN.search(before[-1]) if before else None
        out.append(Block(page, text[:m.start()].count("\n") + 1, m.group(1), m.group(2),
                         marker.group(1) if marker else None))
    return out


BLOCKS = [b for page in PAGES for b in page_blocks(page)]


def block(page: str, kind: str, contains: str = "") -> Block:
    """The one block of `page` (README.md or a docs/ page's name) of that kind holding `contains`."""
    found = [b for b in BLOCKS if b.page.name == page and b.kind == kind and contains in b.text]
    assert len(found) == 1, f"{page}: {len(found)} {kind} blocks hold {contains!r}"
    return found[0]


def commands(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    joined = text.replace("\\\n", " ")
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


def stage_argv(words: list[str]) -> list[str] | None:
    """`python -m lowmem_dpo.STAGE ARGS`, `python -m lowmem_dpo STAGE ARGS`, `lowmem-dpo STAGE ARGS` as
    lowmem-dpo's arguments; None for any other command."""
    if words[:1] == ["lowmem-dpo"]:
        return words[1:]
    if words[:2] == ["python", "-m"] and len(words) > 2:
        if words[2] == "lowmem_dpo":
            return words[3:]
        if words[2].startswith("lowmem_dpo."):
            return [words[2].removeprefix("lowmem_dpo."), *words[3:]]
    return None


def run_stage(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """lowmem-dpo ARGV with `env` set for it, in this process (what the stage sets, sys.argv, the environment and
    warning filters, is put back): the exit code, and stdout and stderr together."""
    out = io.StringIO()
    with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", list(sys.argv)), \
            warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = one.main(argv)
    return code, out.getvalue()


def check_pip(words: list[str]) -> None:
    """`pip install 'lowmem_dpo[EXTRA]'`: not run (the network); EXTRA is one of setup.cfg's extras, and each
    distribution it names is installed here (the test extra holds them all)."""
    extras = re.findall(r"lowmem_dpo\[(\w+)\]", " ".join(words))
    assert extras, f"a pip line this test cannot check: {' '.join(words)}"
    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg", encoding="utf-8")
    for extra in extras:
        assert setup.has_option("options.extras_require", extra), f"setup.cfg has no extra {extra!r}"
        for requirement in setup.get("options.extras_require", extra).split("\n"):
            name = re.match(r"[A-Za-z0-9_.-]*", requirement.split("#")[0].strip()).group()
            if name:
                importlib.metadata.distribution(name)  # raises PackageNotFoundError


def run_torchrun(words: list[str]) -> tuple[int, str]:
    """torchrun ARGS as a user runs it (its console script beside this Python; torch's module if absent)."""
    script = Path(sys.executable).with_name("torchrun")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]
    p = subprocess.run([*launcher, *words[1:]], capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def run_shell(text: str) -> list[tuple[str, str]]:
    """Each command of a shell block; (command, its output) for each."""
    done = []
    for line in commands(text):
        words = shlex.split(line, comments=True)
        env = {}
        while words and ENV_SETTING.fullmatch(words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[:2] == ["pip", "install"]:
            check_pip(words)
            continue
        if words[0] == "source":  # a new shell's activation: test_commands_run_in_a_new_shell runs it there
            assert words[1:] == [".venv/bin/activate"], f"an activation this test does not know: {line!r}"
            continue
        argv = stage_argv(words)
        if words[0] == "torchrun" and not env:
            code, output = run_torchrun(words)
        else:
            assert argv is not None, f"not a command this test runs: {line!r}; mark the block <!-- not run here: WHY -->"
            code, output = run_stage(argv, env)
        assert code == 0, f"{line!r} exited {code}:\n{output[-3000:]}"
        assert "Traceback" not in output and "warning: report_to" not in output, output[-3000:]
        done.append((line, output))
    return done


def check_transcript(text: str) -> None:
    """`$ COMMAND` lines, each followed by lines of its output: every line shown is a line the command prints now,
    in order (a transcript may leave lines out, and says so)."""
    before, *parts = re.split(r"^\$ ", text, flags=re.M)
    assert not before.strip(), f"text before the first $ COMMAND: {before!r}"
    for part in parts:
        command, *shown = part.rstrip("\n").splitlines()
        (_, output), = run_shell(command)
        printed = iter(output.splitlines())
        for line in (s for s in shown if s.strip()):
            assert any(p.rstrip() == line.rstrip() for p in printed), (
                f"$ {command}\nshows a line it no longer prints (or not in this order):\n{line}\n\nit prints:\n{output}")


def check_rows(text: str, tokenizer) -> None:
    """The block as one .jsonl file, as a user saves it: it loads (one format throughout), and every row
    tokenizes."""
    from lowmem_dpo.data.encode import tokenize_rows
    from lowmem_dpo.data.rows import REQUIRED, load_rows
    from lowmem_dpo.data.unpaired import tokenize_unpaired

    rows = [json.loads(line) for line in text.splitlines()]
    path = Path("rows.jsonl")
    path.write_text(text, encoding="utf-8")
    unpaired = "label" in rows[0]
    ds = load_rows(str(path), required=("prompt",) if unpaired else REQUIRED)  # as train reads them
    tokenize = tokenize_unpaired if unpaired else tokenize_rows
    assert len(tokenize(ds, tokenizer, 256, 128, str(path), progress=False, strict=True).pairs) == len(rows)


def check_yaml(text: str) -> None:
    """A whole recipe (it names model_name_or_path) loads from its own file; lines of one load in place of the
    README recipe's own. Either way each key reads as written."""
    import yaml

    keys = yaml.safe_load(text)
    recipe = Path("block.yaml")
    if "model_name_or_path" in keys:
        recipe.write_text(text, encoding="utf-8")
    else:
        mine = yaml.safe_load(block("README.md", "yaml", "model_name_or_path").text)
        recipe.write_text(yaml.safe_dump({**mine, **keys}, sort_keys=False), encoding="utf-8")
    cfg = load_config(recipe)
    for key, value in keys.items():  # each key read as written (a single dataset is a list of one)
        assert same(getattr(cfg, key), value), (key, getattr(cfg, key), value)


def same(got, value) -> bool:
    if hasattr(got, "path") and isinstance(value, (str, dict)):  # a dataset source: its path, or {path, ...}
        return got == type(got)(**(value if isinstance(value, dict) else {"path": value}))
    if isinstance(got, (list, tuple)) and not isinstance(value, list):
        return len(got) == 1 and same(got[0], value)
    if isinstance(value, list):
        return len(got) == len(value) and all(same(g, v) for g, v in zip(got, value))
    try:
        return float(got) == float(value)
    except (TypeError, ValueError):
        return str(got) == str(value)


@dataclass
class World:
    ran: dict  # block id -> its commands' (command, output), for the blocks the fixture ran
    tokenizer: object  # my-model's


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The folder the pages assume, as the working directory; docs/demo.md's commands and the README's run first
    (the other pages use their runs/tiny and runs/my-run)."""
    from lowmem_dpo.model.models import load_tokenizer

    root = tmp_path_factory.mktemp("docs-world")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for key, folder in [("TRACKIO_DIR", "trackio"), ("WANDB_CACHE_DIR", "wandb-cache"),
                            ("WANDB_CONFIG_DIR", "wandb-config"), ("WANDB_DATA_DIR", "wandb-data"),
                            ("MPLCONFIGDIR", "matplotlib")]:  # the trackers' and matplotlib's files: here, not ~
            mp.setenv(key, str(root / folder))
        mp.setenv("WANDB_SILENT", "true")
        (root / "recipes").symlink_to(REPO / "recipes")
        (root / "my-model").symlink_to(build_llama2_style(root / "built") / "base")
        (root / "data").mkdir()
        rows = TINY_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:96]
        (root / "data" / "my-prefs.jsonl").write_text("".join(rows), encoding="utf-8")
        recipe = block("README.md", "yaml", "model_name_or_path").text
        (root / "my-run.yaml").write_text(recipe, encoding="utf-8")
        # RECIPE.yaml, the README's first block's: the same recipe, its folders left to their defaults (the
        # recipe's own comments: runs/RECIPE and runs/RECIPE-ref-cache)
        (root / "RECIPE.yaml").write_text("".join(line for line in recipe.splitlines(keepends=True)
                                                  if not line.startswith(("output_dir:", "ref_cache_dir:"))))
        ran = {}
        for first in (block("demo.md", "bash"), block("README.md", "bash", "my-run.yaml")):
            ran[first.id] = run_shell(first.text)
        yield World(ran, load_tokenizer(root / "my-model"))


def test_every_block_is_run_or_says_why_not():
    for page in PAGES:
        fences = re.findall(r"^\s*```", page.read_text(encoding="utf-8"), re.M)
        assert len(fences) == 2 * len(page_blocks(page)), f"{page.name}: an indented or unclosed fence"
    for b in BLOCKS:
        assert b.kind in KINDS, f"{b.id}: a fence without a kind ({', '.join(KINDS)})"
        if b.kind == "text":
            assert b.not_run is None, f"{b.id}: text is never run; the marker says nothing"
            for line in b.text.splitlines():
                words = [w for w in line.split() if not ENV_SETTING.fullmatch(w)]
                assert not words or words[0] not in COMMAND_WORDS or "[key=value" in line, (
                    f"{b.id}: a command in a text block: {line!r}; make it bash (run here), a transcript "
                    "($ COMMAND) or mark it")
        if b.not_run is not None:
            assert len(b.not_run) > 10, f"{b.id}: say why it cannot run here"


def test_commands_run_in_a_new_shell(tmp_path):
    """What the pages run, from a user's new terminal: no activated venv, no PYTHONPATH, a folder outside the
    repository. The README's activation line (in the repository, its venv this test's: make's .venv, or where
    this Python is), then in tmp_path each command the blocks start with resolves: `lowmem-dpo --help` runs,
    every stage and library imports, every `python bench/...` script is where the pages say (from the
    repository)."""
    venv = Path(sys.prefix)
    activation = block("README.md", "bash", "source .venv/bin/activate").text
    if venv != REPO / ".venv":
        activation = activation.replace(".venv/", f"{venv}/")
    assert (venv / "bin" / "activate").is_file(), f"this Python ({sys.executable}) is not in a venv"
    stages, scripts, programs = set(), set(), {"lowmem-dpo"}
    for b in (b for b in BLOCKS if b.kind == "bash"):
        for line in commands(b.text):
            words = [w for w in shlex.split(line, comments=True) if not ENV_SETTING.fullmatch(w)]
            argv = stage_argv(words)
            if words[0] == "python" and words[1].endswith(".py"):  # a bench, run or not here: it is there
                scripts.add(words[1])
            elif b.not_run is None and argv and argv[0] in one.STAGES:
                stages.add(argv[0])
            elif b.not_run is None and words[0] in ("torchrun", "accelerate"):
                programs.add(words[0])
    modules = ["torch", "transformers", "peft", *(f"lowmem_dpo.{s}" for s in sorted(stages))]
    script = "\n".join([
        "set -e", f"cd {shlex.quote(str(REPO))}", activation, f"cd {shlex.quote(str(tmp_path))}",
        *(f"command -v {p} >/dev/null || {{ echo 'not found: {p}'; exit 1; }}" for p in sorted(programs)),
        "lowmem-dpo --help",
        "python -c 'import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) "
        "is None]; sys.exit(f\"cannot import {missing}\" if missing else 0)' " + " ".join(modules)])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(f"  {stage}" in p.stdout for stage in stages)  # lowmem-dpo --help lists them
    assert stages >= {"plan", "precompute", "train", "report", "export"} and scripts
    for path in scripts:
        assert (REPO / path).is_file(), f"the pages run python {path}, which is not in the repository"


def test_make_demo_runs_the_commands_of_docs_demo_md():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^RECIPE \?= (\S+)$", makefile, re.M).group(1)
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    lines = [line.strip().replace("$(LOWMEM_DPO)", "lowmem-dpo").replace("$(RECIPE)", recipe) for line in demo.splitlines()]
    assert lines == commands(block("demo.md", "bash").text)


RUN = [b for b in BLOCKS if b.not_run is None and (b.kind != "text" or re.search(r"^\$ ", b.text, re.M))]


@pytest.mark.parametrize("b", RUN, ids=lambda b: b.id)
def test_block(b, world):
    outputs = []
    if b.id in world.ran:  # the fixture ran it
        outputs = world.ran[b.id]
    elif b.kind == "bash":
        outputs = run_shell(b.text)
    elif b.kind == "python":
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # PEFT's unmatched keys, a tokenizer not found, ...
            namespace = {"__name__": "__main__"}
            exec(compile(b.text, b.id, "exec"), namespace)
        if b == block("cache.md", "python"):  # "float64, one entry per dataset row"
            ref = namespace["ref"]
            assert ref.chosen.dtype == ref.rejected.dtype == torch.float64 and len(ref.chosen) == len(ref.rejected)
            assert len(ref.chosen) == len(TINY_DATA.read_text(encoding="utf-8").splitlines())
    elif b.kind == "yaml":
        check_yaml(b.text)
    elif b.kind == "jsonl":
        check_rows(b.text, world.tokenizer)
    else:
        check_transcript(b.text)
    if b == block("several-processes.md", "bash", "precompute lowmem_dpo:tiny-cpu"):  # "precompute on two processes after make demo
        reused = len(sequences_of(load_config(TINY_RECIPE)))  # every sequence of the demo's rows
        assert f"computed 0 sequences, reused {reused}" in outputs[0][1]  # computes nothing"
    if b == block("evaluation.md", "bash"):  # each tracker's own files
        import trackio.utils  # its store: TRACKIO_DIR when it was first imported (here, or an earlier test's)

        assert (Path(trackio.utils.TRACKIO_DIR) / "lowmem_dpo.db").is_file()
        assert list(Path("runs/tiny-wandb/wandb").glob("offline-run-*/run-*.wandb"))
        assert list(Path("runs/tiny-wandb/runs").glob("events.out.tfevents.*"))
    if b == block("demo.md", "bash"):  # the demo learns, and writes what the page lists
        metrics = [json.loads(line) for line in open("runs/tiny/metrics.jsonl")]
        last = [m for m in metrics if "rewards/accuracies" in m][-1]
        assert last["step"] == load_config(TINY_RECIPE).max_steps and last["rewards/accuracies"] >= 0.9 and last["rewards/margins"] > 0.05
        listing = block("demo.md", "text", "runs/tiny/config.yaml").text
        for line in listing.splitlines():
            first, *siblings = line.split("  ")[0].split(", ")
            for name in (first, *(s if "/" in s else str(Path(first).parent / s) for s in siblings)):
                assert Path(name).exists(), f"docs/demo.md lists {name}, which make demo did not write"
