"""The reference cache's store: one SQLite file, ref_cache_dir/index.sqlite, holding each row's reference values
under (model side, row key). cache.py makes the keys; this module keeps them.

    sides  id, digest (cache.side_digest), components (JSON: what the side is), created
    rows   side, key (16 bytes: cache.row_key), chosen, rejected (float32 values, stored exactly as doubles),
           chosen_tokens, rejected_tokens                    PRIMARY KEY (side, key), WITHOUT ROWID

Why SQLite (the standard library's) rather than safetensors shards with an index file: a build looks up every row
and adds the missing ones, a few at a time; SQLite does both by key, commits each batch atomically (a kill -9
loses at most the batch in flight, and the file is consistent when next opened: its journal rolls back), and lets
two processes (two recipes on one cache folder, or the ranks of one build) write the same file, each waiting for
the other's commit. Shards would need their own index, compaction and locking to do the same. A row costs ~60
bytes on disk. SQLite's locks need a local filesystem: keep ref_cache_dir off NFS.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from lowmem_dpo.errors import UserError

INDEX = "index.sqlite"
SCHEMA = """
CREATE TABLE IF NOT EXISTS sides (id INTEGER PRIMARY KEY, digest TEXT UNIQUE NOT NULL, components TEXT NOT NULL,
                                  created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rows (side INTEGER NOT NULL, key BLOB NOT NULL, chosen REAL NOT NULL,
                                 rejected REAL NOT NULL, chosen_tokens INTEGER NOT NULL,
                                 rejected_tokens INTEGER NOT NULL, PRIMARY KEY (side, key)) WITHOUT ROWID;
"""
CHUNK = 500  # keys per lookup query (SQLite's bound on parameters is 999 on old builds)
WAIT_S = 600  # how long a writer waits for another process's commit before giving up


@dataclass(frozen=True)
class Value:
    """One row's reference values."""

    chosen: float
    rejected: float
    chosen_tokens: int
    rejected_tokens: int


@dataclass(frozen=True)
class SideUsage:
    digest: str
    components: dict
    rows: int
    bytes: int  # its share of the file, by rows


class Store:
    """The index of one cache folder, opened for the life of a stage (one connection, one process)."""

    def __init__(self, cache_dir: str | Path, create: bool = False):
        self.path = Path(cache_dir) / INDEX
        if not create and not self.path.is_file():
            raise FileNotFoundError(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=WAIT_S)
            self.db.execute("PRAGMA journal_mode=WAL")  # readers do not wait for a writer
            self.db.execute("PRAGMA synchronous=NORMAL")  # a commit survives a killed process (not a power cut)
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise UserError(f"the reference cache index {self.path} is unreadable ({e}): move it away and run "
                            "precompute again") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def side(self, digest: str, components: dict | None = None) -> int | None:
        """The id of a model side; with `components`, created when it is new."""
        row = self.db.execute("SELECT id FROM sides WHERE digest = ?", (digest,)).fetchone()
        if row is not None or components is None:
            return None if row is None else row[0]
        with self.db:
            self.db.execute("INSERT OR IGNORE INTO sides (digest, components, created) VALUES (?, ?, ?)",
                            (digest, json.dumps(components, sort_keys=True), time.strftime("%Y-%m-%dT%H:%M:%S%z")))
        return self.side(digest)

    def get(self, side: int | None, keys: list[bytes]) -> dict[bytes, Value]:
        """The values the store holds for `keys` under `side` (the others are absent from the result)."""
        out: dict[bytes, Value] = {}
        if side is None:
            return out
        unique = list(dict.fromkeys(keys))
        for i in range(0, len(unique), CHUNK):
            chunk = unique[i:i + CHUNK]
            query = ("SELECT key, chosen, rejected, chosen_tokens, rejected_tokens FROM rows WHERE side = ? AND key "
                     f"IN ({','.join('?' * len(chunk))})")
            for key, *values in self.db.execute(query, (side, *chunk)):
                out[bytes(key)] = Value(*values)
        return out

    def values(self, side: int | None) -> list[Value]:
        """Every value stored under `side` (benchmarks: the statistics of a whole build)."""
        if side is None:
            return []
        return [Value(*v) for v in self.db.execute(
            "SELECT chosen, rejected, chosen_tokens, rejected_tokens FROM rows WHERE side = ?", (side,))]

    def put(self, side: int, values: dict[bytes, Value]) -> None:
        """Add rows, in one transaction (all or none of them); a key already there keeps its value (any process
        computes the same one)."""
        with self.db:
            self.db.executemany("INSERT OR IGNORE INTO rows VALUES (?, ?, ?, ?, ?, ?)",
                                [(side, k, v.chosen, v.rejected, v.chosen_tokens, v.rejected_tokens)
                                 for k, v in values.items()])

    def usage(self) -> list[SideUsage]:
        """Each model side's rows and its share of the file's bytes, the largest first."""
        counts = dict(self.db.execute("SELECT side, COUNT(*) FROM rows GROUP BY side").fetchall())
        total_rows = max(1, sum(counts.values()))
        size = sum(p.stat().st_size for p in self.path.parent.glob(INDEX + "*") if p.is_file())
        out = [SideUsage(digest, json.loads(components), counts.get(i, 0), size * counts.get(i, 0) // total_rows)
               for i, digest, components in self.db.execute("SELECT id, digest, components FROM sides")]
        return sorted(out, key=lambda u: -u.rows)

    def prune(self, side: int, keep: set[bytes]) -> int:
        """Drop every row but `keep` under `side`, and every other side; returns the rows dropped. The file
        shrinks (VACUUM) afterwards."""
        before = self.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
        with self.db:
            self.db.execute("CREATE TEMP TABLE keep (key BLOB PRIMARY KEY) WITHOUT ROWID")
            self.db.executemany("INSERT OR IGNORE INTO keep VALUES (?)", [(k,) for k in keep])
            self.db.execute("DELETE FROM rows WHERE side != ? OR key NOT IN (SELECT key FROM keep)", (side,))
            self.db.execute("DELETE FROM sides WHERE id != ?", (side,))
            self.db.execute("DROP TABLE keep")
        self.db.execute("VACUUM")
        return before - self.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]
