"""SimPO, AlphaPO and ORPO equal TRL 1.16's experimental CPOTrainer and ORPOTrainer on the same log-probs: the
loss (the NLL term included) and every metric both log, within 1e-5.

Each trainer is built as TRL ships it, on the real tiny model and rows, and its get_batch_loss_metrics runs
unchanged: its forward, its log-prob gathering (get_batch_logps, average_log_prob), its cross-entropy NLL and its
loss. Only the policy's logits are given: a module whose logits put on each label token the log-probability this
test chose (the inputs of both computations), so both sides see the same numbers and nothing of TRL's
arithmetic is replaced."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_DATA

from lowmem_dpo.objectives import (
    OBJECTIVES,
    PairLogps,
    Settings,
    combine,
    nll_prompt,
    nll_weight,
    pair_metrics,
    per_token_loss,
)
from lowmem_dpo.objectives.metrics import LOG_ODDS_CHOSEN

B, T, V = 5, 20, 32  # pairs, tokens per sequence, the given logits' vocabulary


class GivenLogits(torch.nn.Module):
    """The policy in TRL's concatenated_forward: logits (2B, T, V) whose log-softmax at each next label is the
    log-prob the test chose."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, **kwargs):
        return SimpleNamespace(logits=self.logits)


def batch(seed: int):
    """B pairs as TRL's collator gives them (chosen_/rejected_ input_ids, attention_mask, labels with -100 off
    the completion), the logits that give the chosen per-token log-probs, and our PairLogps of the same."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2 * B, T), generator=g)
    labels, attention, prompt = torch.full((2 * B, T), -100), torch.zeros(2 * B, T, dtype=torch.long), []
    for i in range(2 * B):  # [prompt (start tokens), completion (n), padding]
        start = int(torch.randint(2, 8, (1,), generator=g))
        n = int(torch.randint(1, T - start + 1, (1,), generator=g))
        labels[i, start:start + n] = ids[i, start:start + n]
        attention[i, :start + n] = 1
        prompt.append(start)
    lp = -0.05 - 2.5 * torch.rand(2 * B, T - 1, generator=g, dtype=torch.float64)  # per-token log-probs, < 0
    # the label's logit a against V - 1 zeros: log-softmax a - log(e^a + V - 1) = lp
    a = torch.log(torch.exp(lp) * (V - 1) / -torch.expm1(lp))
    logits = torch.zeros(2 * B, T, V, dtype=torch.float64)
    logits[:, :-1].scatter_(2, ids[:, 1:, None], a[..., None])
    on = labels[:, 1:] != -100
    sums, counts = (lp * on).sum(1).float(), on.sum(1)
    # the chosen prompts' tokens 1..start-1 (token 0 has no predictor): ORPO's NLL covers them, as TRL's
    prompts = torch.tensor([lp[i, :prompt[i] - 1].sum().item() for i in range(B)], dtype=torch.float32)
    trl_batch = {"chosen_input_ids": ids[:B], "rejected_input_ids": ids[B:], "chosen_attention_mask": attention[:B],
                 "rejected_attention_mask": attention[B:], "chosen_labels": labels[:B], "rejected_labels": labels[B:]}
    x = PairLogps(sums[:B], sums[B:], counts[:B], counts[B:], chosen_prompt=prompts,
                  chosen_prompt_tokens=torch.tensor(prompt[:B]) - 1)
    return GivenLogits(logits.float()), trl_batch, x


def built(trainer_cls, config_cls, tmp_path, tiny_path, **kw):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(x) for x in open(TINY_DATA)][:8]
    args = config_cls(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, max_length=64,
                      disable_tqdm=True, **kw)
    return trainer_cls(model=AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), args=args,
                       train_dataset=datasets.Dataset.from_list(rows),
                       processing_class=AutoTokenizer.from_pretrained(tiny_path))


@pytest.fixture(scope="module")
def cpo(tmp_path_factory, tiny_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return built(CPOTrainer, CPOConfig, tmp_path_factory.mktemp("cpo"), tiny_path, loss_type="simpo", cpo_alpha=0.0)


@pytest.fixture(scope="module")
def orpo_trainer(tmp_path_factory, tiny_path):
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return built(ORPOTrainer, ORPOConfig, tmp_path_factory.mktemp("orpo"), tiny_path)


def ours(x: PairLogps, terms: list[tuple[str, float]], s: Settings) -> dict:
    """Our loss and metrics of one micro-batch that is the whole step, as objective.Pairs.loss logs them."""
    types = [t for t, _ in terms]
    if not nll_prompt(types):  # the prompts' log-probs are computed only for an NLL that covers them
        x = dataclasses.replace(x, chosen_prompt=None, chosen_prompt_tokens=None)
    nll_tokens = int(x.chosen_tokens.sum()) + (0 if x.chosen_prompt is None else int(x.chosen_prompt_tokens.sum()))
    nll = x.chosen if x.chosen_prompt is None else x.chosen + x.chosen_prompt
    loss = combine(x, s, terms).mean() + per_token_loss(x, nll_weight(terms), nll_tokens)
    out = {"loss": float(loss), "nll_loss": (-nll.sum() / nll_tokens).item()}
    return out | {metric.name: v.mean().item() for metric, v in pair_metrics(x, s, types).items()}


def assert_equal(mine: dict, trls: dict, skip=("logits/chosen", "logits/rejected")):
    for key, want in trls.items():
        if key not in skip:  # TRL's mean logits over the vocabulary: not logged here (docs/objectives.md)
            assert mine[key] == pytest.approx(want, rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("beta, gamma, alpha, smoothing", [(2.5, 1.2, 0.0, 0.0), (2.0, 0.5, 0.0, 0.2),
                                                           (2.5, 1.0, 0.25, 0.0), (1.0, 0.5, -0.3, 0.1)])
@pytest.mark.parametrize("cpo_alpha", [0.0, 0.7])  # SimPO, and CPO-SimPO: [simpo, sft] weighted [1, cpo_alpha]
def test_simpo_and_alphapo_equal_trl_s_cpo_trainer(cpo, beta, gamma, alpha, smoothing, cpo_alpha):
    model, trl_batch, x = batch(seed=int(10 * beta + 100 * gamma + 10 * alpha))
    cpo.beta, cpo.simpo_gamma, cpo.alpha, cpo.label_smoothing, cpo.cpo_alpha = beta, gamma, alpha, smoothing, cpo_alpha
    loss, metrics = cpo.get_batch_loss_metrics(model, trl_batch)
    s = Settings(beta=beta, simpo_gamma=gamma, alpha=alpha, label_smoothing=smoothing)
    name = "alphapo" if alpha else "simpo"
    terms = [(name, 1.0)] + ([("sft", cpo_alpha)] if cpo_alpha else [])
    mine = ours(x, terms, s)
    if not cpo_alpha:  # TRL logs nll_loss 0 when it does not compute it; ours logs no nll_loss then
        assert metrics.pop("nll_loss") == 0.0
    assert_equal(mine, {"loss": loss.item(), **metrics})


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_orpo_equals_trl_s_orpo_trainer(orpo_trainer, beta):
    model, trl_batch, x = batch(seed=int(100 * beta))
    orpo_trainer.beta = beta
    loss, metrics = orpo_trainer.get_batch_loss_metrics(model, trl_batch)
    mine = ours(x, [("orpo", 1.0)], Settings(beta=beta))
    assert set(metrics) - {"logits/chosen", "logits/rejected"} <= set(mine)  # every metric TRL logs, ours too
    assert_equal(mine, {"loss": loss.item(), **metrics})


def test_log_odds_stay_finite_where_a_completion_is_nearly_certain():
    """ORPO's log1mexp at per-token log-probs near 0 (a completion the model is sure of) and far below it."""
    x = PairLogps(torch.tensor([-1e-6, -30.0]), torch.tensor([-50.0, -1e-7]), torch.tensor([1, 3]),
                  torch.tensor([2, 1]))
    loss = OBJECTIVES["orpo"].formula(x, Settings(beta=1.0))
    assert torch.isfinite(loss).all()

    def log_odds(a: float) -> float:  # log(p / (1 - p)) of p = e^a, in float64
        return a - math.log(-math.expm1(a))

    want = [log_odds(-1e-6) - log_odds(-25.0), log_odds(-10.0) - log_odds(-1e-7)]  # ~ +38.8, ~ -25.6
    got = pair_metrics(x, Settings(beta=1.0), ["orpo"])[LOG_ODDS_CHOSEN]
    assert got.tolist() == pytest.approx(want, rel=1e-4)
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-w)) for w in want], rel=1e-4)
