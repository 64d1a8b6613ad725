"""Completion log-probs: the one function precompute (reference) and train (policy) both use.

For each sequence: sum over completion tokens t of log p(x_t | x_<t), each token's in fp32, the sum in float64 in
a fixed order (sequence_sums). Prompt and padding positions contribute nothing. The LM head runs only on the
hidden states that predict a completion token, in (token, vocabulary) tiles with an online logsumexp (head.py),
so no [tokens, vocab] logits exist and backward recomputes each tile (at a 7B model's 32k-152k vocabulary, the full
[batch, seq, vocab] fp32 tensor would be the largest thing in memory); a LoRA-adapted head in checkpointed chunks.

The LM head is the model's own: `Head` is what its CausalLM forward does to lm_head's output (Gemma's
softcapping, Granite's logits_scaling, Cohere's logit_scale, Falcon-H1's lm_head_multiplier), read from the
config through the HEADS table of model types. For a model type not in the table `head_of` reads the same
attributes generically and says so; headcheck.check_head then compares this path with the model's own forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from lowmem_dpo.model.head import FUSED, HEAD_TILE_ELEMENTS, Tile, Tiling, tiled_logps


@dataclass
class SequenceLogps:
    """Per-sequence completion log-prob sums and completion token counts."""

    logps: torch.Tensor  # (N,) float64 (float32 on mps)
    n_tokens: torch.Tensor  # (N,) int64
    # with prompts=True (ORPO's NLL, which TRL takes over the prompt too): the chosen rows' prompt log-prob sums
    # and predicted prompt tokens (its first has no predictor), (B,) each; else None
    prompt_logps: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    aligned: torch.Tensor | None = None  # weighting=True: (N,) sums of WPO's aligned log-probs, detached
    tokens: list[torch.Tensor] | None = None  # per_token=True: each sequence's (n_tokens[i],) fp32 log-probs

    def split(self) -> tuple["SequenceLogps", "SequenceLogps"]:
        """Chosen half and rejected half of a concatenated [chosen; rejected] batch (the prompts' go with chosen)."""
        b = self.logps.shape[0] // 2
        aligned = (None, None) if self.aligned is None else (self.aligned[:b], self.aligned[b:])
        return (SequenceLogps(self.logps[:b], self.n_tokens[:b], self.prompt_logps, self.prompt_tokens, aligned[0]),
                SequenceLogps(self.logps[b:], self.n_tokens[b:], aligned=aligned[1]))


@dataclass(frozen=True)
class Head:
    """What a CausalLM's forward does to lm_head's output: logits = softcap(scale * lm_head(h)), where
    softcap(x) = c * tanh(x / c) (none when softcap is None). Applied in fp32."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """apply, in place on `logits` (no autograd: head.py's tiles)."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def grad_at(self, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient with respect to lm_head's output of `grad`, the gradient of apply's output `out`: times
        scale * (1 - (out / softcap)^2), tanh's derivative read off its output. In place on grad (and on out, which
        is not usable after)."""
        if self.softcap:
            grad.mul_(out.div_(self.softcap).square_().neg_().add_(1))
        return grad.mul_(self.scale) if self.scale != 1.0 else grad


def _plain(config) -> Head:
    return Head()


def _softcap(name: str) -> Callable[[object], Head]:
    return lambda config: Head(softcap=getattr(config, name, None) or None)


def _granite(config) -> Head:
    return Head(scale=1.0 / config.logits_scaling)  # logits / logits_scaling


def _times(name: str) -> Callable[[object], Head]:
    return lambda config: Head(scale=float(getattr(config, name)))


# model_type -> its head, each read off the CausalLM forward of transformers 5.x (what follows `self.lm_head(`).
# Plain: the backbone's last hidden state goes through lm_head and nothing else.
PLAIN = ("llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3",
         "phimoe", "gpt2", "gpt_neox", "gptj", "gpt_neo", "gpt_bigcode", "codegen", "bloom", "falcon", "mpt",
         "stablelm", "starcoder2", "gemma", "olmo", "olmo2", "olmo3", "olmoe", "deepseek_v2", "deepseek_v3", "glm",
         "glm4", "helium", "smollm3", "exaone4", "seed_oss", "apertus", "arcee", "ernie4_5", "nemotron",
         "persimmon", "gpt_oss", "dbrx", "opt")
HEADS: dict[str, Callable[[object], Head]] = {
    **dict.fromkeys(PLAIN, _plain),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma", "nanochat"), _softcap("final_logit_softcapping")),
    "recurrent_gemma": _softcap("logits_soft_cap"),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                     "granitemoe_swa"), _granite),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _times("logit_scale")),
    "falcon_h1": _times("lm_head_multiplier"),
    "hyperclovax": _times("logits_scaling"),  # multiplies by it, where Granite divides
}


def _detected(config) -> Head:
    """An unknown model type's head, guessed from the attributes the known families use (their conventions)."""
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= config.logits_scaling
    for name in ("logit_scale", "lm_head_multiplier"):
        if isinstance(getattr(config, name, None), (int, float)):
            scale *= getattr(config, name)
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    return Head(scale=scale, softcap=softcap or None)


def head_of(config) -> tuple[Head, bool]:
    """The head of a model with this (transformers) config, and whether its model_type is in HEADS. An unknown
    type's head is read generically from its text config (a multimodal config nests it as text_config)."""
    model_type = getattr(config, "model_type", None)
    if model_type in HEADS:
        return HEADS[model_type](config), True
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _detected(text), False


@contextlib.contextmanager
def eval_mode(model):
    """`model` in eval mode for the block (no dropout, LoRA's included), every module's own mode restored after:
    the eval, the samples and the first batch's checks compute what the policy is, not one dropout draw of it."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes.items():
            module.training = training


def causal_lm(model):
    """The transformers CausalLM inside a (possibly PEFT-wrapped) model."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


@dataclass(frozen=True)
class LM:
    """A model's parts as completion_logps runs them, read once (lm_of) by a stage that runs many forwards (train's
    Trainee, precompute's batches) rather than at every forward. The LoRA layers live inside the backbone's modules,
    so its forward is the adapted one (and the base one under model.disable_adapter())."""

    model: torch.nn.Module  # as given: a PeftModel (its adapter switched off for a live reference) or a CausalLM
    config: object  # the CausalLM's config: its attention implementation, read at each forward (a stage may set it)
    backbone: torch.nn.Module  # the decoder stack: input ids to last hidden states
    lm_head: torch.nn.Module  # its output embeddings
    head: Head  # what its forward does to lm_head's output (head_of)


def lm_of(model) -> LM:
    """The parts of `model` (a PeftModel or a CausalLM) that completion_logps runs."""
    lm = causal_lm(model)
    return LM(model, lm.config, getattr(lm, lm.base_model_prefix), lm.get_output_embeddings(), head_of(lm.config)[0])


def token_logps(lm_head, hidden: torch.Tensor, labels: torch.Tensor, head: Head, weighting: bool = False):
    """(c,) log p(label) of each row of `hidden`; weighting: also WPO's aligned log-prob, log p(label) - log
    sum_v p(v)^2, detached (c,), as TRL 1.16 computes it for use_weighting."""
    logits = head.apply(lm_head(hidden).float())  # (c, V) fp32
    # (c,) log p(label) = logit[label] - logsumexp(logits). Saves memory: in this order (gather first) backward
    # peaks one (c, V) float32 buffer lower than with the logsumexp first (measured: tests/memory/test_plan.py).
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not weighting:
        return logp
    with torch.no_grad():  # log sum_v p(v)^2: one more (c, V) temporary
        return logp, logp.detach() - torch.logsumexp(2 * torch.log_softmax(logits, dim=-1), dim=-1)


# The packed rows' attention implementation (packing.py), which runs any other batch as transformers' SDPA.
PACKED_ATTENTION = "lowmem_dpo_packed"
# Attention implementations that take the custom 4D mask of a shared-prefix batch, and the mask each takes.
MASK_KINDS = {"sdpa": "bool", PACKED_ATTENTION: "bool", "eager": "additive"}


def shared_prefix_mask(attention_mask: torch.Tensor, completion_mask: torch.Tensor, kind: str) -> torch.Tensor:
    """The (B, 1, T, T) attention mask of a shared-prefix batch (data.collate_shared): token i sees token j <= i
    when j is in the prompt or in i's own completion, so chosen never sees rejected nor rejected chosen; padding
    sees only itself (a row with nothing visible would be NaN). kind "bool": True where visible (SDPA);
    "additive": 0 where visible, float32's min elsewhere (eager attention adds it to the scores)."""
    seg = torch.where(attention_mask.bool(), completion_mask, -1)  # (B, T): -1 pad, 0 prompt, 1 chosen, 2 rejected
    t = seg.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()  # (T, T)
    q, k = seg[:, :, None], seg[:, None, :]  # (B, T, 1), (B, 1, T)
    visible = causal & (((k == 0) & (q >= 0)) | ((q == k) & (q > 0)))  # (B, T, T)
    visible |= torch.eye(t, dtype=torch.bool, device=seg.device)
    if kind == "bool":
        return visible[:, None]
    return torch.zeros(visible.shape, device=seg.device).masked_fill_(~visible, torch.finfo(torch.float32).min)[:, None]


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's real tokens come first, its padding after (data.collate's batches): (N, T) 0/1."""
    mask = attention_mask.bool()  # (N, T)
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def _targets(attention_mask: torch.Tensor, completion_mask: torch.Tensor, shared: bool):
    """Where each completion token's log-prob comes from: (seq, pred, label, out, n_out), each (M,) but n_out.
    Token `label` of row `seq` is predicted by the hidden state at `pred` and summed into output `out`.
    Unshared: pred = label - 1, out = seq (N outputs). Shared: chosen into out = seq, rejected into B + seq (2B
    outputs, [chosen; rejected] as unshared), and rejected's first token is predicted by the prompt's last."""
    seq, label = (completion_mask[:, 1:] > 0).nonzero(as_tuple=True)  # (M,), (M,)
    label = label + 1  # position t-1 predicts token t: a completion token at 0 has no predictor
    pred = label - 1
    n = completion_mask.shape[0]
    if not shared:
        return seq, pred, label, seq, n
    rejected = completion_mask[seq, label] == 2  # (M,)
    prompt_len = ((attention_mask > 0) & (completion_mask == 0)).sum(1)  # (B,)
    first = rejected & (completion_mask[seq, pred] != 2)  # (M,) rejected's first token: after chosen's last
    pred = torch.where(first, prompt_len[seq] - 1, pred)
    keep = pred >= 0  # an empty prompt predicts no first token (as unshared)
    return seq[keep], pred[keep], label[keep], (seq + n * rejected.long())[keep], 2 * n


def ld_weights(out: torch.Tensor, n: int, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's weight of each completion token summed into output `out` (M,) of a pair batch's n = 2B outputs
    [chosen; rejected] (_targets': each output's tokens contiguous and in order): 1 up to the pair's shorter
    completion's token count, ld_alpha beyond it (TRL 1.16's shared and tail masks). (M,) float32."""
    index = torch.arange(out.shape[0], device=out.device)  # (M,)
    first = torch.full((n,), out.shape[0], device=out.device).scatter_reduce(0, out, index, "amin")  # (2B,)
    own = index - first[out] + 1  # (M,) 1-based rank of each token in its own output
    counts = torch.bincount(out, minlength=n)  # (2B,)
    pairs = n // 2
    shared = torch.minimum(counts[:pairs], counts[pairs:])  # (B,)
    return torch.where(own > shared[out % pairs], ld_alpha, 1.0).float()  # (M,)


def _prompt_targets(attention_mask: torch.Tensor, completion_mask: torch.Tensor, shared: bool, n_out: int):
    """_targets' (seq, pred, label, out) of the prompt tokens of the chosen rows (unshared: the first half; shared:
    every row), summed into outputs n_out + pair, and the number of pairs. Token 0 has no predictor."""
    prompt = (attention_mask[:, 1:] > 0) & (completion_mask[:, 1:] == 0)  # (N, T-1); shared: before chosen
    if shared:  # the prompt is the row's leading run of completion_mask 0
        prompt &= torch.cumsum(completion_mask[:, 1:] > 0, dim=1) == 0
    seq, label = prompt.nonzero(as_tuple=True)  # (P,), (P,)
    pairs = completion_mask.shape[0] if shared else completion_mask.shape[0] // 2
    keep = seq < pairs
    seq, label = seq[keep], label[keep] + 1
    return seq, label - 1, label, n_out + seq, pairs


def chunked_head(lm_head, head: Head, h: torch.Tensor, labels: torch.Tensor, tile: Tile | None,
                 weighting: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logps of the hidden states h (M, H) predicting `labels` (M,): (M,) fp32 log-probs, and with weighting
    WPO's aligned ones (M,), detached. A frozen nn.Linear head runs in tiles of `tile`'s rows x entries (None:
    head.head_tile's defaults) with an online logsumexp (head.tiled_logps; a fused kernel where the stage set one
    for the device: head.FUSED); any other (LoRA on the head, a trainable one) in checkpointed chunks of the tile's
    rows (default: HEAD_TILE_ELEMENTS of logits), the whole vocabulary each."""
    tile = tile or Tile()
    chunk_tokens = tile.tokens
    if (type(lm_head) is torch.nn.Linear and not lm_head.weight.requires_grad
            and (lm_head.bias is None or not lm_head.bias.requires_grad)):
        kernel = FUSED.get(h.device.type) if tile.tokens is None and tile.entries is None else None
        if kernel is not None:
            return kernel(h, lm_head.weight, lm_head.bias, labels, head.scale, head.softcap, weighting)
        return tiled_logps(h, lm_head.weight, lm_head.bias, labels, Tiling(head, weighting, tile))
    if chunk_tokens is None:
        chunk_tokens = max(1, HEAD_TILE_ELEMENTS // lm_head.weight.shape[0])
    grad = torch.is_grad_enabled() and h.requires_grad
    parts, aligned = [], []
    for start in range(0, h.shape[0], chunk_tokens):
        hc, lc = h[start:start + chunk_tokens], labels[start:start + chunk_tokens]  # (c, H), (c,)
        if grad:
            # Saves memory: keep only (c, H) hidden for backward and recompute the (c, V) logits there.
            got = checkpoint(token_logps, lm_head, hc, lc, head, weighting, use_reentrant=False)
        else:
            got = token_logps(lm_head, hc, lc, head, weighting)
        parts.append(got[0] if weighting else got)
        if weighting:
            aligned.append(got[1])
    tok = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)  # (M,) fp32
    return tok, (torch.cat(aligned) if aligned else tok.detach()) if weighting else None


def sequence_sums(out: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) float64 sums of `values` (M,) into outputs `out` (M,), whose each output's values are contiguous
    (_targets' order: a precondition, two runs of one output would overwrite each other), each sum in a fixed
    order: a (n, longest) float64 table, each value at its place in its output, summed by row. index_add would add
    float32 atomically on CUDA, in another order each launch (~0.6 nats apart at 24k tokens); this gives the same
    bits for the same batch every time, exact to ~1e-12 (float32 on mps, which has no float64)."""
    dtype = torch.float32 if values.device.type == "mps" else torch.float64  # mps has no float64
    if values.numel() == 0:
        return values.new_zeros(n, dtype=dtype)
    index = torch.arange(out.shape[0], device=out.device)  # (M,)
    first = torch.ones_like(out, dtype=torch.bool)
    first[1:] = out[1:] != out[:-1]  # (M,) where an output's values begin
    place = index - torch.cummax(torch.where(first, index, 0), 0).values  # (M,) each value's place in its output
    table = values.new_zeros((n, int(place.max()) + 1), dtype=dtype)  # (n, longest)
    return table.index_put((out, place), values.to(dtype)).sum(1)  # (n,)


def last_hidden(lm: LM, batch) -> torch.Tensor:
    """The backbone's last hidden states of a collated batch, in its layout: its packed row's (1, S, H), through the
    packed attention (packing.py); a shared-prefix batch's (B, T, H), with its mask; else (N, T, H)."""
    if batch.packed is not None:  # padding_free: the sequences in one row, attention within each
        return lm.backbone(**batch.packed.kwargs(), use_cache=False).last_hidden_state  # (1, S, H)
    if batch.position_ids is not None:
        kind = MASK_KINDS[lm.config._attn_implementation]  # headcheck.sharing_problem refused the others
        mask = shared_prefix_mask(batch.attention_mask, batch.completion_mask, kind)  # (B, 1, T, T)
        return lm.backbone(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                           use_cache=False).last_hidden_state  # (B, T, H)
    # Saves memory: no padding mask. The batch is right-padded (data.collate), so under causal attention no real
    # token sees a pad: without a mask transformers runs SDPA causal, whose flash and memory-efficient kernels never
    # build the (N, 1, T, T) mask nor its additive copy (1.5 GiB for a pair at 16k tokens). The pads' own hidden
    # states are garbage and never read (the targets are real tokens).
    mask = batch.attention_mask
    return lm.backbone(input_ids=batch.input_ids, attention_mask=None if right_padded(mask) else mask,
                       use_cache=False).last_hidden_state  # (N, T, H)


def completion_logps(model, batch, tile: Tile | None = None, prompts: bool = False, weighting: bool = False,
                     ld_alpha: float | None = None, per_token: bool = False) -> SequenceLogps:
    """Sum of log p over each sequence's completion tokens of a collated batch (data.Batch), shifted by one (position
    t-1 predicts token t), through `model` (a PeftModel or a CausalLM, or its parts as lm_of read them once).

    batch.input_ids, attention_mask, completion_mask: (N, T). Returns (N,) float64 sums and (N,) token counts. A
    shared-prefix batch (data.collate_shared, with position_ids: (B, T) rows [prompt, chosen, rejected] and
    completion_mask 1 on chosen, 2 on rejected) returns (2B,) in the order [chosen; rejected], as the unshared batch
    of the same pairs: each prompt goes through the model once. A batch with its packed row (batch.packed:
    padding_free) runs that row instead of the padded ones (last_hidden), and gives the same values; the padded rows
    still say where each target is. prompts: also the chosen rows' prompt tokens' sums and counts (prompt_logps,
    prompt_tokens), through the same chunked LM head. weighting: also each sequence's sum
    of WPO's aligned log-probs (aligned), detached. ld_alpha (pairs): LD-DPO's sums, each completion's tokens beyond
    its pair's shorter completion's count weighted by ld_alpha. per_token (not with prompts): also each sequence's
    token log-probs, in order (tokens). tile: the LM head's tiles (chunked_head; None: its defaults).
    """
    lm = model if isinstance(model, LM) else lm_of(model)
    lm_head, head = lm.lm_head, lm.head
    input_ids, attention_mask, completion_mask = batch.input_ids, batch.attention_mask, batch.completion_mask
    shared, packed = batch.position_ids is not None, batch.packed
    hidden = last_hidden(lm, batch)  # (N, T, H); packed (1, S, H)
    seq_idx, pred, label, out, n = _targets(attention_mask, completion_mask, shared)  # (M,) each
    weight = None if ld_alpha is None else ld_weights(out, n, ld_alpha)  # (M,)
    pairs = 0
    if prompts:  # appended after the completion tokens, summed into outputs n..n+pairs
        p_seq, p_pred, p_label, p_out, pairs = _prompt_targets(attention_mask, completion_mask, shared, n)  # (P,)
        seq_idx, pred, label, out = (torch.cat(t) for t in ((seq_idx, p_seq), (pred, p_pred), (label, p_label),
                                                             (out, p_out)))
    if packed is not None:  # padded row seq's position pred is packed position starts[seq] + pred
        h = hidden[0, packed.starts[seq_idx.to(hidden.device)] + pred.to(hidden.device)]  # (M, H)
    else:
        h = hidden[seq_idx.to(hidden.device), pred.to(hidden.device)]  # (M, H)
    labels = input_ids[seq_idx, label]  # (M,)
    tok, aligned_tok = chunked_head(lm_head, head, h.to(lm_head.weight.device), labels.to(lm_head.weight.device),
                                    tile, weighting)
    if weight is not None:  # the completions' tokens come first in tok, the prompts' (unweighted) after
        tok = torch.cat([tok[:weight.shape[0]].double() * weight.to(tok.device), tok[weight.shape[0]:].double()])
    out = out.to(tok.device)
    logps = sequence_sums(out, tok, n + pairs)  # (N + pairs,) float64
    n_tokens = torch.bincount(out, minlength=n + pairs)  # (N + pairs,)
    aligned = None
    if weighting:  # (N,): the completions' tokens only
        aligned = sequence_sums(out, aligned_tok, n + pairs)[:n]
    if not prompts:
        # each output's tokens are contiguous in `out` and in order (_targets): a stable sort keeps that order
        tokens = None if not per_token else list(tok.detach()[torch.sort(out, stable=True)[1]].split(
            n_tokens.tolist()))
        return SequenceLogps(logps, n_tokens, aligned=aligned, tokens=tokens)
    return SequenceLogps(logps[:n], n_tokens[:n], logps[n:], n_tokens[n:], aligned)
