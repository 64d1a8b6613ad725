"""One optimizer step's own parts (training/step.py): the data stream, the micro-batches, the sums it adds and
averages, and the idle forwards that pair the ranks' forwards when the base is sharded. The step over a real
model: tests/training/test_objective.py (any split, the same gradients), tests/test_train.py (accumulation, ln 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lowmem_dpo import data
from lowmem_dpo.objectives.metrics import LOSS, MARGIN, NLL_LOSS
from lowmem_dpo.runtime.ranks import World
from lowmem_dpo.training.step import Sums, idle_forwards, item_tokens, micro_batches, next_items, pair_stream


def test_pair_stream_covers_each_epoch_once_and_splits_in_order():
    pairs = [data.TokenizedPair(i, [1], [2], [3]) for i in range(10)]
    stream = pair_stream(pairs, seed=1)
    epoch = [p.row for p in next_items(stream, 10)]
    assert sorted(epoch) == list(range(10))
    second = [p.row for p in next_items(stream, 10)]
    assert sorted(second) == list(range(10)) and second != epoch  # a fresh permutation each epoch
    again = pair_stream(pairs, seed=1)
    assert [p.row for p in next_items(again, 10)] == epoch  # a function of the seed
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_sums_add_over_micro_batches_and_the_loss_mean_adds_the_nll_at_its_weight():
    a = Sums.of((LOSS, MARGIN, NLL_LOSS), nll_weight=0.5)
    a.note(LOSS, 1.2, 2)
    a.note(NLL_LOSS, 6.0, 12)  # 12 tokens
    a.items, a.tokens, a.ref_drift = 2, 40, 0.25
    b = Sums.of((LOSS, MARGIN, NLL_LOSS), nll_weight=0.5)
    b.note(LOSS, 0.6, 1)
    b.note(MARGIN, 3.0, 1)
    b.items, b.tokens, b.ref_drift = 1, 15, 0.5
    a.add(b)
    assert (a.items, a.tokens, a.ref_drift) == (3, 55, 0.75)
    means = a.means()
    assert means[LOSS.name] == pytest.approx(1.8 / 3 + 0.5 * 6.0 / 12) and means[MARGIN.name] == 3.0
    assert a.means(preference=True)[LOSS.name] == pytest.approx(0.6)  # what the warning signs judge
    assert Sums.of((LOSS,)).means() == {LOSS.name: None} and Sums.of((LOSS,)).empty


@pytest.mark.parametrize("micro_batch, idle", [(1, [0, 1]), (2, [0, 0]), (3, [0, 0])])
def test_a_rank_with_fewer_micro_batches_runs_idle_forwards_to_pair_with_the_others(micro_batch, idle):
    # three pairs over two ranks: rank 0 takes the longest and the shortest (every 2nd by length), rank 1 one
    items = [data.TokenizedPair(i, [1] * (i + 1), [2], [3]) for i in range(3)]
    assert [item_tokens(p) for p in items] == [3, 4, 5]
    got = [idle_forwards(SimpleNamespace(world=World(rank, 2)), items, micro_batch) for rank in (0, 1)]
    assert got == idle
