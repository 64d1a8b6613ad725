"""Host RAM a run takes beside the device's memory: planned with it (from a search.Plan) and checked against what
the OS says is available before anything loads.

    host_ram(arch, plan, "train")     # HostRam: its terms, the load's file pages
    host_problem(host, available, "train", "available (MemAvailable)")   # the refusal's line, or None

The terms are memory the kernel can neither swap nor drop:
  pinned activations    activation_offloading: the saved layer inputs in page-locked host memory, each block
                        rounded up to a power of two by torch's caching host allocator (model.pinned_bytes)
  streamed layers       the trailing decoder layers' frozen weights, pinned, one buffer per layer (search.Stream)
  paged optimizer state paged_adamw_8bit: its 8-bit states (the plan's optimizer_state) in CUDA managed memory,
                        which the driver moves to host RAM under device pressure: at most all of it
  the whole base while it loads  fsdp: each process loads the whole quantized base in CPU RAM, then keeps its
                        shard (runtime/sharding.py); the rest is freed once sharded
  offloaded shards      fsdp_offload_params: this process's shard of the base, pinned (FSDP2's CPUOffloadPolicy)
The load reads the checkpoint through mmap (bitsandbytes quantizes the 16-bit shards as they come): those file
pages show in RSS (18.8 GB for a 4-bit Llama-3.1-8B on the last GPU loan) but are page cache the kernel drops
under pressure, so they are shown and never refused on.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_dpo.memory.arch import Arch
from lowmem_dpo.memory.weights import base_weight_bytes, card_host_bytes
from lowmem_dpo.runtime import devices, ram
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.rules import PAGED_ADAMW_8BIT
from lowmem_dpo.runtime.units import fmt

CHECKPOINT_BYTES = 2  # bytes a parameter in the checkpoint read at load: the 16-bit shards 7B models ship

# What the process itself takes from host RAM after the check, beyond the planned terms: the CUDA runtime's host side
# and the load's staging buffers (an estimate: bench/gpu_check.py records peak_rss_gib beside host_planned_gib).
HOST_MARGIN = 1 << 30
# What frees each term, for the refusal's line.
KNOBS = {
    "pinned activations": "activation_offloading=false, with a lower max_length so the card holds the activations",
    "streamed layers": "a lower max_length (fewer layers streamed)",
    "paged optimizer state": "a smaller lora_r (the device rule's paged 8-bit AdamW holds its state there)",
    "the whole base while it loads": "more RAM: with fsdp each process loads the whole quantized base in CPU RAM "
                                     "before it keeps its shard",
    "offloaded shards": "fsdp_offload_params=false, with more cards or a lower max_length so the shards fit them",
}


@dataclass(frozen=True)
class HostRam:
    """The host RAM one stage holds while it runs (terms: name -> bytes), and the checkpoint's file pages it reads
    while loading (page cache)."""

    terms: dict[str, int]
    load_file_pages: int

    @property
    def total(self) -> int:
        """The bytes held while the stage runs (the load's page cache not counted)."""
        return sum(self.terms.values())

    def describe(self) -> str:
        held = (f"{fmt(self.total)} held (" + ", ".join(f"{name} {fmt(n)}" for name, n in self.terms.items()) + ")"
                if self.total else "nothing pinned or paged")
        return f"{held}; the load reads {fmt(self.load_file_pages)} of checkpoint pages"


def checkpoint_bytes(arch: Arch) -> int:
    """The bytes of the model's 16-bit checkpoint: the layers, the rest, an untied LM head."""
    head = 0 if arch.tie_word_embeddings else arch.vocab * arch.hidden
    return CHECKPOINT_BYTES * (arch.layers * arch.layer_params + arch.outer_params + head)


def host_ram(arch: Arch, plan, stage: str, streamed: bool = True) -> HostRam:
    """The host RAM of `stage` ("train" or "precompute") under `plan` (search.Plan: the setup as applied, its
    prediction and streams). streamed=False: the stage does not stream the layers the plan would (a stream that
    does not make the run fit is not applied), so they hold no host RAM."""
    setup, terms = plan.setup, {}
    if stage == "train":
        if setup.activation_offloading:
            terms["pinned activations"] = plan.prediction.train.details["offload.host_bytes"]
        if setup.optimizer == PAGED_ADAMW_8BIT:  # the plan's own figure (counted on the device too: it may be either)
            terms["paged optimizer state"] = plan.prediction.train.breakdown["optimizer_state"]
    if streamed and stage in plan.streams:
        terms["streamed layers"] = plan.streams[stage].cpu_bytes
    if setup.sharded and setup.device != "cpu":  # on a CPU these are the run's own memory, the budget's
        dtype, quantization = (setup.dtype, setup.quantization) if stage == "train" else (setup.ref_dtype,
                                                                                          setup.ref_quantization)
        terms["the whole base while it loads"] = sum(base_weight_bytes(arch, dtype, quantization).values())
        if setup.shard_offload:
            terms["offloaded shards"] = card_host_bytes(arch, dtype, quantization, setup.processes)
    return HostRam(terms, checkpoint_bytes(arch))


def host_problem(host: HostRam, available: int, stage: str, source: str = "available") -> str | None:
    """The refusal's line when `stage`'s host RAM and HOST_MARGIN are more than `available` (as `source` names
    it), naming the largest term and the knob that frees it; None when it fits."""
    if host.total + HOST_MARGIN <= available:
        return None
    name, largest = max(host.terms.items(), key=lambda kv: kv[1])
    return (f"{stage} needs {fmt(host.total)} of host RAM it cannot give back ("
            + ", ".join(f"{n} {fmt(b)}" for n, b in host.terms.items() if b)
            + f") and {fmt(HOST_MARGIN)} for the process itself, and this machine has {fmt(available)} {source}: "
            "pinned or paged memory past that fails in "
            f"cudaHostAlloc or ends in the kernel's out-of-memory killer. The largest, {name} ({fmt(largest)}), is "
            f"freed by {KNOBS[name]}")


def check_host_ram(host: HostRam, stage: str) -> list[str]:
    """The stage's host RAM (memory/host.py) against what this machine has available now, shared by the run's
    processes on it: refused before anything loads when it does not fit; else the line that says it (none when
    the stage pins and pages nothing)."""
    if not host.total:
        return []
    available, source = ram.available()
    share = available // devices.local_size()
    problem = host_problem(host, share, stage, source if share == available else f"{source}, per process here")
    if problem:
        raise UserError(problem)
    return [f"host RAM: {host.describe()}; {fmt(share)} {source}"]
