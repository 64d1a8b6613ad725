"""The objectives' formulas (lowmem_dpo.objectives) against numbers worked out by hand."""

import math

import pytest
import torch

from lowmem_dpo.objectives import (
    OBJECTIVES,
    PairLogps,
    Settings,
    combine,
    nll_weight,
    pair_metrics,
    per_token_loss,
)
from lowmem_dpo.objectives.metrics import REWARDS_CHOSEN, REWARDS_REJECTED


def dpo_loss(pc, pr, rc, rr, *, beta, loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None,
             rejected_lengths=None):
    """(per-pair losses, chosen rewards, rejected rewards) of one objective on sequence log-prob sums."""
    ones = torch.ones_like(pc, dtype=torch.long)
    x = PairLogps(pc, pr, ones if chosen_lengths is None else chosen_lengths,
                  ones if rejected_lengths is None else rejected_lengths, rc, rr)
    s = Settings(beta=beta, label_smoothing=label_smoothing)
    return (OBJECTIVES[loss_type].formula(x, s), *rewards(x, s, [loss_type]))


def rewards(x: PairLogps, s: Settings, loss_types) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected rewards a run of `loss_types` logs (objectives.pair_metrics)."""
    logged = pair_metrics(x, s, loss_types)
    return logged[REWARDS_CHOSEN], logged[REWARDS_REJECTED]


def preference_losses(pc, pr, rc, rr, *, beta, terms):
    ones = torch.ones_like(pc, dtype=torch.long)
    x, s = PairLogps(pc, pr, ones, ones, rc, rr), Settings(beta=beta)
    return (combine(x, s, terms), *rewards(x, s, [t for t, _ in terms]))


def sft_shares(chosen, chosen_tokens):
    """sft's per-pair shares of the mean over the step's chosen tokens (objective.Pairs.loss divides by them)."""
    ones = torch.ones_like(chosen, dtype=torch.long)
    return OBJECTIVES["sft"].formula(PairLogps(chosen, chosen, ones, ones), Settings()) / max(1, chosen_tokens)

# One pair: policy chosen -10, rejected -12; reference -11 for both.
#   r_c = -10 - (-11) = 1,  r_r = -12 - (-11) = -1,  Delta = r_c - r_r = 2.
PC, PR, RC, RR = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))
LOG_SIG_1 = -math.log1p(math.exp(-1))  # log s(1) = -0.31326169
LOG_SIG_M1 = -math.log1p(math.exp(1))  # log s(-1) = -1.31326169


def test_sigmoid_by_hand():
    """beta 0.5: b*Delta = 1, loss = -log s(1) = log(1 + e^-1) = 0.31326169.
    Rewards: 0.5 * 1 = 0.5 and 0.5 * -1 = -0.5."""
    losses, rc, rr = dpo_loss(PC, PR, RC, RR, beta=0.5)
    assert losses.item() == pytest.approx(0.31326169, abs=1e-6)
    assert rc.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)


def test_label_smoothing_is_cdpo_s_not_sigmoid_s():
    """cdpo, e = 0.1: 0.9 * 0.31326169 + 0.1 * 1.31326169 = 0.28193552 + 0.13132617 = 0.41326169. sigmoid with the
    same e is plain DPO's 0.31326169, as TRL 1.16 computes it (tests/test_vs_trl.py checks against TRL itself)."""
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="cdpo", label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.41326169, abs=1e-6)
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.31326169, abs=1e-6)


def test_hinge_by_hand():
    """beta 0.25: 1 - 0.25 * 2 = 0.5. beta 0.5: max(0, 1 - 1) = 0."""
    assert dpo_loss(PC, PR, RC, RR, beta=0.25, loss_type="hinge")[0].item() == pytest.approx(0.5)
    assert dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="hinge")[0].item() == pytest.approx(0.0)


def test_ipo_by_hand():
    """Lengths 2 (chosen) and 4 (rejected): 1/2 - (-1/4) = 0.75; beta 0.5: 1/(2b) = 1; (0.75 - 1)^2 = 0.0625."""
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo", chosen_lengths=torch.tensor([2]),
                            rejected_lengths=torch.tensor([4]))
    assert losses.item() == pytest.approx(0.0625, abs=1e-7)


def test_robust_by_hand():
    """e = 0.1, beta 0.5: (0.9 * 0.31326169 - 0.1 * 1.31326169) / 0.8 = (0.28193552 - 0.13132617) / 0.8
    = 0.18826169. With e = 0 it equals the sigmoid loss."""
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="robust", label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.18826169, abs=1e-6)
    assert losses.item() == pytest.approx((-0.9 * LOG_SIG_1 + 0.1 * LOG_SIG_M1) / 0.8, abs=1e-7)
    plain = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="robust")[0]
    assert plain.item() == pytest.approx(0.31326169, abs=1e-6)


def test_policy_equal_to_reference_gives_ln2():
    x = torch.tensor([-5.0, -80.0, -3.5])
    y = torch.tensor([-7.0, -20.0, -3.5])
    losses, rc, rr = dpo_loss(x, y, x, y, beta=0.1)
    assert torch.allclose(losses, torch.full((3,), math.log(2)))
    assert torch.equal(rc, torch.zeros(3)) and torch.equal(rr, torch.zeros(3))


def test_gradient_pushes_chosen_up():
    pc = torch.tensor([-10.0], requires_grad=True)
    pr = torch.tensor([-10.0], requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-10.0]), torch.tensor([-10.0]), beta=0.1)[0].sum().backward()
    # d/dpc of -log s(b(pc - pr)) at 0 = -b * s(0) = -0.05
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)


def test_loss_list_sums_weighted_terms_by_hand():
    """[sigmoid, hinge] weights [2, 0.5], beta 0.5 (b*Delta = 1): 2 * 0.31326169 + 0.5 * max(0, 1 - 1) = 0.62652338.
    sft is not a per-pair preference term: it adds nothing here (sft_shares)."""
    losses, rc, rr = preference_losses(PC, PR, RC, RR, beta=0.5, terms=[("sigmoid", 2.0), ("hinge", 0.5),
                                                                        ("sft", 3.0)])
    assert losses.item() == pytest.approx(0.62652338, abs=1e-6)
    assert rc.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)
    only_sft, _, _ = preference_losses(PC, PR, RC, RR, beta=0.5, terms=[("sft", 1.0)])
    assert only_sft.item() == 0.0


def test_sft_shares_sum_to_the_mean_nll_per_chosen_token():
    """Chosen log-prob sums -6 (3 tokens) and -2 (1 token): the NLL per token over both is 8 / 4 = 2, split 6/4 and
    2/4 whichever micro-batch each pair is in."""
    shares = sft_shares(torch.tensor([-6.0, -2.0]), chosen_tokens=4)
    assert shares.tolist() == [1.5, 0.5] and shares.sum().item() == 2.0


def test_per_token_loss_is_the_weighted_mean_nll_over_the_step_s_chosen_tokens_in_any_split():
    """[sigmoid, sft] weights [1, 3]: the pairs of the test above, in one micro-batch or in two, give
    3 * 8 / 4 = 6 in all; the per-pair term adds nothing here, and a list without sft gives 0."""
    chosen = torch.tensor([-6.0, -2.0])
    ones = torch.ones(2, dtype=torch.long)
    terms = [("sigmoid", 1.0), ("sft", 3.0)]
    weight = nll_weight(terms)
    whole = per_token_loss(PairLogps(chosen, chosen, ones, ones), weight, nll_tokens=4)
    parts = [per_token_loss(PairLogps(c, c, ones[:1], ones[:1]), weight, nll_tokens=4) for c in chosen.split(1)]
    assert weight == 3.0 and whole.item() == 6.0 and sum(p.item() for p in parts) == 6.0
    assert nll_weight([("sigmoid", 1.0)]) is None
    assert per_token_loss(PairLogps(chosen, chosen, ones, ones), nll_weight([("sigmoid", 1.0)]), nll_tokens=4) == 0
