"""The reference log-prob cache on disk: manifest, shards, fingerprint check, `load_ref_logps`.

Layout under `ref_cache_dir`:
    manifest.json                    written last, atomically: the cache is valid iff it exists
    shards-<fp16>/shard-00000.safetensors ...   per-row `rows` (int64), `chosen`, `rejected` (float32) logps
                                                and `chosen_tokens`, `rejected_tokens` (int32) counts
    shards-<fp16>/eval-shard-00000.safetensors ...  the same for the rows of eval_dataset, when it is set
    shards-<fp16>/build.json         how rows are split into shards (so a killed build resumes)
    preflight.json                   the preflight report (preflight.py)

The fingerprint hashes everything the numbers depend on (inputs.fingerprint_components: the keys a Config field
declares reference="value" or "files"). Training knobs are not in it. Precompute writes the cache; this module
reads and checks it.

The manifest's top-level counts and shards are the training dataset's; with eval_dataset, its "eval" entry
holds the same for the eval rows (part_manifest): one build, one fingerprint, for both.

Row order: tensors are indexed by dataset row as loaded (eval shards: by eval_dataset row). Rows skipped by
tokenization (data.SKIPS, e.g. a prompt alone reaching max_length) hold NaN in `chosen`/`rejected` and 0 tokens;
train never samples them.
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
    """The command that builds the cache this run needs, for messages: precompute with the run's recipe and the
    same overrides (a dataset, a max_length given on the command line is the cache's too); a config built in
    code names its cache folder."""
    import shlex

    args = list(cfg.overrides) or [f"ref_cache_dir={cfg.ref_cache_dir}"]
    return shlex.join(["python", "-m", "lowmem_dpo.precompute", recipe or "RECIPE.yaml", *args])


# -- reading ---------------------------------------------------------------------------------------------------
@dataclass
class RefCache:
    """Reference log-probs per dataset row (NaN / 0 tokens for skipped rows), of one part of the cache."""

    chosen: torch.Tensor  # (num_rows,) fp32
    rejected: torch.Tensor  # (num_rows,) fp32
    chosen_tokens: torch.Tensor  # (num_rows,) int32
    rejected_tokens: torch.Tensor  # (num_rows,) int32
    manifest: dict  # part_manifest: the eval part's counts and shards in place of the training rows'


def read_manifest(cache_dir: Path) -> dict | None:
    path = Path(cache_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def part_manifest(manifest: dict, part: str = "train") -> dict | None:
    """The manifest of one part of the cache: "train" (the rows of dataset: the manifest itself) or "eval" (the
    rows of eval_dataset: the manifest with its "eval" entry's num_rows, num_pairs, dropped_rows, skipped,
    truncated and shards in place of the training rows'); None when the cache has no such part."""
    if part == "train":
        return manifest
    if part != "eval":
        raise ValueError(f"cache part {part!r}: 'train' or 'eval'")
    return {**manifest, **manifest["eval"]} if manifest.get("eval") else None


def load_ref_cache(cache_dir: str | os.PathLike, part: str = "train") -> RefCache:
    """The cached reference of one part (part_manifest): "train" in dataset row order, "eval" in eval_dataset
    row order."""
    from safetensors.torch import load_file

    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}: run `python -m lowmem_dpo.precompute "
                        "RECIPE.yaml` first")
    manifest = part_manifest(manifest, part)
    if manifest is None:
        raise UserError(f"the reference cache in {str(cache_dir)!r} holds no eval rows (it was built without "
                        "eval_dataset): rerun `python -m lowmem_dpo.precompute RECIPE.yaml` with eval_dataset set")
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
def check_fingerprint(cache_dir: Path, components: dict, rebuild_cmd: str, cfg=None) -> dict:
    """The cache's manifest if it matches `components`; otherwise a UserError naming what changed, in words (cfg:
    the run's Config, for the files' names)."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise UserError(f"no reference cache in {str(cache_dir)!r}; build it with: {rebuild_cmd}")
    if manifest.get("fingerprint") == fingerprint_digest(components):
        return manifest
    old = manifest.get("components", {})
    detail = "; ".join(describe_change(k, old.get(k), components.get(k), cfg)
                       for k in changed_components(old, components))
    raise UserError(f"the reference cache in {str(cache_dir)!r} was built for other inputs: {detail or 'its format'} "
                    f"changed since. Rebuild it with: {rebuild_cmd}")


def check_for_training(cache_dir: Path, components: dict, rebuild_cmd: str, cfg=None) -> dict:
    """check_fingerprint; when only the reference's precision differs, the message also says which settings
    train against the cache as built (it may hold a higher-precision reference on purpose)."""
    try:
        return check_fingerprint(cache_dir, components, rebuild_cmd, cfg)
    except UserError as e:
        old = (read_manifest(cache_dir) or {}).get("components", {})
        changed = set(changed_components(old, components))
        if not changed or not changed <= PRECISION_COMPONENTS:
            raise
        raise UserError(f"{e} ; or train against it as built: ref_quantization={old['quantization']} "
                        f"ref_dtype={old['dtype']} (the dtype and quantization above are the reference's)") from None


def changed_components(old: dict, new: dict) -> list[str]:
    return [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def completion_tokens(prompt_ids: list[int], completion_ids: list[int]) -> int:
    """The completion tokens logps.completion_logps counts for a sequence: each is predicted by the token before
    it, so a completion with no prompt before it loses its first token."""
    return len(completion_ids) - (1 if completion_ids and not prompt_ids else 0)


def check_rows(ref: RefCache, pairs: list, cache_dir: Path, rebuild_cmd: str) -> None:
    """Refuse a cache that does not serve the pairs (data.TokenizedPair) this run trains on: a row it lacks, a
    chosen or rejected log-prob that is not finite, or completion token counts other than this run's
    tokenization gives (a tokenizer or tokenizers/transformers library change since precompute: the fingerprint
    holds the tokenizer's files, not the library). Each names the first rows and how to rebuild."""
    # The fingerprint matched, so precompute would call this cache up to date: the rebuild starts from nothing.
    redo = f"remove it and rebuild it: rm -r {cache_dir} && {rebuild_cmd}"
    where = f"the reference cache in {str(cache_dir)!r}"
    rows = torch.tensor([p.row for p in pairs])  # (P,)
    if int(rows.max()) >= len(ref.chosen):
        raise UserError(f"{where} holds {len(ref.chosen)} rows; this run trains on rows up to {int(rows.max())}; "
                        + redo)
    finite = torch.isfinite(ref.chosen[rows]) & torch.isfinite(ref.rejected[rows])  # (P,)
    if not finite.all():
        raise UserError(f"{where} has no finite chosen and rejected reference log-probs for "
                        f"{int((~finite).sum())} of the rows this run trains on (rows {_first(rows[~finite])}); "
                        + redo)
    cached = torch.stack([ref.chosen_tokens[rows], ref.rejected_tokens[rows]], 1)  # (P, 2)
    counts = [(completion_tokens(p.prompt_ids, p.chosen_ids), completion_tokens(p.prompt_ids, p.rejected_ids))
              for p in pairs]
    now = torch.tensor(counts, dtype=cached.dtype)  # (P, 2)
    differ = (cached != now).any(1)  # (P,)
    if differ.any():
        i = int(differ.nonzero()[0])
        raise UserError(f"{where} counts other completion tokens than this run's tokenization for "
                        f"{int(differ.sum())} rows (rows {_first(rows[differ])}; row {int(rows[i])}: chosen "
                        f"{int(cached[i, 0])}, rejected {int(cached[i, 1])} cached, {int(now[i, 0])} and "
                        f"{int(now[i, 1])} now): the tokenizer or the tokenizers/transformers library changed "
                        f"since precompute; {redo}")


def _first(rows: torch.Tensor, n: int = 5) -> str:
    """The first n row indices, for messages."""
    shown = ", ".join(str(r) for r in sorted(rows.tolist())[:n])
    return shown + (", ..." if len(rows) > n else "")


# The fingerprint's components (inputs.fingerprint_components) in words, for "what changed".
WHAT = {"model": "the base model's weights or config", "adapter": "the SFT adapter's files",
        "tokenizer": "the tokenizer's files", "chat_template": "the chat template's text", "format": "the cache format"}


def describe_change(key: str, old, new, cfg=None) -> str:
    """One changed component of the fingerprint in words: which file's content, which key's value."""
    if key in WHAT:
        return WHAT[key] + (" (added)" if old is None else " (removed)" if new is None else "")
    if key == "dataset":
        paths = [s.path for s in cfg.dataset] if cfg is not None else []
        return _data_change("dataset", old, new, paths)
    if key == "eval_dataset":
        return _data_change("eval_dataset", old, new, [cfg.eval_dataset] if cfg is not None else [])
    return f"{key} {old} -> {new}"


def _data_change(key: str, old, new, paths: list) -> str:
    """What differs between two data components (inputs.dataset_component): a file's content, a split, a
    mixture's fractions and rows, the cap, the seed."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return f"{key} ({'added' if old is None else 'removed' if new is None else 'its form'})"
    if ("sources" in old) != ("sources" in new):
        return f"{key}: its sources (one source taken whole, against a mixture or a selection)"
    if "sources" not in old:
        return _source_change(key, old, new, paths[0] if paths else key)
    parts = []
    if len(old["sources"]) != len(new["sources"]):
        parts.append(f"{key}: {len(old['sources'])} -> {len(new['sources'])} sources")
    for i, (a, b) in enumerate(zip(old["sources"], new["sources"])):
        if a != b:
            parts.append(_source_change(f"{key}[{i}]", a, b, paths[i] if i < len(paths) else f"{key}[{i}]"))
    parts += [f"{key} {k} {old.get(k)} -> {new.get(k)}" for k in ("max_train_samples", "seed")
              if old.get(k) != new.get(k)]
    return "; ".join(parts)


def _source_change(key: str, old: dict, new: dict, path: str) -> str:
    parts = []
    if old.get("files") != new.get("files") or old.get("fingerprint") != new.get("fingerprint"):
        parts.append(f"the content of {path}")
    parts += [f"{key}.{k} {old.get(k)} -> {new.get(k)}" for k in ("split", "fraction", "rows", "hub")
              if old.get(k) != new.get(k)]
    return ", ".join(parts) or key
