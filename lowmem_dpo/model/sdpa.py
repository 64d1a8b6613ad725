"""Which scaled_dot_product_attention kernel a batch gets (math, flash, memory-efficient), which decides whether the
T x T scores exist: sdpa_kernel asks torch's own dispatcher, and headcheck logs the answer; sdpa_calls records the
arguments of the attention calls a forward makes, the probe's input.
"""

from __future__ import annotations

import contextlib

import torch

SDPA_KERNELS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "device's own"}
# torch.nn.functional.scaled_dot_product_attention's options after attn_mask, with its defaults
SDPA_OPTIONS = {"dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_kernel(query, key, value, attn_mask=None, **options) -> str:
    """The kernel torch's scaled_dot_product_attention runs for these arguments (torch._fused_sdp_choice, torch's
    own dispatcher: a private function, so "unknown" when it is missing or refuses them). It takes what
    scaled_dot_product_attention takes, its options (SDPA_OPTIONS) by keyword: a call sdpa_calls recorded."""
    options = {**SDPA_OPTIONS, **options}
    try:
        choice = torch._fused_sdp_choice(query, key, value, attn_mask, options["dropout_p"], options["is_causal"],
                                         scale=options["scale"], enable_gqa=options["enable_gqa"])
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

    # In scaled_dot_product_attention's place, it takes what that takes: the options after attn_mask by keyword
    # (SDPA_OPTIONS, as transformers and packing.attention pass them), each recorded with its default when unset
    def recording(query, key, value, attn_mask=None, **options):
        options = {**SDPA_OPTIONS, **options}
        seen.append(dict(query=query, key=key, value=value, attn_mask=attn_mask, **options))
        if stop:
            raise FirstCall
        return real(query, key, value, attn_mask=attn_mask, **options)

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        yield seen
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
