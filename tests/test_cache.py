"""The reference cache: numbers equal an independent forward, reuse, refusal, resume, remembered digests."""

import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY_DATA, write_jsonl
from safetensors.torch import load_file

from lowmem_dpo import cache, data, files, precompute
from lowmem_dpo.errors import UserError
from lowmem_dpo.logps import completion_logps
from lowmem_dpo.models import load_model


def test_cache_equals_independent_forward_in_row_order(make_cfg, tiny_path, tokenizer, tmp_path):
    rows = data.load_rows(str(TINY_DATA)).select(range(12)).to_list()
    rows[5]["prompt"] = "Write a positive review of the lamp. " * 20  # dropped: prompt reaches max_length
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = make_cfg(dataset=str(path), cache_shard_rows=5, precompute_batch_size=3)
    precompute.run(cfg, progress=False)
    chosen, rejected = cache.load_ref_logps(cfg.ref_cache_dir)
    assert chosen.dtype == torch.float32 and chosen.shape == (12,)
    assert math.isnan(chosen[5]) and math.isnan(rejected[5])
    manifest = cache.read_manifest(cfg.ref_cache_dir)
    assert manifest["dropped_rows"] == [5] and len(manifest["shards"]) == 3  # 11 rows / 5 per shard

    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    for i, row in enumerate(rows):
        if i == 5:
            continue
        p = data.tokenize_rows(data.load_rows(str(write_jsonl(tmp_path / "one.jsonl", [row]))), tokenizer, 64,
                               None, progress=False).pairs[0]
        b = data.collate([p], 0)
        with torch.no_grad():
            c, r = completion_logps(model, b.input_ids, b.attention_mask, b.completion_mask).split()
        assert chosen[i].item() == pytest.approx(c.logps.item(), abs=1e-4)
        assert rejected[i].item() == pytest.approx(r.logps.item(), abs=1e-4)


def test_rerun_is_a_no_op_and_training_knobs_reuse_the_cache(make_cfg):
    cfg = make_cfg()
    precompute.run(cfg, progress=False)
    manifest_path = cache.Path(cfg.ref_cache_dir) / cache.MANIFEST
    before = manifest_path.stat().st_mtime_ns
    shard = next(cache.Path(cfg.ref_cache_dir).glob("shards-*/shard-*.safetensors"))
    shard_before = shard.stat().st_mtime_ns
    knobs = make_cfg(learning_rate=0.5, seed=9, beta=0.3, lora_r=2, max_steps=99, per_device_train_batch_size=1,
                     precompute_batch_size=5, loss_type="hinge")
    precompute.run(knobs, progress=False)
    assert manifest_path.stat().st_mtime_ns == before and shard.stat().st_mtime_ns == shard_before


def test_changed_inputs_are_refused_with_what_changed(make_cfg, tmp_path):
    from lowmem_dpo import devices, inputs

    cfg = make_cfg()
    precompute.run(cfg, progress=False)
    other = make_cfg(max_length=48)
    fp = inputs.fingerprint_components(other, devices.resolve(other), cache.Path(inputs.models.resolve_model_path(
        other.model_name_or_path)))
    with pytest.raises(UserError) as e:
        cache.check_fingerprint(cache.Path(cfg.ref_cache_dir), fp, "REBUILD")
    assert "max_length 64 -> 48" in str(e.value) and "REBUILD" in str(e.value)

    rows = [json.loads(line) for line in TINY_DATA.read_text().splitlines()]
    rows[0]["chosen"] = "The lamp is great and great."
    changed = write_jsonl(tmp_path / "changed.jsonl", rows)
    p = subprocess.run([sys.executable, "-m", "lowmem_dpo.train", "recipes/tiny-cpu.yaml", f"dataset={changed}",
                        f"ref_cache_dir={cfg.ref_cache_dir}", f"output_dir={tmp_path / 'o'}", "max_length=64"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "dataset" in p.stderr and "changed" in p.stderr
    assert "python -m lowmem_dpo.precompute recipes/tiny-cpu.yaml" in p.stderr
    assert not (tmp_path / "o" / "adapter_model.safetensors").exists()


def test_killed_precompute_resumes_from_last_shard(make_cfg, monkeypatch):
    """A kill is simulated by raising from the shard writer after two shards (a real SIGKILL cannot be timed
    on a run this short). The rerun computes only the missing shards and ends equal to a clean build."""
    cfg = make_cfg(cache_shard_rows=64, ref_cache_dir=str(make_cfg().ref_cache_dir) + "-killed")
    real_save = files.atomic_save_tensors
    calls = {"n": 0}

    def dying_save(path, tensors):
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill")
        calls["n"] += 1
        real_save(path, tensors)

    monkeypatch.setattr(files, "atomic_save_tensors", dying_save)
    with pytest.raises(KeyboardInterrupt):
        precompute.run(cfg, progress=False)
    assert cache.read_manifest(cfg.ref_cache_dir) is None
    shard_dir = next(cache.Path(cfg.ref_cache_dir).glob("shards-*"))
    assert len(list(shard_dir.glob("shard-*.safetensors"))) == 2
    assert not list(shard_dir.glob(".*.tmp"))  # no half-written shard left behind
    first = {p.name: load_file(p) for p in shard_dir.glob("shard-*.safetensors")}

    monkeypatch.setattr(files, "atomic_save_tensors", real_save)
    computed = []
    real_shard_logps = precompute.shard_logps
    monkeypatch.setattr(precompute, "shard_logps", lambda m, pairs, *a: computed.append(len(pairs)) or
                        real_shard_logps(m, pairs, *a))
    precompute.run(cfg, progress=False)
    assert sum(computed) == 384 - 2 * 64
    for name, t in first.items():  # finished shards were kept, not recomputed
        assert torch.equal(load_file(shard_dir / name)["chosen"], t["chosen"])

    clean = make_cfg(ref_cache_dir=str(make_cfg().ref_cache_dir) + "-clean")
    precompute.run(clean, progress=False)
    a, b = cache.load_ref_logps(cfg.ref_cache_dir), cache.load_ref_logps(clean.ref_cache_dir)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)


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
