"""The objectives without a reference: SimPO (and AlphaPO, its reward shaped by alpha) and ORPO, as TRL 1.16's
experimental CPOTrainer (loss_type="simpo", cpo_alpha=0; "alphapo") and ORPOTrainer compute them
(trl/experimental/cpo/cpo_trainer.py cpo_loss, trl/experimental/orpo/orpo_trainer.py odds_ratio_loss). Neither
reads the reference, so a run of these alone needs no precompute and no cache; tests/objectives compares them
with TRL's own code on the same log-probs.

Notation: a_c = log pi(y_c|x) / n_c, the chosen completion's mean log-prob per token, a_r likewise; b = beta,
e = label_smoothing, g = simpo_gamma.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lowmem_dpo.objectives.metrics import LOG_ODDS_CHOSEN, LOG_ODDS_RATIO
from lowmem_dpo.objectives.registry import Key, Objective, PairLogps, Settings, smoothed_sigmoid


def _means(x: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    return x.per_token(x.chosen, x.rejected)  # (B,) each: a_c, a_r


def _shaped(x: PairLogps, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """SimPO's rewards before beta: a_c and a_r, or with alpha != 0 AlphaPO's (1 - p^-alpha) / alpha of the
    per-token probability p = e^a."""
    chosen, rejected = _means(x)
    if s.alpha == 0.0:
        return chosen, rejected
    return (1 - torch.exp(-s.alpha * chosen)) / s.alpha, (1 - torch.exp(-s.alpha * rejected)) / s.alpha


def simpo(x, s):  # -(1 - e) log s(b (a_c - a_r) - g) - e log s(-(b (a_c - a_r) - g)) (SimPO, eq. 6)
    chosen, rejected = _shaped(x, s)
    return smoothed_sigmoid(s.beta * (chosen - rejected - s.simpo_gamma / s.beta), s.label_smoothing)


def simpo_rewards(x, s):  # b a_c, b a_r (AlphaPO: b times the shaped rewards)
    chosen, rejected = _shaped(x, s)
    return s.beta * chosen.detach(), s.beta * rejected.detach()


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - e^a) for a < 0, without cancellation: log1p(-e^a) below -ln 2, log(-expm1(a)) above."""
    return torch.where(a < -math.log(2), torch.log1p(-torch.exp(a)), torch.log(-torch.expm1(a)))


def log_odds(x: PairLogps) -> torch.Tensor:
    """log(odds(y_c) / odds(y_r)), odds(y) = p / (1 - p) of the per-token probability p = e^a, in float32. (B,)"""
    chosen, rejected = (t.float() for t in _means(x))
    return (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))


def orpo(x, s):  # -b log s(log odds ratio); the chosen NLL (prompt included) is the entry's nll (ORPO, eq. 6)
    return -s.beta * F.logsigmoid(log_odds(x))


def orpo_rewards(x, s):  # b a_c, b a_r
    chosen, rejected = _means(x)
    return s.beta * chosen.detach(), s.beta * rejected.detach()


def orpo_metrics(x, s):  # TRL's log_odds_ratio (the mean of log s(.)) and log_odds_chosen (the mean log odds ratio)
    z = log_odds(x).detach()
    return {LOG_ODDS_RATIO: F.logsigmoid(z), LOG_ODDS_CHOSEN: z}


SIMPO_GAMMA = Key("simpo_gamma", 0.5, "SimPO's target reward margin (loss_type=simpo, alphapo): the loss pulls beta "
                  "times the per-token margin past it.", min=0.0)
ALPHA = Key("alpha", 0.0, "AlphaPO's reward shape (loss_type=simpo, alphapo; TRL's CPOConfig.alpha): the reward is "
            "(1 - p^-alpha) / alpha of the per-token probability p; 0: SimPO's log p.")
_SIMPO = dict(needs_reference=False, smoothing=True, keys=(SIMPO_GAMMA, ALPHA), rewards=simpo_rewards,
              average_logps=True, usual_beta="2-2.5 (simpo_gamma 0.5-1.5)")

OBJECTIVES = (
    Objective("simpo", simpo, "SimPO: the per-token mean log-prob as the reward, a target margin simpo_gamma; no "
              "reference", "Meng et al. 2024, arXiv:2405.14734", "CPOTrainer (loss_type=simpo, cpo_alpha=0)",
              **_SIMPO),
    Objective("alphapo", simpo, "AlphaPO: SimPO with the reward (1 - p^-alpha) / alpha of the per-token "
              "probability p (alpha 0: SimPO)", "AlphaPO, 2025, arXiv:2501.03884",
              "CPOTrainer (loss_type=alphapo: simpo, cpo_alpha=0)",
              note=lambda s: None if s.alpha else "with alpha=0 is simpo: set alpha (TRL's CPOConfig.alpha) to "
              "shape the reward", **_SIMPO),
    Objective("orpo", orpo, "ORPO: the chosen NLL plus beta (lambda) times the log odds ratio; no reference, "
              "no SFT stage", "Hong et al. 2024, arXiv:2403.07691", "ORPOTrainer", needs_reference=False, nll=1.0, nll_prompt=True,
              rewards=orpo_rewards, average_logps=True, metrics=orpo_metrics),
)
