"""The frozen base sharded over several processes with torch's FSDP2 (fsdp: true, or auto where the plan needs it).

    torchrun --nproc-per-node 2 -m lowmem_dpo.train RECIPE.yaml fsdp=true

Data parallel (distributed.py) puts the whole model on every process; a model that does not fit one card fits N
when each holds 1/N of it. `shard` calls torch's `fully_shard` on each decoder layer, then on the decoder stack
(the embeddings and the final norm; the root that completion_logps calls). A layer's weights are gathered from
every rank just before its forward (and again in backward, for the gradient of its input) and freed after it.

What stays whole on every rank, and why:
- the LoRA weights (ignored_params): a few hundred MB at most, so the optimizer, the gradient sum
  (distributed.sum_gradients), the checkpoints and the saved adapter are those of data parallel, unchanged;
- the output embeddings: the LM head (logps.chunked_head) reads its weight whole at every forward and backward of a
  micro-batch, so a sharded head would be gathered for the whole step and held twice (shard + gathered copy).

A 4-bit weight (bitsandbytes, uint8 storage) is sharded as bytes, never cast: no MixedPrecisionPolicy is set (the
weights are already in the run's dtype). A 4-bit weight stored in a floating dtype (bnb_4bit_quant_storage) is
refused: FSDP2 treats it as a float, and a cast of it corrupts the weights silently (../shared/fsdp-probe).

Every forward of a sharded model is a collective: each rank must run as many forwards as the others, in the same
order. The step, the eval, the samples and precompute pad a rank with fewer items with idle forwards
(`idle_forwards`), whose results are dropped.
"""

from __future__ import annotations

import torch

from lowmem_dpo.runtime.errors import UserError

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def is_sharded(model) -> bool:
    """Whether some module of `model` was sharded by fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules whose class transformers names in _no_split_modules (the units
    accelerate's FSDP wraps too)."""
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in names]


def storage_problem(model) -> str | None:
    """Why the model's 4-bit weights cannot be sharded safely, or None: a 4-bit weight stored in a floating dtype."""
    for name, p in model.named_parameters():
        if type(p).__name__ == "Params4bit" and p.dtype in FLOATS:
            return (f"fsdp: the 4-bit weight {name} is stored as {str(p.dtype).removeprefix('torch.')} "
                    "(bnb_4bit_quant_storage); FSDP2 would treat its bytes as numbers and a cast corrupts them "
                    "silently. Quantize with uint8 storage (bitsandbytes' default: load the full-precision "
                    "checkpoint, quantization=4bit) or set fsdp=false")
    return None


def shard(model, backbone: torch.nn.Module, lm_head: torch.nn.Module, device: torch.device,
          offload: bool = False) -> tuple[int, bool]:
    """fully_shard on each decoder layer, then on `backbone`, over every process (one mesh dimension); the
    trainable (LoRA) weights and `lm_head`'s stay whole (the module docstring says why). offload: the shards live in
    CPU RAM and come to the device for each layer's forward and backward (FSDP2's CPUOffloadPolicy). Returns how many
    decoder layers it sharded, and whether it sharded the embeddings (not when tied to the head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    problem = storage_problem(model)
    if problem:
        raise UserError(problem)
    layers = decoder_layers(backbone)
    if not layers:
        raise UserError(f"fsdp: no decoder layers found in {type(backbone).__name__} (transformers' "
                        "_no_split_modules names none): this model cannot be sharded; set fsdp=false")
    keep = {p for p in model.parameters() if p.requires_grad} | set(lm_head.parameters())
    if device.type == "cuda":  # loaded in CPU RAM (models.load_device): fully_shard moves what it shards; the
        for p in keep:  # weights kept whole, and the 4-bit constants (not parameters), go to the card here
            p.data = p.data.to(device)
        quant_states_to(model, device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    embeddings = backbone.get_input_embeddings() if hasattr(backbone, "get_input_embeddings") else None
    # The embeddings in a unit of their own: gathered for the lookup and freed right after it. Their output
    # requires grad under checkpointing (transformers' input-grad hook), so FSDP gathers them once more in backward,
    # once the layers' gradients are done and their activations freed. Tied to the head, they stay whole with it.
    shard_embeddings = embeddings is not None and not set(embeddings.parameters()) & keep
    units = layers + ([embeddings] if shard_embeddings else [])
    for unit in units:
        fully_shard(unit, mesh=mesh, offload_policy=policy, ignored_params={p for p in unit.parameters() if p in keep})
    # The root: the final norm and whatever else is outside the units; the forward's entry, which lazily sets up
    # every unit inside it. Resharded after its forward like the others (a root keeps its weights by default):
    # every unit is then sharded between forwards on every rank. Kept gathered, the first step after a checkpoint
    # (rank 0 alone saving the adapter) met a collective mismatch over gloo: the ranks' root states had parted.
    fully_shard(backbone, mesh=mesh, offload_policy=policy, reshard_after_forward=True,
                ignored_params={p for p in backbone.parameters() if p in keep})
    return len(layers), shard_embeddings


def quant_states_to(model, device: torch.device) -> None:
    """Each 4-bit weight's quantization constants (bitsandbytes' QuantState: absmax, code) onto `device`."""
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if state is not None:
            state.to(device)


def local_bytes(model, shards_only: bool = False) -> int:
    """Bytes of the model's weights this process holds: a sharded weight's local shard, a whole one's all
    (shards_only: the shards alone)."""
    total = 0
    for p in model.parameters():
        if shards_only and not hasattr(p, "to_local"):
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def oom_message(lower: str, offloaded: bool, kept: str = "") -> str:
    """Out of memory in a sharded run (oom.halving_on_oom's collective): a process cannot halve its batch and
    retry alone. `lower`: the keys that lower this stage's peak; kept: what the stage keeps (a sentence)."""
    return (f"out of memory with fsdp: every forward is shared by all processes, so one cannot halve its batch and "
            f"retry alone; lower {lower}" + ("" if offloaded else ", or set fsdp_offload_params=true")
            + " (lowmem-dpo plan RECIPE.yaml --nproc N shows what fits)" + (f"; {kept}" if kept else ""))


def idle_forwards(mine: int, counts: list[int]) -> int:
    """How many idle forwards a rank with `mine` forwards to run adds so that it runs as many as the rank with the
    most (`counts`: every rank's, computed alike on each)."""
    return max(counts) - mine
