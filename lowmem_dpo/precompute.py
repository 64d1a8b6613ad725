"""Run the reference model once over the data and cache per-row completion log-probs on disk.

    python -m lowmem_dpo.precompute recipes/tiny-cpu.yaml [key=value ...]

Re-running on a valid cache is a quick no-op (the fingerprint is computed from remembered file digests, no
model load). Both end with the preflight report (lowmem_dpo.preflight), printed and saved beside the manifest. A killed run resumes from its last finished shard. The manifest is written last, atomically, so
a previous cache stays usable until the new one is complete.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from lowmem_dpo import adapters, cache, data, devices, inputs, preflight
from lowmem_dpo.cli import log, run_cli
from lowmem_dpo.config import Config, load_config
from lowmem_dpo.logps import completion_logps


def shard_plan(pairs: list[data.TokenizedPair], shard_rows: int) -> list[list[data.TokenizedPair]]:
    """Rows sorted by length (longest first: an OOM shows at once, and batches carry little padding), then cut
    into shards. Deterministic, so a resumed build puts the same rows in the same shard."""
    order = sorted(pairs, key=lambda p: (-(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))), p.row))
    return [order[i:i + shard_rows] for i in range(0, len(order), shard_rows)]


@torch.inference_mode()
def shard_logps(model, pairs: list[data.TokenizedPair], batch_size: int, pad_id: int,
                resolved: devices.Resolved, bar) -> dict:
    out = {"rows": [], "chosen": [], "rejected": [], "chosen_tokens": [], "rejected_tokens": []}
    for i in range(0, len(pairs), batch_size):
        batch = data.collate(pairs[i:i + batch_size], pad_id).to(resolved.device)
        # The same precision as train's forward at the same settings: step 1 shows ln 2.
        with devices.autocast(resolved.device, resolved.ref_dtype):
            chosen, rejected = completion_logps(model, batch.input_ids, batch.attention_mask,
                                                batch.completion_mask).split()
        out["rows"].append(batch.rows)
        out["chosen"].append(chosen.logps.cpu())
        out["rejected"].append(rejected.logps.cpu())
        out["chosen_tokens"].append(chosen.n_tokens.cpu().int())
        out["rejected_tokens"].append(rejected.n_tokens.cpu().int())
        bar.update(len(batch.rows))
    return {k: torch.cat(v) for k, v in out.items()}


def offload_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> dict | None:
    """On CUDA, when the planner predicts the reference does not fit memory_budget (default: the card's
    memory), a device_map that streams the trailing decoder layers from CPU RAM through the GPU (no gradients
    here, so only their weights move); None otherwise, and always on a CPU or mps."""
    from lowmem_dpo import plan

    if resolved.device.type != "cuda":
        return None
    budget = plan.run_budget(cfg, "cuda")
    arch = plan.arch_of_run(model_path, "no CPU offload")
    if arch is None:
        return None
    return plan.offload_map(arch, plan.setup_from_config(cfg, budget), budget, "precompute",
                            resolved.device.index or 0)


def rebuild_command(cfg: Config, recipe: str | None) -> str:
    return f"python -m lowmem_dpo.precompute {recipe or 'RECIPE.yaml'} ref_cache_dir={cfg.ref_cache_dir}"


def run(cfg: Config, progress: bool = True) -> Path:
    """Build (or confirm) the cache for `cfg`; returns the cache folder."""
    from tqdm.auto import tqdm

    from lowmem_dpo.models import load_model

    resolved = devices.resolve(cfg)
    ins = inputs.prepare(cfg, resolved)
    cache_dir = Path(cfg.ref_cache_dir)
    fp = cache.fingerprint_digest(ins.fingerprint)
    manifest = cache.read_manifest(cache_dir)
    if manifest is not None and manifest.get("fingerprint") == fp:
        # The rows a cache holds do not depend on strict; a strict run still refuses data it would skip.
        data.check_skips(data.manifest_skips(manifest), manifest["num_rows"], manifest["num_pairs"],
                         cfg.dataset, cfg.max_length, cfg.strict)
        log(f"reference cache {cache_dir} is up to date ({manifest['num_rows']} rows, fingerprint {fp[:12]})")
        report(cache_dir)
        return cache_dir
    if resolved.ref_quantization != "none":  # fail before tokenizing, not after
        devices.import_bitsandbytes(f"ref_quantization={resolved.ref_quantization}")
    log(ins.source.description)

    tok = inputs.tokenized(cfg, ins.tokenizer, progress)  # bad data stops here, before anything is written
    shards = shard_plan(tok.pairs, cfg.cache_shard_rows)
    shard_dir = cache_dir / f"shards-{fp[:16]}"
    build = {"fingerprint": fp, "shard_rows": cfg.cache_shard_rows, "num_shards": len(shards)}
    info = shard_dir / "build.json"
    if info.is_file() and json.loads(info.read_text()) != build:
        shutil.rmtree(shard_dir)  # a different split of the same rows: start this build over
    if not (shard_dir / "build.json").is_file():
        cache.atomic_write_json(shard_dir / "build.json", build)
    names = [f"shard-{k:05d}.safetensors" for k in range(len(shards))]
    done = [(shard_dir / n).is_file() for n in names]
    done_rows = sum(len(s) for s, d in zip(shards, done) if d)
    if any(done):
        log(f"resuming: {sum(done)} of {len(shards)} shards already finished ({done_rows} rows)")

    # rows (int64) + chosen, rejected (float32) + two token counts (int32) per row, a header per shard
    need = (len(tok.pairs) - done_rows) * 24 + len(shards) * 4096 + (1 << 20)
    cache.ensure_free_space(cache_dir, need, "the reference cache",
                            "Finished shards are kept: the rerun resumes after them." if any(done) else
                            "Nothing was written; an existing cache there is untouched.")
    quantized = "" if resolved.ref_quantization == "none" else f", quantized {resolved.ref_quantization}"
    log(f"precompute: {len(tok.pairs)} rows on {resolved.device.type} in {devices.dtype_name(resolved.ref_dtype)}"
        f"{quantized}, batch {cfg.precompute_batch_size}, into {shard_dir}")
    model = load_model(ins.model_path, resolved.device, resolved.ref_dtype, resolved.ref_quantization,
                       device_map=offload_plan(cfg, resolved, ins.model_path))
    model = adapters.reference_model(model, ins.source)  # base + the SFT adapter, when there is one
    pad_id = data.pad_token_id(ins.tokenizer)
    t0 = time.perf_counter()
    bar = tqdm(total=len(tok.pairs), initial=done_rows, desc="precompute", unit="row", disable=not progress,
               dynamic_ncols=True)
    for shard, name, finished in zip(shards, names, done):
        if finished:
            continue
        tensors = shard_logps(model, shard, cfg.precompute_batch_size, pad_id, resolved, bar)
        try:
            cache.atomic_save_tensors(shard_dir / name, tensors)
        except OSError as e:
            if cache.is_disk_full(e):
                raise cache.disk_full_error(shard_dir, name, need, "Finished shards are kept: the rerun "
                                            "resumes after them; an existing cache there is untouched.") from None
            raise
    bar.close()
    elapsed = time.perf_counter() - t0
    computed = len(tok.pairs) - done_rows

    manifest = {
        "format": cache.FORMAT_VERSION,
        "fingerprint": fp,
        "components": ins.fingerprint,
        "num_rows": tok.num_rows,
        "num_pairs": len(tok.pairs),
        "dropped_rows": tok.dropped,
        "skipped": tok.skipped,
        "truncated": {part: len(rows) for part, rows in tok.truncated.items()},
        "shard_dir": shard_dir.name,
        "shards": names,
        "rows_per_s": round(computed / elapsed, 3) if elapsed > 0 and computed else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    cache.atomic_write_json(cache_dir / cache.MANIFEST, manifest)
    for old in cache_dir.glob("shards-*"):  # the new manifest is in place: older builds are unreachable
        if old.name != shard_dir.name:
            shutil.rmtree(old, ignore_errors=True)
    log(f"wrote reference cache {cache_dir}: {len(tok.pairs)} rows, fingerprint {fp[:12]}"
        + (f", {computed / elapsed:.1f} rows/s" if elapsed > 0 and computed else ""))
    report(cache_dir)
    return cache_dir


def report(cache_dir: Path) -> None:
    """Write the preflight report beside the manifest and log its summary and warnings."""
    for line in preflight.summary_lines(preflight.refresh(cache_dir)):
        log(line)
    log(f"preflight report: {cache_dir / preflight.REPORT}")


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "precompute", __doc__))
