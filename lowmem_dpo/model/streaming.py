"""Decoder layers streamed from CPU RAM: the planner's last knob (memory/search.py, `stream`), which train and
precompute apply on CUDA when nothing cheaper fits the budget.

    stream_layers(model, Plan(k, arch.layers_prefix), device)   # after the adapters are on the model

The frozen weights of the trailing `k` decoder layers live in host memory (pinned on CUDA, so copies run
asynchronously) and are copied to the device for each forward, the next layer's on a side stream while this one
computes; their device memory is released after each use. Everything else (the other layers, embeddings, head,
every LoRA weight) is on the device for good. A layer streams its weights as loaded: a 4-bit layer its packed
4-bit bytes and their quantization scales (about a quarter of a 16-bit copy).

With gradients, the backward needs a streamed layer's weights again: an identity autograd function at the layer's
output (`_Refetch`), whose backward runs before any of the layer's own, copies them back, releases the layer above
(its backward is done) and prefetches the one below; the end of the backward releases what is left. Gradient
checkpointing recomputes the layer with those weights. The model's own tensor objects are kept throughout (their
storage freed and refilled in place), so what autograd holds by reference (bitsandbytes keeps the 4-bit weight on
its context) finds the weights in the backward. Streaming changes no number: the same weights, the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowmem_dpo.model.logps import causal_lm
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.runtime.units import fmt


@dataclass(frozen=True)
class Plan:
    """What a stage streams: the last `layers` decoder layers of the ModuleList at `prefix` (arch.Arch.layers_prefix)."""

    layers: int
    prefix: str


@dataclass
class Slot:
    """One streamed tensor: the model's own (its storage empty between uses) and its copy in CPU RAM (a view into
    its layer's one host buffer)."""

    tensor: torch.Tensor
    host: torch.Tensor

    def fill(self) -> None:
        self.tensor.untyped_storage().resize_(self.host.numel() * self.host.element_size())
        devices.copy_async(self.tensor.data, self.host)  # .data: no version bump for autograd's saved copies

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)


def _in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpointed layer's recompute, or _Refetch). The layer
    hooks run in the recompute with transformers <= 5.22, which checkpoints a layer's __call__ (5.23 and later
    checkpoint forward, inside the hooks, and then never ask from a recompute)."""
    return torch._C._current_graph_task_id() != -1


class _Refetch(torch.autograd.Function):
    """Identity on a streamed layer's output; its backward fetches the layer's weights before the layer's own
    backward needs them."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, streamer: "Streamer", index: int) -> torch.Tensor:
        ctx.streamer, ctx.index = streamer, index
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.streamer.backward_reaches(ctx.index)
        return grad, None, None


class Streamer:
    """The streamed layers of one model: their slots by layer index, what is on the device, the side stream.

    Stream order, on CUDA: a layer's copy runs on the side stream, and the compute stream waits for it before the
    layer runs (`use`). Memory is handed back at once when a layer is released (no record_stream: its blocks
    return to the side stream's pool), so the side stream waits, before its next copy, for the compute stream to
    have passed the last release (`freed`): a reused block is never written while a kernel still reads it. At most
    two streamed layers are on the device, the one computing and the next (memory.search.STREAM_BUFFERS)."""

    def __init__(self, slots: dict[int, list[Slot]], device: torch.device):
        self.slots = slots
        self.device = device
        self.stream = devices.side_stream(device)
        self.ready: dict[int, object] = {}  # layer index -> the event of its copy (None: usable now)
        self.freed = None  # the compute stream's event at the last release
        self.end_queued = False

    def fetch(self, i: int) -> None:
        """Start copying layer i's weights to the device (a no-op for a layer that is there or not streamed)."""
        if i not in self.slots or i in self.ready:
            return
        with devices.on_stream(self.stream):
            devices.wait(self.freed, self.stream)
            for slot in self.slots[i]:
                slot.fill()
        self.ready[i] = devices.mark(self.device, self.stream)

    def use(self, i: int) -> None:
        """Layer i's weights, copied, before the compute stream runs the layer."""
        self.fetch(i)
        devices.wait(self.ready.get(i), device=self.device)
        self.ready[i] = None

    def release(self, i: int) -> None:
        if self.ready.pop(i, False) is not False:
            for slot in self.slots[i]:
                slot.free()
            self.freed = devices.mark(self.device)

    def release_all(self) -> None:
        for i in list(self.ready):
            self.release(i)
        self.end_queued = False

    def before_forward(self, i: int) -> None:
        if self.end_queued and not _in_backward():  # a backward that raised never ran its end-of-backward release
            self.release_all()
        self.use(i)
        self.fetch(i - 1 if _in_backward() else i + 1)  # the next layer this pass reaches

    def after_forward(self, i: int, output):
        """A forward's end: keep the weights for a recompute inside the backward; else release them, after
        marking the output so that the backward fetches them again."""
        if _in_backward():
            return output
        if torch.is_grad_enabled():
            output = _mark(output, self, i)
        self.release(i)
        return output

    def backward_reaches(self, i: int) -> None:
        self.use(i)
        self.release(i + 1)  # the layer above: its backward is done
        self.fetch(i - 1)
        if not self.end_queued:  # the layers still on the device go when the whole backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
            self.end_queued = True


def _mark(output, streamer: Streamer, i: int):
    """The layer's output with its hidden states through _Refetch (a tensor, or the first item of a tuple)."""
    if isinstance(output, torch.Tensor):
        return _Refetch.apply(output, streamer, i) if output.requires_grad else output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) and output[0].requires_grad:
        return (_Refetch.apply(output[0], streamer, i), *output[1:])
    return output


def _frozen_tensors(layer: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors a layer streams: its frozen parameters (LoRA's are trainable and stay) and, for a 4-bit weight,
    its quantization scales (bitsandbytes' QuantState.absmax; the small code tables stay)."""
    out = []
    for module in layer.modules():
        for p in module._parameters.values():
            if p is None or p.requires_grad:
                continue
            out.append(p)
            state = getattr(p, "quant_state", None)
            if state is not None and isinstance(getattr(state, "absmax", None), torch.Tensor):
                out.append(state.absmax)
    return out


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is its storage's only view: freeing the storage then frees nothing else."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _host_copies(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copies of a layer's `tensors` in one host buffer (devices.host_buffer), each at a 64-byte aligned offset."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    buffer = devices.host_buffer(total, device)
    copies = []
    for t, offset in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        host = buffer[offset:offset + n].view(t.dtype).view(t.shape)
        host.copy_(t.detach())
        copies.append(host)
    return copies


def stream_layers(model: torch.nn.Module, plan: Plan | None, device: torch.device) -> Streamer | None:
    """Stream the decoder layers `plan` names from CPU RAM and move everything else of `model` to `device`; None
    without a plan. Call it once the adapters are on the model (their weights stay on the device). Logs what moves
    and its size. An 8-bit base is refused: LLM.int8 keeps a second reference to each weight (Int8Params.CB) that
    would stay on the device (the planner never asks: memory.search streams 16-bit and 4-bit layers only)."""
    if plan is None or plan.layers <= 0:
        return None
    layers = causal_lm(model).get_submodule(plan.prefix)
    k = min(plan.layers, len(layers))
    first = len(layers) - k
    shared = {}  # storage pointer -> tensors there, across the whole model: a shared storage is not streamed
    for t in [*model.parameters(), *model.buffers()]:
        shared.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    slots, moved = {}, 0
    for i in range(first, len(layers)):
        tensors = [t for t in _frozen_tensors(layers[i])
                   if _owns_storage(t) and len(shared.get(t.untyped_storage().data_ptr(), [t])) == 1]
        if any(hasattr(t, "CB") for t in tensors):
            raise AssertionError("streaming an 8-bit (LLM.int8) layer: memory.search never plans it")
        slots[i] = [Slot(t, host) for t, host in zip(tensors, _host_copies(tensors, device))]
        for t in tensors:
            # its own storage on the device, resizable (a memory-mapped weight's is not), emptied below
            t.data = torch.empty_like(t.data, device=device)
        moved += sum(slot.host.untyped_storage().nbytes() for slot in slots[i][:1])  # the layer's one buffer
    streamed = {id(slot.tensor) for layer in slots.values() for slot in layer}
    for p in model.parameters():
        if id(p) not in streamed and p.device != device:
            p.data = p.data.to(device)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)
    streamer = Streamer(slots, device)
    for i, layer_slots in slots.items():
        for slot in layer_slots:
            slot.free()
        layers[i].register_forward_pre_hook(lambda module, args, i=i: streamer.before_forward(i))
        layers[i].register_forward_hook(lambda module, args, output, i=i: streamer.after_forward(i, output))
    log(f"stream: decoder layers {first}-{len(layers) - 1} ({k} of {len(layers)}, {fmt(moved)}) stay in "
        f"{'pinned ' if device.type == 'cuda' else ''}CPU RAM and are copied to {device.type} for each forward "
        "(the planner's last knob: expect slower steps)")
    return streamer
