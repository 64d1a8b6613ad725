"""The reference cache's store: one SQLite file, ref_cache_dir/index.sqlite, holding each sequence's reference
values under (model side, sequence key). cache.py makes the keys; this module keeps them.

    sides      id (never reused: AUTOINCREMENT), digest (sides.side_digest), components (JSON: what the side is),
               created
    sequences  side, key (16 bytes: cache.sequence_key of a prompt and one completion), logps (the completion's
               float64 log-prob sum: logps.sequence_sums), tokens (its token count), token_logps (each
               token's float32 log-prob, for the sides that keep them: LD-DPO's; else NULL)
                                                             PRIMARY KEY (side, key), WITHOUT ROWID

Why SQLite (the standard library's) rather than safetensors shards with an index file: a build looks up every row
and adds the missing ones, a few at a time; SQLite does both by key, commits each batch atomically (a kill -9
loses at most the batch in flight, and the file is consistent when next opened: its journal rolls back), and lets
two processes (two recipes on one cache folder, or the ranks of one build) write the same file, each waiting for
the other's commit. Shards would need their own index, compaction and locking to do the same. A sequence costs
~40 bytes on disk (and 4 per token where token_logps are kept). SQLite's locks need a local filesystem: keep
ref_cache_dir off NFS.

An index of an earlier format (the pair-keyed `rows` table) is refused (OldFormat): no release wrote one, and
its values cannot be split into sequences. A damaged index (a disk's or a copy's fault, bytes written over it, a
truncated file) is Damaged, said in one line naming it, whatever SQLite raises and wherever: SQLite's quick check
on open, before anything can write to the file or its log (~0.25 s per million sequences), and every query after
it (_refused). Train and preflight refuse it; precompute moves it aside (move_aside: renamed, never deleted) and
builds a new one. SQLite cannot see bytes changed inside a stored value; cache.damaged finds a value whose token
count disagrees, which train refuses and precompute drops (drop) and computes again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.runtime.errors import UserError, log

INDEX = "index.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS sides (id INTEGER PRIMARY KEY AUTOINCREMENT, digest TEXT UNIQUE NOT NULL,
                                  components TEXT NOT NULL, created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sequences (side INTEGER NOT NULL, key BLOB NOT NULL, logps REAL NOT NULL,
                                      tokens INTEGER NOT NULL, token_logps BLOB, PRIMARY KEY (side, key))
                                      WITHOUT ROWID;
"""
OLD_TABLE = "rows"  # the pair-keyed format's table
LEGACY_MANIFEST = "manifest.json"  # format 1's index: refused, and recognised as this tool's folder


class OldFormat(UserError):
    """The folder's index is of an earlier format (cache.open_store says what to remove and the command)."""


class Damaged(UserError):
    """The index, or values in it, are damaged: what (SQLite's words, or cache.damaged's), where, and what precompute
    does about it (`fix`), which the command (`command`, when the stage knows it) runs."""

    def __init__(self, path: Path, what: str, fix: str = "it moves the damaged file aside and rebuilds",
                 command: str = ""):
        self.path, self.what, self.fix = path, what, fix
        super().__init__(f"the reference cache index {path} is damaged ({what}): rerun precompute ({fix})"
                         + (f": {command}" if command else ""))

    def running(self, command: str) -> "Damaged":
        """The same refusal, naming the precompute that repairs it."""
        return Damaged(self.path, self.what, self.fix, command)


def refuse_earlier_format(cache_dir: Path, command: str = "") -> None:
    """A UserError, before anything is written there, when the folder holds a cache of an earlier format: what to
    remove and `command` (the precompute that rebuilds it)."""
    cache_dir = Path(cache_dir)
    whole = (cache_dir / LEGACY_MANIFEST).is_file()  # format 1: one fingerprint over the whole data
    if not whole and OLD_TABLE not in tables(cache_dir):
        return
    raise UserError(f"the reference cache in {str(cache_dir)!r} is of an earlier format (values keyed by "
                    f"{'the whole dataset' if whole else 'pair'}; this version keys them per completion) and cannot "
                    f"be read: remove it (rm -r {shlex.quote(str(cache_dir))}) and rebuild it with: "
                    f"{command or 'lowmem-dpo precompute RECIPE.yaml'}")


def tables(cache_dir: str | Path) -> set[str]:
    """The tables of the folder's index, read without writing; empty when it has none or it is unreadable. Without
    a write-ahead log it is read as immutable (SQLite makes no -shm file); with one (a writer killed, or still
    running) read-only through it, since the tables may be there only. Unreadable is not refused here: read
    without locks, a file another process is folding its log into may look damaged for a moment; Store's open,
    with locks, refuses a damaged one."""
    path = Path(cache_dir) / INDEX
    if not path.is_file():
        return set()
    wal = Path(f"{path}-wal").is_file()
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro" + ("" if wal else "&immutable=1"), uri=True)
        try:
            return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.Error:
        return set()


def is_store(cache_dir: str | Path) -> bool:
    """Whether the folder holds this tool's index, of this format or an earlier one."""
    found = tables(cache_dir)
    return "sides" in found and bool({"sequences", OLD_TABLE} & found)


SEQUENCE_BYTES = 40  # a value without token log-probs, with its key and index entry (measured)
ROOM_SEQUENCE_BYTES = 100  # what precompute's free-space check asks per sequence (SEQUENCE_BYTES, with room)
ROOM_TOKEN_BYTES = 12  # and per token on a per-token side (4 B of float32; ~10 measured with SQLite's overflow
#                        pages and its write-ahead log)
CHUNK = 500  # keys per lookup query (SQLite's bound on parameters is 999 on old builds)
WAIT_S = 600  # how long a writer waits for another process's commit before giving up


def room_for(seqs: list, per_token: bool) -> int:
    """What storing `seqs` (data.TokenizedCompletion) takes on disk, at most, for precompute's free-space check
    (and 1 MiB for SQLite's own); per_token: with each token's log-prob."""
    tokens = sum(len(seq.completion_ids) for seq in seqs) if per_token else 0
    return len(seqs) * ROOM_SEQUENCE_BYTES + tokens * ROOM_TOKEN_BYTES + (1 << 20)


@dataclass(frozen=True)
class Value:
    """One sequence's reference values."""

    logps: float  # the completion's log-prob sum
    tokens: int  # its token count
    token_logps: bytes | None = None  # (tokens,) float32, where the side keeps them (sides.Side.per_token)


@dataclass(frozen=True)
class SideUsage:
    digest: str
    components: dict
    sequences: int
    bytes: int  # its share of the file, by sequences


def _refused(method: Callable) -> Callable:
    """A Store method whose SQLite errors are the index's, said in one line naming it (_problem): a damaged file
    may fail any query, not only the open's check. A full disk goes on as SQLite raised it: precompute meets it
    with the space it needs and what is kept."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as e:
            if "full" in str(e):
                raise
            raise _refusal(self.path, e) from None

    return run


class Store:
    """The index of one cache folder, opened for the life of a stage (one connection, one process)."""

    def __init__(self, cache_dir: str | Path, create: bool = False):
        self.path = Path(cache_dir) / INDEX
        existed = self.path.is_file()
        if not create and not existed:
            raise FileNotFoundError(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if OLD_TABLE in tables(cache_dir):  # read only: the file stays as it is
            raise OldFormat(f"{self.path} is a reference cache of the earlier pair-keyed format")
        self.db = None
        try:
            if existed:  # a damaged file is refused before a connection that may write to it opens it
                _check(self.path)
            self.db = sqlite3.connect(self.path, timeout=WAIT_S)
            if self.db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                # readers do not wait for a writer; SQLite answers "locked" at once (no busy wait) while another
                # process holds the file, as when two processes create a new cache together
                _busy(lambda: self.db.execute("PRAGMA journal_mode=WAL"))
            self.db.execute("PRAGMA synchronous=NORMAL")  # a commit survives a killed process (not a power cut)
            _busy(lambda: self.db.executescript(SCHEMA))
        except sqlite3.Error as e:
            if self.db is not None:
                self.db.close()  # SQLite removes the -wal and -shm files it made beside the user's file
            raise _refusal(self.path, e) from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def writing(self):
        """One write transaction, its lock taken at the start (BEGIN IMMEDIATE: what it reads stays true until it
        commits); rolled back on any error."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.rollback()
            raise
        self.db.commit()

    @_refused
    def side(self, digest: str, components: dict | None = None) -> int | None:
        """The id of a model side; with `components`, created when it is new."""
        row = self.db.execute("SELECT id FROM sides WHERE digest = ?", (digest,)).fetchone()
        if row is not None or components is None:
            return None if row is None else row[0]
        with self.db:
            self.db.execute("INSERT OR IGNORE INTO sides (digest, components, created) VALUES (?, ?, ?)",
                            (digest, json.dumps(components, sort_keys=True), time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        return self.side(digest)

    @_refused
    def get(self, side: int | None, keys: list[bytes]) -> dict[bytes, Value]:
        """The values the store holds for `keys` under `side` (the others are absent from the result)."""
        out: dict[bytes, Value] = {}
        if side is None:
            return out
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), CHUNK):
            chunk = unique[i:i + CHUNK]
            query = ("SELECT key, logps, tokens, token_logps FROM sequences WHERE side = ? AND key "
                     f"IN ({','.join('?' * len(chunk))})")
            for key, *values in self.db.execute(query, (side, *chunk)):
                out[bytes(key)] = Value(*values)
        return out

    @_refused
    def values(self, side: int | None) -> list[Value]:
        """Every value stored under `side` (benchmarks: the statistics of a whole build)."""
        if side is None:
            return []
        return [Value(*v) for v in self.db.execute(
            "SELECT logps, tokens, token_logps FROM sequences WHERE side = ?", (side,))]

    @_refused
    def put(self, side: int, values: dict[bytes, Value]) -> None:
        """Add sequences, in one transaction (all or none of them); a key already there keeps its value (any process
        computes the same one). A side that another process's --prune removed meanwhile is refused: its id is
        never reused, and sequences under it would serve nothing."""
        with self.writing():
            if self.db.execute("SELECT 1 FROM sides WHERE id = ?", (side,)).fetchone() is None:
                raise UserError(f"the reference cache in {str(self.path.parent)!r} lost this run's model side to a "
                                "--prune in another process while precompute ran; run precompute again")
            self.db.executemany("INSERT OR IGNORE INTO sequences VALUES (?, ?, ?, ?, ?)",
                                [(side, k, v.logps, v.tokens, v.token_logps) for k, v in values.items()])

    @_refused
    def drop(self, side: int, keys: set[bytes]) -> int:
        """Drop the sequences `keys` under `side` (damaged values, which precompute computes again), in one
        transaction; returns how many."""
        if keys:
            with self.writing():
                self.db.executemany("DELETE FROM sequences WHERE side = ? AND key = ?", [(side, k) for k in keys])
        return len(keys)

    @_refused
    def usage(self) -> list[SideUsage]:
        """Each model side's sequences and its share of the file's bytes in use (pages not on the free list), by
        what its values hold (a per-token side's blobs count), the largest first."""
        sizes = self.db.execute("SELECT side, COUNT(*), SUM(COALESCE(LENGTH(token_logps), 0)) FROM sequences "
                                "GROUP BY side").fetchall()
        counts = {side: n for side, n, _ in sizes}
        weight = {side: n * SEQUENCE_BYTES + blobs for side, n, blobs in sizes}
        total = max(1, sum(weight.values()))
        pages, free, page = (self.db.execute(f"PRAGMA {k}").fetchone()[0]
                             for k in ("page_count", "freelist_count", "page_size"))
        size = (pages - free) * page
        out = [SideUsage(digest, json.loads(components), counts.get(i, 0), size * weight.get(i, 0) // total)
               for i, digest, components in self.db.execute("SELECT id, digest, components FROM sides")]
        return sorted(out, key=lambda u: -u.sequences)

    @_refused
    def prune(self, side: int, keep: set[bytes]) -> int:
        """Drop every sequence but `keep` under `side`, and every other side; returns the sequences dropped. The
        file shrinks (VACUUM) afterwards."""
        before = self.count()
        with self.writing():
            self.db.execute("CREATE TEMP TABLE keep (key BLOB PRIMARY KEY) WITHOUT ROWID")
            self.db.executemany("INSERT OR IGNORE INTO keep VALUES (?)", [(k,) for k in keep])
            self.db.execute("DELETE FROM sequences WHERE side != ? OR key NOT IN (SELECT key FROM keep)", (side,))
            self.db.execute("DELETE FROM sides WHERE id != ?", (side,))
            self.db.execute("DROP TABLE keep")
        self.db.execute("VACUUM")
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the rewritten file replaces the old one now
        return before - self.count()

    @_refused
    def count(self) -> int:
        """The sequences stored, under every side."""
        return self.db.execute("SELECT COUNT(*) FROM sequences").fetchone()[0]

    def file_bytes(self) -> int:
        """The index's files on disk (the write-ahead log included)."""
        files = (Path(f"{self.path}{suffix}") for suffix in ("", "-wal", "-shm"))
        return sum(p.stat().st_size for p in files if p.is_file())


def _busy(run: Callable, wait_s: float = WAIT_S):
    """run(), retried while SQLite answers that another process holds the file, up to wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return run()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


QUICK_CHECK = "SQLite's quick check"
DAMAGE = ("malformed", "not a database", QUICK_CHECK)  # what SQLite says of a damaged file (SQLITE_CORRUPT,
#                                                       SQLITE_NOTADB), and _check


def _check(path: Path) -> None:
    """SQLite's quick check of the whole file (every page's structure and every record's form, not the values):
    a DatabaseError saying the first problem it finds. Beside a writer's log (running, or killed) read only: closing
    a connection that may write folds the log into the file and deletes it, damaged or not. Without one, a writer's
    connection, which removes on close the -wal and -shm files it made (a read-only one leaves the -shm)."""
    logged = Path(f"{path}-wal").is_file()
    db = sqlite3.connect(path.absolute().as_uri() + ("?mode=ro" if logged else ""), uri=True, timeout=WAIT_S)
    try:
        found = [line.strip() for (text,) in _busy(lambda: db.execute("PRAGMA quick_check").fetchall())
                 for line in str(text).splitlines()]
    finally:
        db.close()
    problems = [line for line in found if line and line != "ok" and not line.startswith("***")]
    if problems:
        raise sqlite3.DatabaseError(f"{QUICK_CHECK}: {problems[0]}")


def _refusal(path: Path, e: sqlite3.Error) -> UserError:
    """What an SQLite error on the index means, and what to do, in one line: Damaged where SQLite says the file is."""
    text = " ".join(str(e).split())
    if any(word in text for word in DAMAGE):
        return Damaged(path, text)
    if "locked" in text or "busy" in text:
        return UserError(f"the reference cache index {path} stayed locked by another process for {WAIT_S // 60} "
                         f"minutes ({text}): wait for that process (another precompute?) to finish, then run this "
                         "again")
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return UserError(f"cannot write the reference cache index {path} ({text}): make {path.parent} writable, or "
                         "point ref_cache_dir elsewhere")
    return UserError(f"the reference cache index {path} is unreadable ({text}): move it away, with its -wal and -shm "
                     "files if there are any, and run precompute again")


def rebuilt(cache_dir: str | Path, damage: Damaged) -> Store:
    """A new index in place of a damaged one (`damage`), which move_aside keeps beside it; said in one line. Checked
    again first: another precompute on the folder may have put a new one there meanwhile."""
    try:
        return Store(cache_dir, create=True)
    except Damaged:
        aside = move_aside(cache_dir)
    log(f"the reference cache index {damage.path} is damaged ({damage.what}): moved it aside to {aside} (nothing "
        "deleted; remove it once you no longer need it), and building a new one")
    return Store(cache_dir, create=True)


def move_aside(cache_dir: str | Path) -> Path:
    """Rename the folder's damaged index to index.sqlite.damaged-<time> beside it, its -wal and -shm files (if
    any) to that name with their suffixes, so that SQLite opens the three together; returns the new name. Nothing
    is deleted. The index goes last: SQLite would apply an old -wal to a new index of the same name."""
    path = Path(cache_dir) / INDEX
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    aside = path.with_name(f"{INDEX}.damaged-{stamp}")
    while any(aside.with_name(aside.name + suffix).exists() for suffix in ("", "-wal", "-shm")):
        n += 1
        aside = path.with_name(f"{INDEX}.damaged-{stamp}-{n}")
    for suffix in ("-wal", "-shm", ""):
        with contextlib.suppress(FileNotFoundError):  # none, or another process moved it first
            path.with_name(INDEX + suffix).rename(aside.with_name(aside.name + suffix))
    return aside
