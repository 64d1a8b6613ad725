"""The reference log-prob cache: fingerprint, shards, manifest, `load_ref_logps`.

Layout under `ref_cache_dir`:
    manifest.json                    written last, atomically: the cache is valid iff it exists
    shards-<fp16>/shard-00000.safetensors ...   per-row `rows` (int64), `chosen`, `rejected` (float32) logps
                                                and `chosen_tokens`, `rejected_tokens` (int32) counts
    shards-<fp16>/build.json         how rows are split into shards (so a killed build resumes)

The fingerprint hashes everything the numbers depend on: the model's weight files and config, the tokenizer
files, the dataset's content, the tokenization settings and the reference's dtype and quantization (plus an
adapter's files, when one is used). Training knobs are not in it. File digests are remembered by
(path, size, mtime) in $LOWMEM_DPO_HOME/file-digests.json so a multi-GB model is hashed once.

Row order: tensors are indexed by dataset row as loaded. Rows skipped by tokenization (data.SKIPS, e.g. a
prompt alone reaching max_length) hold NaN in `chosen`/`rejected` and 0 tokens; train never samples them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo.cli import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_UMASK = os.umask(0)
os.umask(_UMASK)


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


def atomic_save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous().cpu() for k, v in tensors.items()}))


# -- disk space --------------------------------------------------------------------------------------------------
DISK_FULL_ERRNOS = (28, 122)  # ENOSPC, EDQUOT (quota)


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS


def free_bytes(folder: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds `folder` (or its nearest existing
    parent)."""
    import shutil

    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def ensure_free_space(folder: Path, need: int, what: str, then: str) -> None:
    """Refuse (exit 2) before writing `need` bytes of `what` into `folder` when the disk has less free:
    better than a half-written file after hours of work. `then` says what happens to the work so far."""
    from lowmem_dpo.plan import fmt

    free = free_bytes(folder)
    if free < need:
        raise UserError(f"not enough disk space for {what} in {str(folder)!r}: needs ~{fmt(need)}, "
                        f"{fmt(free)} free; free some space (or point the output elsewhere) and rerun. {then}")


def disk_full_error(folder: Path, what: str, need: int, then: str) -> UserError:
    """The UserError for a write that hit a full disk after all (the estimate was short, or space went)."""
    from lowmem_dpo.plan import fmt

    return UserError(f"disk full while writing {what} in {str(folder)!r} (needs ~{fmt(need)}, "
                     f"{fmt(free_bytes(folder))} free now); free some space and rerun. {then}")


# -- fingerprint -------------------------------------------------------------------------------------------------
def _digest_store() -> Path:
    from lowmem_dpo.tiny import home

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


def fingerprint_digest(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


# -- reading ---------------------------------------------------------------------------------------------------
@dataclass
class RefCache:
    """Reference log-probs per dataset row (NaN / 0 tokens for skipped rows)."""

    chosen: torch.Tensor  # (num_rows,) fp32
    rejected: torch.Tensor  # (num_rows,) fp32
    chosen_tokens: torch.Tensor  # (num_rows,) int32
    rejected_tokens: torch.Tensor  # (num_rows,) int32
    manifest: dict


def read_manifest(cache_dir: Path) -> dict | None:
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def load_ref_cache(cache_dir: str | os.PathLike) -> RefCache:
    from safetensors.torch import load_file

    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}: run `python -m lowmem_dpo.precompute "
                        "RECIPE.yaml` first")
    n = manifest["num_rows"]
    chosen = torch.full((n,), float("nan"))
    rejected = torch.full((n,), float("nan"))
    chosen_tokens = torch.zeros(n, dtype=torch.int32)
    rejected_tokens = torch.zeros(n, dtype=torch.int32)
    for name in manifest["shards"]:
        t = load_file(cache_dir / manifest["shard_dir"] / name)
        rows = t["rows"]
        chosen[rows], rejected[rows] = t["chosen"], t["rejected"]
        chosen_tokens[rows], rejected_tokens[rows] = t["chosen_tokens"], t["rejected_tokens"]
    return RefCache(chosen, rejected, chosen_tokens, rejected_tokens, manifest)


def load_ref_logps(cache_dir: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected): float32 reference log-prob sums in dataset row order; NaN for skipped rows."""
    c = load_ref_cache(cache_dir)
    return c.chosen, c.rejected


def check_fingerprint(cache_dir: Path, components: dict, rebuild_cmd: str) -> dict:
    """The cache's manifest if it matches `components`; otherwise a UserError saying what changed."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}; build it with: {rebuild_cmd}")
    if manifest.get("fingerprint") == fingerprint_digest(components):
        return manifest
    old = manifest.get("components", {})
    changed = [k for k in sorted(set(old) | set(components)) if old.get(k) != components.get(k)]
    detail = ", ".join(f"{k} ({_short(old.get(k))} -> {_short(components.get(k))})" for k in changed)
    raise UserError(f"the reference cache in {str(cache_dir)!r} was built for other inputs: {detail or 'format'} "
                    f"changed. Rebuild it with: {rebuild_cmd}")


def _short(v) -> str:
    if isinstance(v, str) and len(v) == 64:
        return v[:12]
    return json.dumps(v, sort_keys=True)[:80]
