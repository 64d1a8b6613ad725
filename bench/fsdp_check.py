"""fsdp's device path on one card: the sharded policy against the whole one, the same log-probs and LoRA gradients.

    python bench/fsdp_check.py --json $OUT/fsdp_check.json          # on a lent GPU machine (one card: one rank)
    python bench/fsdp_check.py --device cpu --json OUT              # the same flow on this CPU (gloo)

A GPU loan lends one card, and FSDP's point is two or more; what one card can still show is the part that has run
on no GPU yet: the base loaded in CPU RAM (models.load_device's sharded path), the 4-bit constants and the weights
kept whole moved to the card (runtime/sharding.py), fully_shard moving each shard there, FSDP2's CPUOffloadPolicy
bringing pinned shards in for each layer, under a one-rank process group (NCCL on CUDA). Each way builds the
policy as train does (policy.setup_model: the built-in tiny Llama, 4-bit, float32 compute, LoRA with its seeded
init) and runs the demo's first pairs forward and backward; the whole model on the device is the reference.
Prints and writes each way's largest differences (log-probs, LoRA gradients) and the device memory it held.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowmem_dpo import data  # noqa: E402
from lowmem_dpo.config.recipe import load_config  # noqa: E402
from lowmem_dpo.model.logps import completion_logps, lm_of  # noqa: E402
from lowmem_dpo.runtime import devices  # noqa: E402
from lowmem_dpo.training import inputs, policy  # noqa: E402


def forward_backward(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The batch's completion log-probs (N,) and each LoRA weight's gradient of their sum."""
    model.zero_grad(set_to_none=True)
    out = completion_logps(lm_of(model), batch)
    out.logps.sum().backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.logps.detach().double().cpu(), grads


def held(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cfg = load_config("lowmem_dpo:tiny-cpu", [f"device={args.device}", "dtype=float32", "quantization=4bit"])
    rendezvous = Path(tempfile.mkdtemp()) / "rdv"
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                         init_method=f"file://{rendezvous}",
                                         device_id=device if device.type == "cuda" else None)
    try:
        resolved = devices.resolve(cfg)
        prepared = inputs.prepare(cfg, resolved)
        pairs = inputs.load_data(cfg, prepared.tokenizer, progress=False).train[:args.pairs]
        batch = data.collate(pairs, data.pad_token_id(prepared.tokenizer)).to(resolved.device)
        whole = policy.setup_model(cfg, resolved, prepared.model_path, source=prepared.source)
        want_logps, want_grads = forward_backward(whole, batch)
        rows = [{"way": "whole, on the device", "device_bytes": held(resolved.device)}]
        del whole
        for offload in (False, True):
            way = dataclasses.replace(resolved, sharded=True, shard_offload=offload)
            model = policy.setup_model(cfg, way, prepared.model_path, source=prepared.source)
            logps, grads = forward_backward(model, batch)
            assert grads.keys() == want_grads.keys(), "the sharded policy's LoRA weights are not the whole one's"
            rows.append({"way": "sharded" + (", shards in CPU RAM" if offload else ""),
                         "device_bytes": held(resolved.device),
                         "logps_max_diff": float((logps - want_logps).abs().max()),
                         "grad_max_diff": max(float((grads[n] - want_grads[n]).abs().max()) for n in grads)})
            del model
    finally:
        torch.distributed.destroy_process_group()
    for row in rows:
        print(json.dumps(row))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                               "pid": os.getpid(), "rows": rows}, indent=2) + "\n")
    return 0 if all(r.get("logps_max_diff", 0) < 1e-4 and r.get("grad_max_diff", 0) < 1e-4 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
