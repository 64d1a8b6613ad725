"""report_to: a short real run logged to TensorBoard, trackio and wandb at once, offline (trackio's local store,
WANDB_MODE=offline), each read back from its own files: the scalars equal metrics.jsonl's, and trackio and wandb
hold the run's config. A tracker that fails mid-run is dropped with one warning and the run finishes; a missing
package is one line with the pip command."""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
import sys
from pathlib import Path

import pytest

from lowmem_dpo import precompute, train
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import trackers


def flat(by_tag: dict[str, dict[int, float]]) -> dict[tuple[str, int], float]:
    return {(tag, step): v for tag, steps in by_tag.items() for step, v in steps.items()}


def expected(out) -> dict[str, dict[int, float]]:
    """metrics.jsonl's numbers by tracker tag (train/KEY, eval/KEY) and step."""
    want: dict[str, dict[int, float]] = {}
    for line in map(json.loads, open(out / "metrics.jsonl")):
        for tag, value in trackers.scalars(line).items():
            want.setdefault(tag, {})[line["step"]] = value
    return want


def wandb_history(path) -> dict[str, dict[int, float]]:
    """The history records of a .wandb file (LevelDB-log blocks of wandb's protobuf Records), by key and step."""
    from wandb.proto import wandb_internal_pb2

    data, pos, records, part = open(path, "rb").read(), 7, [], b""  # 7: wandb's file header
    while pos < len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the rest of a block, zero-filled
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last fragment
            records.append(part)
            part = b""
    got: dict[str, dict[int, float]] = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_"):
                    got.setdefault(key, {})[items["_step"]] = value
    return got


def test_three_trackers_hold_what_metrics_jsonl_holds(make_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read at trackio's import: unless an earlier
    pytest.importorskip("trackio")  # test imported it (test_doc_blocks.py), its store is here
    from trackio.utils import TRACKIO_DIR
    pytest.importorskip("wandb")
    cfg = make_cfg(max_steps=4, logging_steps=1, eval_fraction=0.15, eval_steps=2, save_steps=2, eval_generations=0,
                   report_to=["tensorboard", "trackio", "wandb"], run_name="three")
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    out = tmp_path / "out"
    want = expected(out)
    assert {"train/loss", "eval/loss", "train/rewards/margins"} <= set(want)

    db = sqlite3.connect(Path(TRACKIO_DIR) / "lowmem_dpo.db")
    logged: dict[str, dict[int, float]] = {}
    for step, metrics in db.execute("SELECT step, metrics FROM metrics WHERE run_name = 'three'"):
        for tag, value in json.loads(metrics).items():
            logged.setdefault(tag, {})[step] = value
    (config,) = db.execute("SELECT config FROM configs WHERE run_name = 'three'").fetchone()
    assert flat(logged) == pytest.approx(flat(want)) and json.loads(config)["learning_rate"] == cfg.learning_rate

    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert flat(wandb_history(run_file)) == pytest.approx(flat(want))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs"), size_guidance={"scalars": 0})
    events.Reload()
    got = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in want}
    assert flat(got) == pytest.approx(flat(want), rel=1e-6)  # TensorBoard stores float32


def test_a_tracker_that_fails_is_dropped_and_a_missing_one_named(make_cfg, tmp_path, monkeypatch, capsys):
    """A writer failing at its third line (a service gone: simulated, a real one cannot be made to fail on cue):
    one warning, the run finishes and metrics.jsonl has every line. trackio absent (simulated: None in
    sys.modules): the pip command, before the run starts."""
    real = trackers.Writer.add
    calls = []

    def flaky(self, line):
        calls.append(line["step"])
        if len(calls) == 3:
            raise ConnectionError("the service went away")
        real(self, line)

    monkeypatch.setattr(trackers.Writer, "add", flaky)
    cfg = make_cfg(max_steps=5, logging_steps=1, report_to=["tensorboard"])
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    err = capsys.readouterr().err
    assert "warning: report_to=tensorboard failed to log a line (ConnectionError: the service went away); it gets " \
           "nothing more, metrics.jsonl has every line" in err
    assert len(calls) == 3 and len([x for x in open(tmp_path / "out" / "metrics.jsonl") if '"loss"' in x]) == 5
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(UserError, match=r"report_to=trackio needs trackio: pip install 'lowmem_dpo\[trackio\]'"):
        train.run(make_cfg(max_steps=1, report_to=["trackio"], output_dir=str(tmp_path / "other")), progress=False)
