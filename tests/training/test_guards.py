"""The DPO warning signs per loss type (guards.thresholds): limits worked out by hand, then checked against the
losses themselves (loss.dpo_loss) for what the limits claim, and the signs they raise."""

from __future__ import annotations

import math

import pytest
import torch

from lowmem_dpo.objectives import OBJECTIVES, PairLogps, Settings
from lowmem_dpo.training import guards


def limits(loss_type):
    return OBJECTIVES[loss_type].limits if loss_type else guards.SEVERAL


def thresholds(loss_type, *args, **kw):
    return guards.thresholds(limits(loss_type), *args, **kw)

# loss_type, beta, label_smoothing, chosen tokens per pair -> (margin limit, early-loss limit or None), by hand:
#   sigmoid, robust, hinge: margin 10 whatever beta and the length.
#   sigmoid: early 0.05 (as before per-loss limits).
#   robust, e = 0: it is the sigmoid loss, 0.05. e = 0.1: at x0 = ln(1 / (e^0.05 - 1)) = ln(19.50416) = 2.970628,
#     log s(x0) = -0.05 and log s(-x0) = -ln(20.50416) = -3.020628, so
#     (-(0.9)(-0.05) + 0.1 (-3.020628)) / 0.8 = (0.045 - 0.3020628) / 0.8 = -0.3213285.
#   cdpo, e = 0: the sigmoid loss, 0.05. e = 0.1: at the same x0, 0.9 * 0.05 + 0.1 * 3.020628 = 0.3470628 (its loss
#     never goes below the binary entropy H(0.1) = 0.325).
#   hinge: no early limit (0 once every margin reaches 1, by design).
#   ipo: margin = n (twice the optimum n/2: beta * n * 1/(2 beta) = n/2 over n tokens), whatever beta;
#     beta 0.1, 20 tokens -> 20; beta 0.5, 64 tokens -> 64. No early limit (0 at the optimum).
CASES = [
    ("sigmoid", 0.1, 0.0, 20.0, 10.0, 0.05),
    ("sigmoid", 0.5, 0.0, 300.0, 10.0, 0.05),
    ("robust", 0.1, 0.0, 20.0, 10.0, 0.05),
    ("robust", 0.1, 0.1, 20.0, 10.0, -0.3213285),
    ("cdpo", 0.1, 0.0, 20.0, 10.0, 0.05),
    ("cdpo", 0.1, 0.1, 20.0, 10.0, 0.3470628),
    ("hinge", 0.1, 0.0, 20.0, 10.0, None),
    ("ipo", 0.1, 0.0, 20.0, 20.0, None),
    ("ipo", 0.5, 0.0, 64.0, 64.0, None),
]


@pytest.mark.parametrize("loss_type, beta, e, tokens, margin, early", CASES)
def test_thresholds_hand_computed(loss_type, beta, e, tokens, margin, early):
    t = thresholds(loss_type, beta, e, tokens)
    assert t.margin == pytest.approx(margin, rel=1e-9)
    assert (t.early_loss is None) == (early is None)
    if early is not None:
        assert t.early_loss == pytest.approx(early, abs=1e-6)
    assert (t.early_fraction, t.chosen_drop_per_token) == (0.2, 0.5)  # the same for every loss


def test_every_objective_declares_its_limits_or_none_and_the_default_is_the_sigmoid_s():
    guarded = {n for n, o in OBJECTIVES.items() if o.limits is not None}
    assert {"sigmoid", "cdpo", "robust", "hinge", "ipo", "sigmoid_norm", "discopop", "sppo_hard"} <= guarded
    assert thresholds("sigmoid", 0.1, 0.0, 20.0) == guards.Thresholds()  # the default is the sigmoid's
    assert guards.thresholds(None, 0.1, 0.0, 20.0) == guards.UNGUARDED  # no limits: no such context
    notes = guards.context_signs({"rewards/margins": 1e6, "loss": 0.0, "rewards/chosen": 0.0}, 1, 100, 0.1,
                                 guards.UNGUARDED)
    assert notes == []


def test_a_weighted_or_missing_preference_loss_moves_or_drops_the_early_limit():
    """loss_type [sigmoid, sft] with sigmoid weighted 2: the preference part is 2x the sigmoid loss, so its early
    limit is 2 x 0.05; loss_type [sft] (or several preference terms) has no early limit, the sigmoid's margin."""
    assert thresholds("sigmoid", 0.1, 0.0, 20.0, weight=2.0).early_loss == pytest.approx(0.1)
    none = thresholds(None, 0.1, 0.0, 20.0)
    assert (none.margin, none.early_loss) == (10.0, None)


def _loss(loss_type: str, reward_margin: float, beta: float, e: float = 0.0, tokens: int = 20) -> float:
    """The objective's loss on one pair whose rewards/margins is `reward_margin` (the whole margin on the chosen
    side), with `tokens` completion tokens on each side."""
    delta = torch.tensor([reward_margin / beta], dtype=torch.float64)
    zero = torch.zeros(1, dtype=torch.float64)
    n = torch.tensor([tokens])
    x = PairLogps(delta, zero, n, n, zero, zero)
    return OBJECTIVES[loss_type].formula(x, Settings(beta=beta, label_smoothing=e)).item()


def test_the_limits_mean_what_they_say():
    """sigmoid: at the margin limit the loss is below 5e-5; robust's early limit is its loss at the margin where
    the sigmoid's is 0.05; ipo: at the margin limit the loss is back to its value at the start, at half of it the
    loss is 0; hinge: 0 from a margin of 1 on."""
    assert _loss("sigmoid", thresholds("sigmoid", 0.1, 0, 20).margin, 0.1) < 5e-5
    x0 = math.log(1 / math.expm1(0.05))
    assert _loss("sigmoid", x0, 0.1) == pytest.approx(0.05, rel=1e-9)
    assert _loss("robust", x0, 0.1, 0.1) == pytest.approx(thresholds("robust", 0.1, 0.1, 20).early_loss,
                                                          rel=1e-9)
    for beta, tokens in ((0.1, 20), (0.5, 64)):
        limit = thresholds("ipo", beta, 0, tokens).margin
        start = _loss("ipo", 0.0, beta, tokens=tokens)
        assert start == pytest.approx(1 / (4 * beta ** 2))
        assert _loss("ipo", limit, beta, tokens=tokens) == pytest.approx(start)
        assert _loss("ipo", limit / 2, beta, tokens=tokens) == pytest.approx(0.0, abs=1e-12)
    assert _loss("hinge", 1.0, 0.1) == 0.0 and _loss("hinge", 0.99, 0.1) > 0


CALM = {"rewards/margins": 0.5, "loss": 0.6, "rewards/chosen": -0.01}


@pytest.mark.parametrize("loss_type, e, margin, flagged", [
    ("sigmoid", 0.0, 15.0, True),  # > 10
    ("ipo", 0.0, 15.0, False),  # below 20 (its optimum over 20 tokens is 10)
    ("ipo", 0.0, 21.0, True),
    ("hinge", 0.0, 10.5, True),
])
def test_margin_sign_per_loss(loss_type, e, margin, flagged):
    t = thresholds(loss_type, 0.1, e, 20.0)
    signs = guards.context_signs({**CALM, "rewards/margins": margin}, 50, 100, 0.1, t)
    assert [s.startswith("reward margin exploding") for s in signs] == ([True] if flagged else [])
    if flagged and loss_type == "ipo":
        assert signs[0] == ("reward margin exploding: rewards/margins 21.00 > 20 (twice IPO's optimum of "
                            "1/(2 beta) nats per token over 20 chosen tokens: the loss is back above its value at "
                            "the start)")


@pytest.mark.parametrize("loss_type, e, loss, flagged", [
    ("sigmoid", 0.0, 0.0, True),
    ("sigmoid", 0.0, 0.06, False),
    ("hinge", 0.0, 0.0, False),  # 0 by design
    ("ipo", 0.0, 0.0, False),  # 0 at its optimum
    ("robust", 0.1, -0.30, False),  # above -0.3213
    ("robust", 0.1, -0.33, True),
])
def test_early_loss_sign_per_loss(loss_type, e, loss, flagged):
    t = thresholds(loss_type, 0.1, e, 20.0)
    signs = guards.context_signs({**CALM, "loss": loss}, 10, 100, 0.1, t)
    assert [s.startswith("loss collapsing early") for s in signs] == ([True] if flagged else [])
