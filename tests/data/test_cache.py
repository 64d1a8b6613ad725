"""The reference cache keyed per sequence: served values equal an independent forward and a fresh build after
every kind of data change, only new sequences are computed (none for a re-pairing), a rerun loads no model, the
store survives kill -9 and a second writer, the formats before are refused with what to do, --prune, and the
digest memo and atomic writes under it."""

import json
import math
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    REPO,
    TINY_DATA,
    TINY_RECIPE,
    cached,
    sequences_of,
    stored_sequences,
    stored_sides,
    write_jsonl,
)
from safetensors.torch import load_file, save_file

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.model import models
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model
from lowmem_dpo.runtime import devices, files
from lowmem_dpo.training import inputs

RECIPE = str(TINY_RECIPE)
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}</s>{% endfor %}" \
           "{% if add_generation_prompt %}[assistant] {% endif %}"


def rows(n: int, start: int = 0) -> list[dict]:
    return [json.loads(x) for x in TINY_DATA.read_text().splitlines()[start:start + n]]


def served(cfg) -> torch.Tensor:
    """(4, rows) what train serves for cfg's rows (the dataset's, then eval_dataset's): chosen and rejected
    log-probs and token counts, NaN / 0 where a row has none."""
    parts = [r for r in cached(cfg) if r is not None]
    return torch.cat([torch.stack([r.chosen, r.rejected, r.chosen_tokens.float(), r.rejected_tokens.float()])
                      for r in parts], dim=1)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32's rounding: 1e-6, relative for values above 1 (a row's sum of log-probs, -5 to -70 here,
    moves by a few ulps when its batch is padded to another length: the rows batched with it differ between an
    incremental build and a fresh one)."""
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=1e-6, equal_nan=True)


def counted(err: str) -> tuple[int, int]:
    """(computed, reused) from precompute's line."""
    m = re.findall(r"computed (\d+) sequences, reused (\d+)", err)
    return int(m[-1][0]), int(m[-1][1])


def test_cache_equals_independent_forward_in_row_order(make_cfg, tiny_path, tokenizer, tmp_path, capsys):
    some = rows(12)
    some[5]["prompt"] = "Write a positive review of the lamp. " * 20  # dropped: prompt reaches max_length
    cfg = make_cfg(dataset=str(write_jsonl(tmp_path / "d.jsonl", some)), cache_shard_rows=5,
                   precompute_batch_size=3)
    precompute.run(cfg, progress=False)
    assert counted(capsys.readouterr().err) == (len(sequences_of(cfg)), 0) and len(sequences_of(cfg)) > 11
    ref = cached(cfg)[0]
    assert ref.chosen.dtype == torch.float64 and ref.chosen.shape == (12,)
    assert math.isnan(ref.chosen[5]) and math.isnan(ref.rejected[5]) and ref.counts["dropped_rows"] == [5]
    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    for i, row in enumerate(some):
        if i == 5:
            continue
        p = data.tokenize_rows(data.load_rows(str(write_jsonl(tmp_path / "one.jsonl", [row]))), tokenizer, 64,
                               None, progress=False).pairs[0]
        b = data.collate([p], 0)
        with torch.no_grad():
            c, r = completion_logps(model, b).split()
        assert ref.chosen[i].item() == pytest.approx(c.logps.item(), abs=1e-4)
        assert ref.rejected[i].item() == pytest.approx(r.logps.item(), abs=1e-4)
        assert int(ref.chosen_tokens[i]) == int(c.n_tokens) and int(ref.rejected_tokens[i]) == int(r.n_tokens)


def test_rerun_and_training_knobs_load_no_model(make_cfg, monkeypatch, capsys):
    cfg = make_cfg()
    precompute.run(cfg, progress=False)
    total = len(sequences_of(cfg))  # 384 pairs, some completions shared between rows: each computed once
    assert counted(capsys.readouterr().err) == (total, 0) and 384 < total < 768

    def no_model(*args, **kwargs):
        raise AssertionError("precompute loaded a model for a cache that holds every row")

    monkeypatch.setattr(models, "load_model", no_model)
    knobs = make_cfg(learning_rate=0.5, seed=9, beta=0.3, lora_r=2, max_steps=99, per_device_train_batch_size=1,
                     precompute_batch_size=5, loss_type="hinge", eval_fraction=0.3)
    precompute.run(knobs, progress=False)
    err = capsys.readouterr().err
    assert counted(err) == (0, total) and "preflight report" in err
    assert stored_sequences(cfg.ref_cache_dir) == total


def _changed_weights(tiny_path, tmp_path) -> str:
    """A copy of the tiny model with one weight moved: another model side, the same token ids."""
    folder = tmp_path / "moved-model"
    shutil.copytree(tiny_path, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("layers.0.mlp.down_proj.weight"))
    weights[name] = weights[name] + 0.01
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def _conversations(some: list[dict]) -> list[dict]:
    return [{"chosen": [{"role": "user", "content": r["prompt"].strip()}, {"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "user", "content": r["prompt"].strip()},
                          {"role": "assistant", "content": r["rejected"]}]} for r in some]


def _change(name: str, tmp_path, tiny_path) -> tuple[dict, dict]:
    """(the base build's keys, the changed run's keys) of one change."""
    def file(tag, some):
        return str(write_jsonl(tmp_path / f"{tag}.jsonl", some))

    base = {"dataset": file("base", rows(40))}
    edited = rows(40)
    edited[3]["chosen"] += " Truly."
    big = file("big", rows(200))
    return {
        "10% more rows": (base, {"dataset": file("more", rows(44))}),
        "reordered": (base, {"dataset": file("reordered", rows(40)[::-1])}),
        "subset": (base, {"dataset": file("subset", rows(40)[::2])}),
        "one row's text": (base, {"dataset": file("edited", edited)}),
        "max_train_samples": (base, {**base, "max_train_samples": 20}),
        "eval split": ({**base, "eval_fraction": 0.1}, {**base, "eval_fraction": 0.25}),
        "rows moved to eval_dataset": (base, {"dataset": file("train", rows(30)), "eval_dataset":
                                              file("eval", rows(10, 30))}),
        "mixture 10% -> 20%": ({"dataset": [{"path": big, "fraction": 0.1}]},
                               {"dataset": [{"path": big, "fraction": 0.2}]}),
        "chat template": ({"dataset": file("conv", _conversations(rows(40)))},
                          {"dataset": file("conv", _conversations(rows(40))), "chat_template": TEMPLATE}),
        "truncation (max_length)": (base, {**base, "max_length": 40}),
        "weights": (base, {**base, "model_name_or_path": _changed_weights(tiny_path, tmp_path)}),
    }[name]


@pytest.mark.parametrize("name", ["10% more rows", "reordered", "subset", "one row's text", "max_train_samples",
                                  "eval split", "rows moved to eval_dataset", "mixture 10% -> 20%", "chat template",
                                  "truncation (max_length)", "weights"])
def test_a_change_computes_only_new_rows_and_serves_a_fresh_builds_values(name, make_cfg, tiny_path, tmp_path,
                                                                          capsys):
    """After each change, precompute on the old cache computes exactly the sequences whose token ids it never saw
    (every one for new weights), the values served equal a fresh build's within 1e-6 (float32), and the first
    train step sits at ln 2."""
    before, after = _change(name, tmp_path, tiny_path)
    old = make_cfg(**before, ref_cache_dir=str(tmp_path / "cache"))
    precompute.run(old, progress=False)
    new = make_cfg(**after, ref_cache_dir=str(tmp_path / "cache"), max_steps=1)
    capsys.readouterr()
    precompute.run(new, progress=False)
    computed, reused = counted(capsys.readouterr().err)
    ids = sequences_of(new)
    expected = len(ids) if name == "weights" else len(ids - sequences_of(old))
    assert (computed, reused) == (expected, len(ids) - expected)
    fresh = make_cfg(**after, ref_cache_dir=str(tmp_path / "fresh"))
    precompute.run(fresh, progress=False)
    assert same(served(new), served(fresh))
    train.run(new, progress=False)
    m = next(m for x in open(f"{new.output_dir}/metrics.jsonl") if "loss" in (m := json.loads(x)))
    assert m["step"] == 1 and m["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_train_names_the_rows_without_a_value_and_the_command(make_cfg, tmp_path, capsys):
    """Rows no precompute saw are refused by train before any model loads: how many, which (file and line), and
    the command that computes only them; a changed model side says what differs from the one the cache holds."""
    first = write_jsonl(tmp_path / "first.jsonl", rows(30))
    grown = write_jsonl(tmp_path / "grown.jsonl", rows(34))
    precompute.run(make_cfg(dataset=str(first)), progress=False)
    args = [RECIPE, f"dataset={grown}", f"ref_cache_dir={tmp_path / 'cache'}", "dtype=float32",
            f"output_dir={tmp_path / 'out'}", "max_steps=1"]
    capsys.readouterr()
    assert run_cli(train.main, args, "train", train.__doc__) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    err = err.splitlines()[-1]
    assert f"has no reference values for 4 of the 34 rows this run uses ({grown} row 30 at line 31; {grown} row " \
           "31 at line 32" in err and "; and 1 more): new, or changed since precompute ran" in err
    assert err.endswith("Compute them (only them) with: lowmem-dpo precompute " + " ".join(args))
    assert not (tmp_path / "out").exists()
    capsys.readouterr()
    assert run_cli(train.main, [*args[:1], f"dataset={first}", *args[2:3], "dtype=bfloat16", *args[4:]], "train",
                   train.__doc__) == 2
    err = capsys.readouterr().err
    assert "the cache holds values for another model side (dtype float32 -> bfloat16 changed); or train against " \
           "the values it holds: ref_quantization=none ref_dtype=float32" in err


def _build(recipe_keys: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowmem_dpo.precompute", RECIPE, *recipe_keys], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)})


def _stored_of(cache_dir, keys: list[bytes]) -> int:
    """How many of `keys` the store holds, read without writing (0 before it exists)."""
    path = cache_dir / "index.sqlite"
    if not path.is_file():
        return 0
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    try:
        return db.execute(f"SELECT COUNT(*) FROM sequences WHERE key IN ({','.join('?' * len(keys))})",
                          keys).fetchone()[0]
    except sqlite3.OperationalError:  # the tables are not created yet
        return 0
    finally:
        db.close()


def test_two_writers_and_a_kill_9_leave_the_store_consistent(tmp_path, capsys):
    """Two precompute processes (two recipes: overlapping rows) write one cache folder at once, one sequence per
    commit; one is killed with SIGKILL mid-build (a real kill, not simulated). The other finishes; the store
    passes SQLite's integrity check and holds no partial value; the killed recipe's rerun computes only the
    sequences nobody committed, and each recipe's served values equal a fresh build's."""
    keys = {n: [f"dataset={write_jsonl(tmp_path / f'{n}.jsonl', rows(80, start))}", "dtype=float32",
                f"ref_cache_dir={tmp_path / 'cache'}", "cache_shard_rows=1", "precompute_batch_size=1"]
            for n, start in (("a", 0), ("b", 40))}
    only_a = load_config(RECIPE, [f"dataset={write_jsonl(tmp_path / 'only-a.jsonl', rows(40))}", *keys["a"][1:]])
    ins = inputs.prepare(only_a, devices.resolve(only_a))
    # the sequences of a's own rows that b lacks: the synthetic rows repeat completions, and one b also computes
    # would count b's commit as a's (the kill then came before a committed 3 of its own, on a loaded machine)
    b_keys = set(inputs.load_data(load_config(RECIPE, keys["b"]), ins.tokenizer, progress=False).sequences())
    only_a_keys = [k for k in inputs.load_data(only_a, ins.tokenizer, progress=False).sequences() if k not in b_keys]
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in keys}
    a, b = _build(keys["a"], logs["a"]), _build(keys["b"], logs["b"])
    deadline = time.monotonic() + 300
    while _stored_of(tmp_path / "cache", only_a_keys) < 3 and a.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    a.send_signal(signal.SIGKILL)  # a is committing its own rows now
    assert a.wait() == -signal.SIGKILL and b.wait(timeout=300) == 0, (tmp_path / "b.log").read_text()[-2000:]
    db = sqlite3.connect(tmp_path / "cache" / "index.sqlite")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    kept = db.execute("SELECT COUNT(*) FROM sequences").fetchone()[0]
    db.close()
    cfg = load_config(RECIPE, keys["a"])
    seq_a, seq_b = sequences_of(cfg), sequences_of(load_config(RECIPE, keys["b"]))
    total = len(seq_a | seq_b)
    assert len(seq_b) + 3 <= kept < total  # b's, and what a committed before the kill
    precompute.run(cfg, progress=False)
    assert counted(capsys.readouterr().err) == (total - kept, len(seq_a) - (total - kept))
    assert stored_sequences(tmp_path / "cache") == total
    for n in ("a", "b"):
        fresh = load_config(RECIPE, [*keys[n][:2], f"ref_cache_dir={tmp_path / ('fresh-' + n)}"])
        precompute.run(fresh, progress=False)
        assert same(served(load_config(RECIPE, keys[n])), served(fresh))


def test_a_cache_of_an_earlier_format_is_refused_with_what_to_remove_and_the_command(make_cfg, tmp_path, capsys):
    """A pair-keyed index (format 2) and a manifest.json cache (format 1) are refused by precompute and by train:
    exit 2, one line naming the folder, what to remove and the precompute that rebuilds it; nothing is changed
    or recomputed silently."""
    some = write_jsonl(tmp_path / "d.jsonl", rows(10))
    pair_keyed = tmp_path / "pair-keyed"
    pair_keyed.mkdir()
    db = sqlite3.connect(pair_keyed / "index.sqlite")
    db.executescript("CREATE TABLE sides (id INTEGER PRIMARY KEY AUTOINCREMENT, digest TEXT UNIQUE NOT NULL, "
                     "components TEXT NOT NULL, created TEXT NOT NULL); CREATE TABLE rows (side INTEGER NOT NULL, "
                     "key BLOB NOT NULL, chosen REAL NOT NULL, rejected REAL NOT NULL, chosen_tokens INTEGER NOT NULL,"
                     " rejected_tokens INTEGER NOT NULL, PRIMARY KEY (side, key)) WITHOUT ROWID;")
    db.close()
    whole = tmp_path / "whole"
    (whole / "shards-00000000").mkdir(parents=True)
    (whole / "manifest.json").write_text(json.dumps({"format": 1, "fingerprint": "f" * 64,
                                                      "shard_dir": "shards-00000000", "shards": []}))
    for folder, keyed in ((pair_keyed, "pair"), (whole, "the whole dataset")):
        before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        for stage in (precompute, train):
            args = [RECIPE, f"dataset={some}", f"ref_cache_dir={folder}", "dtype=float32",
                    f"output_dir={tmp_path / 'out'}", "max_steps=1"]
            assert run_cli(stage.main, args, stage.__name__.split(".")[-1], stage.__doc__) == 2
            err = capsys.readouterr().err.strip()
            assert "Traceback" not in err
            assert err.splitlines()[-1].endswith(
                f"the reference cache in {str(folder)!r} is of an earlier format (values keyed by {keyed}; this "
                f"version keys them per completion) and cannot be read: remove it (rm -r {folder}) and rebuild it "
                "with: lowmem-dpo precompute " + " ".join(args))
        assert {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
        assert not (tmp_path / "out").exists()



def _damaged(index, how: str, rng) -> None:
    """Damage a copy of an index as a disk, a bad copy or a stray write would: 64 random bytes over `how` (an
    offset: 16 is the file header's page size, 100 the first page's b-tree header, "middle" the header of the
    middle page, "end" the last page's last cell), or the file cut to a third ("truncated")."""
    data = index.read_bytes()
    if how == "truncated":
        index.write_bytes(data[:len(data) // 3])
        return
    pages = len(data) // 4096
    at = {"middle": pages // 2 * 4096, "end": len(data) - 64}.get(how, how)
    index.write_bytes(data[:at] + rng.randbytes(64) + data[at + 64:])


def test_a_damaged_index_is_refused_by_train_and_moved_aside_by_precompute(tmp_path, capsys):
    """One real cache of 96 of the demo's rows, copied and damaged five ways (random bytes, seeded, over the file
    header, the first page, the middle page and the last cell; the file cut short): preflight and train each exit
    2 with one line calling index.sqlite damaged and naming the precompute that rebuilds it, no traceback, and every
    file in the folder as it was. That precompute (--prune too) moves the damaged file aside, its bytes kept, says
    where in one line, builds a new index of every sequence, and train runs on it."""
    import random

    from lowmem_dpo import preflight

    stages = {"precompute": precompute, "preflight": preflight, "train": train}

    def main(argv: list[str]) -> int:
        return run_cli(stages[argv[0]].main, argv[1:], argv[0], stages[argv[0]].__doc__)

    args = [f"ref_cache_dir={tmp_path / 'built'}", f"dataset={write_jsonl(tmp_path / 'd.jsonl', rows(96))}",
            "dtype=float32", f"output_dir={tmp_path / 'out'}", "max_steps=1"]
    assert main(["precompute", RECIPE, *args]) == 0
    assert main(["preflight", RECIPE, *args]) == 0  # the intact cache serves every row
    built = counted(capsys.readouterr().err)[0]
    rng = random.Random(47)
    for how in (16, 100, "middle", "end", "truncated"):
        folder = tmp_path / f"damaged-{how}"
        shutil.copytree(tmp_path / "built", folder)
        _damaged(folder / "index.sqlite", how, rng)
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        args[0] = f"ref_cache_dir={folder}"
        for stage in ("preflight", "train"):
            assert main([stage, RECIPE, *args]) == 2, (how, stage)
            err = capsys.readouterr().err.strip()
            assert "Traceback" not in err and err.count("error:") == 1, (how, stage, err)
            assert re.fullmatch(rf"lowmem_dpo\.{stage}: error: the reference cache index "
                                rf"{re.escape(str(folder / 'index.sqlite'))} is damaged \(.+\): rerun precompute \(it "
                                r"moves the damaged file aside and rebuilds\): lowmem-dpo precompute "
                                + re.escape(" ".join([RECIPE, *args])), err.splitlines()[-1]), (how, stage, err)
            assert {p.name: p.read_bytes() for p in folder.iterdir()} == before, (how, stage)
    assert not (tmp_path / "out").exists()
    assert main(["precompute", RECIPE, *args, "--prune"]) == 0  # the last one (a model load each: one is enough)
    err = capsys.readouterr().err
    (aside,) = folder.glob("index.sqlite.damaged-*")
    assert re.search(rf"the reference cache index {re.escape(str(folder / 'index.sqlite'))} is damaged \(.+\): moved "
                     rf"it aside to {re.escape(str(aside))} \(nothing deleted; remove it once you no longer need it\), "
                     "and building a new one", err) and counted(err) == (built, 0)
    assert aside.read_bytes() == before["index.sqlite"] and stored_sequences(folder) == built
    assert main(["train", RECIPE, *args]) == 0


def _four_completions(n: int) -> list[list]:
    """n prompts with 4 completions each, best first (UltraFeedback's shape): the demo rows' chosen and rejected
    of row i and of row i + n."""
    some = rows(2 * n)
    return [[some[i]["prompt"], [some[i]["chosen"], some[i + n]["chosen"], some[i + n]["rejected"],
                                 some[i]["rejected"]]] for i in range(n)]


def test_a_new_pairing_of_the_same_completions_computes_no_sequence(make_cfg, tmp_path, capsys):
    """Best-vs-worst, then best-vs-each, then every pair and a subset: each completion is computed once, in the
    first build that reads it; a pairing of completions already there computes none and serves a fresh build's
    values."""
    prompts = _four_completions(20)

    def pairing(name: str, pairs: list[tuple[int, int]]) -> str:
        return str(write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": p, "chosen": c[i], "rejected": c[j]}
                                                             for p, c in prompts for i, j in pairs]))

    worst = make_cfg(dataset=pairing("worst", [(0, 3)]))
    precompute.run(worst, progress=False)
    assert counted(capsys.readouterr().err) == (len(sequences_of(worst)), 0)
    each = make_cfg(dataset=pairing("each", [(0, 1), (0, 2), (0, 3)]))
    precompute.run(each, progress=False)
    new = len(sequences_of(each) - sequences_of(worst))
    assert counted(capsys.readouterr().err) == (new, len(sequences_of(each)) - new) and new >= 2 * len(prompts) - 2
    for name, pairs in (("all", [(i, j) for i in range(4) for j in range(i + 1, 4)]), ("subset", [(1, 2)])):
        again = make_cfg(dataset=pairing(name, pairs))
        precompute.run(again, progress=False)
        assert counted(capsys.readouterr().err) == (0, len(sequences_of(again)))
        fresh = make_cfg(dataset=pairing(name, pairs), ref_cache_dir=str(tmp_path / f"fresh-{name}"))
        precompute.run(fresh, progress=False)
        assert same(served(again), served(fresh))


def test_prune_keeps_this_recipes_rows_and_says_what_each_side_holds(make_cfg, tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", rows(30))
    b = write_jsonl(tmp_path / "b.jsonl", rows(30, 20))
    precompute.run(make_cfg(dataset=str(a)), progress=False)
    precompute.run(make_cfg(dataset=str(a), ref_dtype="bfloat16"), progress=False)
    capsys.readouterr()
    cfg = make_cfg(dataset=str(b))
    seq_a, seq_b = sequences_of(make_cfg(dataset=str(a))), sequences_of(cfg)
    precompute.run(cfg, progress=False)
    err = capsys.readouterr().err
    assert counted(err) == (len(seq_b - seq_a), len(seq_b & seq_a))
    assert re.search(rf"model side \w{{12}} \(this run's\): {len(seq_a | seq_b)} sequences, [\d.]+ KiB \(float32, "
                     r"quantization none\)", err)
    assert re.search(rf"model side \w{{12}}: {len(seq_a)} sequences, [\d.]+ KiB \(bfloat16, quantization none, "
                     r"(un)?shared\)", err)
    assert run_cli(precompute.main, [RECIPE, f"dataset={b}", f"ref_cache_dir={cfg.ref_cache_dir}", "dtype=float32",
                                     "--prune"], "precompute", precompute.__doc__) == 0
    err = capsys.readouterr().err
    assert f"pruned {len(seq_a | seq_b) + len(seq_a) - len(seq_b)} sequences this recipe does not use (other data, " \
           "other model sides)" in err
    assert stored_sequences(cfg.ref_cache_dir) == len(seq_b) and [s["dtype"] for s in stored_sides(cfg.ref_cache_dir)] == [
        "float32"]
    assert not torch.isnan(served(cfg)[0]).any()


def test_file_digests_are_remembered_by_path_size_mtime(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"abc" * 1000)
    real = files.file_digests([f])[0]
    store = files._digest_store()
    memo = json.loads(store.read_text())
    key = next(k for k in memo if k.startswith(str(f.resolve())))
    memo[key] = "remembered"
    store.write_text(json.dumps(memo))
    assert files.file_digests([f]) == ["remembered"]  # not re-read
    f.write_bytes(b"abd" * 1000)  # new content, new mtime: hashed again
    assert files.file_digests([f])[0] not in ("remembered", real)


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    """A full disk is simulated by making fsync fail mid-write (it cannot be produced here on demand)."""
    target = tmp_path / "m.json"
    files.atomic_write_json(target, {"ok": 1})

    def full_disk(fd):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        files.atomic_write_json(target, {"new": 2})
    assert json.loads(target.read_text()) == {"ok": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temp file left behind


def test_a_run_s_cache_keys_its_sequences_and_sides_itself(tmp_path, capsys):
    """cache.for_run is the one owner of the keys: a pair's sequences put under one layout are missing from the
    other, read back into the part's RefCache (the twin serves a layout that lacks them), and prune keeps only the
    sequences asked for; the side is the run's in either layout, its identity the same. A value whose token count
    disagrees with its sequence is damaged: read refuses it naming its row and the command, missing drops it (one
    line) and lists it."""
    from lowmem_dpo.data import cache, sides
    from lowmem_dpo.data import store as stores

    side = sides.run_side({"model": "m", "adapter": None}, "bfloat16", "none", shared=True)
    pairs = [data.TokenizedPair(0, [1, 2], [3, 4], [5]), data.TokenizedPair(1, [1, 2], [6], [5])]  # one rejected
    tok = data.TokenizedData(pairs=pairs, num_rows=2, dropped=[])
    sequences = {k: seq for p in pairs for k, seq in zip(cache.pair_keys(p), cache.pair_sequences(p))}
    keys = list(sequences)  # row 0's chosen and rejected, row 1's chosen
    with cache.for_run(tmp_path / "c", side, create=True, command="lowmem-dpo precompute R") as run_cache:
        assert run_cache.missing(sequences) == {True: [0, 1, 2], False: [0, 1, 2]}
        first = cache.pair_sequences(pairs[0])
        run_cache.put(True, [(seq, stores.Value(-1.0 - i, cache.completion_tokens(seq.prompt_ids, seq.completion_ids)))
                             for i, seq in enumerate(first)])
        assert run_cache.missing(sequences) == {True: [2], False: [0, 1, 2]}  # row 1's rejected is row 0's
        ref, lacking = run_cache.read(tok)
        assert [p.row for p in lacking] == [1] and ref.chosen[0].item() == -1.0 and ref.rejected[0].item() == -2.0
        twin = run_cache.preferring(False)
        assert twin.identity == run_cache.identity and twin.read(tok)[0].shared is True  # read from the twin
        assert {u.digest for u in run_cache.store.usage()} == {side.digest} and run_cache.mine(side.digest)
        assert run_cache.prune(True, {keys[0]}) == 1 and run_cache.missing(sequences)[True] == [1, 2]
        run_cache.put(True, [(cache.pair_sequences(pairs[1])[0], stores.Value(-3.0, 2))])  # row 1's chosen: 1 token
        with pytest.raises(stores.Damaged) as e:
            run_cache.read(tok, name_row=lambda row: f"row {row}")
        assert str(e.value) == (f"the reference cache index {tmp_path / 'c' / 'index.sqlite'} is damaged (its values "
                                "for 1 sequences, of row 1, disagree with their token counts): rerun precompute (it "
                                "drops and computes them again): lowmem-dpo precompute R")
        capsys.readouterr()
        assert run_cache.missing(sequences)[True] == [1, 2] and run_cache.store.count() == 1
        assert capsys.readouterr().err.strip() == (
            f"the reference cache index {tmp_path / 'c' / 'index.sqlite'} held damaged values for 1 sequences (token "
            "counts that disagree with their sequences): dropped them; this build computes again those it reads")
