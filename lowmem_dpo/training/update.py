"""What a step's summed gradients become (loop.optimizer_step calls these in order): unscaled (float16) and
clipped; then the update, or a skip: a non-finite loss or gradient (max_nonfinite_steps in a row stop the run as
diverged), or float16 gradients that overflowed at the loss scale (a scaler skip: the scale halves, the run goes
on); then the end of every step, skipped or not: the scale, the schedule, the gradients zeroed.
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import guards, policy


class Outcome(Enum):
    """What a step's gradients become."""

    APPLY = "the update"
    SCALER_SKIP = "skipped: float16 overflow at the loss scale"
    NONFINITE = "skipped: a non-finite loss or gradient"


def unscale_and_clip(trainee: policy.Trainee, max_grad_norm: float | None) -> float:
    """The trainee's gradients unscaled (float16: by its loss scaler) and clipped to max_grad_norm (None: not
    clipped); returns their norm before clipping."""
    if trainee.scaler is not None:
        trainee.scaler.unscale_(trainee.optimizer)
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    return torch.nn.utils.clip_grad_norm_(trainee.params, max_norm).item()


def outcome(loss: float, grad_norm: float, scaler) -> Outcome:
    """What the step's gradients become. In float16 an overflowing gradient with a finite loss is the loss
    scaler's business (SCALER_SKIP: the scale halves), not a sign of divergence, unless the scale is already at 1
    or below (the gradients overflow unscaled). Any other non-finite loss or norm: NONFINITE, no update."""
    if scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm) and scaler.get_scale() > 1:
        return Outcome.SCALER_SKIP
    return Outcome.NONFINITE if guards.nonfinite(loss, grad_norm) else Outcome.APPLY


def optimizer_update(trainee: policy.Trainee) -> None:
    """AdamW's step (through the loss scaler in float16), and the LoRA weights' compute copies refreshed."""
    if trainee.scaler is None:
        trainee.optimizer.step()
    else:
        trainee.scaler.step(trainee.optimizer)
    if trainee.copies is not None:
        trainee.copies.refresh()


def scaler_skip_note(step: int, scale: float, skips: int) -> str:
    return (f"note: step {step}: the float16 gradients overflowed at loss scale {scale:g}; update skipped and the "
            f"scale halved (scaler skip {skips}; not divergence)")


def nonfinite_note(step: int, loss: float, grad_norm: float, in_a_row: int) -> str:
    return (f"warning: step {step}: non-finite loss ({loss:.4g}) or gradient norm ({grad_norm:.4g}); update "
            f"skipped ({in_a_row} in a row)")


def diverged(step: int, in_a_row: int, checkpoint_note: str) -> UserError:
    """max_nonfinite_steps skipped in a row: the run stops (exit 2) as diverged; `checkpoint_note` says what it
    leaves to resume from (checkpoint.intact_note)."""
    return UserError(f"diverged: {in_a_row} steps in a row with a non-finite loss or gradient (up to step {step}); "
                     f"the weights were not updated by them and {checkpoint_note}; lower learning_rate or check the "
                     "data and the cache")


def finish_update(trainee: policy.Trainee) -> None:
    """Every step's end, updated or skipped: the loss scale (halved after an overflow, skipped steps' included;
    grown after 2000 clean ones), the schedule, the gradients zeroed. The schedule advances on a skipped step too,
    so the rate is a function of the step number, as the log, a resume and a changed run length read it
    (transformers' Trainer holds it back after a float16 scaler skip: a shift of the few steps scaler_skips
    counts)."""
    if trainee.scaler is not None:
        trainee.scaler.update()
    trainee.scheduler.step()
    trainee.zero_grad()
