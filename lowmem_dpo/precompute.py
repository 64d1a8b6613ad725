"""Run the reference model over the sequences the reference cache lacks, and store their completion log-probs.

    lowmem-dpo precompute lowmem_dpo:tiny-cpu [key=value ...] [--prune]

Each sequence's values (a prompt and one completion: a pair is two) are stored under its model side and its
sequence key (cache.py: the model's weights, dtype and quantization; the sequence's own token ids), in
ref_cache_dir/index.sqlite (store.py). Precompute looks every sequence of the recipe's rows up (the dataset's, and
eval_dataset's when it is set) and computes only the missing ones, then says `computed N sequences, reused M`.
Reordered, subset, newly mixed or re-paired rows cost no forward; a run whose sequences are all there loads no
model. A killed run keeps every batch it committed. A damaged index is moved aside (index.sqlite.damaged-<time>,
nothing deleted) for a new one, and damaged values are dropped and computed again. --prune drops the values this
recipe does not use (other model sides included) and says how much the cache holds. It ends with the preflight
report (lowmem_dpo.preflight), printed and saved as ref_cache_dir/preflight.json.

On several processes (distributed.py) each computes every world-size-th batch of the missing sequences into the
same store:

    torchrun --nproc-per-node 2 -m lowmem_dpo.precompute lowmem_dpo:tiny-cpu
"""

from __future__ import annotations

import math
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowmem_dpo import data, objectives, preflight
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config, place, require
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache, sides
from lowmem_dpo.data import store as stores
from lowmem_dpo.data.store import Value
from lowmem_dpo.memory import cards, search
from lowmem_dpo.memory.host import check_host_ram, host_ram
from lowmem_dpo.model import headcheck, streaming
from lowmem_dpo.model.logps import completion_logps, lm_of
from lowmem_dpo.runtime import devices, distributed, files, folders, heap, oom, sharding
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.units import fmt
from lowmem_dpo.training import inputs, policy

BUILD = cache.BUILD  # what the last precompute did: sequences computed and reused, its forward's sequences/s


def forward_units(pairs: list[data.TokenizedPair], keys: list[tuple[bytes, bytes]], todo: set[bytes] | None,
                  shared: bool) -> list[list[data.TokenizedCompletion]]:
    """The sequences of `pairs` (`keys`: their cache.pair_keys) in `todo` (None: all), each once, as the rows of
    their forwards: unshared, one sequence a row. Shared, a pair both of whose sequences are to compute is one row
    [prompt, chosen, rejected], exactly as train lays it out (the same numbers to the bit in 16 bits); the
    sequences left (a completion another pair already computes, or one of a re-pairing) go two of one prompt to a
    row, an odd one alone."""
    units, singles, taken = [], {}, set()
    for p, pair in zip(pairs, keys):
        wanted = [seq for key, seq in zip(pair, cache.pair_sequences(p))
                  if (todo is None or key in todo) and key not in taken and seq.completion_ids]
        taken.update(key for key in pair if todo is None or key in todo)
        if not shared:
            units += [[seq] for seq in wanted]
        elif len(wanted) == 2:
            units.append(wanted)
        else:
            singles.setdefault(tuple(p.prompt_ids), []).extend(wanted)
    return units + [group[i:i + 2] for group in singles.values() for i in range(0, len(group), 2)]


def unit_tokens(unit: list[data.TokenizedCompletion]) -> int:
    """A forward unit's length: its prompt and its longest completion (a shared unit's second completion rides in
    the same row)."""
    return len(unit[0].prompt_ids) + max(len(seq.completion_ids) for seq in unit)


def longest_first(units: list[list[data.TokenizedCompletion]]) -> list[list[data.TokenizedCompletion]]:
    """Precompute's order: longest first (data.by_length), ties by row."""
    return data.by_length(sorted(units, key=lambda unit: unit[0].row), unit_tokens)


def collate_units(units: list[list[data.TokenizedCompletion]], pad_id: int, layout: data.Layout
                  ) -> tuple[data.Batch, list]:
    """One forward of `units` (forward_units) in `layout`, and the sequence each of its outputs is (None: an empty
    slot)."""
    if not layout.shared:
        return data.collate_completions([u[0] for u in units], pad_id, layout.packed), [u[0] for u in units]
    rows = [data.TokenizedPair(u[0].row, u[0].prompt_ids, u[0].completion_ids, u[1].completion_ids if len(u) > 1
                               else []) for u in units]
    return data.collate_shared(rows, pad_id, layout.packed), [u[0] for u in units] + [
        u[1] if len(u) > 1 else None for u in units]


@dataclass(frozen=True)
class ReferenceForward:
    """The reference's forward as precompute runs it, the same for every batch of a build."""

    model: object  # the reference: base, or base + the SFT adapter (load_model)
    pad_id: int
    resolved: devices.Resolved  # its device and ref_dtype
    layout: data.Layout = data.Layout()  # a pair's prompt once per row, packed rows (headcheck.bring_up decides)
    per_token: bool = False  # each token's log-prob kept too (a per_token side: ld_alpha)


@torch.inference_mode()
def units_logps(reference: ReferenceForward, units: list[list[data.TokenizedCompletion]], batch_size: int,
                bar=None) -> list:
    """(sequence, store Value) of every sequence of `units`, batch_size units per forward. `bar` (a progress bar)
    advances by the sequences of each batch."""
    out, resolved, per_token = [], reference.resolved, reference.per_token
    lm = lm_of(reference.model)  # its parts, read once for the batches
    for i in range(0, len(units), batch_size):
        batch, seqs = collate_units(units[i:i + batch_size], reference.pad_id, reference.layout)
        # The same precision as train's forward at the same settings: step 1 shows ln 2.
        with devices.autocast(resolved.device, resolved.ref_dtype):
            got = completion_logps(lm, batch.to(resolved.device), per_token=per_token)
        logps, counts = got.logps.cpu().tolist(), got.n_tokens.cpu().tolist()
        for j, seq in enumerate(seqs):
            if seq is not None:
                tokens = got.tokens[j].float().cpu().numpy().tobytes() if per_token else None  # (n,) float32
                out.append((seq, Value(logps[j], counts[j], tokens)))
        if bar is not None:
            bar.update(sum(seq is not None for seq in seqs))
    return out


def memory_plan(cfg: Config, resolved: devices.Resolved, model_path: Path) -> tuple[int, streaming.Plan | None]:
    """Precompute's knobs from the planner (memory/search.py), in the order of their cost: the batch halved until
    the reference's forward fits the budget (memory_budget, or the device's), and on CUDA, last, the trailing
    decoder layers streamed from CPU RAM (no gradients here: each is copied once per batch). Returns (batch,
    what to stream)."""
    budget = policy.planning_budget(resolved)
    arch = search.arch_of_run(model_path, cfg, f"precompute_batch_size={cfg.precompute_batch_size} as given")
    if arch is None:
        cards.sharded_as_planned(cfg, resolved, None, "precompute")
        return cfg.precompute_batch_size, None
    plan = cards.on_cards(arch, cfg, budget, distributed.world().size,
                          search.stage_knobs(cfg, "precompute", resolved.device.type), ("precompute",))
    cards.sharded_as_planned(cfg, resolved, plan, "precompute")
    batch, stream = plan.setup.precompute_batch, plan.streams.get("precompute")
    if resolved.share_prompt and not plan.setup.share_prompt:
        resolved.share_prompt = False
        log(f"share_prompt: the unshared forward (the planner: a shared row's (T, T) mask does not fit {fmt(budget)})")
    if batch != cfg.precompute_batch_size:
        log(f"precompute_batch_size={batch} (the planner: {cfg.precompute_batch_size} pairs per forward do not fit "
            f"{fmt(budget)}; the same numbers)")
    if not plan.fits:
        log(f"warning: the planner predicts precompute does not fit {fmt(budget)} even so (python -m "
            "lowmem_dpo.plan shows the terms); an out-of-memory error halves the batch again")
    streamed = bool(stream) and plan.fits
    kept = resolved.device.type == "cpu" and plan.fits and heap.keep_freed_blocks(
        plan.prediction.precompute.peak_bytes, plan.prediction.precompute.transient, budget)
    if kept:
        log(kept)
    for line in check_host_ram(host_ram(arch, plan, "precompute", streamed), "precompute"):
        log(line)
    return batch, streaming.Plan(stream.layers, arch.layers_prefix) if streamed else None


def compute_missing(reference: ReferenceForward, every: list[list], run_cache: cache.RunCache, layout: bool | None,
                    batch: int, need: int, progress: bool) -> None:
    """Compute the sequences of `every` (forward units, longest first, cut into commits) by batches and commit
    each chunk to the run's cache under `layout` (a killed run keeps what it committed; `need`: the bytes the
    free-space check asked for, which a full disk's message names). Several processes: each its every
    world-size-th chunk. Out of memory halves the batch (down to 1 pair) for that chunk and the ones after it."""
    from tqdm.auto import tqdm

    mine = distributed.shard(every)
    total = sum(len(u) for chunk in mine for u in chunk)
    bar = tqdm(total=total, desc="precompute", unit="seq", dynamic_ncols=True,
               disable=not progress or not distributed.is_main())
    kept = 0
    try:
        for chunk in mine:
            got, batch = chunk_with_backoff(reference, chunk, batch, bar)
            bad = sorted({seq.row for seq, v in got if not math.isfinite(v.logps)})
            if bad:
                raise UserError(f"the reference gives non-finite reference log-probs for {len(bad)} rows (rows "
                                f"{', '.join(map(str, bad[:5]))}): its weights, or its dtype's range (float16 "
                                "overflows above 65504), cannot score them; nothing was stored for them. Check the "
                                "model, or set ref_dtype=float32")
            try:
                run_cache.put(layout, got)
            except Exception as e:
                if files.is_disk_full(e) or "database or disk is full" in str(e):
                    raise files.disk_full_error(run_cache.store.path.parent, "the reference cache", need, "The sequences "
                                                "committed so far are kept: the rerun computes only the rest."
                                                ) from None
                raise
            kept += len(got)
        idle_forwards(reference, every, mine, batch)
    except KeyboardInterrupt:  # Ctrl-C: what the rerun will not compute again
        raise KeyboardInterrupt(f"{kept} of the {total} sequences to compute are kept in the cache "
                                f"({run_cache.store.path.parent}); the same command computes only the other "
                                f"{total - kept}") from None
    finally:
        bar.close()  # before any error message, which then stands on its own line


def idle_forwards(reference: ReferenceForward, every: list[list], mine: list[list], batch: int) -> None:
    """With the base sharded (fsdp), every forward gathers each layer from every rank: a rank with fewer forwards
    than another (its share of the commits, `mine` of `every`) runs idle ones (the shortest unit; dropped) until it
    has run as many."""
    if not reference.resolved.sharded:
        return
    per = batch * (1 if reference.layout.shared else 2)  # units per forward (chunk_with_backoff)
    world = distributed.world()
    counts = [sum(math.ceil(len(chunk) / per) for chunk in distributed.shard(every, distributed.World(r, world.size)))
              for r in range(world.size)]
    idle = sharding.idle_forwards(counts[world.rank], counts)
    shortest = min((unit for chunk in every for unit in chunk), key=unit_tokens) if idle else None
    for _ in range(idle):
        units_logps(reference, [shortest], 1)


def commits(units: list[list[data.TokenizedCompletion]], size: int) -> list[list]:
    """`units` in order, cut into commits of at most `size` sequences (cache_shard_rows; one unit at least)."""
    out, count = [[]], 0
    for unit in units:
        if out[-1] and count + len(unit) > size:
            out.append([])
            count = 0
        out[-1].append(unit)
        count += len(unit)
    return out if out[0] else []


def chunk_with_backoff(reference: ReferenceForward, chunk: list[list[data.TokenizedCompletion]], batch: int,
                       bar) -> tuple[list, int]:
    """units_logps of one chunk, its batch halved on out-of-memory down to 1 pair (oom.halving_on_oom); the
    values, and the batch that worked, where the next chunks start. `batch` is in pairs: a pair is one shared
    row, or two unshared ones."""
    start = bar.n
    rows_per_pair = 1 if reference.layout.shared else 2

    def attempt(size: int):
        bar.n = start  # a retry computes the chunk from its start
        return units_logps(reference, chunk, size * rows_per_pair, bar), size

    said = oom.Said(
        lambda n: f"out of memory in precompute: retrying with precompute_batch_size={n}",
        "out of memory in precompute with 1 pair per forward: lower max_length, or set ref_quantization=4bit "
        "(lowmem-dpo plan RECIPE.yaml shows what fits); the sequences computed so far are kept, and the "
        "rerun computes only the rest",
        sharding.oom_message("precompute_batch_size or max_length", reference.resolved.shard_offload,
                             "the sequences computed so far are kept, and the rerun computes only the rest")
        if reference.resolved.sharded else None)
    return oom.halving_on_oom(attempt, batch, reference.resolved.device, said)


def load_model(cfg: Config, resolved: devices.Resolved, prepared: inputs.Inputs, sequences: int):
    """The reference (base, or base + SFT adapter) as the planner fits it; and the batch it plans."""
    batch, stream = memory_plan(cfg, resolved, prepared.model_path)
    quantized = "" if resolved.ref_quantization == "none" else f", quantized {resolved.ref_quantization}"
    log(f"precompute: {sequences} sequences on {resolved.device.type} in {devices.dtype_name(resolved.ref_dtype)}"
        f"{quantized}, batch {batch}, into {cfg.ref_cache_dir}")
    model = policy.setup_model(cfg, resolved, prepared.model_path, stream, prepared.source, reference=True)
    return model, batch


def run(cfg: Config, progress: bool = True, prune: bool = False, recipe: str | None = None) -> Path | None:
    """Compute the sequences of `cfg` the cache lacks (prune: then drop what it does not use); returns the cache
    folder, or None when the loss reads no reference (SimPO, ORPO): nothing to compute, nothing written."""
    if not objectives.needs_reference(cfg.loss_type):
        log(f"loss_type={cfg.loss_type} reads no reference: nothing to compute, and train needs no cache (nothing "
            "written)")
        return None
    require(cfg, "precompute")
    resolved = devices.resolve(cfg)
    prepared = inputs.prepare(cfg, resolved)
    cache_dir = Path(cfg.ref_cache_dir)
    folders.check(cache_dir, "reference cache", "ref_cache_dir", cache.earlier_cache)  # nothing of a user's replaced
    if resolved.ref_quantization != "none":  # fail before tokenizing, not after
        devices.import_bitsandbytes(f"ref_quantization={resolved.ref_quantization}")
    log(prepared.source.description)
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress)  # bad data stops here, before anything is written
    sequences = dataset.sequences()  # key -> the sequence: one per key, however many rows pair it
    keys = list(sequences)
    side = inputs.run_side(cfg, resolved, prepared)
    cache_layout = sides.CacheLayout.of_run(side, cfg)
    command = cache.rebuild_command(cfg, recipe)
    stores.refuse_earlier_format(cache_dir, command)  # before anything is written there
    folders.mark(cache_dir, "reference cache")  # every rank before it creates the store: a rank checking late sees it
    log(f"reference cache: {place(cfg, 'ref_cache_dir')}")
    with open_cache(cache_dir, side, command) as run_cache:
        # as rank 0 reads them: every process splits the same sequences (not so after another rank's first commit)
        lacking = distributed.broadcast(run_cache.missing(sequences, reuse_twin=cache_layout.reuse_twin)
                                        if distributed.is_main() else None)
        need = {layout: stores.room_for([sequences[keys[i]] for i in miss], side.per_token)
                for layout, miss in lacking.items()}
        files.ensure_free_space(cache_dir, min(need.values()), "the reference cache",
                                "Nothing was computed; the cache there is untouched.")
        if complete := cache_layout.complete(lacking):  # every sequence is there: no model
            computed, layout, seconds = 0, complete[0], 0.0
        else:
            model, batch = load_model(cfg, resolved, prepared, len(keys))
            pad_id = data.pad_token_id(prepared.tokenizer)
            # decided on the dataset's pairs, as train decides: the two agree on the layout
            forward_layout = headcheck.bring_up(model, cfg, resolved, pad_id, dataset.tok.pairs[:1], dataset.tok.pairs)
            layout = cache_layout.of_forward(forward_layout.shared)  # the cache's 16-bit layout
            todo = {keys[i] for i in lacking[layout]}
            units = forward_units(*dataset.all_pairs(), todo, forward_layout.shared)
            computed, t0 = len(todo), time.perf_counter()
            reference = ReferenceForward(model, pad_id, resolved, forward_layout, per_token=side.per_token)
            compute_missing(reference, commits(longest_first(units), cfg.cache_shard_rows), run_cache, layout, batch,
                            need[layout], progress)
            # the model's memory goes now (bitsandbytes' weights hold a reference cycle): train may follow
            del model, reference
            oom.release_memory(resolved.device)
            distributed.barrier()  # every process's sequences are in the store
            seconds = time.perf_counter() - t0
        if not distributed.is_main():
            return cache_dir
        record_build(cache_dir, computed, len(keys) - computed, seconds if computed else 0.0,
                     side.preferring(layout).digest)
        if prune:
            prune_store(run_cache, layout, set(keys))
        report(cache_dir, run_cache.preferring(layout), dataset, cfg)
    return cache_dir


def open_cache(cache_dir: Path, side: sides.Side, command: str) -> cache.RunCache:
    """The run's cache, created where there is none: the main process's first, so that it alone moves a damaged
    index aside for a new one (cache.open_store) before the others open the folder."""
    first = cache.for_run(cache_dir, side, create=True, command=command) if distributed.is_main() else None
    distributed.barrier()
    return first or cache.for_run(cache_dir, side, create=True, command=command)


def record_build(cache_dir: Path, computed: int, reused: int, seconds: float, side: str) -> None:
    """Say what this build did, in one line, and keep it in ref_cache_dir/build.json (benchmarks read
    sequences/s there: the forwards only, not the model's load or the tokenization)."""
    rate = round(computed / seconds, 3) if seconds > 0 else None
    if rate is not None:
        log(f"precompute: {rate:.1f} sequences/s")
    log(f"computed {computed} sequences, reused {reused} (reference cache {cache_dir}, model side {side[:12]})")
    files.atomic_write_json(cache_dir / BUILD, {"computed": computed, "reused": reused, "compute_s": round(seconds, 3),
                                                "sequences_per_s": rate, "model_side": side,
                                                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def prune_store(run_cache: cache.RunCache, layout: bool | None, keep: set[bytes]) -> None:
    """--prune: keep only this recipe's sequences (their keys) under this run's model side in `layout`; say what
    went. SQLite rewrites the file to shrink it (VACUUM), which needs room for a copy; a full disk leaves it as it
    was."""
    store = run_cache.store
    folder = store.path.parent
    files.ensure_free_space(folder, store.file_bytes(), "pruning the reference cache",
                            "Nothing was dropped; the cache there is untouched.")
    try:
        dropped = run_cache.prune(layout, keep)
    except sqlite3.OperationalError as e:
        if "full" not in str(e):
            raise
        raise files.disk_full_error(folder, "pruning the reference cache", store.file_bytes(),
                                    "The cache is as it was before --prune.") from None
    log(f"pruned {dropped} sequences this recipe does not use (other data, other model sides)")


def report(cache_dir: Path, run_cache: cache.RunCache, dataset: inputs.Data, cfg: Config) -> None:
    """The preflight report of the recipe's rows, printed and saved (KTO's rows: their classes, printed); then
    what the cache holds, per model side."""
    if objectives.unpaired(cfg.loss_type):
        rows = [dataset.unpaired["train"][v.row] for v in dataset.train]
        for line in preflight.unpaired_lines(rows, cfg.loss_settings, objectives.needs_kl(cfg.loss_type)):
            log(line)
    else:
        ref, _ = run_cache.read(dataset.tok, keys=dataset.keys("train"), ld_alpha=cfg.ld_alpha)
        eval_ref = (run_cache.read(dataset.eval_tok, keys=dataset.keys("eval"), ld_alpha=cfg.ld_alpha)[0]
                    if dataset.eval_tok is not None else None)
        lost = inputs.losses(cfg, dataset.tok)  # only past limits the run raised (max_*_share set higher)
        for line in preflight.summary_lines(preflight.save(cache_dir, preflight.report(ref, eval_ref, lost=lost))):
            log(line)
        log(f"preflight report: {cache_dir / preflight.REPORT}")
    for u in run_cache.store.usage():
        mine = " (this run's)" if run_cache.mine(u.digest) else ""
        log(f"  model side {u.digest[:12]}{mine}: {u.sequences} sequences, {fmt(u.bytes)} ({u.components.get('dtype')}, "
            f"quantization {u.components.get('quantization')}" + (f", {u.components['layout']}" if
                                                                  "layout" in u.components else "") + ")")


def main(argv: list[str]) -> int:
    prune = "--prune" in argv
    argv = [a for a in argv if a != "--prune"]
    run(load_config(argv[0], argv[1:]), prune=prune, recipe=argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "precompute", __doc__))
