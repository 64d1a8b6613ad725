"""The reference cache's store (store.py) on its own: real SQLite files, several connections at once, --prune's
ids and sizes. No model: the values are made up (the store never computes them)."""

import multiprocessing

import pytest

from lowmem_dpo.data import store as stores
from lowmem_dpo.runtime.errors import UserError


def values(n: int, start: int = 0) -> dict:
    return {i.to_bytes(16, "big"): stores.Value(-float(i), -float(i) - 1, 3, 4) for i in range(start, start + n)}


def _open_and_write(folder, k: int, start) -> None:
    start.wait()
    with stores.Store(folder, create=True) as s:
        s.put(s.side("side", {"k": 1}), values(50, 50 * k))


def test_processes_that_create_one_store_at_once_all_open_it(tmp_path):
    """Eight processes creating a new store together (the ranks of a torchrun build on a fresh ref_cache_dir, or
    two recipes started at once): SQLite answers "locked" at once, without waiting, to all but one switching the
    file to WAL; each retries until it opens it."""
    ctx = multiprocessing.get_context("fork")  # the children only touch SQLite
    for trial in range(20):  # the race is lost in ~2% of opens: 160 of them
        folder = tmp_path / str(trial)
        start = ctx.Event()
        procs = [ctx.Process(target=_open_and_write, args=(folder, k, start)) for k in range(8)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0] * 8
        with stores.Store(folder) as s:
            assert len(s.get(s.side("side"), list(values(400)))) == 400
            assert s.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_prune_never_hands_a_dropped_sides_id_to_a_new_side(tmp_path):
    """A side dropped by --prune keeps its id: a new side gets another one, and a writer still holding the dropped
    id is refused instead of filing rows under it."""
    with stores.Store(tmp_path, create=True) as s:
        old, kept = s.side("old", {"model": "x"}), s.side("kept", {"model": "y"})
        s.put(old, values(10))
        s.put(kept, values(10, 100))
        assert s.prune(kept, set(values(5, 100))) == 15
        new = s.side("new", {"model": "z"})
        assert new not in (old, kept)
        assert s.get(new, list(values(10))) == {}
        with pytest.raises(UserError, match="lost this run's model side to a --prune in another process"):
            s.put(old, values(3))
        assert s.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0] == 5


def test_usage_counts_the_pages_in_use_not_the_write_ahead_log(tmp_path):
    """What each side holds is its share of the file's pages in use: after a prune the file shrinks (VACUUM,
    then the log folded back), and the figure follows it."""
    with stores.Store(tmp_path, create=True) as s:
        a, b = s.side("a", {"model": "a"}), s.side("b", {"model": "b"})
        s.put(a, values(20_000))
        s.put(b, values(20_000, 20_000))
        before = {u.digest: u for u in s.usage()}
        assert before["a"].rows == 20_000 and 20 * 20_000 < before["a"].bytes < 100 * 20_000
        s.prune(a, set(values(20_000)))
        (after,) = [u for u in s.usage() if u.rows]
        assert after.digest == "a" and after.bytes <= s.file_bytes() < 100 * 20_000
        assert not (tmp_path / "index.sqlite-wal").exists() or (tmp_path / "index.sqlite-wal").stat().st_size == 0


def test_an_unreadable_index_is_named_with_what_to_do(tmp_path):
    (tmp_path / "index.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(UserError, match="index.sqlite is unreadable .*: move it away and run precompute again"):
        stores.Store(tmp_path)
