"""The ground floor of every message: `UserError` (bad input: exit code 2, one line, no traceback), `ConfigError`
(a recipe to fix) and `log`."""

from __future__ import annotations

import sys

from lowmem_dpo.runtime.ranks import world

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input: say what, where, and what to do. Never shown with a traceback."""


class ConfigError(UserError):
    """A recipe or override the user must fix (config.py, coerce.py). Entry points print it and exit with code 2."""


def log(msg: str) -> None:
    """One line to stderr that does not break a running progress bar; rank 0's alone when several processes run
    (ranks.py: the others would repeat it)."""
    if not world().main:
        return
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)
