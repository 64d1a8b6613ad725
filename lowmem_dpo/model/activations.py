"""Where a long sequence's activations live: the MLP run in tiles over the sequence, and the tensors the forward
saves for backward offloaded to pinned host memory (activation_offloading). Both change no number beyond rounding;
both are for sequences of thousands of tokens on a card that holds the weights but not the activations.

    tile_mlps(model, "mlp", "model.layers")          # every decoder layer's MLP, MLP_TILE_TOKENS at a time
    offload_activations(model, device)               # the backbone's saved tensors to host memory (CUDA)

Tiles. A decoder MLP works on each token alone (gate, up, act, down per position), so it can run on a few
thousand tokens at a time and its (N, T, I) intermediates exist for one tile only. With gradients each tile is
checkpointed (non-reentrant), so the backward recomputes one tile at a time: inside a checkpointed layer's
recompute, the layer's peak then holds one tile's MLP, not the sequence's (memory/model.py counts it). Only forwards
longer than a tile are tiled. With lora_dropout > 0 each tile draws its own dropout mask (another draw of the same
distribution).

Offloading. Every tensor the backbone's forward saves for backward (with gradient checkpointing: each layer's
input and the final norm's input; the position embeddings and mask go to the checkpointed call as keywords, and
stay), at least OFFLOAD_MIN_BYTES and not a weight, is copied to pinned host memory on a side stream as the forward
leaves it (once, when several ops save it), and its device memory is released once the copy is done. In backward
each comes back when autograd asks for it, the next one (the layer below) prefetched on the side stream meanwhile,
so the copy overlaps the layer's recompute. A new forward with gradients drops what an earlier one left (a backward
that raised). Off CUDA the activations are in host memory already: nothing moves (tests force the copies through
the same bookkeeping).

Kernels. Which scaled_dot_product_attention kernel a batch gets (math, flash, memory-efficient) decides whether
the T x T scores exist: sdpa_kernel asks torch's own dispatcher, and headcheck logs the answer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from lowmem_dpo.model.logps import causal_lm
from lowmem_dpo.runtime import devices

# Tokens (over the batch's sequences) per MLP tile. 4096 x I=14336 x 2 bytes = 112 MiB per intermediate at 7B-8B
# widths; below that, kernel launches start to show.
MLP_TILE_TOKENS = 4096
# Saved tensors smaller than this stay where they are: copying a few KiB costs more than it saves.
OFFLOAD_MIN_BYTES = 1 << 20


# -- the MLP in tiles ----------------------------------------------------------------------------------------------
def _tiled(forward, tokens: int, grad_tiles: bool, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """forward(x) on the sequence (dim 1 of x: (N, T, H)) in tiles of tokens // N positions, concatenated; with
    gradients, each tile checkpointed, or (grad_tiles off) untiled."""
    grad = torch.is_grad_enabled()
    if args or kwargs or x.dim() != 3 or (grad and not grad_tiles):
        return forward(x, *args, **kwargs)
    n, t = x.shape[:2]
    step = max(1, tokens // n)
    if t <= step:
        return forward(x)
    def tile(part: torch.Tensor) -> torch.Tensor:
        return forward(part.contiguous())  # some MLPs view their input flat (GPT-2's Conv1D); the copy is a tile's

    # Checkpointed, a tile keeps its input as a view of x (no copy) and recomputes the rest in backward.
    outs = [checkpoint(tile, x[:, i:i + step], use_reentrant=False) if grad else tile(x[:, i:i + step])
            for i in range(0, t, step)]  # each (N, step, H)
    return torch.cat(outs, dim=1)  # (N, T, H)


def tile_mlps(model: torch.nn.Module, block: str, prefix: str, grad_tiles: bool = True,
              tokens: int = MLP_TILE_TOKENS) -> int:
    """Run the MLP block `block` (arch.Arch.mlp_block, e.g. "mlp") of every decoder layer of the ModuleList at
    `prefix` (arch.Arch.layers_prefix) in tiles of `tokens` tokens: without gradients always, with gradients when
    `grad_tiles` (train with gradient checkpointing: the recompute's peak; without it, tiling would add an MLP
    recompute for little). Returns the MLPs tiled (0 when the layers have no such block)."""
    layers = causal_lm(model).get_submodule(prefix)
    n = 0
    for layer in layers:
        mlp = getattr(layer, block, None) if block else None
        if not isinstance(mlp, torch.nn.Module) or getattr(mlp, "_lowmem_dpo_tiled", False):
            continue
        mlp.forward = functools.partial(_tiled, mlp.forward, tokens, grad_tiles)  # the instance's, not the class's
        mlp._lowmem_dpo_tiled = True
        n += 1
    return n


# -- saved tensors to host memory ---------------------------------------------------------------------------------
@dataclass
class Saved:
    """One offloaded tensor: its host copy, how often the forward saved it, and while it is back on the device, the
    device copy and the event of the copy back."""

    host: torch.Tensor
    saves: int = 1  # the same tensor saved by several ops (a norm's input by pow and mul) is copied once
    unpacked: int = 0
    device_tensor: torch.Tensor | None = None  # prefetched or in use: back from the host
    event: object = None  # the side stream's event after the copy back (None off CUDA)

    @property
    def consumed(self) -> bool:
        return self.unpacked >= self.saves


class Offloader:
    """saved_tensors_hooks that move the saved tensors of one forward to host memory and back (module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, min_bytes: int = OFFLOAD_MIN_BYTES,
                 force: bool = False):
        self.device, self.min_bytes, self.force = device, min_bytes, force
        self.weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.stream = devices.side_stream(device)
        self.saved: dict[int, Saved] = {}
        self.keys: dict[tuple, tuple] = {}  # a saved tensor's identity -> (a weak reference to it, its key)
        self.ids = itertools.count()
        self.hooks = None
        self.end_queued = False
        self.packed = 0  # tensors copied to the host, in all (tests read it)
        self.fetched = 0  # copies back to the device, in all

    # the forward
    def moves(self, t: torch.Tensor) -> bool:
        """Whether a saved tensor goes to host memory: an activation (not a weight, nor a view of one), large
        enough, on the device (or any tensor when forced)."""
        if type(t) is not torch.Tensor or t.numel() * t.element_size() < self.min_bytes:
            return False  # a Parameter (or a quantized weight's subclass), or too small
        if t.untyped_storage().data_ptr() in self.weights:
            return False
        return self.force or t.device.type == "cuda"

    def pack(self, t: torch.Tensor):
        if not self.moves(t):
            return t
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        ref, key = self.keys.get(ident, (None, None))
        if ref is not None and ref() is not None:  # the same tensor, alive, saved again by another op: one copy
            self.saved[key].saves += 1  # (a dead one's memory may hold another tensor now: a new entry then)
            return key
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda")  # t's shape, contiguous
        written = devices.mark(self.device)  # on the compute stream, after the kernel that writes t (not inside
        with devices.on_stream(self.stream):  # on_stream: there it would mark the side stream, which waits on itself)
            devices.wait(written, self.stream)
            devices.copy_async(host, t, hold_src=True)  # t's memory is freed before the copy has run
        key = next(self.ids)
        self.keys[ident] = (weakref.ref(t), key)
        self.saved[key] = Saved(host)
        self.packed += 1
        return key

    # the backward
    def unpack(self, key):
        if not isinstance(key, int):
            return key
        if not self.end_queued:  # the host copies go when the whole backward is done
            torch.autograd.Variable._execution_engine.queue_callback(self.reset)
            self.end_queued = True
        s = self.saved.get(key)
        if s is None:
            raise RuntimeError("activation offloading: this backward needs a tensor saved by a forward before the last "
                               "one with gradients, which the offloader has dropped; set activation_offloading=false")
        if s.device_tensor is None:
            self._fetch(s)
        out = s.device_tensor
        devices.wait(s.event, device=self.device)  # the compute stream waits for the copy back
        s.unpacked += 1
        if s.consumed:
            s.device_tensor, s.event = None, None  # autograd holds it now
        below = max((k for k, other in self.saved.items()
                     if k < key and other.device_tensor is None and not other.consumed), default=None)
        if below is not None:
            self._fetch(self.saved[below])  # the next one the backward reaches, while this layer computes
        return out

    def _fetch(self, s: Saved) -> None:
        """Start copying a saved tensor back to the device (allocated on the compute stream, which the side stream
        waits for: a reused block is never written while a kernel still reads it; the side stream's copies run in
        order, so a copy to the host still in flight ends before this one starts)."""
        out = torch.empty(s.host.shape, dtype=s.host.dtype, device=self.device)
        free = devices.mark(self.device)  # on the compute stream: after every queued reader of out's reused block
        with devices.on_stream(self.stream):
            devices.wait(free, self.stream)
            devices.copy_async(out, s.host)
        s.device_tensor, s.event = out, devices.mark(self.device, self.stream)
        self.fetched += 1

    def reset(self) -> None:
        """Forget every offloaded tensor (a backward's end, or a forward whose backward never ran or raised)."""
        for s in self.saved.values():  # a prefetched copy not used: its memory goes once the copy is done
            devices.wait(s.event, device=self.device)
        self.saved.clear()
        self.keys.clear()
        self.end_queued = False

    # the backbone's forward, through module hooks
    def enter(self, *_) -> None:
        if not torch.is_grad_enabled():
            return
        # A new forward with gradients: what an earlier one saved is gone or never needed again (its backward ran,
        # raised before its end, or never ran: an out-of-memory retry)
        self.reset()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()

    def leave(self, *_) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None
        self.keys.clear()  # the identities are valid within one forward


def offload_activations(model: torch.nn.Module, device: torch.device, force: bool = False) -> Offloader:
    """Offload what the backbone of `model` (its decoder, LM head excepted) saves for backward, in every forward
    with gradients. `force`: copy on a CPU too (tests: the bookkeeping without a GPU)."""
    lm = causal_lm(model)
    backbone = getattr(lm, lm.base_model_prefix)
    offloader = Offloader(model, device, force=force)
    backbone.register_forward_pre_hook(offloader.enter)
    backbone.register_forward_hook(offloader.leave, always_call=True)  # also when the forward raises
    return offloader


# -- attention kernels -------------------------------------------------------------------------------------------
SDPA_KERNELS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "device's own"}


def sdpa_kernel(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                enable_gqa: bool = False) -> str:
    """The kernel torch's scaled_dot_product_attention runs for these arguments (torch._fused_sdp_choice, torch's
    own dispatcher: a private function, so "unknown" when it is missing or refuses them)."""
    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    except Exception:  # noqa: BLE001 - a private function: any failure means we cannot tell
        return "unknown"
    return SDPA_KERNELS.get(int(choice), "unknown")


class FirstCall(Exception):
    """sdpa_calls(stop=True) ends the forward at the first attention call: the probe needs its arguments only."""


@contextlib.contextmanager
def sdpa_calls(stop: bool = False):
    """The arguments of every torch.nn.functional.scaled_dot_product_attention call in the block (transformers looks
    the function up at each call), as dicts: the kernel probe's input. stop: raise FirstCall at the first call, so
    that a probe costs the embeddings and one layer's projections, not a forward (the caller catches it)."""
    real = torch.nn.functional.scaled_dot_product_attention
    seen: list[dict] = []

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append(dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))
        if stop:
            raise FirstCall
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
