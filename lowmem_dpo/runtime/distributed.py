"""Several processes, one run: what torchrun and `accelerate launch` start, through torch.distributed.

    torchrun --nproc-per-node 2 -m lowmem_dpo.train RECIPE.yaml
    accelerate launch --num_processes 2 -m lowmem_dpo.train RECIPE.yaml

The launchers set each process's rank and world size in its environment (ranks.py reads them: torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, or mpirun's under `accelerate launch --cpu`); `init` joins the process group they
describe (NCCL for GPU tensors beside gloo for CPU ones on CUDA, gloo on a CPU). A single process needs nothing:
every function here is then the identity or a no-op, so the stages call them unconditionally; the optimizer step
(training/step.py), which runs thousands of times, calls them only with several ranks.

Data parallelism only: every rank holds the whole (LoRA) policy and computes its part of each step; the LoRA
gradients are summed across ranks (`sum_gradients`) before the update, which is then the same on every rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os

import torch

from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.ranks import World, world


def check_launch() -> None:
    """Refuse `accelerate launch --num_processes N` that started one process: without --multi_gpu (on a CPU:
    without --mpirun_hostfile) accelerate starts one and expects MPI to start the others, and the run would
    quietly be a single process's. Its simple launcher sets ACCELERATE_MIXED_PRECISION, and MASTER_ADDR for N > 1."""
    env = os.environ
    if "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env and not world().distributed:
        raise UserError("accelerate launch --num_processes N started one process: on GPUs add --multi_gpu; on a CPU "
                        "accelerate needs mpirun to start the others (--mpirun_hostfile), or use torchrun "
                        "--nproc-per-node N -m lowmem_dpo.STAGE ..., which starts N")


WAIT = datetime.timedelta(hours=3)  # how long a rank waits for the others in a collective


def is_main() -> bool:
    return world().main


def active() -> bool:
    """Whether this process is one of several, joined in a process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def init(device: torch.device) -> torch.device:
    """Join the launcher's process group (once) and return this process's device: cuda:LOCAL_RANK on CUDA, the
    device itself elsewhere. A single process: `device` as it is."""
    check_launch()
    w = world()
    if not w.distributed:
        return device
    if not w.main:  # the other ranks' library progress bars would repeat rank 0's
        _quiet_libraries()
    if device.type == "cuda":
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    if not active():
        # torch.distributed.nn's functions take `group=group.WORLD` as a default argument, evaluated when the
        # module is first imported; transformers' model loading imports it (through torch.distributed.fsdp). Were
        # that after the group exists, ten defaults would hold the group for good: destroy_process_group could not
        # free it, and its gloo threads would end in the interpreter's teardown, where a finished rank sometimes
        # aborts ("terminate called without an active exception", exit -6; twice in the suite). Imported first,
        # the defaults are None, which means the default group.
        import torch.distributed.nn as _defaults  # noqa: F401
        # Other ranks wait in a collective while rank 0 alone writes samples or a checkpoint, or while the last
        # precompute shards finish: longer than the 10 minutes NCCL allows by default.
        torch.distributed.init_process_group(backend(device), rank=w.rank, world_size=w.size, timeout=WAIT,
                                             device_id=device if device.type == "cuda" else None)
        atexit.register(leave)  # the group and its threads end before the interpreter's teardown
    return device


def leave() -> None:
    """Destroy the process group (at exit: init registers it): its threads end here, while Python still runs."""
    if active():
        torch.distributed.destroy_process_group()


def _quiet_libraries() -> None:
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def backend(device: torch.device) -> str:
    """NCCL for the gradients on GPUs, gloo for the small CPU tensors (flags, metric sums) on every device."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    if active():
        torch.distributed.all_reduce(t, op=op)
    return t


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    if not active():
        return flag
    return bool(_reduce(torch.tensor([int(flag)], dtype=torch.int64), torch.distributed.ReduceOp.MAX).item())


def smallest(n: int) -> int:
    """The smallest of every rank's `n` (every rank gets it): a memory budget the ranks plan alike with, though
    their cards had different free memory (a display on one)."""
    if not active():
        return n
    return int(_reduce(torch.tensor([n], dtype=torch.int64), torch.distributed.ReduceOp.MIN).item())


def broadcast(obj):
    """Rank 0's `obj` on every rank (a picklable value)."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj) -> list:
    """Every rank's `obj` (a picklable value), in rank order, on every rank; [obj] in one process."""
    if not active():
        return [obj]
    out = [None] * world().size
    torch.distributed.all_gather_object(out, obj)
    return out


def sum_gradients(params: list[torch.Tensor]) -> None:
    """Sum each trainable parameter's gradient over the ranks (its .grad becomes the sum): one all-reduce of one
    flat buffer (the LoRA gradients are a few MB). A parameter without a gradient keeps none (every rank runs the
    same graph, so it has none on any rank; AdamW then leaves it alone, as in one process)."""
    if not active():
        return
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])  # (sum of numels,), float32 for an exact-enough sum
    torch.distributed.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
        offset += n


def sum_stats(stats):
    """A step's metric sums (a dataclass of numbers, and of dicts of numbers) summed over the ranks: every rank
    gets the step's totals. Fields declared with metadata {"sum": False} (a weight), and those that are not
    numbers, stay as they are."""
    if not active():
        return stats
    summed = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.metadata.get("sum", True)}
    summed = {n: v for n, v in summed.items() if isinstance(v, (dict, int, float)) and not isinstance(v, bool)}
    keys = [(n, k) for n, v in summed.items() for k in (sorted(v) if isinstance(v, dict) else [None])]
    values = [summed[n] if k is None else summed[n][k] for n, k in keys]
    total = _reduce(torch.tensor(values, dtype=torch.float64), torch.distributed.ReduceOp.SUM).tolist()
    changes = {n: dict(v) for n, v in summed.items() if isinstance(v, dict)}
    for (n, k), v in zip(keys, total):
        if k is None:
            changes[n] = type(summed[n])(v)  # an int count stays an int (float64 sums them exactly)
        else:
            changes[n][k] = v
    return dataclasses.replace(stats, **changes)


def shard(items: list, w: World | None = None) -> list:
    """This rank's share of a list every rank holds the same: every size-th item from its rank (rank 0 the
    first): a list sorted by length gives each rank items of every length."""
    w = w or world()
    return items[w.rank::w.size]
