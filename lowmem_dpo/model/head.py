"""The LM head of a frozen nn.Linear in (token, vocabulary) tiles: each row's log p(label) through an online
logsumexp, with no (rows, V) logits and no float32 tile kept for backward. Pure: tensors in, tensors out.

    logp, aligned = tiled_logps(h, lm_head.weight, lm_head.bias, labels, Tiling(head, weighting))  # (M,), (M,)|None

A tile is HEAD_TOKENS rows of hidden states against as many vocabulary entries as keep its float32 logits at
HEAD_TILE_ELEMENTS (64 MiB). The forward keeps each row's logsumexp; the backward recomputes each tile, turns it
into the logits' gradient in place, and accumulates the hidden states' gradient over the vocabulary in float32.
The matmuls run in the compute dtype (autocast's, else h's), the head's transform (logps.Head: scale, softcap),
the softmax and the sums in float32. TRL 1.16's DPOTrainer computes the same tiles (its fused LM head);
`FUSED` holds a kernel that does it in one pass per tile on a device, which a stage sets at model bring-up
(headcheck.bring_up: TRL's Triton kernel on CUDA, runtime.kernels.fused_head), where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# A fused kernel per device type, f(h, weight, bias, labels, scale, softcap, weighting) -> (log-probs, aligned);
# set by headcheck.bring_up (runtime.kernels.fused_head). None for a device type: tiled_logps in torch ops.
FUSED: dict[str, Callable] = {}

# The LM head's tiles: HEAD_TOKENS rows of hidden states at a time, against as many vocabulary entries as keep one
# tile of float32 logits at HEAD_TILE_ELEMENTS: 2^24 * 4 B = 64 MiB (4096 tokens x 4096 entries at a 128k
# vocabulary; one tile of the whole vocabulary for up to 2^24 / V tokens).
HEAD_TOKENS = 4096
HEAD_TILE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Tile:
    """An LM-head tile's size: `tokens` rows of hidden states x `entries` vocabulary entries; None: head_tile's
    defaults (tests pick small ones)."""

    tokens: int | None = None
    entries: int | None = None


@dataclass(frozen=True)
class Tiling:
    """What TiledLogps computes beyond its tensors: through `head`'s transform (logps.Head: scale, softcap), with
    weighting also WPO's aligned log-probs, in tiles of `tile`'s size."""

    head: object
    weighting: bool = False
    tile: Tile = Tile()


def head_tile(rows: int, vocab: int, tokens: int | None = None, entries: int | None = None) -> tuple[int, int]:
    """(rows, vocabulary entries) of one LM-head tile for `rows` hidden states (the memory model reads it too)."""
    c = max(1, min(rows, tokens or HEAD_TOKENS))
    return c, max(1, min(vocab, entries or HEAD_TILE_ELEMENTS // c))


def _logit_tile(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, start: int, end: int,
                dtype: torch.dtype) -> torch.Tensor:
    """lm_head's output for the vocabulary entries start:end, in the compute dtype: (c, H) -> (c, end - start)."""
    w = weight[start:end].to(dtype)  # (v, H): no copy when the weight is in the compute dtype already
    return torch.mm(h, w.t()) if bias is None else torch.addmm(bias[start:end].to(dtype), h, w.t())


def out_dtype_matmuls(version: str) -> bool:
    """Whether this torch (its version string) has torch.addmm's out_dtype (from 2.8): a 16-bit product summed in
    float32 on CUDA."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 8)


OUT_DTYPE = out_dtype_matmuls(torch.__version__)


def _add_product(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc + a @ b, (c, v) @ (v, H), accumulated in float32 over the vocabulary tiles: from the second tile on, no
    16-bit product is rounded before the sum (on CUDA with torch >= 2.8, addmm with a float32 output; elsewhere in
    float32). The first tile's product as it comes, in the compute dtype (with one tile, as a plain lm_head
    backward)."""
    if acc is None:
        return a @ b
    if acc.dtype != torch.float32:
        acc = acc.float()
    if a.is_cuda and a.dtype != torch.float32 and OUT_DTYPE:
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


class TiledLogps(torch.autograd.Function):
    """log p(label) of each row of h (M, H) through a frozen nn.Linear LM head (weight (V, H), bias) and the `tiling`
    head's transform (logps.Head), in tiles of its tile's size with an online logsumexp: (M,) float32, and with its
    weighting WPO's aligned log-probs (M,), detached (else None). No (rows, V) logits, and none
    in float32 beyond one tile. The backward recomputes each tile and accumulates the hidden states' gradient over the
    vocabulary in float32. The matmuls run in the compute dtype (autocast's, else h's); the transform, the softmax
    and the sums in float32."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                tiling: Tiling):
        head, weighting = tiling.head, tiling.weighting
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        rows, vocab = h.shape[0], weight.shape[0]
        c, v = head_tile(rows, vocab, tiling.tile.tokens, tiling.tile.entries)
        logp = torch.empty(rows, dtype=torch.float32, device=h.device)  # (M,)
        lse = torch.empty_like(logp)  # (M,) logsumexp of each row's logits
        aligned = torch.empty_like(logp) if weighting else None  # (M,) WPO's log p(label) - log sum_v p(v)^2
        for a in range(0, rows, c):
            hc, lab = h[a:a + c].to(dtype), labels[a:a + c]  # (c, H), (c,)
            top = total = squares = target = None  # (c,) each: running max, sum of exp(z - top), of exp(2(z - top))
            for s in range(0, vocab, v):
                z = head.apply_(_logit_tile(hc, weight, bias, s, s + v, dtype).float())  # (c, v) float32
                picked = z.gather(1, (lab - s).clamp(0, z.shape[1] - 1)[:, None])[:, 0]  # (c,)
                target = picked if target is None else torch.where((lab >= s) & (lab < s + v), picked, target)
                tile_top = z.amax(1)  # (c,)
                if top is not None:
                    tile_top = torch.maximum(top, tile_top)
                e = z.sub_(tile_top[:, None]).exp_()  # (c, v) in place: z is not needed again
                tile_squares = torch.linalg.vector_norm(e, dim=1).square() if weighting else None  # (c,), no tile
                if top is None:
                    total, squares = e.sum(1), tile_squares
                else:
                    rescale = torch.exp(top - tile_top)  # (c,)
                    total = total * rescale + e.sum(1)
                    if weighting:
                        squares = squares * rescale * rescale + tile_squares
                top = tile_top
                del z, e  # Saves memory: this tile goes before the next one is computed (one tile at a time)
            lse[a:a + c] = top + torch.log(total)
            logp[a:a + c] = target - lse[a:a + c]
            if weighting:  # log sum_v p(v)^2 = log sum_v exp(2 z_v) - 2 lse = 2 top + log squares - 2 lse
                aligned[a:a + c] = logp[a:a + c] - (2 * top + torch.log(squares) - 2 * lse[a:a + c])
        ctx.save_for_backward(h, weight, bias, labels, lse)
        ctx.head, ctx.tile, ctx.dtype = head, (c, v), dtype
        if weighting:
            ctx.mark_non_differentiable(aligned)
        return logp, aligned

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _aligned=None):
        h, weight, bias, labels, lse = ctx.saved_tensors
        head, (c, v), dtype = ctx.head, ctx.tile, ctx.dtype
        grad_h = torch.empty_like(h)  # (M, H)
        rows, vocab = h.shape[0], weight.shape[0]
        grad = grad.float()
        for a in range(0, rows, c):
            hc, lab, g = h[a:a + c].to(dtype), labels[a:a + c], grad[a:a + c]  # (c, H), (c,), (c,)
            acc = None  # (c, H): the gradient of these rows, over the vocabulary
            for s in range(0, vocab, v):
                z = head.apply_(_logit_tile(hc, weight, bias, s, s + v, dtype).float())  # (c, v) float32
                # d logp / dz = onehot(label) - softmax, times g: (c, v), in place over z where nothing reads z again
                gz = (z.sub(lse[a:a + c, None]) if head.softcap else z.sub_(lse[a:a + c, None])).exp_()
                gz.mul_(-g[:, None])
                inside = (lab >= s) & (lab < s + v)
                gz.scatter_add_(1, (lab - s).clamp(0, v - 1)[:, None], torch.where(inside, g, 0)[:, None])
                gy = head.grad_at(z, gz)  # (c, v) through the transform (softcap: read off z)
                del z, gz  # Saves memory: the float32 tile goes before its compute-dtype copy (one at a time)
                gy = gy.to(dtype)
                acc = _add_product(acc, gy, weight[s:s + v].to(dtype))  # (c, H)
                del gy
            grad_h[a:a + c] = acc
        return grad_h, None, None, None, None


tiled_logps = TiledLogps.apply  # (h, weight, bias, labels, tiling): every argument, in order
