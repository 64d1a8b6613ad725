"""The update after a step's backward (loop.optimizer_step): unscale (float16), clip, the optimizer, the schedule;
and when a step's gradients must not become an update: a non-finite loss or gradient (skipped, and
max_nonfinite_steps in a row stop the run as diverged), or float16 gradients that overflowed at the loss scale (a
scaler skip: the scale halves, the run goes on).

Used by the loop with its session (loop.Session; not imported here, loop imports this module).
"""

from __future__ import annotations

import math

import torch

from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import guards, output


def apply_gradients(s, loss: float) -> float:
    """The update after a step's backward: unscale (float16), clip; AdamW unless `loss` (the step's mean) or the
    gradient norm is non-finite; schedule; zero the gradients. Returns the gradient norm before clipping.

    In float16 an overflowing gradient with a finite loss is the loss scaler's business: the update is skipped and
    the scale halved (a scaler skip, counted apart), not a sign of divergence, unless the scale is already at 1 or
    below (the gradients overflow unscaled)."""
    if s.scaler is not None:
        s.scaler.unscale_(s.opt)
    max_norm = s.cfg.max_grad_norm if s.cfg.max_grad_norm is not None else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(s.params, max_norm).item()
    s.step += 1
    scaler_skip = s.scaler is not None and math.isfinite(loss) and not math.isfinite(grad_norm) and (
        s.scaler.get_scale() > 1)
    if scaler_skip:
        s.scaler_skips += 1
        log(f"note: step {s.step}: the float16 gradients overflowed at loss scale {s.scaler.get_scale():g}; update "
            f"skipped and the scale halved (scaler skip {s.scaler_skips}; not divergence)")
    elif guards.nonfinite(loss, grad_norm):
        s.skipped_steps += 1
        s.nonfinite_in_a_row += 1
        log(f"warning: step {s.step}: non-finite loss ({loss:.4g}) or gradient "
            f"norm ({grad_norm:.4g}); update skipped ({s.nonfinite_in_a_row} in a row)")
        if s.nonfinite_in_a_row >= s.cfg.max_nonfinite_steps:
            raise UserError(f"diverged: {s.nonfinite_in_a_row} steps in a row with a non-finite loss or gradient "
                            f"(up to step {s.step}); the weights were not updated by them and "
                            + output.last_checkpoint_note(s) + "; lower learning_rate or check the data and the cache")
    else:
        s.nonfinite_in_a_row = 0
        if s.scaler is None:
            s.opt.step()
        else:
            s.scaler.step(s.opt)
    if s.scaler is not None:
        s.scaler.update()  # halves the scale after an overflow (skipped steps' included), grows it after 2000 clean
    s.sched.step()
    s.opt.zero_grad(set_to_none=True)
    return grad_norm
