"""The reference cache's store (store.py) on its own: real SQLite files, several connections at once, --prune's
ids and sizes. No model: the values are made up (the store never computes them)."""

import multiprocessing
import re

import pytest

from lowmem_dpo.data import store as stores
from lowmem_dpo.runtime.errors import UserError


def values(n: int, start: int = 0) -> dict:
    return {i.to_bytes(16, "big"): stores.Value(-float(i), 3) for i in range(start, start + n)}


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
        assert s.count() == 5


def test_usage_counts_the_pages_in_use_not_the_write_ahead_log(tmp_path):
    """What each side holds is its share of the file's pages in use: after a prune the file shrinks (VACUUM,
    then the log folded back), and the figure follows it."""
    with stores.Store(tmp_path, create=True) as s:
        a, b = s.side("a", {"model": "a"}), s.side("b", {"model": "b"})
        s.put(a, values(20_000))
        s.put(b, values(20_000, 20_000))
        before = {u.digest: u for u in s.usage()}
        assert before["a"].sequences == 20_000 and 20 * 20_000 < before["a"].bytes < 100 * 20_000
        s.prune(a, set(values(20_000)))
        (after,) = [u for u in s.usage() if u.sequences]
        assert after.digest == "a" and after.bytes <= s.file_bytes() < 100 * 20_000
        assert not (tmp_path / "index.sqlite-wal").exists() or (tmp_path / "index.sqlite-wal").stat().st_size == 0


def test_a_damaged_index_is_named_and_rebuilt_with_its_files_moved_aside(tmp_path, capsys):
    """An index whose writer was killed (its last commit in the write-ahead log), then damaged (bytes over its
    middle page), twice: Store refuses it (create or not) in one line calling it damaged, and writes nothing to it
    or its log (SQLite's check reads only); rebuilt() renames the index to index.sqlite.damaged-<time>, its -wal and
    -shm to that name with their suffixes (-2 when the first took that name), every byte kept, says so in one line,
    and opens a new, empty index in its place."""
    import shutil

    live = tmp_path / "live"
    writer = stores.Store(live, create=True)
    side = writer.side("side", {"k": 1})
    writer.put(side, values(3000))
    writer.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    writer.put(side, values(500, 3000))  # in the log only, as a killed writer leaves it
    folder, index = tmp_path / "cache", tmp_path / "cache" / "index.sqlite"
    folder.mkdir()
    for n in (1, 2):
        for name in ("index.sqlite", "index.sqlite-wal"):
            shutil.copy(live / name, folder / name)
        data = index.read_bytes()
        at = len(data) // 2 // 4096 * 4096
        index.write_bytes(data[:at] + bytes(range(64)) + data[at + 64:])
        before = {p.name: p.read_bytes() for p in folder.iterdir() if "damaged" not in p.name}  # index and log
        for create in (False, True):
            with pytest.raises(stores.Damaged) as e:
                stores.Store(folder, create=create)
            assert str(e.value) == (f"the reference cache index {index} is damaged ({e.value.what}): rerun precompute "
                                    "(it moves the damaged file aside and rebuilds)") and "malformed" in e.value.what
        earlier = {p.name for p in folder.iterdir() if "damaged" in p.name}
        kept = {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in earlier}
        assert set(kept) == {*before, "index.sqlite-shm"} and all(kept[k] == v for k, v in before.items())
        with stores.rebuilt(folder, e.value) as s:
            assert s.count() == 0
        moved = {p.name for p in folder.iterdir() if "damaged" in p.name} - earlier
        aside = folder / min(moved, key=len)
        stamp = re.fullmatch(r"index\.sqlite\.damaged-(\d{8}-\d{6})(-2)?", aside.name)
        assert stamp and (stamp[2] is not None) == (n == 2 and stamp[1] in "".join(earlier)), moved
        assert {name: (folder / name).read_bytes() for name in moved} == {
            aside.name + name.removeprefix("index.sqlite"): data for name, data in kept.items()}
        assert capsys.readouterr().err.strip() == (
            f"the reference cache index {index} is damaged ({e.value.what}): moved it aside to {aside} (nothing "
            "deleted; remove it once you no longer need it), and building a new one")
        assert sorted(p.name for p in folder.iterdir() if "damaged" not in p.name) == ["index.sqlite"]
    writer.close()


def test_drop_removes_only_the_keys_asked_under_their_side(tmp_path):
    with stores.Store(tmp_path, create=True) as s:
        a, b = s.side("a", {"k": 1}), s.side("b", {"k": 2})
        s.put(a, values(5))
        s.put(b, values(5))
        assert s.drop(a, set(list(values(5))[:2])) == 2 and s.drop(a, set()) == 0
        assert len(s.get(a, list(values(5)))) == 3 and len(s.get(b, list(values(5)))) == 5


def test_token_log_probs_come_back_as_stored_and_a_pair_keyed_index_is_refused(tmp_path):
    """A per_token side's blobs round-trip bit for bit; an index of the pair-keyed format (its `rows` table) is
    refused, not opened or altered."""
    blob = b"".join(float(x).hex().encode()[:4] for x in range(3))  # 12 arbitrary bytes: 3 float32
    with stores.Store(tmp_path / "new", create=True) as s:
        side = s.side("t", {"per_token": True})
        s.put(side, {b"k" * 16: stores.Value(-1.5, 3, blob)})
        assert s.get(side, [b"k" * 16]) == {b"k" * 16: stores.Value(-1.5, 3, blob)}
    import sqlite3

    old = tmp_path / "old"
    old.mkdir()
    db = sqlite3.connect(old / "index.sqlite")
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript("CREATE TABLE sides (id INTEGER PRIMARY KEY, digest TEXT, components TEXT, created TEXT);"
                     "CREATE TABLE rows (side INTEGER, key BLOB, chosen REAL, rejected REAL, chosen_tokens INTEGER,"
                     " rejected_tokens INTEGER);")
    # its writer still open (or killed): the tables are in the write-ahead log only, and are found there
    # the data and its log (-shm is SQLite's shared-memory index, which readers mark)
    files = lambda: {p.name: p.read_bytes() for p in old.iterdir() if not p.name.endswith("-shm")}  # noqa: E731
    before = files()
    assert "index.sqlite-wal" in before and stores.is_store(old)
    with pytest.raises(stores.OldFormat):
        stores.Store(old)
    assert files() == before
    db.close()
    before = files()
    with pytest.raises(stores.OldFormat):
        stores.Store(old)
    assert files() == before


def test_usage_weighs_a_per_token_sides_blobs(tmp_path):
    """Two sides of as many sequences, one keeping 512 token log-probs each: its share of the file is ~50x."""
    with stores.Store(tmp_path, create=True) as s:
        plain, per_token = s.side("plain", {"model": "a"}), s.side("tokens", {"per_token": True})
        s.put(plain, values(500))
        s.put(per_token, {k: stores.Value(v.logps, 512, bytes(2048)) for k, v in values(500).items()})
        got = {u.digest: u for u in s.usage()}
        assert got["plain"].sequences == got["tokens"].sequences == 500
        assert got["tokens"].bytes > 40 * got["plain"].bytes


def test_an_index_damaged_while_open_is_refused_by_every_query_and_left_as_it_is(tmp_path):
    """The file cut short while a stage holds it open (a real truncation): every query after it, a read, a write
    and --prune, refuses in one line naming the index and what to do, and the write adds nothing to the file."""
    import hashlib

    with stores.Store(tmp_path, create=True) as s:
        s.put(s.side("side", {"k": 1}), values(2000))
    s = stores.Store(tmp_path)  # its check on open passes
    side = s.side("side")
    index = tmp_path / "index.sqlite"
    with open(index, "r+b") as f:
        f.truncate(index.stat().st_size // 3)
    digest = hashlib.sha256(index.read_bytes()).hexdigest()
    for query in (s.count, lambda: s.get(side, list(values(2000))), s.usage, lambda: s.side("new", {"k": 2}),
                  lambda: s.put(side, values(10, 5000)), lambda: s.prune(side, set())):
        with pytest.raises(UserError) as e:
            query()
        assert str(e.value) == (f"the reference cache index {index} is damaged (database disk image is "
                                "malformed): rerun precompute (it moves the damaged file aside and rebuilds)")
    s.close()
    assert hashlib.sha256(index.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.sqlite"]


def test_a_full_disk_is_raised_as_sqlite_raised_it(tmp_path):
    """SQLite's own "database or disk is full" (a page limit on the file: a real SQLITE_FULL) is not called
    damage: precompute meets it with the space it needs and what it keeps."""
    import sqlite3

    with stores.Store(tmp_path, create=True) as s:
        side = s.side("side", {"k": 1})
        s.db.execute(f"PRAGMA max_page_count={s.db.execute('PRAGMA page_count').fetchone()[0] + 2}")
        with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
            s.put(side, values(5000))
        assert s.count() == 0
