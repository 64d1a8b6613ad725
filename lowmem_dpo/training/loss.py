"""DPO loss variants as pure functions: tensors in, tensors out.

With log-ratios  r_c = pi(y_c|x) - ref(y_c|x),  r_r = pi(y_r|x) - ref(y_r|x)  (sequence log-prob sums) and
Delta = r_c - r_r, each variant returns a per-pair loss:

  sigmoid  DPO, Rafailov et al. 2023 (arXiv:2305.18290), eq. 7:  -log s(b Delta). label_smoothing does not
           change it, as in TRL 1.16 (train warns when it is set and no term uses it)
  cdpo     conservative DPO (Mitchell 2023), the sigmoid loss with label_smoothing e, as TRL < 1.0 computed
           sigmoid:  -(1 - e) log s(b Delta) - e log s(-b Delta)
  hinge    SLiC, Zhao et al. 2023 (arXiv:2305.10425):  max(0, 1 - b Delta)
  ipo      IPO, Azar et al. 2023 (arXiv:2310.12036), eq. 17, on per-token (length-normalised) log-ratios as TRL
           1.16 does:  (r_c / n_c - r_r / n_r - 1 / (2 b))^2
  robust   rDPO, Chowdhury et al. 2024 (arXiv:2403.00409), eq. 8:
           (-(1 - e) log s(b Delta) + e log s(-b Delta)) / (1 - 2e)

Rewards are the implicit DPO rewards b * r_c and b * r_r, detached (for logging).

A list of loss types sums its terms with weights, as TRL 1.16's `loss_type` and `loss_weights`: the preference
terms per pair (preference_losses), and `sft`, the mean NLL of the chosen completion tokens (sft_shares), the
NLL term of RPO (Pang et al. 2024, arXiv:2404.19733) that keeps chosen log-probs from falling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "cdpo", "hinge", "ipo", "robust")  # preference losses; "sft" is the NLL term (sft_shares)
SMOOTHED = ("cdpo", "robust")  # the loss types label_smoothing changes


# Each: (delta (B,), norm_delta (B,) or None) -> per-pair loss (B,)
def _sigmoid(delta, norm_delta, *, beta, label_smoothing):
    return -F.logsigmoid(beta * delta)


def _cdpo(delta, norm_delta, *, beta, label_smoothing):
    return -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)


def _hinge(delta, norm_delta, *, beta, label_smoothing):
    return torch.relu(1 - beta * delta)


def _robust(delta, norm_delta, *, beta, label_smoothing):
    e = label_smoothing
    return (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)


def _ipo(delta, norm_delta, *, beta, label_smoothing):
    return (norm_delta - 1 / (2 * beta)) ** 2


_LOSSES = {"sigmoid": _sigmoid, "cdpo": _cdpo, "hinge": _hinge, "ipo": _ipo, "robust": _robust}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses (B,), chosen rewards (B,) and rejected rewards (B,). All logps inputs: (B,) sums.

    `chosen_lengths` / `rejected_lengths` (completion token counts, (B,)) are required by loss_type="ipo".
    """
    if loss_type not in _LOSSES:
        raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # (B,)
    delta = chosen_logratios - rejected_logratios  # (B,)
    norm_delta = None
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' needs chosen_lengths and rejected_lengths (completion token counts)")
        norm_delta = (chosen_logratios / chosen_lengths.clamp(min=1).to(delta.dtype)
                      - rejected_logratios / rejected_lengths.clamp(min=1).to(delta.dtype))  # (B,)
    losses = _LOSSES[loss_type](delta, norm_delta, beta=beta, label_smoothing=label_smoothing)
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return losses, chosen_rewards, rejected_rewards


def preference_losses(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    terms: list[tuple[str, float]],
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted sum of dpo_loss's per-pair losses (B,) over the preference terms of `terms` ((loss type,
    weight) pairs; sft is skipped: see sft_shares), and the chosen and rejected rewards (B,) each. With no
    preference term (loss_type [sft]) the losses are zeros."""
    losses = torch.zeros_like(policy_chosen_logps)  # (B,)
    for loss_type, weight in terms:
        if loss_type != "sft":
            term, _, _ = dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                                  beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                                  chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
            losses = losses + weight * term  # (B,)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()  # (B,)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()  # (B,)
    return losses, chosen_rewards, rejected_rewards


def sft_shares(policy_chosen_logps: torch.Tensor, chosen_tokens: int) -> torch.Tensor:
    """Each pair's share (B,) of the sft term, -log pi(y_c|x) / chosen_tokens, where chosen_tokens counts the
    chosen completion tokens of every pair the term averages over (an optimizer step's): summed over those pairs,
    the mean NLL per chosen token, however the pairs are split into micro-batches."""
    return -policy_chosen_logps / max(1, chosen_tokens)  # (B,)
