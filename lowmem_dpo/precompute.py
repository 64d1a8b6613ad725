"""Run the reference model once over the data and cache per-row completion log-probs on disk.

    python -m lowmem_dpo.precompute recipes/tiny-cpu.yaml [key=value ...]

Re-running on a valid cache is a quick no-op (the fingerprint is computed from remembered file digests, no
model load). Both end with the preflight report (lowmem_dpo.preflight), printed and saved beside the manifest.
With eval_dataset, its rows are cached in the same build (eval-shard-*, the manifest's "eval"): one fingerprint,
one command. A killed run resumes from its last finished shard. The manifest is written last, atomically, so a
previous cache stays usable until the new one is complete.

On several processes (distributed.py) each computes every world-size-th unfinished shard; rank 0 writes the
manifest once all are on disk:

    torchrun --nproc-per-node 2 -m lowmem_dpo.precompute recipes/tiny-cpu.yaml
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo import (
    adapters,
    cache,
    data,
    devices,
    distributed,
    files,
    headcheck,
    inputs,
    models,
    preflight,
    streaming,
)
from lowmem_dpo.cli import run_cli
from lowmem_dpo.config import Config
from lowmem_dpo.errors import UserError, log
from lowmem_dpo.logps import batch_logps
from lowmem_dpo.memory import search
from lowmem_dpo.memory.setup import run_budget, setup_from_config
from lowmem_dpo.recipe import load_config
from lowmem_dpo.sources import label
from lowmem_dpo.units import fmt

EVAL_PREFIX = "eval-"  # the eval_dataset rows' shards: eval-shard-00000.safetensors ...


def shard_plan(pairs: list[data.TokenizedPair], shard_rows: int) -> list[list[data.TokenizedPair]]:
    """Rows sorted by length (longest first: an OOM shows at once, and batches carry little padding), then cut
    into shards. Deterministic, so a resumed build puts the same rows in the same shard."""
    order = sorted(pairs, key=lambda p: (-(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))), p.row))
    return [order[i:i + shard_rows] for i in range(0, len(order), shard_rows)]


@torch.inference_mode()
def shard_logps(model, pairs: list[data.TokenizedPair], batch_size: int, pad_id: int,
                resolved: devices.Resolved, bar=None, shared: bool = False) -> dict:
    """Reference log-prob sums and completion token counts of `pairs`, by batches: the tensors of one shard.
    `bar` (a progress bar) advances by the rows of each batch. shared: each prompt once (data.collate_shared)."""
    out = {"rows": [], "chosen": [], "rejected": [], "chosen_tokens": [], "rejected_tokens": []}
    collate = data.collate_shared if shared else data.collate
    for i in range(0, len(pairs), batch_size):
        batch = collate(pairs[i:i + batch_size], pad_id).to(resolved.device)
        # The same precision as train's forward at the same settings: step 1 shows ln 2.
        with devices.autocast(resolved.device, resolved.ref_dtype):
            chosen, rejected = batch_logps(model, batch).split()
        out["rows"].append(batch.rows)
        out["chosen"].append(chosen.logps.cpu())
        out["rejected"].append(rejected.logps.cpu())
        out["chosen_tokens"].append(chosen.n_tokens.cpu().int())
        out["rejected_tokens"].append(rejected.n_tokens.cpu().int())
        if bar is not None:
            bar.update(len(batch.rows))
    return {k: torch.cat(v) for k, v in out.items()}


def memory_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> tuple[int, streaming.Plan | None]:
    """Precompute's knobs from the planner (memory/search.py), in the order of their cost: the batch halved until
    the reference's forward fits the budget (memory_budget, or the device's), and on CUDA, last, the trailing
    decoder layers streamed from CPU RAM (no gradients here: each is copied once per batch). Returns (batch,
    what to stream)."""
    budget = resolved.budget if resolved.budget is not None else run_budget(cfg, resolved.device.type)
    arch = search.arch_of_run(model_path, cfg, f"precompute_batch_size={cfg.precompute_batch_size} as given")
    if arch is None:
        return cfg.precompute_batch_size, None
    knobs = ("precompute_batch",) + (("stream",) if resolved.device.type == "cuda" else ())
    plan = search.choose(arch, setup_from_config(cfg, budget), budget, knobs, stages=("precompute",))
    batch, stream = plan.setup.precompute_batch, plan.streams.get("precompute")
    if batch != cfg.precompute_batch_size:
        log(f"precompute_batch_size={batch} (the planner: {cfg.precompute_batch_size} pairs per forward do not fit "
            f"{fmt(budget)}; the same numbers)")
    if not plan.fits:
        log(f"warning: the planner predicts precompute does not fit {fmt(budget)} even so (python -m "
            "lowmem_dpo.plan shows the terms); an out-of-memory error halves the batch again")
    return batch, streaming.Plan(stream.layers, arch.layers_prefix) if stream and plan.fits else None


@dataclass
class Build:
    """One build of the cache: its shards of rows, where they go, and which of them an earlier, killed build
    of the same fingerprint already finished. The training rows' shards come first, then eval_dataset's."""

    shard_dir: Path
    shards: list[list[data.TokenizedPair]]
    names: list[str]  # shard-00000.safetensors ..., then eval-shard-00000.safetensors ...
    done: list[bool]

    def part_names(self, part: str) -> list[str]:
        """The shard names of one part of the cache, "train" or "eval"."""
        return [n for n in self.names if n.startswith(EVAL_PREFIX) == (part == "eval")]

    @property
    def done_rows(self) -> int:
        return sum(len(s) for s, d in zip(self.shards, self.done) if d)


def start_build(cfg: Config, pairs: list[data.TokenizedPair], fp: str,
                eval_pairs: list[data.TokenizedPair] | None = None) -> Build:
    """The shard folder of fingerprint `fp`, its build.json, and the shards already finished there; with
    `eval_pairs` (eval_dataset's), their shards too."""
    shards = shard_plan(pairs, cfg.cache_shard_rows)
    eval_shards = [] if eval_pairs is None else shard_plan(eval_pairs, cfg.cache_shard_rows)
    shard_dir = Path(cfg.ref_cache_dir) / f"shards-{fp[:16]}"
    build = {"fingerprint": fp, "shard_rows": cfg.cache_shard_rows, "num_shards": len(shards)}
    if eval_pairs is not None:  # only then, so a killed build of a cache without eval data still resumes
        build["num_eval_shards"] = len(eval_shards)
    info = shard_dir / "build.json"
    if distributed.is_main():  # one process decides; the others look once it has
        if info.is_file() and json.loads(info.read_text()) != build:
            shutil.rmtree(shard_dir)  # a different split of the same rows: start this build over
        if not info.is_file():
            files.atomic_write_json(info, build)
    distributed.barrier()
    names = [f"shard-{k:05d}.safetensors" for k in range(len(shards))]
    names += [f"{EVAL_PREFIX}shard-{k:05d}.safetensors" for k in range(len(eval_shards))]
    b = Build(shard_dir, shards + eval_shards, names, [(shard_dir / n).is_file() for n in names])
    if any(b.done):
        log(f"resuming: {sum(b.done)} of {len(b.shards)} shards already finished ({b.done_rows} rows)")
    return b


def compute_shards(model, b: Build, cfg: Config, resolved: devices.Resolved, pad_id: int, need: int,
                   progress: bool, shared: bool = False, batch_size: int | None = None) -> None:
    """Compute and write every shard the build lacks (several processes: each its own, every world-size-th of
    them, longest first, so each gets rows of every length). The bar counts this process's rows (one process:
    all the build's, the finished shards' included). Out of memory halves the batch (batch_size, default
    precompute_batch_size) for that shard and the ones after it, down to 1 pair."""
    from tqdm.auto import tqdm

    left = [k for k, finished in enumerate(b.done) if not finished]
    processes = distributed.world().size
    if 0 < len(left) < processes:
        log(f"note: {len(left)} shards to compute for {processes} processes, so {processes - len(left)} have none: "
            f"a shard is one process's work; lower cache_shard_rows (now {cfg.cache_shard_rows}) to share the rows")
    todo = distributed.shard(left)
    done = b.done_rows if processes == 1 else 0
    bar = tqdm(total=done + sum(len(b.shards[k]) for k in todo), initial=done, desc="precompute", unit="row",
               disable=not progress or not distributed.is_main(), dynamic_ncols=True)
    batch = batch_size or cfg.precompute_batch_size
    try:
        for k in todo:
            shard, name = b.shards[k], b.names[k]
            tensors, batch = shard_with_backoff(model, shard, name, batch, pad_id, resolved, bar, shared)
            try:
                files.atomic_save_tensors(b.shard_dir / name, tensors)
            except OSError as e:
                if files.is_disk_full(e):
                    raise files.disk_full_error(b.shard_dir, name, need, "Finished shards are kept: the rerun "
                                                "resumes after them; an existing cache there is untouched.") from None
                raise
    finally:
        bar.close()  # before any error message, which then stands on its own line


def shard_with_backoff(model, shard: list[data.TokenizedPair], name: str, batch: int, pad_id: int,
                       resolved: devices.Resolved, bar, shared: bool) -> tuple[dict, int]:
    """shard_logps of one shard, its batch halved on out-of-memory down to 1 pair (devices.halving_on_oom); the
    tensors, and the batch that worked, where the next shards start."""
    start = bar.n

    def attempt(size: int):
        bar.n = start  # a retry computes the shard from its start
        return shard_logps(model, shard, size, pad_id, resolved, bar, shared), size

    return devices.halving_on_oom(
        attempt, batch, resolved.device,
        lambda n: f"out of memory in precompute ({name}): retrying with precompute_batch_size={n}",
        "out of memory in precompute with 1 pair per forward: lower max_length, or set ref_quantization=4bit "
        "(python -m lowmem_dpo.plan RECIPE.yaml shows what fits); finished shards are kept, and the rerun resumes "
        "after them")


def part_entry(tok: data.TokenizedData, shards: list[str]) -> dict:
    """The manifest's account of one part's rows (cache.part_manifest): counts, rows left out, shards."""
    return {"num_rows": tok.num_rows, "num_pairs": len(tok.pairs), "dropped_rows": tok.dropped,
            "skipped": tok.skipped, "truncated": {part: len(rows) for part, rows in tok.truncated.items()},
            "shards": shards}


def write_manifest(cache_dir: Path, b: Build, ins: inputs.Inputs, fp: str, tok: data.TokenizedData,
                   computed: int, elapsed: float, eval_tok: data.TokenizedData | None = None,
                   shared: bool = False) -> None:
    """The manifest, last and atomically: from now on the cache is this build; older builds' shards go. Its
    top-level counts and shards are the training rows'; "eval" holds eval_dataset's (absent without it)."""
    manifest = {
        "share_prompt": shared,  # the forward's layout (train notes a 16-bit run that differs: rounding)
        "format": cache.FORMAT_VERSION,
        "fingerprint": fp,
        "components": ins.fingerprint,
        **part_entry(tok, b.part_names("train")),
        "shard_dir": b.shard_dir.name,
        "rows_per_s": round(computed / elapsed, 3) if elapsed > 0 and computed else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if eval_tok is not None:
        manifest["eval"] = part_entry(eval_tok, b.part_names("eval"))
    files.atomic_write_json(cache_dir / cache.MANIFEST, manifest)
    for old in cache_dir.glob("shards-*"):  # the new manifest is in place: older builds are unreachable
        if old.name != b.shard_dir.name:
            shutil.rmtree(old, ignore_errors=True)


def up_to_date(cfg: Config, cache_dir: Path, fp: str) -> bool:
    """Whether the cache already holds this fingerprint (a strict run still refuses data it would skip)."""
    manifest = cache.read_manifest(cache_dir)
    if manifest is None or manifest.get("fingerprint") != fp:
        return False
    data.check_skips(data.manifest_skips(manifest), manifest["num_rows"], manifest["num_pairs"],
                     label(cfg.dataset), cfg.max_length, cfg.strict)
    ev = manifest.get("eval")
    if ev is not None:  # the fingerprint matched, so cfg.eval_dataset names these rows
        data.check_skips(data.manifest_skips(ev), ev["num_rows"], ev["num_pairs"], cfg.eval_dataset,
                         cfg.max_length, cfg.strict)
    log(f"reference cache {cache_dir} is up to date ({manifest['num_rows']} rows"
        + (f", {ev['num_rows']} eval rows" if ev else "") + f", fingerprint {fp[:12]})")
    return True


def run(cfg: Config, progress: bool = True) -> Path:
    """Build (or confirm) the cache for `cfg`; returns the cache folder."""
    resolved = devices.resolve(cfg)
    ins = inputs.prepare(cfg, resolved)
    cache_dir = Path(cfg.ref_cache_dir)
    fp = cache.fingerprint_digest(ins.fingerprint)
    if up_to_date(cfg, cache_dir, fp):
        report(cache_dir)
        return cache_dir
    if resolved.ref_quantization != "none":  # fail before tokenizing, not after
        devices.import_bitsandbytes(f"ref_quantization={resolved.ref_quantization}")
    log(ins.source.description)
    d = inputs.load_data(cfg, ins.tokenizer, progress)  # bad data stops here, before anything is written
    tok, eval_tok = d.tok, d.eval_tok  # every row of dataset (eval_fraction's too) and of eval_dataset
    b = start_build(cfg, tok.pairs, fp, None if eval_tok is None else eval_tok.pairs)
    rows = sum(map(len, b.shards))
    # rows (int64) + chosen, rejected (float32) + two token counts (int32) per row, a header per shard
    need = (rows - b.done_rows) * 24 + len(b.shards) * 4096 + (1 << 20)
    files.ensure_free_space(cache_dir, need, "the reference cache",
                            "Finished shards are kept: the rerun resumes after them." if any(b.done) else
                            "Nothing was written; an existing cache there is untouched.")
    quantized = "" if resolved.ref_quantization == "none" else f", quantized {resolved.ref_quantization}"
    of_eval = "" if eval_tok is None else f" ({len(eval_tok.pairs)} of them eval_dataset's)"
    if cfg.memory_snapshot_on_oom:
        log(devices.record_snapshots(resolved.device, cache_dir))
    batch, stream = memory_plan(cfg, resolved, ins.model_path)
    log(f"precompute: {rows} rows{of_eval} on {resolved.device.type} in {devices.dtype_name(resolved.ref_dtype)}"
        f"{quantized}, batch {batch}, into {b.shard_dir}")
    model = models.load_model(ins.model_path, models.load_device(resolved.device, resolved.ref_quantization,
                                                                 stream.layers if stream else 0),
                              resolved.ref_dtype, resolved.ref_quantization)
    model = adapters.reference_model(model, ins.source)  # base + the SFT adapter, when there is one
    streaming.stream_layers(model, stream, resolved.device)
    pad_id = data.pad_token_id(ins.tokenizer)
    headcheck.verify(model, data.collate(tok.pairs[:1], pad_id).to(resolved.device), resolved.device,
                     resolved.ref_dtype)  # an architecture logps.HEADS does not know: its own forward agrees
    shared = headcheck.decide_sharing(model, tok.pairs, pad_id, resolved, resolved.ref_dtype, cfg.share_prompt,
                                      cfg.max_length)
    t0 = time.perf_counter()
    compute_shards(model, b, cfg, resolved, pad_id, need, progress, shared, batch)
    del model  # the reference's memory goes now (bitsandbytes' weights hold a reference cycle): train may follow
    devices.release_memory(resolved.device)
    distributed.barrier()  # every process's shards are written
    elapsed, computed = time.perf_counter() - t0, rows - b.done_rows
    if not distributed.is_main():
        return cache_dir
    missing = [n for n in b.names if not (b.shard_dir / n).is_file()]
    if missing:
        raise UserError(f"precompute: {len(missing)} shards are missing in {b.shard_dir} after every process "
                        f"finished (first: {missing[0]}); rerun the same command: finished shards are kept")
    write_manifest(cache_dir, b, ins, fp, tok, computed, elapsed, eval_tok, shared)
    log(f"wrote reference cache {cache_dir}: {rows} rows{of_eval}, fingerprint {fp[:12]}"
        + (f", {computed / elapsed:.1f} rows/s" if elapsed > 0 and computed else ""))
    report(cache_dir)
    return cache_dir


def report(cache_dir: Path) -> None:
    """Write the preflight report beside the manifest and log its summary and warnings (rank 0's job)."""
    if not distributed.is_main():
        return
    for line in preflight.summary_lines(preflight.refresh(cache_dir)):
        log(line)
    log(f"preflight report: {cache_dir / preflight.REPORT}")


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "precompute", __doc__))
