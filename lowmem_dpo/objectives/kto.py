"""KTO (Ethayarajh et al. 2024, arXiv:2402.01306) and its unpaired APO-zero (D'Oosterlinck et al. 2024,
arXiv:2408.06266), as TRL 1.16's KTOTrainer computes them: pure.

A row is one completion with a label: desirable (a thumbs-up) or not. KTO's reference point z0 estimates
KL(policy || reference): the policy's log-ratio to the reference on mismatched (prompt, completion) pairs of the
same micro-batch, averaged, detached and clamped at 0 (kl_share, reference_point; TRL also averages over the
processes first). A desirable row's loss is w_d (1 - s(b (r - z0))), an undesirable one's w_u (1 - s(b (z0 - r))),
r its log-ratio; apo_zero_unpaired puts 0 for z0 and needs no KL sequences. A micro-batch's loss is the mean over
its rows.

The mismatched pairs are TRL's: the rows in data order, cut into blocks of per_device_train_batch_size; within a
block row i takes the completion of row i - 1, the first row the last one's (kl_partners).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lowmem_dpo.objectives.registry import Key, Objective, Settings


@dataclass(frozen=True)
class UnpairedLogps:
    """One micro-batch of unpaired rows, (N,) each: the policy's and the reference's completion log-prob sums,
    whether each row is desirable, and the reference point z0 (a () tensor; 0 for apo_zero_unpaired)."""

    logps: torch.Tensor
    ref_logps: torch.Tensor
    desirable: torch.Tensor  # (N,) bool
    z0: torch.Tensor | float = 0.0

    def logratios(self) -> torch.Tensor:
        return self.logps - self.ref_logps  # (N,)


def kto(x: UnpairedLogps, s: Settings) -> torch.Tensor:  # eq. 7 of the KTO paper
    r = x.logratios()  # (N,)
    good, bad = 1 - F.sigmoid(s.beta * (r - x.z0)), 1 - F.sigmoid(s.beta * (x.z0 - r))
    return torch.where(x.desirable, s.desirable_weight * good, s.undesirable_weight * bad)  # (N,)


def apo_zero_unpaired(x: UnpairedLogps, s: Settings) -> torch.Tensor:  # APO-zero, unpaired (eq. 7 of APO)
    r = x.logratios()  # (N,)
    good, bad = 1 - F.sigmoid(s.beta * r), F.sigmoid(s.beta * r)
    return torch.where(x.desirable, s.desirable_weight * good, s.undesirable_weight * bad)  # (N,)


KEYS = (Key("desirable_weight", 1.0, "KTO: the weight of the desirable rows' losses (TRL's KTOConfig); with unequal "
            "classes keep desirable_weight * desirable rows / (undesirable_weight * undesirable rows) in [1, 4/3] (the "
            "KTO paper's advice, which preflight checks).", min=0.0, min_exclusive=True),
        Key("undesirable_weight", 1.0, "KTO: the weight of the undesirable rows' losses (TRL's KTOConfig).", min=0.0,
            min_exclusive=True))
OBJECTIVES = (
    Objective("kto", kto, "unpaired thumbs-up/down rows against a KL reference point", "Ethayarajh et al. 2024, "
              "arXiv:2402.01306", "KTOTrainer `kto`", keys=KEYS, unpaired=True),
    Objective("apo_zero_unpaired", apo_zero_unpaired, "unpaired rows: raise the desirable, lower the others, no "
              "KL term", "D'Oosterlinck et al. 2024, arXiv:2408.06266", "KTOTrainer `apo_zero_unpaired`", keys=KEYS,
              unpaired=True),
)
NEEDS_KL = frozenset({"kto"})  # the unpaired objectives whose reference point is the KL estimate


def kl_partners(n: int, block: int) -> list[int]:
    """For each of n rows in data order, the row whose completion its KL sequence takes: blocks of `block` rows
    (the last one shorter), each rotated by one (TRL's add_kl_completion_ids)."""
    out = []
    for start in range(0, n, block):
        size = min(block, n - start)
        out += [start + (i - 1) % size for i in range(size)]
    return out


def kl_share(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """A micro-batch's estimate of z0 before the clamp: the mean log-ratio over its KL sequences (N,), detached,
    ()."""
    return (kl_logps - ref_kl_logps).float().mean().detach()


def reference_point(share: torch.Tensor) -> torch.Tensor:
    """z0 from kl_share: at least 0."""
    return share.clamp(min=0)


def rewards(x: UnpairedLogps, s: Settings) -> torch.Tensor:
    """b times each row's log-ratio, detached (N,): TRL's rewards/chosen of the desirable rows, rewards/rejected of
    the others."""
    return s.beta * x.logratios().detach()


def weight_advice(desirable: int, undesirable: int, s: Settings) -> tuple[tuple, tuple] | None:
    """None when the classes are balanced or the weights within KTO's advice (the paper's eq. 8, as TRL 1.16
    checks it: w_d n_d / (w_u n_u) in [1, 4/3]); else the ranges of desirable_weight and of undesirable_weight
    (either, not both) that would be, rounded to 2 decimals as TRL's warning."""
    desirable, undesirable = max(desirable, 1), max(undesirable, 1)
    if desirable == undesirable:
        return None
    d = (round(undesirable * s.undesirable_weight / desirable, 2),
         round(undesirable * s.undesirable_weight / desirable * 1.33, 2))
    u = (round(desirable * s.desirable_weight / undesirable / 1.33, 2),
         round(desirable * s.desirable_weight / undesirable, 2))
    if d[0] <= s.desirable_weight <= d[1] or u[0] <= s.undesirable_weight <= u[1]:
        return None
    return d, u
