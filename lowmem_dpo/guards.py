"""Signs that a DPO run is going wrong, from the metrics train logs: pure functions, numbers in, messages out.

Train (its DPO objective, through loop.py) logs each sign as a warning at the logging step where it shows; with
early_stop_on_divergence=true it stops there (exit 2, the last checkpoint kept). Non-finite losses and gradients
are handled in the loop's update (loop.apply_gradients: the update is skipped; max_nonfinite_steps in a row stop
the run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    # rewards/margins = beta * (chosen log-ratio - rejected log-ratio). Above 10 the sigmoid loss is below
    # 5e-5: the pairs are separated, and further growth comes from pushing the two log-probs apart, the road
    # to a policy that repeats itself.
    margin: float = 10.0
    # The loss below this within the first `early_fraction` of the steps: the data is too easy, or the
    # reference does not match the policy's start (e.g. a base-model reference for an SFT policy).
    early_loss: float = 0.05
    early_fraction: float = 0.2
    # Chosen log-probs this many nats per token below the reference's (each chosen token e^-0.5 = 0.61 times as
    # likely): DPO is lowering both completions, the known failure where chosen falls with rejected.
    chosen_drop_per_token: float = 0.5


def nonfinite(*values: float) -> bool:
    return not all(math.isfinite(v) for v in values)


def warning_signs(means: dict, step: int, total_steps: int, beta: float, chosen_tokens_per_pair: float,
                  t: Thresholds = Thresholds()) -> list[str]:
    """The warning signs that `means` (one logged line's rewards/*, loss) show at optimizer step `step` of
    `total_steps`, each as a message with its numbers; [] when none."""
    signs = []
    margin = means["rewards/margins"]
    if margin > t.margin:
        signs.append(f"reward margin exploding: rewards/margins {margin:.2f} > {t.margin:g} (the loss is already "
                     "~0; growth now only pushes log-probs apart)")
    if step <= t.early_fraction * total_steps and means["loss"] < t.early_loss:
        signs.append(f"loss collapsing early: {means['loss']:.4f} < {t.early_loss:g} at step {step} of "
                     f"{total_steps} (data too easy, or a reference that is not the policy's start, e.g. the base "
                     "model for an SFT policy)")
    if beta > 0 and chosen_tokens_per_pair > 0:
        per_token = means["rewards/chosen"] / beta / chosen_tokens_per_pair  # policy - reference, nats/token
        if per_token < -t.chosen_drop_per_token:
            signs.append(f"chosen log-probs falling fast: {per_token:.3f} nats/token below the reference (limit "
                         f"-{t.chosen_drop_per_token:g}); both completions are being pushed down")
    return signs
