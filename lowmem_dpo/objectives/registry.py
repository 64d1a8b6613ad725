"""What an objective is: one entry holds its formula, whether it needs the reference, the keys it reads, its
warning limits, what it logs and its paper. dpo.py and reference_free.py declare the entries; __init__.py collects
them into OBJECTIVES, which config, train, precompute, guards, report and the docs read.

A formula is a pure function over one micro-batch's sequence log-probs (PairLogps) and the run's loss settings
(Settings), returning the per-pair loss (B,). The step sums its terms, weighted by loss_weights, and averages each
over the step's pairs (or, for a per-token term, over the step's chosen tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """One micro-batch of preference pairs, (B,) each: the policy's log-prob sums over each completion, the
    completions' token counts, and the reference's sums (None where the objective needs no reference)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    # the chosen rows' prompt log-prob sums and predicted prompt tokens, where a term's NLL covers the prompt too
    # (ORPO's, as TRL's); else None
    chosen_prompt: torch.Tensor | None = None
    chosen_prompt_tokens: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # use_weighting: WPO's per-pair weights (wpo_weights), detached; else None

    def logratios(self) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi/ref of the chosen and of the rejected completion, (B,) each."""
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def nll_logps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-prob sums the chosen NLL is over and their token counts, (B,) each: the chosen completions, with
        chosen_prompt their prompts too (ORPO's NLL, as TRL's)."""
        if self.chosen_prompt is None:
            return self.chosen, self.chosen_tokens
        return self.chosen + self.chosen_prompt, self.chosen_tokens + self.chosen_prompt_tokens

    def per_token(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`chosen` and `rejected` (B,) divided by their completions' token counts (at least 1), as TRL does."""
        return (chosen / self.chosen_tokens.clamp(min=1).to(chosen.dtype),
                rejected / self.rejected_tokens.clamp(min=1).to(rejected.dtype))


@dataclass(frozen=True)
class Settings:
    """The run's loss settings that formulas read: beta and label_smoothing here, each objective's own keys (the
    entries' Key declarations) on the Settings that objectives/__init__.py builds from them, which
    Config.loss_settings fills."""

    beta: float = 0.1
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class Key:
    """A config key an objective reads, declared in its entry (or, for the keys that modify several, MODIFIERS):
    its name, default, doc, type and bounds. The config's field and the Settings' are built from it."""

    name: str
    default: object
    doc: str
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    choices: tuple | None = None
    type: object = None  # its type, where the default's is not it (a null default)

    @property
    def kind(self):
        return self.type or type(self.default)


@dataclass(frozen=True)
class Limits:
    """An objective's warning-sign limits (guards.thresholds turns them into a run's numbers)."""

    margin: Callable[[float, float], float]  # (beta, chosen tokens per pair) -> the limit on rewards/margins
    margin_why: str  # what a margin above it means ({tokens}: the chosen tokens per pair)
    early_loss: Callable[[float], float] | None  # label_smoothing -> the limit on the loss; None: no early sign


@dataclass(frozen=True)
class Objective:
    """One preference objective, declared once."""

    name: str  # loss_type's value, as TRL spells it
    formula: Callable[[PairLogps, Settings], torch.Tensor]  # per-pair loss (B,)
    summary: str  # what it is for, one line (the docs' table)
    paper: str
    trl: str  # where TRL 1.16 has it: "DPOTrainer" (its loss_type of the same name), or what stands for it
    usual_beta: str = "0.1"
    needs_reference: bool = True
    smoothing: bool = False  # label_smoothing changes it
    f_divergence: bool = False  # f_divergence_type changes it (its margin is the difference of two scores)
    keys: tuple[Key, ...] = ()  # its own config keys (several entries may share one Key)
    limits: Limits | None = None  # None: the margin and early-loss signs are off for it
    per_token: bool = False  # averaged over the step's chosen tokens (sft), not over its pairs
    # The chosen tokens' NLL it adds, at this weight times its own, averaged as sft's (ORPO: 1)
    nll: float = 0.0
    nll_prompt: bool = False  # that NLL covers the prompt tokens too (TRL's ORPO, as ORPO's own code)
    # Its implicit rewards (b * r_c, b * r_r), (B,) each, detached: TRL's rewards/*; None: b times the log-ratios
    rewards: Callable[[PairLogps, Settings], tuple[torch.Tensor, torch.Tensor]] | None = None
    average_logps: bool = False  # its logps/* metrics are per-token means (TRL's CPO simpo, ORPO), not sums
    # Metrics of its own (metrics.py rows of kind "term"): row -> (B,) values, detached
    metrics: Callable[[PairLogps, Settings], dict] | None = None
    # Trains on unpaired rows (KTO): its formula takes kto.UnpairedLogps, one loss per row; it is a run's only term
    unpaired: bool = False
    weighs: bool = True  # use_weighting (WPO) may weight it, where it needs the reference
    # What it cannot compute with these settings (a config error, naming the key), or None
    refuse: Callable[[Settings], str | None] | None = None
    # What it ignores or reduces to with these settings (a warning), or None
    note: Callable[[Settings], str | None] | None = None


# -- the f-divergences of f-DPO (Wang et al. 2023, arXiv:2309.16240), as TRL 1.16 computes them ---------------------
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

# The keys that modify several objectives' losses (which ones: the entries' f_divergence, needs_reference and weighs
# flags), beyond beta and label_smoothing.
F_DIVERGENCE_TYPE = Key("f_divergence_type", "reverse_kl", "f-DPO's divergence (Wang et al. 2023): reverse_kl is "
                        "DPO's; forward_kl, js_divergence or alpha_divergence (with f_alpha_divergence_coef) change the "
                        "margin of the losses that allow it (docs/objectives.md).", choices=F_DIVERGENCES)
F_ALPHA_DIVERGENCE_COEF = Key("f_alpha_divergence_coef", 1.0, "alpha of f_divergence_type=alpha_divergence (1.0: "
                              "reverse KL).", min=0.0, min_exclusive=True)
LD_ALPHA = Key("ld_alpha", None, "LD-DPO (arXiv:2409.06411): each completion's log-prob counts its tokens beyond the "
               "pair's shorter completion at this weight, for the policy and the reference alike (its reference values "
               "are a cache side of their own); null: off (as TRL's DPOConfig).", min=0.0, max=1.0, type=Optional[float])
USE_WEIGHTING = Key("use_weighting", False, "WPO (Zhou et al. 2024): weight each pair's loss by how likely the policy "
                    "finds its two completions, per token, against its own distribution (as TRL's DPOConfig).")
MODIFIERS = (F_DIVERGENCE_TYPE, F_ALPHA_DIVERGENCE_COEF, USE_WEIGHTING, LD_ALPHA)
_EXP_MAX = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0, torch.float64: 80.0}  # exp in float32


def scores(x: PairLogps, s: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    """f'(pi/ref) of the chosen and of the rejected completion, (B,) each: the log-ratios under reverse KL (DPO)."""
    chosen, rejected = x.logratios()
    kind, alpha = s.f_divergence_type, s.f_alpha_divergence_coef
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return chosen, rejected
    if kind == "forward_kl":  # f'(t) = 1 - 1/t
        return 1 - torch.exp(-chosen), 1 - torch.exp(-rejected)
    if kind == "js_divergence":  # f'(t) = log(2t / (t + 1))
        return math.log(2) + F.logsigmoid(chosen), math.log(2) + F.logsigmoid(rejected)
    # alpha divergence: f'(t) = (t^(alpha - 1) - 1) / (alpha - 1), exp clamped to stay finite in the dtype
    out = []
    for r in (chosen, rejected):
        t = (alpha - 1.0) * r
        out.append((torch.exp(torch.clamp(t.float(), max=_EXP_MAX[t.dtype])) - 1.0).to(t.dtype) * (1.0 / (alpha - 1.0)))
    return out[0], out[1]


def wpo_weights(aligned_chosen: torch.Tensor, chosen_tokens: torch.Tensor, aligned_rejected: torch.Tensor,
                rejected_tokens: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each pair (Zhou et al. 2024, arXiv:2406.11827, eq. 2, as TRL 1.16): the product over its two
    completions of exp(the mean over its tokens of log p(token) - log sum_v p(v)^2), from the sums of those
    aligned log-probs (logps.SequenceLogps.aligned) and the token counts (at least 1). (B,), no gradient."""
    chosen = torch.exp(aligned_chosen / chosen_tokens.clamp(min=1).to(aligned_chosen.dtype))
    rejected = torch.exp(aligned_rejected / rejected_tokens.clamp(min=1).to(aligned_rejected.dtype))
    return (chosen * rejected).detach()


def smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1 - e) log s(z) - e log s(-z): the sigmoid loss with a share e of the labels assumed flipped."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def softplus(z: float) -> float:
    """log(1 + e^z) = -log s(-z), as a float, without overflow."""
    return z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))
