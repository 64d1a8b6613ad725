"""Completion log-probs: the one function precompute (reference) and train (policy) both use.

For each sequence: sum over completion tokens t of log p(x_t | x_<t), in fp32. Prompt and padding positions
contribute nothing. The LM head runs only on the hidden states that predict a completion token, in chunks of
`chunk_tokens` rows, so the [tokens, vocab] fp32 log-softmax exists one chunk at a time. Under autograd each
chunk is checkpointed: backward recomputes its logits instead of keeping every chunk's alive (at a 7B model's
32k-152k vocabulary, the full [batch, seq, vocab] fp32 tensor would be the largest thing in memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# Elements of one chunk's fp32 logits: 2^24 * 4 B = 64 MiB (e.g. 512 tokens at a 32k vocabulary).
CHUNK_ELEMENTS = 1 << 24


@dataclass
class SequenceLogps:
    """Per-sequence completion log-prob sums and completion token counts."""

    logps: torch.Tensor  # (N,) fp32
    n_tokens: torch.Tensor  # (N,) int64

    def split(self) -> tuple["SequenceLogps", "SequenceLogps"]:
        """Chosen half and rejected half of a concatenated [chosen; rejected] batch."""
        b = self.logps.shape[0] // 2
        return (SequenceLogps(self.logps[:b], self.n_tokens[:b]), SequenceLogps(self.logps[b:], self.n_tokens[b:]))


def causal_lm(model):
    """The transformers CausalLM inside a (possibly PEFT-wrapped) model."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def _token_logps(lm_head, hidden: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = lm_head(hidden).float()  # (c, V) fp32
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    # (c,) log p(label) = logit[label] - logsumexp(logits)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                     chunk_tokens: int | None = None) -> SequenceLogps:
    """Sum of log p over each sequence's completion tokens, shifted by one (position t-1 predicts token t).

    input_ids, attention_mask, completion_mask: (N, T). Returns (N,) fp32 sums and (N,) token counts.
    """
    lm = causal_lm(model)
    backbone = getattr(lm, lm.base_model_prefix)
    lm_head = lm.get_output_embeddings()
    softcap = getattr(lm.config, "final_logit_softcapping", None)

    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # (N, T, H)
    target = completion_mask[:, 1:].bool()  # (N, T-1): position t predicts token t+1
    seq_idx, pos = target.nonzero(as_tuple=True)  # (M,), (M,) for the M completion tokens
    h = hidden[:, :-1][seq_idx, pos]  # (M, H)
    labels = input_ids[:, 1:][seq_idx, pos].to(h.device)  # (M,)
    lm_device = lm_head.weight.device
    h = h.to(lm_device)

    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_ELEMENTS // lm_head.weight.shape[0])
    grad = torch.is_grad_enabled() and h.requires_grad
    parts = []
    for start in range(0, h.shape[0], chunk_tokens):
        hc, lc = h[start:start + chunk_tokens], labels[start:start + chunk_tokens]  # (c, H), (c,)
        if grad:
            # Saves memory: keep only (c, H) hidden for backward and recompute the (c, V) logits there.
            parts.append(checkpoint(_token_logps, lm_head, hc, lc.to(lm_device), softcap, use_reentrant=False))
        else:
            parts.append(_token_logps(lm_head, hc, lc.to(lm_device), softcap))
    tok = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)  # (M,) fp32
    n = input_ids.shape[0]
    seq_idx = seq_idx.to(tok.device)
    logps = torch.zeros(n, dtype=torch.float32, device=tok.device).index_add(0, seq_idx, tok)  # (N,)
    n_tokens = torch.bincount(seq_idx, minlength=n)  # (N,)
    return SequenceLogps(logps, n_tokens)
