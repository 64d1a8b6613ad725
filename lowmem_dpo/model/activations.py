"""Where a long sequence's activations live: the MLP run in tiles over the sequence, and the tensors the forward
saves for backward offloaded to pinned host memory (activation_offloading). Both change no number beyond rounding;
both are for sequences of thousands of tokens on a card that holds the weights but not the activations.

    tile_mlps(model, "mlp", "model.layers")          # every decoder layer's MLP, MLP_TILE_TOKENS at a time
    probe_recompute_stop(model, tiled, autocast)     # with gradients: skip the MLP in a layer's recompute
    offload_activations(model, device)               # the backbone's saved tensors to host memory (CUDA)

Tiles. A decoder MLP works on each token alone, so it can run on a few thousand tokens at a time, its (N*T, I)
intermediates existing for one tile only. With gradients (train, where the plan needs it: memory/search.py) the
forward runs the tiles without gradients and the backward recomputes them one at a time (_TiledMLPFunction): two
passes per step, as an untiled MLP in a checkpointed layer, the backward's peak one tile's (memory/activations.py). A
checkpointed layer's recompute, which torch stops once it has the layer's saved tensors, skips the MLP: its output
is never read there, where nothing after the MLP saves a tensor (probe_recompute_stop asks once; else a third
pass). Only forwards longer than a tile are tiled. With lora_dropout > 0 the backward draws the forward's masks.

Offloading. Every tensor the backbone's forward saves for backward (with gradient checkpointing: each layer's
input and the final norm's input; the position embeddings and mask go to the checkpointed call as keywords, and
stay), at least OFFLOAD_MIN_BYTES and not a weight, is copied to pinned host memory on a side stream as the forward
leaves it (once, when several ops save it), and its device memory is released once the copy is done. In backward
each comes back when autograd asks for it, the next one (the layer below) prefetched on the side stream meanwhile,
so the copy overlaps the layer's recompute. A new forward with gradients drops what an earlier one left (a backward
that raised). Off CUDA the activations are in host memory already: nothing moves (tests force the copies through
the same bookkeeping).

Kernels: which attention kernel a batch gets, whether the T x T scores exist, is sdpa.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass

import torch

from lowmem_dpo.model import compute_copies
from lowmem_dpo.model.logps import causal_lm
from lowmem_dpo.runtime import devices

# Tokens (over the batch's sequences) per MLP tile. 4096 x I=14336 x 2 bytes = 112 MiB per intermediate at 7B-8B
# widths; below that, kernel launches start to show.
MLP_TILE_TOKENS = 4096
# Saved tensors smaller than this stay where they are: copying a few KiB costs more than it saves.
OFFLOAD_MIN_BYTES = 1 << 20


# -- the MLP in tiles ----------------------------------------------------------------------------------------------
_RECOMPUTING = threading.local()  # .depth: how deep this thread is in checkpointed layers' recomputes


class RecomputedPastMLP(RuntimeError):
    """A checkpointed layer's recompute went on past an MLP that skipped its forward there (probe_recompute_stop)."""


class _Recompute:
    """The context of one checkpointed layer's recompute (checkpoint_contexts' second context manager)."""

    def __enter__(self):
        _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1

    def __exit__(self, *exc):
        _RECOMPUTING.depth -= 1
        return False


def checkpoint_contexts():
    """context_fn for torch.utils.checkpoint (use_reentrant=False; policy.enable_checkpointing passes it through
    transformers): the forward as it is, the recompute marked, so that a TiledMLP knows it runs there."""
    return contextlib.nullcontext(), _Recompute()


class TiledMLP:
    """A decoder MLP's forward over its (N, T, H) input in tiles of `tokens` rows of the flattened (N*T, H): an MLP
    works on each token alone. Without gradients the tiles run one after the other into one output. With
    gradients (grad_tiles), _TiledMLPFunction runs them without gradients in the forward and again, one tile at a
    time with gradients, in the backward: two passes of the MLP per step, the recompute's peak one tile's."""

    def __init__(self, mlp: torch.nn.Module, forward, tokens: int, grad_tiles: bool):
        self.mlp, self.forward, self.tokens, self.grad_tiles = mlp, forward, tokens, grad_tiles
        self.skip_in_recompute = False  # in a checkpointed layer's recompute (probe_recompute_stop sets it)

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        if args or kwargs or x.dim() != 3:
            return self.forward(x, *args, **kwargs)
        grad = torch.is_grad_enabled()
        if x.shape[0] * x.shape[1] <= self.tokens or (grad and not self.grad_tiles):
            return self.forward(x)
        if not grad:
            return self.run(x)
        params = [p for p in self.mlp.parameters() if p.requires_grad]  # the LoRA weights: their gradients
        out = _TiledMLPFunction.apply(self, x, *params)
        if out.device.type == "meta":
            # Skipped in a checkpointed layer's recompute, which torch stops (its private _StopRecomputationError,
            # out of apply) once it has every tensor the layer's forward saved: this one was not the last
            raise RecomputedPastMLP("a checkpointed decoder layer's recompute goes on past its MLP (the layer saves "
                                    "tensors after it): probe_recompute_stop should have said so before training")
        return out

    def tiles(self, rows: int):
        return [(a, min(a + self.tokens, rows)) for a in range(0, rows, self.tokens)]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP on x (N, T, H) tile by tile, each tile's output copied into one (N, T, H_out) tensor (never the
        tiles' outputs and their concatenation at once)."""
        flat = x.reshape(1, -1, x.shape[-1])  # (1, N*T, H): each tile a contiguous view (a copy if x is strided)
        out = None
        for a, b in self.tiles(flat.shape[1]):
            part = self.forward(flat[:, a:b])  # (1, b - a, H_out)
            if out is None:
                out = part.new_empty(flat.shape[1], part.shape[-1])  # (N*T, H_out)
            out[a:b] = part[0]
        return out.view(*x.shape[:-1], out.shape[-1])  # (N, T, H_out)


class _TiledMLPFunction(torch.autograd.Function):
    """TiledMLP with gradients: the forward keeps only the MLP's input; the backward recomputes each tile with
    gradients, returns the input's gradient and adds the weights' into their .grad (the tensors the forward reads:
    the LoRA weights, or their compute copies), the tiles' summed in float32 and rounded once, as the untiled
    MLP's. The trainable parameters are inputs so that the output needs a gradient even when x needs none.
    Dropout draws the forward's masks again (the RNG state restored) under the forward's autocast."""

    @staticmethod
    def forward(ctx, tiler: TiledMLP, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.tiler, ctx.params = tiler, params
        ctx.save_for_backward(x)
        if getattr(_RECOMPUTING, "depth", 0) and tiler.skip_in_recompute:
            # a checkpointed layer's recompute, which stops at this save (else TiledMLP raises): the output is
            # never read
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        device = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        dropout = any(isinstance(module, torch.nn.Dropout) and module.training and module.p > 0
                      for module in tiler.mlp.modules())
        ctx.rng = devices.rng_state(x.device) if dropout else None
        with torch.no_grad():
            return tiler.run(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        tiler = ctx.tiler
        wants_x = ctx.needs_input_grad[1]
        flat = x.detach().reshape(-1, x.shape[-1])  # (N*T, H)
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # (N*T, H_out)
        grad_x = torch.empty_like(flat) if wants_x else None  # (N*T, H)
        leaves = [compute_copies.read_by_forward(p) for p in ctx.params]  # what the MLP's forward reads
        sums: list[torch.Tensor | None] = [None] * len(leaves)  # float32: the tiles' gradients, each rounded once
        enabled, dtype = ctx.autocast
        with (devices.restored_rng(x.device, ctx.rng), torch.autocast(x.device.type, dtype=dtype, enabled=enabled),
              torch.enable_grad()):
            for a, b in tiler.tiles(flat.shape[0]):
                part = flat[a:b].detach().requires_grad_(wants_x)  # (b - a, H), a view of x
                out = tiler.forward(part.unsqueeze(0))  # (1, b - a, H_out)
                got = torch.autograd.grad(out, ([part] if wants_x else []) + leaves,
                                          grad_flat[a:b].unsqueeze(0), allow_unused=True)
                if wants_x:
                    grad_x[a:b] = got[0]
                    got = got[1:]
                for i, g in enumerate(got):
                    if g is not None:
                        sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
        for leaf, total in zip(leaves, sums):  # into .grad, as autograd's AccumulateGrad would
            if total is not None:
                total = total.to(leaf.dtype)
                leaf.grad = total if leaf.grad is None else leaf.grad.add_(total)
        return None, (grad_x.view_as(x) if wants_x else None), *(None for _ in ctx.params)


def tile_mlps(model: torch.nn.Module, block: str, prefix: str, grad_tiles: bool = True,
              tokens: int = MLP_TILE_TOKENS) -> list[TiledMLP]:
    """Run the MLP block `block` (arch.Arch.mlp_block, e.g. "mlp") of every decoder layer of the ModuleList at
    `prefix` (arch.Arch.layers_prefix) in tiles of `tokens` tokens (TiledMLP): without gradients always, with
    gradients when `grad_tiles` (train with gradient checkpointing, where the plan needs the recompute's peak
    lower: memory.search). Returns the tiled MLPs' TiledMLP (none when the layers have no such block)."""
    layers = causal_lm(model).get_submodule(prefix)
    tiled = []
    for layer in layers:
        mlp = getattr(layer, block, None) if block else None
        if not isinstance(mlp, torch.nn.Module) or isinstance(mlp.forward, TiledMLP):
            continue
        mlp.forward = TiledMLP(mlp, mlp.forward, tokens, grad_tiles)  # the instance's forward, not the class's
        tiled.append(mlp.forward)
    return tiled


def probe_recompute_stop(model: torch.nn.Module, tiled: list[TiledMLP], forward_context) -> bool:
    """Whether each checkpointed decoder layer's recompute stops at its tiled MLP, which then skips its forward
    there (TiledMLP.skip_in_recompute, set to the answer): two positions, tiles of one, forward and backward under
    `forward_context` (the stage's autocast), the RNG left as it was, no .grad left (it runs before training).
    It does where nothing after the MLP saves a tensor for backward (Llama, Mistral, Qwen: a residual add); a norm
    after the MLP (Gemma2's post_feedforward_layernorm) needs the MLP's output there: 3 MLP passes per step then."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not tiled or not params:
        return False
    lm = causal_lm(model)
    backbone = getattr(lm, lm.base_model_prefix)
    embedding = lm.get_input_embeddings().weight
    kept = [(t.tokens, t.grad_tiles) for t in tiled]
    for t in tiled:
        t.tokens, t.grad_tiles, t.skip_in_recompute = 1, True, True
    ids = torch.zeros(1, 2, dtype=torch.long, device=embedding.device)  # (1, 2)
    cuda = [embedding.device] if embedding.device.type == "cuda" else []
    modes = {module: module.training for module in model.modules()}
    model.train()  # transformers checkpoints a layer only in train mode: the probe's point
    try:
        with torch.random.fork_rng(devices=cuda), torch.enable_grad(), forward_context:
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state  # (1, 2, H)
            torch.autograd.grad(hidden.float().sum(), params, allow_unused=True)
        stops = True
    except RecomputedPastMLP:
        stops = False
    for module, training in modes.items():
        module.training = training
    for p in params:  # what the tiles' backward added into .grad
        p.grad = None
    for t, (tokens, grad_tiles) in zip(tiled, kept):
        t.tokens, t.grad_tiles, t.skip_in_recompute = tokens, grad_tiles, stops
    return stops


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
        if compute_copies.is_copy(t):  # a LoRA weight's 16-bit copy: a weight, not a Parameter
            return False
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
        saved = self.saved.get(key)
        if saved is None:
            raise RuntimeError("activation offloading: this backward needs a tensor saved by a forward before the last "
                               "one with gradients, which the offloader has dropped; set activation_offloading=false")
        if saved.device_tensor is None:
            self._fetch(saved)
        out = saved.device_tensor
        devices.wait(saved.event, device=self.device)  # the compute stream waits for the copy back
        saved.unpacked += 1
        if saved.consumed:
            saved.device_tensor, saved.event = None, None  # autograd holds it now
        below = max((k for k, other in self.saved.items()
                     if k < key and other.device_tensor is None and not other.consumed), default=None)
        if below is not None:
            self._fetch(self.saved[below])  # the next one the backward reaches, while this layer computes
        return out

    def _fetch(self, saved: Saved) -> None:
        """Start copying a saved tensor back to the device (allocated on the compute stream, which the side stream
        waits for: a reused block is never written while a kernel still reads it; the side stream's copies run in
        order, so a copy to the host still in flight ends before this one starts)."""
        out = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=self.device)
        free = devices.mark(self.device)  # on the compute stream: after every queued reader of out's reused block
        with devices.on_stream(self.stream):
            devices.wait(free, self.stream)
            devices.copy_async(out, saved.host)
        saved.device_tensor, saved.event = out, devices.mark(self.device, self.stream)
        self.fetched += 1

    def reset(self) -> None:
        """Forget every offloaded tensor (a backward's end, or a forward whose backward never ran or raised)."""
        for saved in self.saved.values():  # a prefetched copy not used: its memory goes once the copy is done
            devices.wait(saved.event, device=self.device)
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
