"""The objectives as classes (training/objective.py, training/kto.py): each holds its settings and says its forward,
loss and size; the step (step.accumulate) calls the same methods of every kind. On the tiny model with a live reference (the adapter off), a
policy equal to its reference scores ln 2 a pair; a step's items split into any micro-batches give the same loss,
sums and gradients; sizes are counted by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lowmem_dpo import data, train
from lowmem_dpo.objectives import Settings, Terms, metrics
from lowmem_dpo.runtime.ranks import World
from lowmem_dpo.training import kto
from lowmem_dpo.training.objective import Batching, Objective, Pairs, Rows
from lowmem_dpo.training.step import Pass, StepSize, accumulate


def gradients(session) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in session.trainee.params]
    session.trainee.zero_grad()
    return out


def test_a_step_split_into_any_micro_batches_is_the_same_loss_sums_and_gradients(make_cfg, pairs):
    cfg = make_cfg(ref_source="live", eval_fraction=0.0)
    session = train.setup(cfg, progress=False)
    objective, lm = session.run.objective, session.trainee.lm
    assert isinstance(objective, Pairs) and objective.ref is None and objective.reference
    size = objective.size(pairs, False)
    assert size == StepSize(6, sum(len(p.chosen_ids) for p in pairs))  # the sft term would average over these
    runs = {}
    for micro_batch in (1, 4, 6):  # the step hands the objective a Pass and calls groups and group, as for any kind
        sums = accumulate(session, pairs, micro_batch)
        runs[micro_batch] = (sums, gradients(session))
    whole, _ = runs[6]
    assert whole.items == 6 and whole.counts[metrics.LOSS.name] == 6
    # a policy equal to its reference (LoRA's B is 0): each pair's loss is -log s(0) = ln 2
    assert whole.means()[metrics.LOSS.name] == pytest.approx(math.log(2), abs=1e-6)
    assert whole.chosen_tokens == sum(len(p.chosen_ids) for p in pairs)
    for micro_batch in (1, 4):
        sums, grads = runs[micro_batch]
        assert (sums.items, sums.tokens, sums.chosen_tokens) == (6, whole.tokens, whole.chosen_tokens)
        assert sums.means()[metrics.LOSS.name] == pytest.approx(math.log(2), abs=1e-6)
        for got, want in zip(grads, runs[6][1]):
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in runs[6][1])  # the A matrices' gradients are 0, B's are not
    # an eval pass (no backward) sums the same and leaves no gradient
    sums = accumulate(session, pairs, 6, grad=False)
    assert sums.totals == pytest.approx(whole.totals) and all(p.grad is None for p in session.trainee.params)
    # one micro-batch through forward and loss: a Loss whose value is its share of the step's mean
    out = objective.loss(objective.forward(lm, pairs[:2], Pass(None, size, 2)), size)
    assert out.value.item() == pytest.approx(2 * math.log(2) / 6, abs=1e-6) and out.sums.items == 2


def test_the_groups_and_sizes_of_each_kind(pairs, tokenizer):
    batching = Batching(resolved=None, pad_id=0)
    with pytest.raises(TypeError):  # the kind itself is abstract: forward, loss and size are each class's
        Objective(batching=batching)
    rows = [data.TokenizedCompletion(0, [1, 2], [3, 4, 5]), data.TokenizedCompletion(1, [], [6, 7])]
    # position t-1 predicts token t: a completion with no prompt before it has one target fewer
    assert Rows(batching=batching).size(rows, False) == StepSize(2, 3 + 1)
    assert Rows.name == "sft" and Rows.unit == "row" and not Rows.blocks
    # pairs: one group a rank, every world-size-th item by length (longest first), so each rank gets every length
    objective = Pairs(batching=batching, terms=Terms((("sigmoid", 1.0),), Settings()))
    one = objective.groups(pairs, World())
    assert len(one) == 1 and sorted(p.row for p in one[0]) == sorted(p.row for p in pairs)
    ranks = [objective.groups(pairs, World(rank, 2))[0] for rank in (0, 1)]
    assert [p.row for p in ranks[0]] == [p.row for p in one[0][0::2]] and len(ranks[1]) == 3
    assert objective.metrics[0] == metrics.LOSS and objective.nll_weight is None
    # KTO: whole blocks, every world-size-th; a step's size is its blocks
    blocks = kto.Blocks(batching=batching, formula=None, settings=Settings())
    items = [[pairs[0], pairs[1]], [pairs[2]], [pairs[3], pairs[4], pairs[5]]]
    assert blocks.groups(items, World(1, 2)) == [items[1]] and blocks.groups(items, World()) == items
    assert blocks.size(items, True) == StepSize(3) and blocks.metrics == metrics.BLOCK_METRICS
    assert blocks.samples_from(items) == items  # no eval labels: every row
