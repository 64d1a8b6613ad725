"""Every objective TRL 1.16's DPOTrainer has equals TRL's own computation on the same log-probs: the loss, and
every metric both log (rewards/*, logps/*), within 1e-5.

TRL's DPOTrainer._compute_loss runs as TRL ships it, on a trainer built from the real tiny model. Only the policy's
forward is given: a module that returns the per-token log-probs this test chose (the inputs of both computations),
and the reference's log-probs come as TRL's precomputed columns. So both sides see the same numbers, including
extreme ones (log-ratios of +-40 nats), and nothing of TRL's arithmetic is replaced."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_DATA

from lowmem_dpo.objectives import (
    OBJECTIVES,
    PairLogps,
    Settings,
    combine,
    nll_weight,
    pair_metrics,
    per_token_loss,
    wpo_weights,
)

B, T = 6, 24  # pairs, tokens per sequence
TRL_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


class GivenLogps(torch.nn.Module):
    """The policy's forward in TRL's _compute_loss: per-token log-probs chosen by the test (2B, T - 1)."""

    def __init__(self, per_token: torch.Tensor, log_sum_sq: torch.Tensor | None = None):
        super().__init__()
        self.per_token, self.log_sum_sq = per_token, log_sum_sq

    def forward(self, input_ids, **kwargs):
        zeros = torch.zeros_like(self.per_token)
        return SimpleNamespace(log_probs=self.per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                               log_sum_sq_probs=zeros if self.log_sum_sq is None else self.log_sum_sq)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tiny_path):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(x) for x in open(TINY_DATA)][:8]
    config = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True, bf16=False,
                       max_length=64, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    t = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                   processing_class=AutoTokenizer.from_pretrained(tiny_path))
    t.model.train()  # its metrics go to _metrics["train"]
    t.precompute_ref_logps = True  # the reference's log-probs come with the batch, as TRL's precomputed columns
    return t


def batch(seed: int, scale: float):
    """A batch of B pairs: completion masks of 1..T-4 tokens after a prompt, per-token policy log-probs, and
    reference sums `scale` nats around the policy's."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * B, T, dtype=torch.long)
    for i in range(2 * B):
        start = int(torch.randint(2, 6, (1,), generator=g))
        n = int(torch.randint(1, T - start + 1, (1,), generator=g))
        mask[i, start:start + n] = 1
    # (2B, T-1); 0 off the completion, as TRL's LM head gives for a label of -100
    per_token = -3 * torch.rand(2 * B, T - 1, generator=g) * mask[:, 1:]
    sums = per_token.sum(dim=1)
    ref = sums + scale * torch.randn(2 * B, generator=g)
    inputs = {"input_ids": torch.ones(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": ref[:B], "ref_rejected_logps": ref[B:]}
    x = PairLogps(sums[:B], sums[B:], mask[:B].sum(1), mask[B:].sum(1), ref[:B], ref[B:])
    return per_token, inputs, x


def trl_numbers(trainer, per_token, inputs, loss_type, s: Settings, log_sum_sq=None) -> dict:
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer.use_weighting = log_sum_sq is not None
    trainer.beta, trainer.label_smoothing = s.beta, s.label_smoothing
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef = s.f_divergence_type, s.f_alpha_divergence_coef
    trainer.args.discopop_tau = s.discopop_tau
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(GivenLogps(per_token, log_sum_sq), inputs, False)
    return {"loss": loss.item(), **{k: trainer._metrics["train"][k][-1] for k in METRICS}}


def our_numbers(x: PairLogps, loss_type: str, s: Settings) -> dict:
    o = OBJECTIVES[loss_type]
    loss = (per_token_loss(x, nll_weight([(loss_type, 1.0)]), int(x.chosen_tokens.sum())) if o.per_token
            else combine(x, s, [(loss_type, 1.0)]).mean())
    ours = {metric.name: values.mean().item() for metric, values in pair_metrics(x, s, [loss_type]).items()}
    return {"loss": loss.item(), **ours}


def assert_equal(ours: dict, trls: dict):
    for key, want in trls.items():
        assert ours[key] == pytest.approx(want, rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("loss_type", TRL_LOSSES)
@pytest.mark.parametrize("scale", [1.0, 40.0])  # log-ratios around 1 nat, and saturating ones
def test_each_loss_type_equals_trl_s(trainer, loss_type, scale):
    per_token, inputs, x = batch(seed=len(loss_type) + int(scale), scale=scale)
    s = Settings(beta=0.1, label_smoothing=0.1 if OBJECTIVES[loss_type].smoothing else 0.0, discopop_tau=0.05)
    assert_equal(our_numbers(x, loss_type, s), trl_numbers(trainer, per_token, inputs, loss_type, s))


@pytest.mark.parametrize("divergence, alpha", [("forward_kl", 1.0), ("js_divergence", 1.0),
                                               ("alpha_divergence", 0.5), ("alpha_divergence", 1.0)])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm", "discopop", "robust"])
def test_f_divergences_equal_trl_s(trainer, divergence, alpha, loss_type):
    per_token, inputs, x = batch(seed=7, scale=1.0)
    s = Settings(beta=0.2, label_smoothing=0.1 if loss_type == "robust" else 0.0, f_divergence_type=divergence,
                 f_alpha_divergence_coef=alpha)
    assert_equal(our_numbers(x, loss_type, s), trl_numbers(trainer, per_token, inputs, loss_type, s))


@pytest.mark.parametrize("loss_type", [t for t in TRL_LOSSES if t not in ("aot", "aot_unpaired", "sft")])
def test_wpo_weighting_equals_trl_s(trainer, loss_type):
    """use_weighting: each pair's loss times WPO's weight, from per-token log sum_v p(v)^2 (given to both sides)."""
    per_token, inputs, x = batch(seed=11, scale=1.0)
    mask = inputs["completion_mask"][:, 1:]
    g = torch.Generator().manual_seed(3)
    log_sum_sq = -1.5 * torch.rand(per_token.shape, generator=g)  # (2B, T-1): log sum_v p(v)^2 <= 0
    aligned = ((per_token - log_sum_sq) * mask).sum(1)  # (2B,)
    x = dataclasses.replace(x, weights=wpo_weights(aligned[:B], x.chosen_tokens, aligned[B:], x.rejected_tokens))
    assert not torch.allclose(x.weights, torch.ones(B))  # the weights change the loss
    s = Settings(beta=0.1, label_smoothing=0.1 if OBJECTIVES[loss_type].smoothing else 0.0, use_weighting=True)
    assert_equal(our_numbers(x, loss_type, s), trl_numbers(trainer, per_token, inputs, loss_type, s, log_sum_sq))


@pytest.mark.parametrize("loss_type", ["sigmoid", "sigmoid_norm", "ipo", "apo_zero"])
def test_ld_alpha_equals_trl_s(trainer, loss_type):
    """ld_alpha (LD-DPO): the policy's sums weight each completion's tokens beyond its pair's shorter completion,
    by logps.ld_weights on the same completion masks TRL reads; the reference's come precomputed, as TRL's."""
    from lowmem_dpo.model.logps import ld_weights

    per_token, inputs, x = batch(seed=9, scale=1.0)
    mask = inputs["completion_mask"]  # (2B, T); unshared: each row is its own output
    seq, label = (mask[:, 1:] > 0).nonzero(as_tuple=True)
    label = label + 1
    w = ld_weights(seq, 2 * B, 0.3)  # (M,)
    assert 0 < (w == 0.3).sum() < w.numel()  # some tokens are beyond the shorter completion, not all
    sums = torch.zeros(2 * B).index_add(0, seq, per_token[seq, label - 1] * w)  # (2B,)
    x = dataclasses.replace(x, chosen=sums[:B], rejected=sums[B:])
    s = Settings(beta=0.1, ld_alpha=0.3)
    trainer.ld_alpha = 0.3
    try:
        assert_equal(our_numbers(x, loss_type, s), trl_numbers(trainer, per_token, inputs, loss_type, s))
    finally:
        trainer.ld_alpha = None


def test_the_list_of_trl_s_loss_types_is_trl_s():
    """The objectives hold every loss_type TRL 1.16's DPOTrainer knows (its own list, in its error message), and
    cdpo besides."""
    import inspect
    import re

    from trl import DPOTrainer

    listed = re.search(r"Should be one of \[(.*?)\]", inspect.getsource(DPOTrainer._compute_loss), re.S).group(1)
    assert set(re.findall(r"'(\w+)'", listed)) == set(TRL_LOSSES)
    assert {n for n, o in OBJECTIVES.items() if (o.needs_reference or o.per_token) and not o.unpaired} == set(
        TRL_LOSSES) | {"cdpo"}
