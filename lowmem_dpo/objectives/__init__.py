"""The preference objectives and the metrics, each declared once: the floor above runtime, below config, so that
config, train, precompute, guards, report and the docs all read the same entries.

    registry.py  what an objective is (Objective, its Limits and Keys), its inputs (PairLogps, Settings), the
                 f-divergences: pure
    dpo.py       every loss_type of TRL 1.16's DPOTrainer, and cdpo: pure
    reference_free.py  SimPO, AlphaPO and ORPO (TRL 1.16's experimental CPO and ORPO trainers): pure
    kto.py       KTO and apo_zero_unpaired on unpaired rows (TRL 1.16's KTOTrainer), their KL sequences: pure
    metrics.py   every metric a run logs: its name, direction, where it is logged, its report panel

Adding an objective is one entry in dpo.py (or a module beside it, collected below) and its test against TRL in
tests/objectives/. Its face: OBJECTIVES (name -> Objective), KEYS (an objective's own config keys), combine (a
micro-batch's weighted terms), needs_reference.
"""

from __future__ import annotations

import dataclasses

import torch

from lowmem_dpo.objectives import dpo, kto, metrics, reference_free, registry
from lowmem_dpo.objectives.registry import MODIFIERS, Key, Objective, PairLogps, wpo_weights

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (*dpo.OBJECTIVES, *reference_free.OBJECTIVES,
                                                           *kto.OBJECTIVES)}

# The config keys objectives read beyond beta and label_smoothing, by name: the modifiers' and each entry's own, as
# their Key declares them (config/schema.py builds a field of each, Settings below a field of each).
KEYS: dict[str, Key] = {k.name: k for k in (*MODIFIERS, *(k for o in OBJECTIVES.values() for k in o.keys))}
assert len(KEYS) == len({id(k) for k in KEYS.values()}), "a key is declared once (entries share its Key)"

# The run's loss settings that formulas read: beta, label_smoothing and each key above (Config.loss_settings)
Settings = dataclasses.make_dataclass(
    "Settings", [(k.name, k.kind, dataclasses.field(default=k.default)) for k in KEYS.values()],
    bases=(registry.Settings,), frozen=True)
Settings.__doc__ = registry.Settings.__doc__

@dataclasses.dataclass(frozen=True)
class Terms:
    """A run's pair loss, resolved once from its config (Terms.of): its (loss type, weight) terms in order, the
    settings its formulas read, WPO's weighting and LD-DPO's alpha."""

    terms: tuple[tuple[str, float], ...]
    settings: registry.Settings  # Settings above: beta, label_smoothing and each objective's own keys
    weighting: bool = False  # use_weighting: WPO's weight of each pair
    ld_alpha: float | None = None  # LD-DPO: the weight of the tokens beyond the shorter completion's

    @classmethod
    def of(cls, cfg) -> "Terms":
        return cls(tuple(cfg.loss_terms), cfg.loss_settings, cfg.use_weighting, cfg.ld_alpha)

    @property
    def types(self) -> list[str]:  # cfg.loss_type
        return [name for name, _ in self.terms]


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
    return losses if x.weights is None else losses * x.weights  # use_weighting: WPO's weight of each pair


def start_drift(x: PairLogps, s: Settings, terms: list[tuple[str, float]],
                losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the reference values are from the policy's own forward, (B,) each, for a step where the two should
    be one model (step 1: the adapter is the identity): |policy - reference| of each completion's summed log-prob,
    added over the pair's two completions (nats), and the per-pair `losses` (combine(x, s, terms)) minus the loss
    with the reference set to the policy (its value at the start: ln 2 for sigmoid). Detached."""
    chosen, rejected = x.chosen.detach(), x.rejected.detach()
    drift = (chosen - x.ref_chosen).abs() + (rejected - x.ref_rejected).abs()  # (B,)
    start = dataclasses.replace(x, chosen=chosen, rejected=rejected, ref_chosen=chosen, ref_rejected=rejected)
    with torch.no_grad():
        offset = losses.detach() - combine(start, s, terms)  # (B,)
    return drift, offset


def nll_prompt(loss_types) -> bool:
    """Whether the run's NLL covers the chosen rows' prompt tokens too (ORPO's, as TRL's): the policy's forward
    then sums the prompt's log-probs as well (PairLogps.chosen_prompt)."""
    return any(OBJECTIVES[t].nll_prompt for t in loss_types)


def per_token_loss(x: PairLogps, weight: float | None, nll_tokens: int):
    """This micro-batch's share of the chosen tokens' NLL in the loss at `weight` (nll_weight: sft, ORPO's own):
    the mean over `nll_tokens`, the tokens it covers in the whole optimizer step (the chosen completions', and with
    chosen_prompt their prompts'), however its pairs are split into micro-batches. 0 when there is none (None)."""
    if weight is None:
        return 0
    return weight * (-x.nll_logps()[0] / max(1, nll_tokens)).sum()


def primary(loss_types) -> Objective:
    """The objective whose rewards and logps the run logs: its first per-pair term (sft alone: sft)."""
    return next((OBJECTIVES[t] for t in loss_types if not OBJECTIVES[t].per_token), OBJECTIVES[loss_types[0]])


def pair_metrics(x: PairLogps, s: Settings, loss_types, logged: Objective | None = None
                 ) -> dict[metrics.Metric, torch.Tensor]:
    """What a micro-batch of pairs logs, by its metric rows (metrics.py), (B,) each, detached: TRL's rewards/* (the
    primary objective's implicit rewards: by default b * r_c and b * r_r, which need the reference; without one,
    and no rewards of its own: zeros, as TRL's sft alone), their accuracy and margin, logps/* (sums, or per-token
    means: SimPO, ORPO) and the run's terms' own (ORPO's log odds); the loss and the NLL are the step's. logged:
    primary(loss_types), which a run resolves once."""
    o = logged or primary(loss_types)
    if o.rewards is not None:
        chosen, rejected = o.rewards(x, s)
    elif x.ref_chosen is None:
        chosen, rejected = torch.zeros_like(x.chosen).detach(), torch.zeros_like(x.rejected).detach()
    else:
        chosen, rejected = (s.beta * r.detach() for r in x.logratios())
    logps = x.chosen.detach(), x.rejected.detach()
    logps_chosen, logps_rejected = x.per_token(*logps) if o.average_logps else logps
    out = {metrics.REWARDS_CHOSEN: chosen, metrics.REWARDS_REJECTED: rejected,
           metrics.ACCURACY: (chosen > rejected).float(), metrics.MARGIN: chosen - rejected,
           metrics.LOGPS_CHOSEN: logps_chosen, metrics.LOGPS_REJECTED: logps_rejected}
    for t in loss_types:
        if OBJECTIVES[t].metrics is not None:
            out.update(OBJECTIVES[t].metrics(x, s))
    return out


def logs(metric: str, loss_types) -> bool:
    """Whether a run of `loss_types` logs `metric` (its train name); True for unknown loss types (problems says)."""
    if any(t not in OBJECTIVES for t in loss_types):
        return True
    return metrics.logged(metric, loss_types, nll_weight([(t, 1.0) for t in loss_types]) is not None,
                          unpaired(loss_types))


def nll_weight(terms: list[tuple[str, float]]) -> float | None:
    """The weight of the chosen tokens' NLL in the loss (the sft term, ORPO's own), or None without one."""
    weights = [w * (1.0 if OBJECTIVES[t].per_token else OBJECTIVES[t].nll) for t, w in terms
               if OBJECTIVES[t].per_token or OBJECTIVES[t].nll]
    return sum(weights) if weights else None


def problems(loss_types, weights, s: Settings) -> list[str]:
    """What is wrong with this combination of objectives and settings, as config errors: the rules every
    combination follows, then each entry's own refusals (Objective.refuse)."""
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
    out += unpaired_problems(loss_types, s)
    entries = [OBJECTIVES[t] for t in loss_types]
    prompted = [o for o in entries if o.nll_prompt]
    per_token = [o for o in entries if o.per_token]
    if prompted and per_token:
        out.append(f"loss_type={loss_types}: {prompted[0].name} has its own NLL of the chosen rows (over the prompt "
                   f"too, as TRL's {prompted[0].trl}); drop {per_token[0].name}")
    plain = [o.name for o in entries if not o.needs_reference]
    if s.ld_alpha is not None and plain:
        out.append(f"ld_alpha={s.ld_alpha} with loss_type={plain[0]}: LD-DPO weights the log-probs of the losses "
                   "against the reference, not an NLL (TRL's is over the unweighted tokens) or a reference-free "
                   "objective; drop one")
    unweighted = [o.name for o in entries if not (o.needs_reference and o.weighs)]
    if s.use_weighting and unweighted:
        out.append(f"use_weighting=true with loss_type={unweighted[0]}: WPO weights the losses against the "
                   "reference, not the reference-free ones or an NLL (TRL 1.16 fails on its sft with it), nor the "
                   f"losses that sort the pairs ({', '.join(t for t, o in OBJECTIVES.items() if not o.weighs)}), "
                   "which would misalign the weights")
    plain = [o.name for o in entries if not o.f_divergence]
    if s.f_divergence_type != "reverse_kl" and plain:
        out.append(f"f_divergence_type={s.f_divergence_type} with loss_type={plain[0]}: f-DPO's reparameterisation "
                   "holds only for losses of the reward difference (" + ", ".join(
                       t for t, o in OBJECTIVES.items() if o.f_divergence) + "); use reverse_kl with it")
    for o in entries:
        refusal = o.refuse(s) if o.refuse is not None else None
        if refusal:
            out.append(f"loss_type={o.name} {refusal}")
    return out


def unpaired(loss_types) -> bool:
    """Whether the run trains on unpaired rows (KTO): its one term is an unpaired objective."""
    return any(OBJECTIVES[t].unpaired for t in loss_types if t in OBJECTIVES)


def needs_kl(loss_types) -> bool:
    """Whether the run's reference point is KTO's KL estimate (its rows then have KL sequences)."""
    return bool(kto.NEEDS_KL & set(loss_types))


def unpaired_problems(loss_types, s: Settings) -> list[str]:
    """An unpaired objective (KTO) is a run's only term, without the pair-only settings."""
    if not unpaired(loss_types):
        return []
    if len(loss_types) > 1:
        return [f"loss_type={loss_types}: {loss_types[0] if OBJECTIVES[loss_types[0]].unpaired else loss_types[1]} "
                "trains on unpaired rows, one loss per row; it cannot be summed with a pair loss: train it alone"]
    paired_only = [k for k, on in (("ld_alpha", s.ld_alpha is not None), ("use_weighting", s.use_weighting),
                                   ("label_smoothing", s.label_smoothing > 0)) if on]
    return [f"{paired_only[0]} with loss_type={loss_types[0]}: it changes the pair losses only (TRL's KTOConfig has "
            "no such key); remove it"] if paired_only else []


def no_effect(loss_types, s: Settings) -> list[str]:
    """Settings that change none of `loss_types` (the warnings train logs): label_smoothing where no term reads it,
    an entry's own key set for a run without that entry, and each entry's own notes (Objective.note)."""
    out = []
    if s.label_smoothing > 0 and not any(OBJECTIVES[t].smoothing for t in loss_types):
        out.append(f"label_smoothing={s.label_smoothing} does not change loss_type={list(loss_types)} (TRL 1.16's "
                   "sigmoid ignores it too); for conservative DPO use loss_type=cdpo")
    for o in (OBJECTIVES[t] for t in loss_types):
        note = o.note(s) if o.note is not None else None
        if note:
            out.append(f"loss_type={o.name} {note}")
    for key in KEYS:
        users = [t for t, o in OBJECTIVES.items() if KEYS[key] in o.keys]
        if users and getattr(s, key) != KEYS[key].default and not set(users) & set(loss_types):
            out.append(f"{key}={getattr(s, key)} changes only loss_type={users[0]}, not {list(loss_types)}")
    return out


__all__ = ["KEYS", "OBJECTIVES", "REFUSED", "Objective", "PairLogps", "Settings", "combine", "logs",
           "needs_kl", "needs_reference", "nll_prompt", "nll_weight", "no_effect", "per_token_loss", "primary",
           "pair_metrics", "problems", "start_drift", "unpaired", "wpo_weights"]
