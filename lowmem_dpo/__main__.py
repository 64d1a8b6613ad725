"""One command for every stage: `lowmem-dpo STAGE ...` (or `python -m lowmem_dpo STAGE ...`) runs
`python -m lowmem_dpo.STAGE ...` with the same arguments, exit codes and messages.

    lowmem-dpo --help
    lowmem-dpo train recipes/my-run.yaml learning_rate=1e-5      # or TRL's form: --learning_rate 1e-5
    lowmem-dpo STAGE --help                                       # the stage's keys
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

# The stages in the order a run goes through them (each a module lowmem_dpo/STAGE.py, its docstring's first line
# what --help says of it).
STAGES = ("plan", "sft", "precompute", "preflight", "train", "report", "export", "chat")


def summary(stage: str) -> str:
    """The first line of a stage's docstring, read without importing it (torch and transformers load slowly)."""
    doc = ast.get_docstring(ast.parse((Path(__file__).parent / f"{stage}.py").read_text(encoding="utf-8"))) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def help_text() -> str:
    width = max(map(len, STAGES))
    lines = ["usage: lowmem-dpo STAGE RECIPE.yaml [key=value | --key value ...]   (report, export, chat: their own "
             "arguments)", "", "stages, in the order a run goes through them:"]
    lines += [f"  {stage:<{width}}  {summary(stage)}" for stage in STAGES]
    lines += ["", "lowmem-dpo STAGE --help lists the stage's keys; docs/README.md is the manual."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0 if argv else 2
    stage, rest = argv[0], argv[1:]
    if stage not in STAGES:
        print(f"lowmem-dpo: error: {stage!r} is not a stage; one of {', '.join(STAGES)} (lowmem-dpo --help)",
              file=sys.stderr)
        return 2
    caller_argv, sys.argv = sys.argv, [f"lowmem-dpo {stage}", *rest]  # the stage reads them as `python -m` gives
    try:
        runpy.run_module(f"lowmem_dpo.{stage}", run_name="__main__", alter_sys=True)
    except SystemExit as e:  # every stage ends with SystemExit(its exit code)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:  # a caller in this process (a test, a bench's in-process run) keeps its own arguments
        sys.argv = caller_argv
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
