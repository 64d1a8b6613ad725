"""The reference cache's keys: each sequence's reference values are stored (store.py) under its model side and
its sequence key, so a completion computed once under a prompt is never computed again, however the rows pair it.

    model side    what the values depend on besides the sequence: the reference's weights and precision, the
                  log-prob rules, in a 16-bit dtype the forward's layout (sides.py: what exactly, and which layout
                  a run writes and reads).
    sequence key  a digest of one prompt's and one completion's token ids, after template and truncation
                  (sequence_key): the ids train feeds the model. A pair reads two (pair_keys). A changed text, chat
                  template, tokenizer or max_length that changes a sequence's ids gives it a new key; one that
                  leaves them alone keeps its value (the same ids through the same weights give the same numbers).

Reordering the rows, taking a subset, pairing the same completions another way, a mixture's fractions,
max_train_samples and the eval split never change a sequence's key: precompute computes only the sequences the
store lacks, and train looks each of its rows' sequences up. Old values stay until
`lowmem-dpo precompute RECIPE --prune` drops what the recipe does not use.

This module and sides.py alone build and compare keys: a stage asks its run's cache (for_run: a RunCache, below)
and sides.CacheLayout which layout it writes or reads, and never keys a sequence or a side itself.

A cache of an earlier format (pair-keyed, or manifest.json and shards) is refused with what to remove and the
command that rebuilds it (open_store): its values cannot be split into sequences, and no release wrote one. A
damaged one is refused naming the precompute to run (store.Damaged), which rebuilds it (RunCache.missing, open_store).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowmem_dpo.data import store as stores
from lowmem_dpo.data.encode import TokenizedCompletion
from lowmem_dpo.data.sides import Side, side_digest
from lowmem_dpo.runtime import folders
from lowmem_dpo.runtime.errors import log

FINGERPRINT_FORMAT = 1  # the "format" in inputs.fingerprint_components
BUILD, REPORT = "build.json", "preflight.json"  # precompute's record of its last build, preflight's report
# A side's components that are the reference's precision: a cache holding another precision can serve train as
# built (ref_dtype, ref_quantization), and the message says so.
PRECISION_COMPONENTS = {"dtype", "quantization"}


# -- the keys ----------------------------------------------------------------------------------------------------
def sequence_key(prompt_ids: list[int], completion_ids: list[int]) -> bytes:
    """16 bytes of sha256 over one sequence's token ids: the prompt's and the completion's, each with its length,
    so the boundary counts."""
    ids = [len(prompt_ids), *prompt_ids, len(completion_ids), *completion_ids]
    return hashlib.sha256(array("q", ids).tobytes()).digest()[:16]


def pair_keys(pair) -> tuple[bytes, bytes]:
    """The sequence keys of a data.TokenizedPair's chosen and rejected."""
    return sequence_key(pair.prompt_ids, pair.chosen_ids), sequence_key(pair.prompt_ids, pair.rejected_ids)


EMPTY = stores.Value(0.0, 0, b"")  # an empty completion (an unpaired row's missing KL sequence): nothing to compute


def pair_sequences(pair) -> tuple[TokenizedCompletion, TokenizedCompletion]:
    """A pair's chosen and rejected as sequences, each named by the pair's row (an empty one is never computed:
    its value is EMPTY)."""
    return (TokenizedCompletion(pair.row, pair.prompt_ids, pair.chosen_ids),
            TokenizedCompletion(pair.row, pair.prompt_ids, pair.rejected_ids))


def completion_tokens(prompt_ids: list[int], completion_ids: list[int]) -> int:
    """The completion tokens logps.completion_logps counts for a sequence: each is predicted by the token before
    it, so a completion with no prompt before it loses its first token."""
    return len(completion_ids) - (1 if completion_ids and not prompt_ids else 0)


def ld_sums(chosen: stores.Value, rejected: stores.Value, ld_alpha: float) -> tuple[float, float]:
    """LD-DPO's sums of a pair from its sequences' token log-probs (logps.ld_weights' rule): each token up to the
    pair's shorter completion's count at weight 1, those beyond it at ld_alpha."""
    shared = min(chosen.tokens, rejected.tokens)

    def weighted(v: stores.Value) -> float:
        if not v.tokens:  # nothing to weigh (frombuffer refuses an empty buffer)
            return 0.0
        t = torch.frombuffer(bytearray(v.token_logps), dtype=torch.float32)  # (tokens,)
        t = t.double()  # the sums in float64, as logps.sequence_sums
        return float(t[:shared].sum() + ld_alpha * t[shared:].sum())

    return weighted(chosen), weighted(rejected)


# -- reading -----------------------------------------------------------------------------------------------------
@dataclass
class RefCache:
    """Reference log-probs of one part's rows (the dataset's, or eval_dataset's), indexed by row; NaN and 0 tokens
    for rows it does not serve (skipped by tokenization, or held out)."""

    chosen: torch.Tensor  # (num_rows,) float64: the sums as precompute computed them (logps.sequence_sums)
    rejected: torch.Tensor  # (num_rows,) float64
    chosen_tokens: torch.Tensor  # (num_rows,) int32
    rejected_tokens: torch.Tensor  # (num_rows,) int32
    side: str = ""  # the model side its values were computed under (side_digest)
    shared: bool | None = None  # the layout of those values in a 16-bit dtype; None in float32
    counts: dict = field(default_factory=dict)  # the part's rows: tokenization's counts (precompute.part_counts)

    @classmethod
    def empty(cls, num_rows: int, **kwargs) -> "RefCache":
        return cls(torch.full((num_rows,), float("nan"), dtype=torch.float64),
                   torch.full((num_rows,), float("nan"), dtype=torch.float64),
                   torch.zeros(num_rows, dtype=torch.int32), torch.zeros(num_rows, dtype=torch.int32), **kwargs)

    def fill(self, pairs: list, keys: list[tuple[bytes, bytes]], values: dict, ld_alpha: float | None = None
             ) -> None:
        """Put the values of `pairs` (`keys`: their pair_keys, in `values`) at their rows; ld_alpha: LD-DPO's
        sums, from the token log-probs."""
        for p, (kc, kr) in zip(pairs, keys):
            c, r = values.get(kc), values.get(kr)
            if c is None or r is None:
                continue
            self.chosen[p.row], self.rejected[p.row] = (c.logps, r.logps) if ld_alpha is None else ld_sums(
                c, r, ld_alpha)
            self.chosen_tokens[p.row], self.rejected_tokens[p.row] = c.tokens, r.tokens


def open_store(cache_dir: Path, create: bool = False, command: str = "") -> stores.Store | None:
    """The cache folder's store; None when it has none (and `create` is off). A cache of an earlier format is
    refused (stores.refuse_earlier_format). A damaged one is refused naming `command`, the precompute that rebuilds
    it; with `create` (precompute's) it is moved aside for a new one (stores.rebuilt)."""
    stores.refuse_earlier_format(cache_dir, command)
    try:
        return stores.Store(cache_dir, create=create)
    except FileNotFoundError:
        return None
    except stores.Damaged as e:
        if not create:
            raise e.running(command) from None
        return stores.rebuilt(cache_dir, e)


def lookup(store: stores.Store, side: Side, keys: list[bytes]) -> tuple[dict, bool]:
    """The values `store` holds for sequence `keys` under `side`, and under its twin for the sequences the
    preferred layout lacks; and whether any came from the twin."""
    found = store.get(store.side(side.digest), keys)
    from_twin = False
    if side.twin is not None and len(found) < len(set(keys)):
        twin_values = store.get(store.side(side_digest(side.twin)), [k for k in keys if k not in found])
        from_twin = bool(twin_values)
        found.update(twin_values)
    return found, from_twin


def part_counts(tok) -> dict:
    """A part's rows as tokenization counted them (data.TokenizedData), for the preflight report."""
    return {"num_rows": tok.num_rows, "num_pairs": len(tok.pairs), "dropped_rows": tok.dropped,
            "skipped": tok.skipped, "truncated": {part: len(rows) for part, rows in tok.truncated.items()}}


def damaged(found: dict, sequences: dict, per_token: bool) -> list[bytes]:
    """The keys of `sequences` (key -> data.TokenizedCompletion) whose stored value disagrees with their token count,
    or lacks the token log-probs its side keeps (a key is the sequence's ids: only a damaged file holds one)."""
    return [k for k, s in sequences.items() if (v := found.get(k)) is not None and (
        v.tokens != completion_tokens(s.prompt_ids, s.completion_ids)
        or per_token and (v.token_logps is None or len(v.token_logps) != 4 * v.tokens))]


def reference(store: stores.Store, side: Side, tok, name_row=str, keys: list | None = None,
              ld_alpha: float | None = None, command: str = "") -> tuple[RefCache, list]:
    """The RefCache of one part's rows (tok: the dataset's or eval_dataset's data.TokenizedData; keys: their
    pair_keys, when the caller has them) from the store, in the side's preferred layout and its twin's; and the
    pairs it lacks (either sequence). ld_alpha: LD-DPO's sums (a per_token side). A damaged value is refused
    (stores.Damaged), naming the rows and `command`, the precompute that computes it again."""
    keys = keys if keys is not None else [pair_keys(p) for p in tok.pairs]
    sequences = {k: s for p, ks in zip(tok.pairs, keys) for k, s in zip(ks, pair_sequences(p))}
    found, from_other = lookup(store, side, [k for k, s in sequences.items() if s.completion_ids])
    found.update({k: EMPTY for k, s in sequences.items() if not s.completion_ids})
    wrong = damaged(found, sequences, side.per_token)
    if wrong:
        rows = "; ".join(name_row(sequences[k].row) for k in wrong[:3])
        raise stores.Damaged(store.path, f"its values for {len(wrong)} sequences, of {rows}, disagree with their "
                             "token counts", "it drops and computes them again", command)
    ref = RefCache.empty(tok.num_rows, side=side.digest, counts=part_counts(tok),
                         shared=None if side.shared is None else side.shared != from_other)
    ref.fill(tok.pairs, keys, found, ld_alpha)
    return ref, [p for p, (kc, kr) in zip(tok.pairs, keys) if kc not in found or kr not in found]


# -- a run's cache ------------------------------------------------------------------------------------------------
@dataclass
class RunCache:
    """A run's reference cache (for_run): the store in ref_cache_dir under the run's model side. Stages ask it what
    the run's sequences lack (missing), add their values (put), read a part's rows' values (read), keep only the
    run's (prune), and which side it is (identity, mine); how a sequence or a side is keyed is this module's alone."""

    store: stores.Store
    side: Side
    command: str = ""  # the precompute that fills it, for messages (rebuild_command)

    def __enter__(self) -> "RunCache":
        return self

    def __exit__(self, *exc) -> None:
        self.store.close()

    @property
    def identity(self) -> str:
        """The side whatever the layout: what a checkpoint records of the reference it trained against."""
        return self.side.identity

    def preferring(self, layout: bool | None) -> "RunCache":
        """This cache read in `layout` first (Side.preferring), its twin's values where that lacks them."""
        return RunCache(self.store, self.side.preferring(layout), self.command)

    def mine(self, digest: str) -> bool:
        """Whether a stored model side (its digest, store.usage) is this run's, in either layout."""
        return digest in {side_digest(c) for c in self.side.layouts().values()}

    def missing(self, sequences: dict, reuse_twin: bool = False) -> dict:
        """layout (None in float32, else whether shared) -> the indices of `sequences` (key -> TokenizedCompletion)
        the store lacks in it; a damaged value (damaged()) is dropped first, said in one line, and lacking.
        reuse_twin (KTO, which trains one sequence a row: a DPO build's values are mostly in the shared layout):
        what neither layout holds, in both; train then reads the other layout's values, ~1e-3 apart in 16 bits."""
        keys, lacking, dropped = list(sequences), {}, 0
        for layout, components in self.side.layouts().items():
            side = self.store.side(side_digest(components))
            have = self.store.get(side, keys)
            wrong = set(damaged(have, sequences, self.side.per_token))
            dropped += self.store.drop(side, wrong)
            lacking[layout] = [i for i, k in enumerate(keys) if k not in have or k in wrong]
        if reuse_twin and len(lacking) == 2:
            both = sorted(set(lacking[True]) & set(lacking[False]))
            lacking = {True: both, False: both}
        if dropped:
            log(f"the reference cache index {self.store.path} held damaged values for {dropped} sequences (token "
                "counts that disagree with their sequences): dropped them; this build computes again those it reads")
        return lacking

    def put(self, layout: bool | None, got: list) -> None:
        """Store the values `got` ((TokenizedCompletion, stores.Value) pairs) under this side's `layout`, one
        commit."""
        components = self.side.layouts()[layout]
        side = self.store.side(side_digest(components), components)
        self.store.put(side, {sequence_key(seq.prompt_ids, seq.completion_ids): v for seq, v in got})

    def read(self, tok, name_row=str, keys: list | None = None, ld_alpha: float | None = None) -> tuple:
        """reference(): the RefCache of one part's rows, and the pairs it lacks."""
        return reference(self.store, self.side, tok, name_row, keys, ld_alpha, self.command)

    def prune(self, layout: bool | None, keep: set[bytes]) -> int:
        """Drop what the store holds beyond the sequence keys `keep` under this side's `layout`, and every other
        side; the sequences dropped."""
        return self.store.prune(self.store.side(side_digest(self.side.layouts()[layout])), keep)

    def missing_message(self, rows: list, total: int, name_row) -> str:
        return missing_message(self.store.path.parent, rows, total, name_row, self.command, self.store, self.side)


def for_run(cache_dir: Path, side: Side, create: bool = False, command: str = "") -> RunCache | None:
    """The run's cache in `cache_dir` under `side` (open_store: None when the folder has no store and `create` is
    off; an earlier format refused; a damaged one refused, or with `create` rebuilt)."""
    store = open_store(cache_dir, create, command)
    return None if store is None else RunCache(store, side, command)


def missing_message(cache_dir: Path, rows: list, total: int, name_row, command: str, store=None,
                    side: Side | None = None) -> str:
    """What to say when `rows` (pairs) of a run's `total` have no value: which, in its file's lines, and the
    command that computes them (only them); when the store knows no part of this model side, what differs from
    the side it knows best."""
    shown = "; ".join(name_row(p.row) for p in rows[:3]) + (f"; and {len(rows) - 3} more" if len(rows) > 3 else "")
    why = "new, or changed since precompute ran"
    if store is not None and side is not None and store.side(side.digest) is None and not (
            side.twin and store.side(side_digest(side.twin))):
        why = nearest_difference(store, side.components) or why
    return (f"the reference cache in {str(cache_dir)!r} has no reference values for {len(rows)} of the {total} rows "
            f"this run uses ({shown}): {why}. Compute them (only them) with: {command}")


def nearest_difference(store: stores.Store, components: dict) -> str | None:
    """What differs between this model side and the one the store holds most sequences of, in words."""
    usage = [u for u in store.usage() if u.sequences]
    if not usage:
        return None
    near = usage[0].components
    changed = [describe_change(k, near.get(k), components.get(k)) for k in sorted(set(near) | set(components))
               if near.get(k) != components.get(k) and k != "layout"]
    if not changed:
        return None
    hint = ""
    if {k for k in set(near) | set(components) if near.get(k) != components.get(k)} <= PRECISION_COMPONENTS | {
            "layout"}:
        hint = (f"; or train against the values it holds: ref_quantization={near.get('quantization')} "
                f"ref_dtype={near.get('dtype')}")
    return "the cache holds values for another model side (" + "; ".join(changed) + " changed)" + hint


def rebuild_command(cfg, recipe: str | None) -> str:
    """The command that fills the cache this run needs, for messages: precompute with the run's recipe and the
    same overrides (a dataset, a max_length given on the command line is the cache's too); a config built in code
    names its cache folder."""
    args = list(cfg.overrides) or [f"ref_cache_dir={cfg.ref_cache_dir}"]
    return shlex.join(["lowmem-dpo", "precompute", recipe or "RECIPE.yaml", *args])


# -- what changed, in words ------------------------------------------------------------------------------------
WHAT = {"model": "the base model's weights or config", "adapter": "the SFT adapter's files",
        "tokenizer": "the tokenizer's files", "chat_template": "the chat template's text", "format": "the cache format", "per_token": "whether token log-probs are kept",
        "logps": "the log-prob rules"}


def describe_change(key: str, old, new) -> str:
    """One changed component of a model side in words: which files' content, which key's value."""
    if key in WHAT:
        return WHAT[key] + (" (added)" if old is None else " (removed)" if new is None else "")
    return f"{key} {old} -> {new}"


def earlier_cache(cache_dir: Path) -> bool:
    """Whether the folder is a reference cache this tool wrote before it marked its folders: its index (of any
    format), or a format-1 cache's manifest, and nothing but what a cache holds (SQLite's files, the reports, the
    old format's). open_store then refuses the earlier formats with what to do."""
    try:
        manifest = json.loads((Path(cache_dir) / stores.LEGACY_MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = None
    old = isinstance(manifest, dict) and {"fingerprint", "shard_dir"} <= set(manifest)
    names = {stores.INDEX, f"{stores.INDEX}-wal", f"{stores.INDEX}-shm", BUILD, REPORT,
             stores.LEGACY_MANIFEST, manifest.get("shard_dir") if old else None}
    return (stores.is_store(cache_dir) or old) and all(n in names or n.startswith("legacy-v1")
                                                       for n in folders.visible(cache_dir))
