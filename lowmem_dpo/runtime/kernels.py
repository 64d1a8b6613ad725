"""Optional fused kernels, imported lazily and checked before the first step: TRL 1.16's LM-head kernel on CUDA
(`pip install 'lowmem_dpo[kernels]'`), which head.FUSED runs in place of the torch-op tiles.

    kernel, why = fused_head(device)   # the kernel, or None and why not (on CUDA)

A kernel is used only where it is known to run: TRL 1.16 importable, Triton there, a card of compute capability
MIN_CAPABILITY or more (Triton's supported NVIDIA cards), and a probe (a forward and a backward on a few rows, at
bring-up: Triton compiles its kernels then, not inside step 1's backward) that gives the torch log-probs and
gradient. Anywhere else the same tiles run in torch ops (model/head.py), and the line says why.
"""

from __future__ import annotations

import torch

FUSED_HEAD_TILE = (4096, 32768)  # its tile: trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE x the chunk_size passed
MIN_CAPABILITY = (8, 0)  # Triton's supported NVIDIA cards (its README: compute capability 8.0+)
PROBE_TOLERANCE = 1e-3  # the probe's float32 log-probs and gradient against torch's, max abs
_FUSED_HEAD: dict = {}


def trl_head_kernel():
    """TRL 1.16's chunked log-prob function (trl.kernels.chunked_logprob: 4096-token x 32,768-entry tiles, an online
    logsumexp folded by a Triton kernel on CUDA, by torch ops elsewhere), as
    f(h, weight, bias, labels, scale, softcap, weighting) -> ((M,) float32 log-probs, (M,) WPO's aligned log-probs
    or None); None where TRL is not installed at that version."""
    try:
        import trl
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except Exception:  # not installed, or a build that does not import here
        return None
    if not trl.__version__.startswith("1.16."):  # its signature is TRL's own: the one read here
        return None

    def head(h, weight, bias, labels, scale: float, softcap: float | None, weighting: bool):
        tokens, entries = FUSED_HEAD_TILE
        outputs = ("log_sum_sq_probs",) if weighting else ()
        # Saves memory: a call per 4096 rows, so its float32 gradient accumulator is (4096, H), not (M, H); split,
        # so that one concatenation builds h's gradient (slices would each make an (M, H) one; the plan counts the
        # parts and the concatenation: memory/activations.py's logits_train_bytes)
        parts = [ChunkedLogProbFunction.apply(hc, weight, bias, lc, 1.0, entries, softcap, scale, outputs)
                 for hc, lc in zip(h.split(tokens), labels.split(tokens))]
        if not parts:
            return h.new_zeros(0, dtype=torch.float32), (h.new_zeros(0, dtype=torch.float32) if weighting else None)
        logp = torch.cat([p[0] for p in parts])  # (M,)
        return logp, (logp - torch.cat([p[2] for p in parts])).detach() if weighting else None

    return head


def probe(kernel, device: torch.device) -> str | None:
    """Why `kernel` cannot stand in for the torch head on `device`, or None: a forward and a backward of 16 rows
    against a 256-entry head in float32, against log_softmax's log-probs and gradient."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(16, 64, generator=g).to(device).requires_grad_()  # (16, 64)
    weight = torch.randn(256, 64, generator=g).to(device) / 8  # (256, 64)
    labels = torch.randint(0, 256, (16,), generator=g).to(device)  # (16,)
    try:
        got = kernel(h, weight, None, labels, 1.0, None, False)[0]  # (16,)
        (grad,) = torch.autograd.grad(got.sum(), h)
    except Exception as e:  # a kernel that does not compile or launch on this card
        return f"it fails here ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    want = torch.log_softmax(h.float() @ weight.t(), dim=-1).gather(1, labels[:, None])[:, 0]  # (16,)
    (want_grad,) = torch.autograd.grad(want.sum(), h)
    off = max(float((got - want).abs().max()), float((grad - want_grad).abs().max()))
    return None if off <= PROBE_TOLERANCE else (f"its probe is {off:.3g} off torch's log-probs (tolerance "
                                                f"{PROBE_TOLERANCE:g})")


def why_not_fused(device: torch.device) -> tuple[object, str | None]:
    """(TRL's kernel, None) where it runs on this CUDA device, else (None, why not)."""
    from transformers.utils import is_triton_available

    if not is_triton_available():
        return None, "Triton is not installed"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return None, (f"this card's compute capability {capability[0]}.{capability[1]} is below Triton's "
                      f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}")
    kernel = trl_head_kernel()
    if kernel is None:
        return None, "TRL 1.16 is not installed (pip install 'lowmem_dpo[kernels]')"
    problem = probe(kernel, device)
    return (None, problem) if problem else (kernel, None)


def fused_head(device: torch.device) -> tuple[object, str | None]:
    """(the fused LM-head kernel for `device`, None) where it runs there, else (None, why not on CUDA; None off
    it), decided once per process (why_not_fused)."""
    if device.type != "cuda":
        return None, None
    if "head" not in _FUSED_HEAD:
        _FUSED_HEAD["head"] = why_not_fused(device)
    return _FUSED_HEAD["head"]
