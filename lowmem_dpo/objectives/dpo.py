"""The objectives against a reference: every loss_type of TRL 1.16's DPOTrainer, and cdpo. Each formula is TRL
1.16's computation (trl/trainer/dpo_trainer.py, _compute_loss) on sequence log-prob sums; tests/objectives compares
them with TRL's own code on the same log-probs.

Notation: r_c = log pi(y_c|x) - log ref(y_c|x), r_r likewise (the log-ratios; under f_divergence_type, their
scores f'(pi/ref)), Delta = r_c - r_r, b = beta, e = label_smoothing, n_c / n_r the completions' token counts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lowmem_dpo.objectives.registry import (
    Key,
    Limits,
    Objective,
    PairLogps,
    Settings,
    scores,
    smoothed_sigmoid,
    softplus,
)

# The reward margin b * Delta at which the sigmoid loss is 0.05 (ln(1 / (e^0.05 - 1)) = 2.97): the pairs are
# separated. A loss's early-loss limit is its value there.
SEPARATED = -math.log(math.expm1(0.05))
_SEPARATED_WHY = "the loss is already ~0; growth now only pushes log-probs apart"
_SIGMOID_MARGIN = 10.0  # rewards/margins above it: the sigmoid loss is below 5e-5, the pairs long separated


def _delta(x: PairLogps, s: Settings) -> torch.Tensor:
    chosen, rejected = scores(x, s)
    return chosen - rejected  # (B,)


def sigmoid(x, s):  # -log s(b Delta); label_smoothing does not change it (TRL 1.16)
    return -F.logsigmoid(s.beta * _delta(x, s))


def cdpo(x, s):  # -(1 - e) log s(b Delta) - e log s(-b Delta): TRL < 1.0's sigmoid with label smoothing
    return smoothed_sigmoid(s.beta * _delta(x, s), s.label_smoothing)


def cdpo_at(margin: float, e: float) -> float:
    """cdpo's loss at reward margin b * Delta = `margin`, as a float."""
    return (1 - e) * softplus(-margin) + e * softplus(margin)


def hinge(x, s):  # max(0, 1 - b Delta)
    return torch.relu(1 - s.beta * _delta(x, s))


def ipo(x, s):  # (r_c / n_c - r_r / n_r - 1 / (2 b))^2, per-token as TRL 1.16 (agreed with IPO's authors)
    chosen, rejected = x.per_token(*scores(x, s))
    return (chosen - rejected - 1 / (2 * s.beta)) ** 2


def robust(x, s):  # (-(1 - e) log s(b Delta) + e log s(-b Delta)) / (1 - 2e)
    e, z = s.label_smoothing, s.beta * _delta(x, s)
    return (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)


def robust_at(margin: float, e: float) -> float:
    """robust's loss at reward margin b * Delta = `margin`, as a float."""
    return ((1 - e) * softplus(-margin) - e * softplus(margin)) / (1 - 2 * e)


def exo_pair(x, s):  # KL(softmax(b r) over {c, r} || [1 - e, e]) (EXO, eq. 16); needs e > 0
    z, e = s.beta * _delta(x, s), torch.tensor(s.label_smoothing, device=x.chosen.device)
    return (torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-e))
            + torch.sigmoid(-z) * (F.logsigmoid(-z) - torch.log(e)))


def nca_pair(x, s):  # -log s(b r_c) - 1/2 log s(-b r_c) - 1/2 log s(-b r_r)
    chosen, rejected = x.logratios()
    return -F.logsigmoid(s.beta * chosen) - 0.5 * F.logsigmoid(-s.beta * chosen) - 0.5 * F.logsigmoid(-s.beta * rejected)


def bco_pair(x, s):  # -log s(b r_c) - log s(-b r_r): each completion classified on its own (TRL 1.16: no running mean)
    chosen, rejected = x.logratios()
    return -F.logsigmoid(s.beta * chosen) - F.logsigmoid(-s.beta * rejected)


def sppo_hard(x, s):  # (r_c - 1/(2b))^2 + (r_r + 1/(2b))^2: SPPO with hard win probabilities 1 and 0
    chosen, rejected = x.logratios()
    return (chosen - 0.5 / s.beta) ** 2 + (rejected + 0.5 / s.beta) ** 2


def aot(x, s):  # the smoothed sigmoid on sorted(pi_c - pi_r) - sorted(ref_c - ref_r) over the micro-batch
    policy, _ = torch.sort(x.chosen - x.rejected, dim=0)
    ref, _ = torch.sort(x.ref_chosen - x.ref_rejected, dim=0)
    return smoothed_sigmoid(s.beta * (policy - ref), s.label_smoothing)


def aot_unpaired(x, s):  # the smoothed sigmoid on sorted(r_c) - sorted(r_r) over the micro-batch
    chosen, rejected = x.logratios()
    return smoothed_sigmoid(s.beta * (torch.sort(chosen, dim=0)[0] - torch.sort(rejected, dim=0)[0]), s.label_smoothing)


def apo_zero(x, s):  # 1 - s(b r_c) + s(b r_r): raise chosen, lower rejected (APO, eq. 7)
    chosen, rejected = x.logratios()
    return 1 - torch.sigmoid(s.beta * chosen) + torch.sigmoid(s.beta * rejected)


def apo_down(x, s):  # s(b r_c) + 1 - s(b (r_c - r_r)): lower both, rejected more (APO, eq. 8)
    chosen, rejected = x.logratios()
    return torch.sigmoid(s.beta * chosen) + (1 - torch.sigmoid(s.beta * (chosen - rejected)))


def discopop(x, s):  # logistic and exponential losses blended by s(b Delta / tau) (DiscoPOP, eq. 5)
    z = s.beta * _delta(x, s)
    mix = torch.sigmoid(z / s.discopop_tau)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def sigmoid_norm(x, s):  # -log s(b (r_c / n_c - r_r / n_r)): length-normalised DPO (Tulu 3's dpo_norm)
    chosen, rejected = x.per_token(*scores(x, s))
    return -F.logsigmoid(s.beta * (chosen - rejected))


def sft(x, s):  # -log pi(y_c|x), summed per pair: averaged over the step's chosen tokens (per_token)
    return -x.chosen


_SIGMOID_LIMITS = Limits(lambda beta, n: _SIGMOID_MARGIN, _SEPARATED_WHY, lambda e: 0.05)
_TRL = "DPOTrainer"
DISCOPOP_TAU = Key("discopop_tau", 0.05, "DiscoPOP's temperature: how sharply the margin blends the logistic loss into "
                   "the exponential one (loss_type=discopop).", min=0.0, min_exclusive=True)

OBJECTIVES = (
    Objective("sigmoid", sigmoid, "DPO: the Bradley-Terry preference against the reference", "Rafailov et al. 2023, "
              "arXiv:2305.18290", _TRL, f_divergence=True, limits=_SIGMOID_LIMITS),
    Objective("cdpo", cdpo, "conservative DPO: sigmoid with a share label_smoothing of flipped labels",
              "Mitchell 2023, 'A note on DPO with noisy preferences'", "none (TRL < 1.0's sigmoid with "
              "label_smoothing; LLaMA-Factory's cdpo)", smoothing=True, f_divergence=True,
              # its loss never falls below the binary entropy H(e): the early limit is its value at separation
              limits=Limits(lambda beta, n: _SIGMOID_MARGIN, _SEPARATED_WHY, lambda e: cdpo_at(SEPARATED, e))),
    Objective("hinge", hinge, "SLiC: a hinge on the margin, no gradient past 1", "Zhao et al. 2023, arXiv:2305.10425",
              _TRL, f_divergence=True,
              # 0 with no gradient once a margin reaches 1, by design: a low loss is no sign
              limits=Limits(lambda beta, n: _SIGMOID_MARGIN, "10x the margin of 1 where the hinge loss is 0 and stops "
                            "pulling; growth now only pushes log-probs apart", None)),
    Objective("ipo", ipo, "IPO: a squared per-token margin towards 1/(2 beta), no saturation", "Azar et al. 2023, "
              "arXiv:2310.12036", _TRL, usual_beta="0.01-0.5", f_divergence=True,
              # the optimum is rewards/margins = n/2 over n tokens; at n the loss is back at its start; 0 at the
              # optimum by design: no early sign
              limits=Limits(lambda beta, n: n, "twice IPO's optimum of 1/(2 beta) nats per token over {tokens:.0f} "
                            "chosen tokens: the loss is back above its value at the start", None)),
    Objective("exo_pair", exo_pair, "EXO: the reverse KL to [1 - e, e] over the pair; needs label_smoothing > 0 "
              "(1e-3)", "Ji et al. 2024, arXiv:2402.00856", _TRL, smoothing=True, f_divergence=True,
              refuse=lambda s: None if s.label_smoothing > 0 else "needs label_smoothing above 0 (it takes "
              "log(label_smoothing)); EXO's paper recommends 1e-3"),
    Objective("nca_pair", nca_pair, "NCA: absolute rewards, keeps the chosen likelihood up", "Chen et al. 2024, "
              "arXiv:2402.05369", _TRL),
    Objective("robust", robust, "rDPO: unbiased under a share label_smoothing of flipped labels", "Chowdhury et al. "
              "2024, arXiv:2403.00409", _TRL, smoothing=True, f_divergence=True,
              limits=Limits(lambda beta, n: _SIGMOID_MARGIN, _SEPARATED_WHY, lambda e: robust_at(SEPARATED, e)),
              refuse=lambda s: None if s.label_smoothing < 0.5 else "needs label_smoothing below 0.5 (it divides by 1 "
              f"- 2*label_smoothing); it is {s.label_smoothing}"),
    Objective("bco_pair", bco_pair, "BCO on pairs: each completion classified as good or bad on its own",
              "Jung et al. 2024, arXiv:2404.04656", _TRL),
    Objective("sppo_hard", sppo_hard, "SPPO with hard win probabilities: rewards towards +-1/2", "Wu et al. 2024, "
              "arXiv:2405.00675", _TRL, usual_beta="0.001-0.1",
              limits=Limits(lambda beta, n: 2.0, "twice SPPO's optimum margin of 1 (rewards +1/2 and -1/2): the "
                            "log-ratios overshoot it", None)),
    Objective("aot", aot, "AOT: stochastic dominance of the policy's log-ratios over the reference's, paired",
              "Melnyk et al. 2024, arXiv:2406.05882", _TRL, smoothing=True, weighs=False),
    Objective("aot_unpaired", aot_unpaired, "AOT, unpaired: chosen log-ratios dominate rejected ones",
              "Melnyk et al. 2024, arXiv:2406.05882", _TRL, smoothing=True, weighs=False),
    Objective("apo_zero", apo_zero, "APO-zero: for chosen answers better than the model's own", "D'Oosterlinck et "
              "al. 2024, arXiv:2408.06266", _TRL),
    Objective("apo_down", apo_down, "APO-down: for chosen answers worse than the model's own", "D'Oosterlinck et "
              "al. 2024, arXiv:2408.06266", _TRL),
    Objective("discopop", discopop, "DiscoPOP: logistic and exponential losses, blended by the margin", "Chris Lu "
              "et al. 2024, arXiv:2406.08414", _TRL, usual_beta="0.05", f_divergence=True, keys=(DISCOPOP_TAU,),
              limits=_SIGMOID_LIMITS),  # its loss falls like the sigmoid's: e^-z beyond the blend
    Objective("sigmoid_norm", sigmoid_norm, "length-normalised DPO (Tulu 3's dpo_norm): the margin per token",
              "Lambert et al. 2024 (Tulu 3), arXiv:2411.15124", _TRL, usual_beta="5", f_divergence=True,
              limits=Limits(lambda beta, n: _SIGMOID_MARGIN * n, "the per-token margin is 10: the sigmoid loss on "
                            "it is below 5e-5, and growth only pushes log-probs apart", lambda e: 0.05)),
    Objective("sft", sft, "the NLL of the chosen tokens; with sigmoid, RPO: keeps chosen log-probs from falling",
              "Pang et al. 2024, arXiv:2404.19733", _TRL, needs_reference=False, f_divergence=True, per_token=True),
)
