"""Folders this tool writes into are its own: a new or empty folder, or one holding this tool's own output of the
same kind, recognised by the marker file it writes there (MARKER), never by the names of the files.

    check(Path("runs/my-run"), "dpo run", "output_dir")   # before anything loads: refused unless it is ours
    mark(Path("runs/my-run"), "dpo run")                   # when the first file is written

A folder holding anything else is refused, naming what it holds, so that nothing a user had is replaced. A
folder written before the marker existed is recognised by its content (`earlier`, the caller's test) and marked.
Names starting with "." are never this tool's files and are left alone, but for its lock (LOCK).

    with locked(Path("runs/my-run"), "output_dir"):        # a second run into the folder is refused meanwhile
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.files import atomic_write_json

MARKER = "lowmem_dpo.json"
# The advisory lock a run holds on its folder (flock: released when the process ends, however it ends, so a
# killed run leaves no stale lock). An empty file, never rewritten: a refused run changes nothing in the folder;
# the holder's pid is the kernel's (/proc/locks).
LOCK = ".lowmem_dpo.lock"
KINDS = ("dpo run", "sft run", "reference cache", "merged model")


def read_marker(folder: Path) -> dict | None:
    """The marker of a folder this tool wrote, or None (none, unreadable, or not this tool's)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ours = isinstance(marker, dict) and marker.get("written_by") == "lowmem_dpo" and marker.get("kind") in KINDS
    return marker if ours else None


def visible(folder: Path, hidden: bool = False) -> list[str]:
    """The folder's entries but hidden ones (this tool writes no file whose name starts with '.'); `hidden`: all."""
    return sorted(p.name for p in Path(folder).iterdir() if hidden or not p.name.startswith("."))


def free_name(folder: Path) -> Path:
    """A sibling of `folder` that does not exist yet (runs/my-run-2, -3, ...): where a new run can go."""
    folder = Path(folder) if Path(folder).name not in ("", ".", "..") else Path(folder).resolve()
    n = 2
    while folder.with_name(f"{folder.name}-{n}").exists():
        n += 1
    return folder.with_name(f"{folder.name}-{n}")


def listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_writable(folder: Path, key: str) -> None:
    """A UserError, before any work, when `folder` cannot be created or written: a file in its place or on its
    path, or no permission on its nearest existing folder."""
    folder = Path(folder).absolute()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key}={str(folder)!r} is a file: name a folder (it is created if missing)")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{key}={str(folder)!r}: {existing} is a file, so the folder cannot be made; name another")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{key}={str(folder)!r}: no permission to write in {existing}; name a folder you can write")


@dataclass(frozen=True)
class Beside:
    """Writing into a folder of other files (check's `beside`): `writes`, the names this kind writes there; `allowed`
    (overwrite_output_dir): such a folder is accepted when none of its files has one of those names; `hint`: how
    to allow it, offered by a refusal when none has."""

    writes: frozenset[str] = frozenset()
    allowed: bool = False
    hint: str = ""


def check(folder: Path, kind: str, key: str, earlier: Callable[[Path], bool] | None = None,
          beside: Beside = Beside(), hidden: bool = False) -> None:
    """Refuse (UserError) to write `kind` into `folder` (named by config key or argument `key`) unless it is new or
    empty, marked as this tool's `kind`, or (`earlier`) recognised by its content as this tool's from before the
    marker, or a folder of other files `beside` accepts. `hidden`: hidden entries count too (a stage that replaces
    the whole folder)."""
    assert kind in KINDS, kind
    folder = Path(folder)
    check_writable(folder, key)
    if not folder.is_dir() or not visible(folder, hidden):
        return
    marker = read_marker(folder)
    fresh = f"{key}={free_name(folder)} is free"  # what each refusal below offers instead
    if marker is not None and marker.get("kind") != kind:
        raise UserError(f"{key}={str(folder)!r} holds this tool's {marker.get('kind')} ({MARKER}), not a {kind}: "
                        f"writing a {kind} there would replace its files. Name a new or empty folder ({fresh})")
    if marker is not None or (earlier is not None and earlier(folder)):
        return
    held = visible(folder, hidden)
    clash = sorted(set(held) & beside.writes)
    if beside.allowed and not clash:
        log(f"{key}={folder}: writing beside its {len(held)} files ({listed(held)}), none of which it replaces")
        return
    why = (f"its {MARKER} is not a marker this tool wrote" if (folder / MARKER).exists() else
           f"it has no {MARKER}, so this is not a folder this tool wrote")
    raise UserError(f"{key}={str(folder)!r} holds files this tool did not write ({listed(held)}): {why}"
                    + (f", and {listed(clash)} would be replaced" if beside.allowed else "")
                    + f". Name a new or empty folder ({fresh})"
                    + (f", {beside.hint}" if beside.hint and not clash else ""))


def mark(folder: Path, kind: str, files: list[str] = ()) -> None:
    """Write the marker that makes `folder` this tool's `kind`, recording `files` among the names it wrote there
    (unchanged when it already says so)."""
    folder = Path(folder)
    marker = read_marker(folder) or {}
    if marker.get("kind") == kind and set(files) <= set(marker.get("files", [])):
        return
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / MARKER, {"written_by": "lowmem_dpo", "kind": kind, "version": tool_version(),
                                        "created": marker.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "files": sorted(set(marker.get("files", [])) | set(files))})


def check_replacing(folder: Path, names: list[str], ours: frozenset[str], what: str) -> None:
    """Before moving files `names` into `folder`: refuse when one would replace a file that is neither one of the
    names this kind always writes (`ours`) nor one the marker records this tool wrote (a tokenizer may save a file
    of a name of its own, beside a user's file of that name under overwrite_output_dir)."""
    recorded = set((read_marker(folder) or {}).get("files", []))
    clash = [n for n in names if n not in ours and n not in recorded and (Path(folder) / n).exists()]
    if clash:
        raise UserError(f"not saving {what}: {listed(clash)} in {str(folder)!r} would replace a file this tool did "
                        f"not write; move it away and rerun (the checkpoints are intact)")


def tool_version() -> str:
    """lowmem_dpo's installed version ("unknown" from a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lowmem_dpo")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


@contextlib.contextmanager
def locked(folder: Path, key: str):
    """Hold `folder`'s lock (LOCK, created with the folder where missing) for the block: a UserError, before any
    work, when another process holds it (a second train into the same output_dir would write over the first's
    checkpoints and metrics), naming that process. A folder it created that holds nothing else at the end (the
    run was refused before writing) is removed again."""
    folder = Path(folder)
    check_writable(folder, key)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with _held(folder, key):
            yield
    finally:
        if created and visible(folder, hidden=True) == [LOCK]:
            (folder / LOCK).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()


@contextlib.contextmanager
def _held(folder: Path, key: str):
    with open(folder / LOCK, "a", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{key}={str(folder)!r} is in use by another run ({holder(folder / LOCK)}): two runs "
                            "in one folder would write over each other's checkpoints and metrics. Wait for it to "
                            f"end, or name another folder ({key}={free_name(folder)} is free)") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def holder(lock: Path) -> str:
    """Who holds `lock`'s flock, from the kernel's table (/proc/locks: pid and device:inode per lock): "pid N:
    its command line"; "another process" where that cannot be read."""
    try:
        inode = str(os.stat(lock).st_ino)
        for line in open("/proc/locks", encoding="utf-8"):
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == inode:
                command = Path(f"/proc/{parts[4]}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                return f"pid {parts[4]}: {command[:120]}"
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return "another process"
