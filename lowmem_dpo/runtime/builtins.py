"""The built-ins: `lowmem_dpo:NAME` names a recipe or a dataset shipped inside the package (lowmem_dpo/demo/), or a
tiny model built on first use (model/tiny.py), so that the demo runs from any folder, with the wheel alone:

    lowmem-dpo precompute lowmem_dpo:tiny-cpu     # the demo's recipe, its data lowmem_dpo:tiny-prefs
    lowmem-dpo train lowmem_dpo:tiny-cpu

A recipe's built-in name is resolved here (config/recipe.py), a dataset's where rows are read (data/rows.py).
"""

from __future__ import annotations

from pathlib import Path

from lowmem_dpo.runtime.errors import ConfigError

PREFIX = "lowmem_dpo:"
DEMO = Path(__file__).resolve().parents[1] / "demo"  # package data (setup.cfg): the demo's recipes and rows
KINDS = {"recipe": ".yaml", "dataset": ".jsonl"}  # the models are model/tiny.py's BUILTINS


def is_builtin(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def names(kind: str) -> list[str]:
    """The built-in names of a kind: recipe or dataset."""
    return sorted(PREFIX + p.stem for p in DEMO.glob(f"*{KINDS[kind]}"))


def path(spec: str, kind: str, key: str) -> Path:
    """The shipped file of built-in `spec` (a recipe or a dataset); a ConfigError naming `key` and the built-ins of
    that kind when there is none."""
    found = DEMO / f"{spec[len(PREFIX):]}{KINDS[kind]}"
    if not found.is_file():
        raise ConfigError(f"{key}={spec!r}: no built-in {kind} of that name; the built-in {kind}s are "
                          f"{', '.join(names(kind))}")
    return found
