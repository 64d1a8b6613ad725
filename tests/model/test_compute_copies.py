"""The LoRA weights' compute copies (model/compute_copies.py): in a 16-bit run the forward reads 16-bit copies of
the float32 weights, cast once per update instead of in every forward, recompute and backward. The adapter trained
is the autocast one's to the bit; a resume refreshes the copies."""

import pytest
import torch
from torch.profiler import profile

from lowmem_dpo import precompute, train
from lowmem_dpo.model import activations, compute_copies
from lowmem_dpo.training import checkpoint, loop
from lowmem_dpo.training.step import optimizer_step

CASTS = "ToCopyBackward0"  # a cast's node in backward: one per LoRA weight per micro-batch under autocast alone
DTYPES = compute_copies.COMPUTE_DTYPES


def session_of(make_cfg, tmp_path, copies: bool, monkeypatch, dtype: str = "bfloat16", **changes):
    """A 16-bit train session on the tiny model, 2 micro-batches a step, checkpointing, dropout on; `copies`
    False: the LoRA Linears as peft wrote them (no compute dtype to copy into), the float32 weights cast by
    autocast where used."""
    monkeypatch.setattr(compute_copies, "COMPUTE_DTYPES", DTYPES if copies else ())
    cfg = make_cfg(dtype=dtype, per_device_train_batch_size=2, gradient_accumulation_steps=2, lora_dropout=0.1,
                   gradient_checkpointing="true", output_dir=str(tmp_path / f"out-{copies}"), **changes)
    precompute.run(cfg, progress=False)
    return train.setup(cfg, progress=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_copies_train_the_autocast_adapter_to_the_bit(make_cfg, tmp_path, monkeypatch, dtype):
    """Two steps of 2 micro-batches (dropout on, checkpointed): the same float32 adapter with the copies as with
    autocast's casts, and the backward casts no LoRA weight: one cast node fewer per weight and micro-batch."""
    adapters, casts = [], []
    for copies in (False, True):
        session = session_of(make_cfg, tmp_path, copies, monkeypatch, dtype)
        assert (session.trainee.copies is not None and len(session.trainee.copies.params) == 28) == copies
        optimizer_step(session)
        with profile() as prof:
            optimizer_step(session)
        casts.append(sum(e.count for e in prof.key_averages() if e.key == CASTS))
        assert all(p.dtype == torch.float32 for p in session.trainee.params)
        adapters.append([p.detach().clone() for p in session.trainee.params])
    assert all(torch.equal(a, b) for a, b in zip(*adapters))
    assert casts[0] - casts[1] >= 28 * 2  # 28 LoRA weights x 2 micro-batches


def test_a_restored_checkpoint_refreshes_the_copies(make_cfg, tmp_path, monkeypatch):
    """checkpoint.restore loads the float32 weights and the copies follow: the forward reads the restored
    adapter, not the one it had before. Offloading never takes a copy for an activation."""
    session = session_of(make_cfg, tmp_path, True, monkeypatch, max_steps=2, save_steps=1)
    copies = session.trainee.copies
    optimizer_step(session)
    loop.save_checkpoint(session, tmp_path / "out-True")
    saved = [p.detach().clone() for p in session.trainee.params]
    optimizer_step(session)
    assert not all(torch.equal(a, b) for a, b in zip(saved, session.trainee.params))
    checkpoint.restore(checkpoint.folder(tmp_path / "out-True", 1), session.trainee)
    assert all(torch.equal(a, b) for a, b in zip(saved, session.trainee.params))
    assert torch.equal(copies.flat, torch.cat([p.reshape(-1) for p in saved]).to(copies.flat.dtype))
    # activation offloading leaves a copy where it is (a weight), and takes an activation
    offloader = activations.offload_activations(session.trainee.model, torch.device("cpu"), force=True)
    offloader.min_bytes = 0
    assert not any(offloader.moves(c) for c in copies.copies.values()) and offloader.moves(torch.ones(3))
