"""A YAML recipe plus `key=value` overrides, coerced and validated into one Config (config.py declares the keys).

    python -m lowmem_dpo.train RECIPE.yaml learning_rate=1e-4 max_prompt_length=null

Every problem is collected and reported at once, as a `ConfigError` (exit code 2, one message).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import yaml

from lowmem_dpo.config.coerce import check_bounds, coerce
from lowmem_dpo.config.schema import FIELDS, HINTS, Config
from lowmem_dpo.runtime.errors import ConfigError


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value (see --help for the keys)")
        out[key.strip()] = value
    return out


def build_config(values: dict, sources: dict | None = None) -> Config:
    """Coerce and validate a mapping of raw values; collect every problem and raise once.

    `sources` maps a key to where its value came from (a recipe path or "override"), for the messages."""
    sources = sources or {}
    problems, kwargs = [], {}
    for key, raw in values.items():
        where = f" (in {sources[key]})" if key in sources else ""
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see --help for the keys"
            problems.append(f"{key}: unknown key{where}; {hint}")
            continue
        try:
            value = coerce(key, raw, HINTS[key], FIELDS[key].metadata["choices"] or ())
            check_bounds(key, value, FIELDS[key].metadata)
            kwargs[key] = value
        except ConfigError as e:
            problems.append(f"{e}{where}")
    if problems:
        raise ConfigError("; ".join(problems))
    cfg = Config(**kwargs)
    cfg.explicit_keys = frozenset(kwargs)
    problems = cfg.validate()
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


def load_config(recipe: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Recipe YAML, then overrides on top, coerced and validated as one."""
    values: dict = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r} not found: pass the path of a YAML recipe, e.g. "
                              "recipes/tiny-cpu.yaml")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {str(path)!r}: expected a mapping of key: value at the top level")
        values.update(loaded)
    sources = {k: f"recipe {recipe}" for k in values}
    for key, value in parse_overrides(list(overrides)).items():
        values[key] = value
        sources[key] = "override"
    cfg = build_config(values, sources)
    cfg.overrides = tuple(overrides)
    return cfg
