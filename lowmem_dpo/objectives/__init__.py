"""The preference objectives and the metrics, each declared once: the floor above runtime, below config, so that
config, train, precompute, guards, report and the docs all read the same entries.

    registry.py  what an objective is (Objective, its Limits and Keys), its inputs (PairLogps, Settings), the
                 f-divergences: pure
    dpo.py       every loss_type of TRL 1.16's DPOTrainer, and cdpo: pure
    metrics.py   every metric a run logs: its name, direction, where it is logged, its report panel

Adding an objective is one entry in dpo.py (or a module beside it, collected below) and its test against TRL in
tests/objectives/. Its face: OBJECTIVES (name -> Objective), KEYS (an objective's own config keys), combine (a
micro-batch's weighted terms), needs_reference.
"""

from __future__ import annotations

import torch

from lowmem_dpo.objectives import dpo
from lowmem_dpo.objectives.registry import F_DIVERGENCES, Key, Objective, PairLogps, Settings

OBJECTIVES: dict[str, Objective] = {o.name: o for o in dpo.OBJECTIVES}

# The config keys objectives read beyond beta and label_smoothing (config/schema.py declares a field for each).
KEYS = {
    "f_divergence_type": Key("reverse_kl", "f-DPO's divergence (Wang et al. 2023): reverse_kl is DPO's; forward_kl, "
                             "js_divergence or alpha_divergence (with f_alpha_divergence_coef) change the margin of "
                             "the losses that allow it (docs/objectives.md).", choices=F_DIVERGENCES),
    "f_alpha_divergence_coef": Key(1.0, "alpha of f_divergence_type=alpha_divergence (1.0: reverse KL).",
                                   min=0.0, min_exclusive=True),
    "discopop_tau": Key(0.05, "DiscoPOP's temperature: how sharply the margin blends the logistic loss into the "
                        "exponential one (loss_type=discopop).", min=0.0, min_exclusive=True),
}

# TRL's keys whose objective this tool cannot compute, and why (config refuses a recipe that turns one on).
REFUSED = {
    "sync_ref_model": "TR-DPO (sync_ref_model) mixes the policy into the reference during training, and this tool's "
                      "reference is a fixed cache computed once before training; remove the key (or set it false) "
                      "to train against the fixed reference",
}


def needs_reference(loss_types) -> bool:
    """Whether any of `loss_types` needs the reference's log-probs (a cache, or ref_source=live)."""
    return any(OBJECTIVES[t].needs_reference for t in loss_types)


def combine(x: PairLogps, s: Settings, terms: list[tuple[str, float]]) -> torch.Tensor:
    """The weighted sum of the per-pair terms (B,) of `terms` ((loss type, weight) pairs) that average over
    pairs; the per-token ones (sft) are per_token_loss's. Zeros when there are none."""
    losses = torch.zeros_like(x.chosen)  # (B,)
    for name, weight in terms:
        if not OBJECTIVES[name].per_token:
            losses = losses + weight * OBJECTIVES[name].formula(x, s)  # (B,)
    return losses


def per_token_loss(x: PairLogps, s: Settings, terms: list[tuple[str, float]], chosen_tokens: int):
    """This micro-batch's share of the per-token terms of `terms` (sft): each the mean over `chosen_tokens`, the
    chosen completion tokens of the whole optimizer step, however its pairs are split into micro-batches. 0 when
    there are none."""
    loss = 0
    for name, weight in terms:
        if OBJECTIVES[name].per_token:
            loss = loss + weight * (OBJECTIVES[name].formula(x, s) / max(1, chosen_tokens)).sum()
    return loss


def rewards(x: PairLogps, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The implicit rewards b * r_c and b * r_r (B,) each, detached: TRL's rewards/* metrics."""
    chosen, rejected = x.logratios()
    return s.beta * chosen.detach(), s.beta * rejected.detach()


def problems(loss_types, weights, s: Settings) -> list[str]:
    """What is wrong with this combination of objectives and settings, as config errors."""
    out = []
    unknown = [t for t in loss_types if t not in OBJECTIVES]
    if unknown:
        out.append(f"loss_type={unknown[0]}: not an objective; one of {', '.join(OBJECTIVES)}")
        return out
    if not loss_types or len(set(loss_types)) < len(loss_types):
        out.append(f"loss_type={loss_types}: name each loss once, at least one")
    if weights is not None and len(weights) != len(loss_types):
        out.append(f"loss_weights={weights} has {len(weights)} weights for loss_type={loss_types}: give one per "
                   "loss, in its order (or null: 1 each)")
    if "robust" in loss_types and s.label_smoothing >= 0.5:
        out.append(f"label_smoothing={s.label_smoothing}: loss_type=robust needs it below 0.5 (it divides by "
                   "1 - 2*label_smoothing)")
    if "exo_pair" in loss_types and s.label_smoothing == 0:
        out.append("loss_type=exo_pair needs label_smoothing above 0 (it takes log(label_smoothing)); EXO's paper "
                   "recommends 1e-3")
    plain = [t for t in loss_types if not OBJECTIVES[t].f_divergence]
    if s.f_divergence_type != "reverse_kl" and plain:
        out.append(f"f_divergence_type={s.f_divergence_type} with loss_type={plain[0]}: f-DPO's reparameterisation "
                   "holds only for losses of the reward difference (" + ", ".join(
                       t for t, o in OBJECTIVES.items() if o.f_divergence) + "); use reverse_kl with it")
    return out


def no_effect(loss_types, s: Settings) -> list[str]:
    """Settings that change none of `loss_types` (the warnings train logs)."""
    out = []
    if s.label_smoothing > 0 and not any(OBJECTIVES[t].smoothing for t in loss_types):
        out.append(f"label_smoothing={s.label_smoothing} does not change loss_type={list(loss_types)} (TRL 1.16's "
                   "sigmoid ignores it too); for conservative DPO use loss_type=cdpo")
    for key in KEYS:
        users = [t for t, o in OBJECTIVES.items() if key in o.keys]
        if users and getattr(s, key) != KEYS[key].default and not set(users) & set(loss_types):
            out.append(f"{key}={getattr(s, key)} changes only loss_type={users[0]}, not {list(loss_types)}")
    return out


__all__ = ["KEYS", "OBJECTIVES", "REFUSED", "Objective", "PairLogps", "Settings", "combine", "needs_reference", "no_effect",
           "per_token_loss", "problems", "rewards"]
