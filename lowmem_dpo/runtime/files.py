"""Files that are complete or absent: atomic writes, free-space checks before writing, and content digests.

Everything lowmem_dpo writes (checkpoints, the adapter, reports; the reference cache is SQLite's, store.py) goes
through a temp file in the same folder, fsync and a rename. File digests are remembered by (path, size, mtime) in
$LOWMEM_DPO_HOME/file-digests.json, so a multi-GB model is hashed once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import fmt

_UMASK = os.umask(0)
os.umask(_UMASK)


def home() -> Path:
    """$LOWMEM_DPO_HOME (default ~/.cache/lowmem_dpo): built-in models and remembered digests."""
    return Path(os.environ.get("LOWMEM_DPO_HOME", Path.home() / ".cache" / "lowmem_dpo"))


# -- atomic writes -----------------------------------------------------------------------------------------------
def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, rename: the file is complete or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def fsync_tree(folder: Path) -> None:
    """fsync every file of a folder, then the folder itself (its entries)."""
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- disk space --------------------------------------------------------------------------------------------------
DISK_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (quota)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS


def free_bytes(folder: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `folder` (or its nearest existing
    parent)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def ensure_free_space(folder: Path, need: int, what: str, then: str) -> None:
    """Refuse (exit 2) before writing `need` bytes of `what` into `folder` when the disk has less free:
    better than a half-written file after hours of work. `then` says what happens to the work so far."""
    free = free_bytes(folder)
    if free < need:
        raise UserError(f"not enough disk space for {what} in {str(folder)!r}: needs ~{fmt(need)}, "
                        f"{fmt(free)} free; free some space (or point the output elsewhere) and rerun. {then}")


def disk_full_error(folder: Path, what: str, need: int, then: str) -> UserError:
    """The UserError for a write that hit a full disk after all (the estimate was short, or space went)."""
    return UserError(f"disk full while writing {what} in {str(folder)!r} (needs ~{fmt(need)}, "
                     f"{fmt(free_bytes(folder))} free now); free some space and rerun. {then}")


# -- content digests ---------------------------------------------------------------------------------------------
def _digest_store() -> Path:
    return home() / "file-digests.json"


def file_digests(paths: list[Path]) -> list[str]:
    """sha256 of each file, remembered by (absolute path, size, mtime_ns) so unchanged files are not re-read."""
    store = _digest_store()
    try:
        memo = json.loads(store.read_text())
    except (OSError, ValueError):
        memo = {}
    out, changed = [], False
    for p in paths:
        st = Path(p).stat()
        key = f"{Path(p).resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in memo:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
            memo[key] = h.hexdigest()
            changed = True
        out.append(memo[key])
    if changed:
        try:
            atomic_write_json(store, memo)
        except OSError:
            pass  # a read-only home only costs re-hashing next time
    return out


def files_digest(paths: list[Path], root: Path | None = None) -> str:
    """One digest over files' names (relative to root) and contents."""
    h = hashlib.sha256()
    for p, d in zip(paths, file_digests(paths)):
        name = str(Path(p).relative_to(root)) if root else Path(p).name
        h.update(f"{name}:{d}\n".encode())
    return h.hexdigest()
