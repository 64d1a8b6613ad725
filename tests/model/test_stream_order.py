"""The order of the CUDA stream and event calls that activation offloading (activations.py) and layer streaming
(streaming.py) make, recorded on the CPU.

CUDA streams cannot run here, so this test simulates them: devices.py's side_stream, on_stream, mark, wait and
copy_async (every stream, event and copy call the two make) are replaced by a recorder that logs, in order, which
stream each call is on. The model, peft, the checkpointing and the tensors are real. The rules, for both:
  1. a side-stream copy that reads a tensor waits on an event recorded on the compute stream after the tensor was
     written (offloading: a layer's saved input, written by the kernel before the pack hook runs);
  2. a side-stream copy into device memory waits on an event recorded on the compute stream after the last reader
     of any block it may reuse (offloading: the block allocated just before the copy, from the compute stream's
     pool; streaming: the last release of a layer's weights, read by that layer's kernels);
  3. the compute stream waits on an event recorded on the side stream after the copy before it uses what came back.
The offloader as it was before issue 32 (the event recorded inside on_stream: on the side stream) breaks rule 1;
`test_the_check_catches_an_event_recorded_on_the_side_stream` runs that code and asserts that it does.
"""

import contextlib

import pytest
import torch
from conftest import TINY_DATA

from lowmem_dpo import data
from lowmem_dpo.model import activations, streaming
from lowmem_dpo.model.logps import completion_logps
from lowmem_dpo.model.models import load_model
from lowmem_dpo.runtime import devices
from lowmem_dpo.training import policy

CPU = torch.device("cpu")
COMPUTE, SIDE = "compute", "side"


class Streams:
    """devices.py's stream calls, recorded: log entries (what, stream, payload); an event is its mark's index."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = COMPUTE

    def side_stream(self, device):
        return SIDE

    @contextlib.contextmanager
    def on_stream(self, stream):
        before, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = before

    def mark(self, device, stream=None):
        self.log.append(("mark", stream or self.current, None))
        return len(self.log) - 1

    def wait(self, event, stream=None, device=None):
        if event is not None:
            self.log.append(("wait", stream or self.current, event))

    def copy_async(self, dst, src, hold_src=False):
        self.log.append(("copy", self.current, (src.data_ptr(), dst.data_ptr())))
        dst.copy_(src)

    def note(self, what: str, payload) -> None:
        self.log.append((what, None, payload))

    def waited(self, before: int, stream: str, recorded_on: str, after: int) -> bool:
        """Whether `stream` waited, before log position `before`, on an event recorded on `recorded_on` after
        position `after`."""
        return any(what == "wait" and on == stream and self.log[e][1] == recorded_on and e > after
                   for what, on, e in self.log[:before])

    def last(self, what: str, before: int, match=lambda payload: True) -> int:
        return max((k for k, (w, _, p) in enumerate(self.log[:before]) if w == what and match(p)), default=-1)

    def side_copies(self):
        return [(k, p) for k, (w, on, p) in enumerate(self.log) if w == "copy" and on == SIDE]


@pytest.fixture
def streams(monkeypatch):
    rec = Streams()
    for name in ("side_stream", "on_stream", "mark", "wait", "copy_async"):
        monkeypatch.setattr(devices, name, getattr(rec, name))
    return rec


def noted(monkeypatch, rec: Streams, cls, method: str, before=None, after=None):
    """cls.method with a log note before and/or after it (before(args) / after(args, result) give the note)."""
    real = getattr(cls, method)

    def wrapped(self, *args):
        if before:
            rec.note(*before(self, *args))
        out = real(self, *args)
        if after:
            rec.note(*after(self, args, out))
        return out

    monkeypatch.setattr(cls, method, wrapped)


def lora_model(tiny_path, streamed: int = 0):
    from peft import LoraConfig, get_peft_model

    base = load_model(tiny_path, CPU, torch.float32, "none")
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    streamer = streaming.stream_layers(model, streaming.Plan(streamed, "model.layers"), CPU)
    policy.enable_checkpointing(base)
    model.train()
    return model, streamer


def steps(model, tokenizer, n: int = 2) -> None:
    ds = data.load_rows(str(TINY_DATA)).select(range(4))
    batch = data.collate(data.tokenize_rows(ds, tokenizer, 64, None, progress=False).pairs, 0)
    for _ in range(n):
        completion_logps(model, batch).logps.sum().backward()


def offloading_order(monkeypatch, rec: Streams, tiny_path, tokenizer) -> None:
    """Two forward+backward passes with every saved tensor of the backbone offloaded (forced on the CPU), noting
    when each saved tensor was written (the pack hook's start), each block allocated for a copy back (the fetch's
    start) and each use of a tensor that came back (unpack's result)."""
    noted(monkeypatch, rec, activations.Offloader, "pack", before=lambda self, t: ("written", t.data_ptr()))
    noted(monkeypatch, rec, activations.Offloader, "_fetch", before=lambda self, s: ("allocated", None))
    noted(monkeypatch, rec, activations.Offloader, "unpack",
          after=lambda self, args, out: ("use", out.data_ptr() if isinstance(args[0], int) else None))
    model, _ = lora_model(tiny_path)
    offloader = activations.offload_activations(model, CPU, force=True)
    offloader.min_bytes = 0
    steps(model, tokenizer)
    assert offloader.packed >= 8 and offloader.fetched == offloader.packed


def to_host(rec: Streams) -> list[int]:
    """The side copies of the pack hook (the ones after a "written" note; a copy back follows an "allocated" one:
    on this CPU both go to host memory)."""
    return [k for k, _ in rec.side_copies() if rec.last("written", k) > rec.last("allocated", k)]


def rule_1_breaks(rec: Streams) -> list[int]:
    """Copies to the host that read a tensor with no wait on a compute event recorded after it was written."""
    return [k for k in to_host(rec)
            if not rec.waited(k, SIDE, COMPUTE, rec.last("written", k, lambda p, src=rec.log[k][2][0]: p == src))]


def test_offloading_copies_wait_for_the_compute_stream_and_back(monkeypatch, streams, tiny_path, tokenizer):
    offloading_order(monkeypatch, streams, tiny_path, tokenizer)
    outs = to_host(streams)
    assert len(outs) >= 8 and rule_1_breaks(streams) == []
    # rule 2: a copy back (into device memory on a GPU) waits on a compute event recorded after its allocation
    allocations = [k for k, (w, _, _) in enumerate(streams.log) if w == "allocated"]
    copies_back = [next(c for c, _ in streams.side_copies() if c > a) for a in allocations]
    assert len(copies_back) == len(outs) and not set(copies_back) & set(outs)
    assert [a for a, c in zip(allocations, copies_back) if not streams.waited(c, SIDE, COMPUTE, a)] == []
    # rule 3: each tensor back is used after the compute stream waited on a side event after its copy
    uses = [(k, p) for k, (w, _, p) in enumerate(streams.log) if w == "use" and p is not None]
    assert len(uses) >= len(copies_back)
    for k, ptr in uses:
        copy = streams.last("copy", k, lambda p: p[1] == ptr)
        assert copy >= 0 and streams.waited(k, COMPUTE, SIDE, copy), (k, ptr)


def test_the_check_catches_an_event_recorded_on_the_side_stream(monkeypatch, streams, tiny_path, tokenizer):
    """The pack hook as it was before issue 32: devices.mark() inside on_stream(side) records the event on the side
    stream, which then waits on itself: rule 1 fails for every copy."""

    def old_pack(self, t):
        if not self.moves(t):
            return t
        host = torch.empty(t.shape, dtype=t.dtype)
        with devices.on_stream(self.stream):
            devices.wait(devices.mark(self.device), self.stream)
            devices.copy_async(host, t, hold_src=True)
        key = next(self.ids)
        self.saved[key] = activations.Saved(host)
        self.packed += 1
        return key

    monkeypatch.setattr(activations.Offloader, "pack", old_pack)
    offloading_order(monkeypatch, streams, tiny_path, tokenizer)
    outs = to_host(streams)
    assert len(outs) >= 8 and rule_1_breaks(streams) == outs


def test_streamed_layers_are_copied_after_their_last_reader_and_used_after_the_copy(monkeypatch, streams,
                                                                                     tiny_path, tokenizer):
    noted(monkeypatch, streams, streaming.Streamer, "release",  # (a layer that is not on the device frees nothing)
          before=lambda self, i: ("released" if i in self.ready else "not there", i))
    noted(monkeypatch, streams, streaming.Streamer, "use", after=lambda self, args, out: ("use", args[0]))
    model, streamer = lora_model(tiny_path, streamed=2)
    steps(model, tokenizer)
    copies = streams.side_copies()
    releases = [k for k, (w, _, _) in enumerate(streams.log) if w == "released"]
    # each streamed layer comes over for the forward and again for the backward, in each of the two passes
    assert len(copies) >= 4 * sum(len(s) for s in streamer.slots.values()) and len(releases) >= 8
    # rule 2: every copy into a layer's (device) tensors waits on a compute event after the last release before it
    # (none before the first release: no block was read yet)
    assert [k for k, _ in copies if streams.last("released", k) >= 0
            and not streams.waited(k, SIDE, COMPUTE, streams.last("released", k))] == []
    assert sum(streams.last("released", k) >= 0 for k, _ in copies) >= len(copies) // 2
    # rule 3: a layer is used after the compute stream waited on a side event recorded after each of its copies
    uses = [(k, i) for k, (w, _, i) in enumerate(streams.log) if w == "use"]
    assert len(uses) >= 8
    for k, i in uses:
        for slot in streamer.slots[i]:
            copy = streams.last("copy", k, lambda p, ptr=slot.host.data_ptr(): p[0] == ptr)
            assert copy >= 0 and streams.waited(k, COMPUTE, SIDE, copy), (k, i)

