"""A YAML recipe plus `key=value` overrides, coerced and validated into one Config (config.py declares the keys).

    lowmem-dpo train RECIPE.yaml learning_rate=1e-4 max_prompt_length=null

Every problem is collected and reported at once, as a `ConfigError` (exit code 2, one message).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Optional

import yaml

from lowmem_dpo.config.coerce import check_bounds, coerce
from lowmem_dpo.config.schema import FIELD_DEFAULTS, FIELDS, HINTS, RESUMABLE, RUN_LENGTH, Config
from lowmem_dpo.objectives import REFUSED, needs_reference
from lowmem_dpo.runtime import builtins
from lowmem_dpo.runtime.errors import ConfigError


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            close = difflib.get_close_matches(item.lstrip("-").partition("=")[0].replace("-", "_"), FIELDS, n=1)
            hint = f"; did you mean {close[0]}=...?" if close else ""
            raise ConfigError(f"override {item!r}: expected key=value (see --help for the keys){hint}")
        out[key.strip()] = value
    return out


def folded(values: dict) -> dict:
    """A config mapping (raw or typed) with the keys folded into another read as that key: warmup_ratio r, transformers
    4's key, is transformers 5's warmup_steps r (a ratio below 1). Recipes, overrides and the configs of checkpoints
    written before the fold all go through here. ConfigError: a ratio not in [0, 1), or both keys set."""
    if "warmup_ratio" not in values:
        return values
    out = dict(values)
    ratio = coerce("warmup_ratio", out.pop("warmup_ratio"), float)
    if not 0 <= ratio < 1:
        raise ConfigError(f"warmup_ratio={ratio}: a share of the run's steps, at least 0 and below 1 (read as "
                          "warmup_steps, which takes that ratio or whole steps)")
    if ratio:
        if out.get("warmup_steps") is not None and coerce("warmup_steps", out["warmup_steps"], float) > 0:
            raise ConfigError(f"warmup_steps={out['warmup_steps']} and warmup_ratio={ratio}: set one (warmup_steps "
                              "below 1 is the ratio)")
        out["warmup_steps"] = ratio
    return out


def config_changes(saved: dict, current: dict) -> list[str]:
    """Config keys whose values differ from the checkpoint's, except those declared resumable (schema.py): those
    that change nothing the run computes, and those that set its length (RUN_LENGTH)."""
    try:  # a key folded since (warmup_ratio) read as the key it folds into
        saved = folded(saved)
    except ConfigError:
        pass
    keys = (set(saved) | set(current)) - RESUMABLE - RUN_LENGTH
    # a key the checkpoint lacks (added to lowmem_dpo since it was written) ran at its default
    saved = {**{k: FIELD_DEFAULTS[k] for k in keys if k in FIELD_DEFAULTS and k not in saved}, **saved}
    return sorted(k for k in keys if declared(k, saved.get(k)) != declared(k, current.get(k)))


def declared(key: str, value):
    """A config value as its key's declared type, so that an older spelling compares equal (loss_type: sigmoid was
    a string before it could be a list); as it is when it does not coerce."""
    try:
        return coerce(key, value, HINTS[key]) if key in HINTS and value is not None else value
    except ConfigError:
        return value


def build_config(values: dict, sources: dict | None = None) -> Config:
    """Coerce and validate a mapping of raw values; collect every problem and raise once.

    `sources` maps a key to where its value came from (a recipe path or "override"), for the messages."""
    sources = sources or {}
    problems, kwargs = [], {}
    if "warmup_ratio" in sources:  # folded into warmup_steps (folded, above): its value comes from there
        sources = {**sources, "warmup_steps": sources.get("warmup_steps", sources["warmup_ratio"])}
    try:
        values = folded(values)
    except ConfigError as e:
        problems.append(str(e))
        values = {k: v for k, v in values.items() if k != "warmup_ratio"}
    for key, raw in values.items():
        where = f" (in {sources[key]})" if key in sources else ""
        if key in REFUSED:  # TRL's key, accepted only turned off
            try:
                on = coerce(key, raw, Optional[bool], ())
            except ConfigError:
                on = True
            if on:
                problems.append(f"{key}={raw}{where}: {REFUSED[key]}")
            continue
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
    """Recipe YAML (a file, or a built-in lowmem_dpo:NAME), then overrides on top, coerced and validated as one.
    A recipe NAME.yaml that sets no output_dir or ref_cache_dir writes runs/NAME and runs/NAME-ref-cache."""
    values: dict = {}
    if recipe is not None:
        values.update(read_recipe(recipe))
    sources = {k: f"recipe {recipe}" for k in values}
    for key, value in parse_overrides(list(overrides)).items():
        values[key] = value
        sources[key] = "override"
    derived = {k: v for k, v in derived_places(recipe).items() if k not in values}
    cfg = build_config({**values, **derived}, sources)
    cfg.explicit_keys = cfg.explicit_keys - derived.keys()
    cfg.derived_keys = frozenset(derived)
    cfg.overrides = tuple(overrides)
    return cfg


def recipe_path(recipe: str | os.PathLike) -> Path:
    """The file of a recipe: a path, or a built-in's shipped file (lowmem_dpo:tiny-cpu)."""
    if builtins.is_builtin(str(recipe)):
        return builtins.path(str(recipe), "recipe", "recipe")
    path = Path(recipe)
    if not path.is_file():
        where = "is a folder" if path.is_dir() else f"not found (no such file: {path.absolute()})"
        raise ConfigError(f"recipe {str(recipe)!r} {where}: pass the path of a YAML recipe, or a built-in ("
                          f"{', '.join(builtins.names('recipe'))})")
    return path


def read_recipe(recipe: str | os.PathLike) -> dict:
    """A recipe's mapping of key: value; a ConfigError naming the line and column of a YAML syntax error."""
    try:
        text = recipe_path(recipe).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {str(recipe)!r} is not UTF-8 text (byte {e.start + 1}); save it as UTF-8") from None
    try:
        loaded = yaml.load(text, Loader=UniqueKeys)  # a SafeLoader that refuses a key set twice
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(str(recipe), text, e)) from None
    except DuplicateKey as e:
        raise ConfigError(f"recipe {str(recipe)!r}: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {str(recipe)!r}: expected a mapping of key: value at the top level")
    return loaded


class DuplicateKey(Exception):
    """A key a YAML mapping holds twice (yaml's own loaders keep the last, silently)."""


class UniqueKeys(yaml.SafeLoader):
    """yaml's SafeLoader, refusing a mapping that holds a key twice: its message names the key and both lines."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise DuplicateKey(f"{key} is set twice, at line {seen[key]} and line {line}; keep one (YAML "
                                   "would keep the last without a word)")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(recipe: str, text: str, e) -> str:
    """A YAML syntax error as one line: the recipe's line and column (from 1), what is wrong, the line itself."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).splitlines()[0]
    if mark is None:
        return f"recipe {recipe!r}: not valid YAML ({problem})"
    lines = text.splitlines()
    shown = lines[mark.line].strip()[:80] if mark.line < len(lines) else ""
    start = getattr(e, "context_mark", None)
    began = (f", {e.context} that starts at line {start.line + 1}"
             if start is not None and start.line != mark.line and getattr(e, "context", None) else "")
    return (f"recipe {recipe!r} line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({problem}{began})"
            f"{f': {shown!r}' if shown else ''}; each line is `key: value` (a list item `- value`, a comment after #)")


def derived_places(recipe: str | os.PathLike | None) -> dict[str, str]:
    """The output folders a recipe NAME.yaml (or lowmem_dpo:NAME) writes when it names none: runs/NAME and
    runs/NAME-ref-cache, beside the working directory; none without a recipe."""
    if recipe is None:
        return {}
    name = str(recipe)[len(builtins.PREFIX):] if builtins.is_builtin(str(recipe)) else Path(recipe).stem
    return {"output_dir": f"runs/{name}", "ref_cache_dir": f"runs/{name}-ref-cache"}


def require(cfg: Config, stage: str) -> None:
    """ConfigError naming every key `stage` needs (NEEDS) that is not set: nothing defaults to the demo's."""
    no_cache = cfg.ref_source == "live" or not needs_reference(cfg.loss_type)  # SimPO, ORPO: no reference at all
    needs = [k for k in NEEDS[stage] if not (k == "ref_cache_dir" and no_cache)]
    unset = [k for k in needs if getattr(cfg, k) is None]
    if unset:
        raise ConfigError("; ".join(f"{k} is not set: {UNSET[k]}" for k in unset) + f" ({stage} needs "
                          f"{', '.join(unset[:-1]) + ' and ' if unset[:-1] else ''}{unset[-1]})")


def place(cfg: Config, key: str) -> str:
    """An output folder as the log shows it: its path, and where that came from."""
    origin = "from the recipe's name" if key in cfg.derived_keys else "set"
    return f"{getattr(cfg, key)} ({key}, {origin})"


# What each stage needs set: no default points at the demo's model, data or folders.
NEEDS = {"precompute": ("model_name_or_path", "dataset", "ref_cache_dir"),
         "preflight": ("model_name_or_path", "dataset", "ref_cache_dir"),
         "train": ("model_name_or_path", "dataset", "output_dir", "ref_cache_dir"),
         "sft": ("model_name_or_path", "dataset", "output_dir"),
         "plan": ("model_name_or_path",), "plan --measure": ("model_name_or_path", "dataset")}
# How --help shows the defaults of these keys (null is no value for them).
SHOWN_DEFAULTS = {"model_name_or_path": "required", "dataset": "required",
                  "output_dir": "default runs/NAME for a recipe NAME.yaml",
                  "ref_cache_dir": "default runs/NAME-ref-cache for a recipe NAME.yaml"}
UNSET = {"model_name_or_path": "name the model, a local transformers folder (lowmem_dpo:tiny-llama is the demo's)",
         "dataset": "name the preference rows, e.g. a .jsonl file of {prompt, chosen, rejected} objects "
                    "(lowmem_dpo:tiny-prefs is the demo's)",
         "output_dir": "name the folder the run writes (a recipe NAME.yaml writes runs/NAME unless it says)",
         "ref_cache_dir": "name the folder of the reference cache (a recipe NAME.yaml uses runs/NAME-ref-cache "
                          "unless it says)"}
