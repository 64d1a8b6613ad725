"""The reference log-prob cache on disk: manifest, shards, fingerprint check, `load_ref_logps`.

Layout under `ref_cache_dir`:
    manifest.json                    written last, atomically: the cache is valid iff it exists
    shards-<fp16>/shard-00000.safetensors ...   per-row `rows` (int64), `chosen`, `rejected` (float32) logps
                                                and `chosen_tokens`, `rejected_tokens` (int32) counts
    shards-<fp16>/build.json         how rows are split into shards (so a killed build resumes)
    preflight.json                   the preflight report (preflight.py)

The fingerprint hashes everything the numbers depend on (inputs.fingerprint_components: the keys a Config field
declares reference="value" or "files"). Training knobs are not in it. Precompute writes the cache; this module
reads and checks it.

Row order: tensors are indexed by dataset row as loaded. Rows skipped by tokenization (data.SKIPS, e.g. a
prompt alone reaching max_length) hold NaN in `chosen`/`rejected` and 0 tokens; train never samples them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo.errors import UserError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# The fingerprint components that are the reference's precision: a cache that differs only in them can serve
# train as built (ref_quantization, ref_dtype; see check_for_training).
PRECISION_COMPONENTS = {"dtype", "quantization"}


def fingerprint_digest(components: dict) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()


def rebuild_command(cfg, recipe: str | None) -> str:
    """The command that builds the cache a recipe needs, for messages."""
    return f"python -m lowmem_dpo.precompute {recipe or 'RECIPE.yaml'} ref_cache_dir={cfg.ref_cache_dir}"


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


# -- checking --------------------------------------------------------------------------------------------------
def check_fingerprint(cache_dir: Path, components: dict, rebuild_cmd: str) -> dict:
    """The cache's manifest if it matches `components`; otherwise a UserError saying what changed."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}; build it with: {rebuild_cmd}")
    if manifest.get("fingerprint") == fingerprint_digest(components):
        return manifest
    old = manifest.get("components", {})
    detail = ", ".join(f"{k} ({_short(old.get(k))} -> {_short(components.get(k))})"
                       for k in changed_components(old, components))
    raise UserError(f"the reference cache in {str(cache_dir)!r} was built for other inputs: {detail or 'format'} "
                    f"changed. Rebuild it with: {rebuild_cmd}")


def check_for_training(cache_dir: Path, components: dict, rebuild_cmd: str) -> dict:
    """check_fingerprint; when only the reference's precision differs, the message also says which settings
    train against the cache as built (it may hold a higher-precision reference on purpose)."""
    try:
        return check_fingerprint(cache_dir, components, rebuild_cmd)
    except UserError as e:
        old = (read_manifest(cache_dir) or {}).get("components", {})
        changed = set(changed_components(old, components))
        if not changed or not changed <= PRECISION_COMPONENTS:
            raise
        raise UserError(f"{e} ; or train against it as built: ref_quantization={old['quantization']} "
                        f"ref_dtype={old['dtype']} (the dtype and quantization above are the reference's)") from None


def changed_components(old: dict, new: dict) -> list[str]:
    return [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def check_rows(ref: RefCache, rows: list[int], cache_dir: Path) -> None:
    """Refuse a cache that lacks (or holds NaN for) a row the run trains on."""
    index = torch.tensor(rows)
    if len(ref.chosen) <= int(index.max()) or not torch.isfinite(ref.chosen[index]).all():
        raise UserError(f"the reference cache in {str(cache_dir)!r} lacks rows this run trains on; rebuild it "
                        "with python -m lowmem_dpo.precompute")


def _short(v) -> str:
    if isinstance(v, str) and len(v) == 64:
        return v[:12]
    return json.dumps(v, sort_keys=True)[:80]
