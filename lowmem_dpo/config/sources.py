"""The `dataset` key: one source of rows, or a mixture of several (docs/data.md, Mixtures).

    dataset: data/prefs.jsonl                       # one source (also as an override: dataset=data/prefs.jsonl)
    dataset:                                        # a mixture
      - data/prefs.jsonl                            #   every row
      - {path: org/hub-prefs, split: train, fraction: 0.1}   # a tenth of its rows
      - {path: data/extra.parquet, rows: 500}       #   500 of its rows

config.py declares `dataset` as a list of Source; coerce.py hands its raw value to Source.coerce_list, which
turns a string, a mapping or a list of either into that list, or raises a ConfigError naming the entry
("dataset[1]: ..."). Which rows a fraction or a count takes is data/mix.py's business.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass

import yaml

from lowmem_dpo.config.coerce import coerce
from lowmem_dpo.runtime.errors import ConfigError


@dataclass(frozen=True, repr=False)
class Source:
    """One source of a mixture: a file, a save_to_disk folder or a hub name, and how many of its rows to take."""

    path: str
    split: str | None = None  # null: dataset_split
    fraction: float | None = None  # in (0, 1]: this share of the source's rows (data/mix.py rounds it)
    rows: int | None = None  # this many of its rows; neither: every row

    DESCRIPTION = "a path or hub name, or a list of sources: each a path or {path, split, fraction | rows}"

    @property
    def selects(self) -> bool:
        """Whether the source takes a subset of its rows, chosen by `seed` (data/mix.py)."""
        return self.rows is not None or (self.fraction is not None and self.fraction < 1)

    def yaml_form(self) -> str | dict:
        """The entry as a recipe writes it: the path alone when nothing else is set."""
        set_keys = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return self.path if set_keys.keys() == {"path"} else set_keys

    def __repr__(self) -> str:  # as the recipe writes it, for messages (a resume refused names the change)
        return repr(self.yaml_form())

    @classmethod
    def coerce_list(cls, name: str, raw) -> list[Source]:
        """A recipe's (or an override's) value as a list of sources: a path, a mapping, a list of either; an
        override starting with `[` or `{` is read as YAML (dataset="[a.jsonl, {path: b.jsonl, rows: 10}]")."""
        if isinstance(raw, str) and raw.strip().startswith(("[", "{")):
            try:
                raw = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}={raw!r}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(raw, (list, tuple)):
            return [_entry(name, raw)]
        if not raw:
            raise ConfigError(f"{name}=[]: name at least one source")
        return [_entry(f"{name}[{i}]", e) for i, e in enumerate(raw)]


def repeated(sources: list[Source], default_split: str) -> str | None:
    """The problem of a source named twice (the same file however spelled, the same split with dataset_split as
    `default_split`): its rows would be taken twice. None when each is named once."""
    seen: dict[tuple, int] = {}
    for i, source in enumerate(sources):
        path = os.path.normpath(os.path.abspath(source.path)) if os.path.exists(source.path) else source.path
        j = seen.setdefault((path, source.split or default_split), i)
        if j != i:
            return (f"dataset[{i}]: {source.path!r} (split {source.split or default_split}) is already dataset[{j}]; "
                    "name each source once (its fraction or rows says how much)")
    return None


KEYS = tuple(f.name for f in dataclasses.fields(Source))


def _entry(name: str, raw) -> Source:
    """One entry of `dataset`, or ConfigError naming it."""
    if isinstance(raw, Source):
        return raw
    if isinstance(raw, str):
        if not raw.strip():
            raise ConfigError(f"{name}={raw!r}: expected the path of a file or folder, or a hub dataset name")
        return Source(raw.strip())
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}={raw!r}: expected a path, or a mapping {{path, split, fraction | rows}}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), KEYS, n=1)
        raise ConfigError(f"{name}: unknown key {unknown[0]!r}" + (f" (did you mean {close[0]}?)" if close else "")
                          + f"; a source takes {', '.join(KEYS)}")
    if not isinstance(raw.get("path"), str) or not raw["path"].strip():
        raise ConfigError(f"{name}: needs a path (a file, a save_to_disk folder or a hub dataset name), e.g. "
                          "{path: data/prefs.jsonl, fraction: 0.5}")
    split = coerce(f"{name}.split", raw.get("split"), str | None)
    fraction = coerce(f"{name}.fraction", raw.get("fraction"), float | None)
    rows = coerce(f"{name}.rows", raw.get("rows"), int | None)
    if fraction is not None and rows is not None:
        raise ConfigError(f"{name}: fraction={fraction} and rows={rows}; set one (a share of the source's rows, "
                          "or a count)")
    if fraction is not None and not 0 < fraction <= 1:
        raise ConfigError(f"{name}.fraction={fraction}: out of range, expected a share in (0, 1]")
    if rows is not None and rows < 1:
        raise ConfigError(f"{name}.rows={rows}: out of range, expected >= 1")
    return Source(raw["path"].strip(), split, fraction, rows)


def yaml_form(value):
    """A config value as YAML writes it: a list of sources as their recipe form (a single plain source as its
    path, so a config.yaml of one source reads as it always did); any other value as it is."""
    if isinstance(value, list) and value and all(isinstance(v, Source) for v in value):
        forms = [source.yaml_form() for source in value]
        return forms[0] if len(forms) == 1 and isinstance(forms[0], str) else forms
    return value


def label(sources: list[Source]) -> str:
    """The sources for messages: the path of one, the paths of a mixture joined by ' + '."""
    return " + ".join(source.path for source in sources)
