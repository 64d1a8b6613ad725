"""The warning signs of a run of pairs, from its sums (guards.py's pure functions, with the run's loss and device
read once): what Pairs.signs returns for a logged line's window or an eval, and step 1's drift line.

    signs = pair_signs(window, guards.At(step, steps), terms, resolved_or_None)   # None: no drift line
"""

from __future__ import annotations

import torch

from lowmem_dpo import objectives
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.training import guards
from lowmem_dpo.training.step import Sums


def judged_limits(terms: objectives.Terms):
    """(the warning-sign limits the run's loss is judged by, the judged term's weight, its name): its one per-pair
    term's (None where that objective has none), or guards.SEVERAL for several summed or none (loss_type [sft])."""
    per_pair = [(term, weight) for term, weight in terms.terms if not objectives.OBJECTIVES[term].per_token]
    if len(per_pair) != 1:
        return guards.SEVERAL, 1.0, None
    name, weight = per_pair[0]
    return objectives.OBJECTIVES[name].limits, weight, name


def pair_signs(sums: Sums, at: guards.At, terms: objectives.Terms, drift: devices.Resolved | None = None
               ) -> list[str]:
    """The warning signs (guards.py) in a window's (or at.held_out: an eval's) sums of pairs; drift: step 1's
    device, whose drift line comes first (its sign, if the cache is not this policy's forward)."""
    tokens, rejected_tokens = sums.chosen_tokens / sums.items, sums.rejected_tokens / sums.items
    means = sums.means(preference=True)  # the signs judge the preference loss: the NLL term has its own scale
    limits, weight, _ = judged_limits(terms)
    beta = terms.settings.beta
    thresholds = guards.thresholds(limits, beta, terms.settings.label_smoothing, tokens, weight)
    if not objectives.needs_reference(terms.types):
        tokens = rejected_tokens = 0.0  # the per-token signs read log-ratios to the reference: none here
    signs = guards.warning_signs(means, at, beta, tokens, thresholds, rejected_tokens)
    if drift is not None:  # the drift line, first
        context = guards.context_signs(means, 1, at.steps, beta, thresholds, rejected_tokens)
        signs = [guards.with_context(sign, context) for sign in drift_signs(sums, drift)] + signs
    return signs


def drift_signs(window: Sums, resolved: devices.Resolved) -> list[str]:
    """Log step 1's drift line, from its window (step 1 alone, every rank's pairs); its warning sign, if any: the
    cache is not this policy's forward."""
    other = [f"ref_dtype={devices.dtype_name(resolved.ref_dtype)} against the policy's "
             f"{devices.dtype_name(resolved.dtype)}"] if resolved.ref_dtype != resolved.dtype else []
    if resolved.ref_quantization != resolved.quantization:
        other.append(f"ref_quantization={resolved.ref_quantization} against the policy's {resolved.quantization}")
    tokens = window.chosen_tokens + window.rejected_tokens
    rounding = None if resolved.dtype == torch.float32 else guards.Rounding(
        window.layout_drift / max(1, tokens), devices.dtype_name(resolved.dtype), resolved.device.type)
    lines, sign = guards.drift_lines(window.ref_drift, window.ref_offset, window.items, tokens,
                                     resolved.quantization == "8bit", " and ".join(other) or None, rounding)
    for line in lines:
        log(line)
    if sign and resolved.sharded:  # a shard that differs between processes shows here first
        sign += ("; with fsdp, a process whose shard of the base differs from the weights precompute read (a "
                 "corrupted or mismatched checkpoint file on one machine) gives the same sign")
    return [sign] if sign else []
