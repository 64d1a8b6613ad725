"""use_weighting (WPO) in a real run: step 1's loss is ln 2 (the policy is the reference) times the mean of the
pairs' WPO weights, each worked out by hand from the model's full distribution; and the combinations TRL cannot
weight are refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lowmem_dpo import precompute, train
from lowmem_dpo.runtime.errors import ConfigError
from lowmem_dpo.training import loop
from lowmem_dpo.training.step import next_items


def test_step_one_loss_is_ln2_times_the_mean_wpo_weight(make_cfg, tmp_path):
    cfg = make_cfg(use_weighting=True, max_steps=1, eval_fraction=0.0)
    precompute.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)
    items = next_items(session.progress.stream, session.run.items_per_step)
    session.progress.stream = iter(items)
    weights = []
    with torch.no_grad(), session.trainee.model.disable_adapter():
        for p in items:
            w = 1.0
            for completion in (p.chosen_ids, p.rejected_ids):
                ids = torch.tensor([p.prompt_ids + completion])  # (1, T)
                logp = torch.log_softmax(session.trainee.model(input_ids=ids).logits[0, :-1].float(), -1)  # (T-1, V)
                tok = logp.gather(1, ids[0, 1:, None])[:, 0]  # (T-1,)
                aligned = (tok - torch.logsumexp(2 * logp, -1))[len(p.prompt_ids) - 1:]  # the completion's tokens
                w *= math.exp(aligned.mean().item())
            weights.append(w)
    loop.run(session, progress=False)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert max(abs(w - 1) for w in weights) > 0.01  # the weights change the loss
    assert step["loss"] == pytest.approx(math.log(2) * sum(weights) / len(weights), rel=1e-4)


@pytest.mark.parametrize("loss_type", ["aot", "sft", "simpo", "orpo"])
def test_what_wpo_cannot_weight_is_refused(make_cfg, loss_type):
    with pytest.raises(ConfigError, match=f"use_weighting=true with loss_type={loss_type}: WPO weights the losses"):
        make_cfg(use_weighting=True, loss_type=[loss_type])
