"""The stages' first-batch check of an architecture logps.py does not know (its model_type is not in
logps.HEADS): precompute, train and sft compare their log-probs with the model's own forward before computing
anything, and stop (exit 2) when the two differ. For a known architecture it costs nothing."""

from __future__ import annotations

import torch

from lowmem_dpo import data, devices, logps
from lowmem_dpo.errors import UserError, log


def describe(head: logps.Head) -> str:
    parts = ([f"logits x {head.scale:g}"] if head.scale != 1.0 else []) + \
        ([f"softcap {head.softcap:g}"] if head.softcap else [])
    return ", ".join(parts) or "plain lm_head"


def verify(model, batch: data.Batch, device: torch.device, dtype: torch.dtype) -> None:
    """Raise UserError when the chunked log-probs of an unknown architecture differ from its own forward on
    `batch` (already on `device`; the stage's forward precision `dtype`); log a note when they agree."""
    with devices.autocast(device, dtype):
        check = logps.check_head(model, batch.input_ids, batch.attention_mask)
    if check is None:
        return
    t = check.model_type
    if not check.ok:
        hint = ""
        if check.head != logps.Head() and check.plain_difference <= check.tolerance:
            hint = f" A plain head matches it (difference {check.plain_difference:.2g}): add \"{t}\": _plain."
        raise UserError(
            f"model_type {t!r} is not in lowmem_dpo's table of LM heads (logps.HEADS), and on the first batch its "
            f"log-probs differ from the model's own forward by up to {check.difference:.3g} nats per token "
            f"(tolerance {check.tolerance:g} in {devices.dtype_name(dtype)}; head read from the config: "
            f"{describe(check.head)}). They would be wrong, so nothing was computed. Add {t!r} to HEADS in "
            f"lowmem_dpo/logps.py with what its ForCausalLM.forward does after self.lm_head(...).{hint}")
    log(f"model_type {t!r} is not in logps.HEADS; its head ({describe(check.head)}) matches the model's own "
        f"forward on the first batch (max difference {check.difference:.2g} nats per token over "
        f"{check.positions} positions, tolerance {check.tolerance:g})")
