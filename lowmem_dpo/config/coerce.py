"""Values as the config declares them: a YAML value or a `key=value` override string turned into the field's type.

Pure functions of (key, raw value, declared type, field metadata). Never YAML's guess: `1e-4` is a float for a
float key, `null`/`None`/`none`/`~` is None for an Optional key (never the string "None"; but a choice spelled
`none` stays the choice), `1.5` for an int key is an error. Errors are ConfigError: exit code 2, one line.
"""

from __future__ import annotations

import difflib
import math
import types
import typing
from typing import Literal

from lowmem_dpo.runtime.errors import ConfigError

NULLS = {"null", "none", "~", ""}
AUTO = "auto"
# A tri-state key: true, false, or auto (the device rules and the planner decide): a bool where the recipe chose one.
Switch = typing.Union[bool, Literal["auto"]]


def describe(tp) -> str:
    """A declared type as --help and the messages name it."""
    if tp == Switch:
        return "auto|true|false"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{describe(inner[0])} or null"
    if origin is Literal:
        return "|".join(map(str, typing.get_args(tp)))
    if tp is list:
        return "list of str"
    if origin is list:
        item = typing.get_args(tp)[0]
        return getattr(item, "DESCRIPTION", None) or f"list of {item.__name__}"
    return tp.__name__


def _to_bool(name: str, raw) -> bool:
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word in ("true", "yes", "1", "on"):
        return True
    if word in ("false", "no", "0", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected true or false")


def _to_int(name: str, raw) -> int:
    if isinstance(raw, bool):
        raise ConfigError(f"{name}={raw!r}: expected an integer")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float):
        raise ConfigError(f"{name}={raw!r}: expected an integer, got a fraction")
    try:
        return int(str(raw).strip().replace("_", ""))
    except ValueError:
        try:
            float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r}: expected an integer") from None
        raise ConfigError(f"{name}={raw}: expected an integer, got a fraction") from None


def _to_float(name: str, raw) -> float:
    if isinstance(raw, bool):
        raise ConfigError(f"{name}={raw!r}: expected a number")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r}: expected a number such as 1e-4") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r}: expected a finite number")
    return value


def _to_list(name: str, raw) -> list[str]:
    if isinstance(raw, str):
        items = [item.strip() for item in raw.strip().strip("[]").split(",")]
    elif isinstance(raw, (list, tuple)):
        items = [str(item).strip() for item in raw]
    else:
        raise ConfigError(f"{name}={raw!r}: expected a list of names or a comma-separated string")
    return [item for item in items if item]


def _to_str(name: str, raw) -> str:
    if isinstance(raw, bool):  # YAML reads a bare `true` as a bool: keep the choice's spelling
        return str(raw).lower()
    if isinstance(raw, (dict, list)):
        raise ConfigError(f"{name}={raw!r}: expected a string")
    return str(raw)


def _to_dict(name: str, raw) -> dict:
    """A mapping: from a recipe as YAML wrote it, from an override as YAML flow text (key={a: 1, b: 2})."""
    if isinstance(raw, str):
        import yaml

        try:
            raw = yaml.safe_load(raw)
        except yaml.YAMLError:
            raw = None
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}={raw!r}: expected a mapping such as {{min_lr_rate: 0.1}}")
    return {str(k): v for k, v in raw.items()}


CONVERTERS = {bool: _to_bool, int: _to_int, float: _to_float, list: _to_list, str: _to_str, dict: _to_dict}


def coerce(name: str, raw, tp, choices: tuple = ()):
    """`raw` as the declared type `tp` of key `name` (Optional[...] and Switch included), or ConfigError."""
    if tp == Switch:  # auto, or a bool (an earlier version's config held the strings "true" and "false")
        if isinstance(raw, str) and raw.strip().lower() == AUTO:
            return AUTO
        try:
            return _to_bool(name, raw)
        except ConfigError:
            raise ConfigError(f"{name}={raw!r}: expected auto, true or false") from None
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        is_choice = isinstance(raw, str) and raw.strip() in choices  # ref_quantization=none: the choice, not null
        if raw is None or (not is_choice and isinstance(raw, str) and raw.strip().lower() in NULLS):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return coerce(name, raw, inner, choices)
    if raw is None or (tp in (int, float, bool) and isinstance(raw, str) and raw.strip().lower() in NULLS):
        raise ConfigError(f"{name}=null: expected {describe(tp)}, and this key cannot be null")
    if typing.get_origin(tp) is list:  # list[float]: each entry as that type
        item = typing.get_args(tp)[0]
        if hasattr(item, "coerce_list"):  # a structured entry (sources.Source) reads the whole value itself
            return item.coerce_list(name, raw)
        return [CONVERTERS[item](name, v) for v in (raw if isinstance(raw, (list, tuple)) else _to_list(name, raw))]
    if tp not in CONVERTERS:
        raise AssertionError(f"unhandled config type {tp} for {name}")
    return CONVERTERS[tp](name, raw)


def check_bounds(name: str, value, meta: dict) -> None:
    """ConfigError when `value` is outside the field's choices or [min, max] (metadata of schema.key)."""
    if value is None:
        return
    if isinstance(value, list):  # a list key: each entry
        for v in value:
            check_bounds(name, v, meta)
        return
    if meta["choices"] is not None and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), meta["choices"], n=1)
        raise ConfigError(f"{name}={value!r}: expected one of {', '.join(meta['choices'])}"
                          + (f"; did you mean {close[0]}?" if close else ""))
    lo, hi = meta["min"], meta["max"]
    if lo is not None and (value < lo or (meta["min_exclusive"] and value == lo)):
        op = ">" if meta["min_exclusive"] else ">="
        raise ConfigError(f"{name}={value!r}: out of range, expected {op} {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{name}={value!r}: out of range, expected <= {hi}")
