"""Padding-free micro-batches (padding_free): a micro-batch's sequences run as one row, one after another, with
no padding (data.Packed), and each token attends only within its own sequence.

    problem(model, max_length)   # why this model cannot run packed rows, or None
    enable(model)                # its attention through `attention` below, for the rest of the run
    logps.completion_logps(model, data.collate(pairs, pad_id, packed=True))   # the backbone gets Packed.kwargs()

The attention is torch's SDPA, called once per sequence on its own slice of the row, causal: each sequence's
keys are its own, so the work is each sequence's T_i^2, where a padded batch computes every row at the longest T
and a block-diagonal mask over the whole row would compute S^2. A shared row ([prompt, chosen, rejected]:
data.collate_shared) runs [prompt, chosen] causal, and [prompt, rejected] causal with only the rejected queries
kept: rejected sees the prompt and itself, as the padded shared row's mask says, with no (T, T) mask at all.

`attention` is registered in transformers' AttentionInterface under NAME, and the model's attention
implementation is set to it once (enable): a forward with `sequence_bounds` (a packed row) runs per sequence, any
other forward (the eval's padded batches, generation) runs transformers' own SDPA with its own masks, the same
call the model made before. The implementation is set for the whole run, not per forward: a checkpointed layer's
backward recomputes its forward outside any context a forward could set, and must take the same path.

A model qualifies where its attention classes call AttentionInterface (transformers' own test of
`set_attn_implementation`), its attention is SDPA, and no sliding window is shorter than a sequence can be; the
stage then checks on its first pairs that the packed forward gives the padded one's log-probs
(headcheck.decide_packing), which catches what the structure cannot show (ALiBi, a layer that mixes tokens
outside attention).
"""

from __future__ import annotations

import torch

from lowmem_dpo.model.logps import PACKED_ATTENTION as NAME  # its name in transformers' AttentionInterface

_registered: list[bool] = []
GQA_SDPA = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)  # enable_gqa


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' attention call (query (1, Hq, S, D), key and value (1, Hkv, S, D)) over a packed row:
    SDPA per sequence between consecutive `sequence_bounds`; a shared row's (its `shared_splits` entry: the ends of
    its prompt and of its chosen, from its start) as [prompt, chosen] and [prompt, rejected]. Returns (1, S, Hq, D)
    and no weights. Without sequence_bounds: transformers' own SDPA.

    Its signature is transformers' AttentionInterface's: the layer passes dropout, scaling, is_causal and the
    backbone's own keywords (Packed.kwargs: sequence_bounds, shared_splits) in kwargs."""
    from transformers.integrations import sdpa_attention

    dropout, scaling, is_causal = kwargs.pop("dropout", 0.0), kwargs.pop("scaling", None), kwargs.pop("is_causal", None)
    sequence_bounds, shared_splits = kwargs.pop("sequence_bounds", None), kwargs.pop("shared_splits", None)

    if sequence_bounds is None:
        return sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                     scaling=scaling, is_causal=is_causal, **kwargs)
    sdpa = torch.nn.functional.scaled_dot_product_attention  # looked up at the call (sdpa.py's sdpa_calls)
    p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    # grouped-query k and v repeated to every query head where transformers' SDPA would repeat them: torch before
    # 2.5, or a card whose SDPA would run its math kernel with enable_gqa (models.repeat_kv_heads sets that)
    if gqa and not (GQA_SDPA and sdpa_attention.use_gqa_in_sdpa(None, key, value)):
        groups = query.shape[1] // key.shape[1]
        key, value, gqa = sdpa_attention.repeat_kv(key, groups), sdpa_attention.repeat_kv(value, groups), False
    outs = []
    for i, (a, b) in enumerate(zip(sequence_bounds[:-1], sequence_bounds[1:])):
        q, k, v = query[:, :, a:b], key[:, :, a:b], value[:, :, a:b]  # (1, H, T_i, D)
        if shared_splits is None:
            outs.append(sdpa(q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa))
            continue
        n, c = shared_splits[i]  # the prompt ends at n, chosen at c, rejected at b - a
        outs.append(sdpa(q[:, :, :c], k[:, :, :c], v[:, :, :c], dropout_p=p, is_causal=True, scale=scaling,
                         enable_gqa=gqa))  # (1, H, c, D): [prompt, chosen]
        if c < b - a:  # [prompt, rejected] causal; the prompt's queries' outputs are chosen's above, not these
            both = [torch.cat([t[:, :, :n], t[:, :, c:]], dim=2) for t in (q, k, v)]  # (1, H, n + r, D) each
            outs.append(sdpa(*both, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)[:, :, n:])
    return torch.cat(outs, dim=2).transpose(1, 2), None  # (1, S, Hq, D)


def register() -> None:
    """NAME in transformers' attention and mask interfaces (once per process): its masks are SDPA's."""
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    _registered.append(True)


def problem(lm, max_length: int, shared: bool = False) -> str | None:
    """Why the CausalLM `lm` cannot run packed rows of sequences up to max_length tokens (2 x max_length shared
    rows), or None."""
    impl = lm.config._attn_implementation
    if impl not in ("sdpa", NAME):
        return f"its attention implementation is {impl!r}; packed rows run on SDPA (attn_implementation=sdpa)"
    if not type(lm)._can_set_attn_implementation():
        return f"{type(lm).__name__}'s attention does not go through transformers' AttentionInterface"
    longest = 2 * max_length if shared else max_length
    windows = [getattr(lm.config, name, None) for name in ("sliding_window", "attention_chunk_size")]
    window = min((w for w in windows if isinstance(w, int) and w > 0), default=None)
    if window is not None and window < longest:
        return f"its attention window ({window} tokens) is shorter than a sequence can be ({longest})"
    return None


def enable(lm) -> None:
    """Run the CausalLM `lm`'s attention through `attention` from now on (module doc)."""
    register()
    lm.set_attn_implementation(NAME)


def disable(lm) -> None:
    """Back to transformers' SDPA (a model whose check failed)."""
    lm.set_attn_implementation("sdpa")

