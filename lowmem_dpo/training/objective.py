"""The training objectives as the loop runs them: entries of one kind (`Objective`), built in one place (`build`).

An objective is a loss: what it needs per batch (`forward`: a micro-batch of its items into log-probs, with the
reference's where it reads one), a function from those log-probs to the loss and the metric sums (`loss`), and its
units (`size`: what a step's loss is a mean over, counted over every rank's items). The loop (step.py) splits the
items into micro-batches, backs off on out-of-memory, backward()s each micro-batch's loss and sums the metrics.

    objective = build(cfg, resolved, pad_id, stage="train", ref=ref, eval_ref=eval_ref, layout=layout)
    f = objective.forward(trainee.lm, pairs, objective.ref, None)   # lm: the policy's parts (logps.lm_of)
    loss, sums = objective.loss(f, objective.size(pairs, False))

DPO and the reference-free objectives (pairs), SFT (rows) and KTO (blocks of unpaired rows: training/kto.py) are
entries of this kind.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache
from lowmem_dpo.model.logps import LM, completion_logps, eval_mode
from lowmem_dpo.objectives import metrics as m
from lowmem_dpo.objectives.metrics import Metric
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.training import guards, kto
from lowmem_dpo.training.step import Sums


@dataclass(frozen=True)
class StepSize:
    """What one step's loss is a mean over, every rank's items counted (so the split changes no gradient)."""

    items: int  # pairs (DPO), KTO blocks; SFT: rows
    tokens: int = 0  # DPO: the tokens its NLL averages over; SFT: the completion tokens predicted
    drift: bool = False  # DPO at a new run's step 1: measure the reference values against this forward


@dataclass(frozen=True)
class Objective:
    """One training objective, as the loop runs it."""

    name: str  # the stage, the progress bar's label: "train" (DPO, KTO) or "sft"
    unit: str  # what a data row is, in messages: "pair", "row"
    metrics: tuple[Metric, ...]  # the summed metrics it logs, in the line's order (metrics.py rows)
    forward: Callable  # (lm, items, reference, block) -> a micro-batch's log-probs: what it needs per batch
    loss: Callable  # (log-probs, StepSize) -> (the micro-batch's share of the step's loss, its Sums)
    size: Callable[[list, bool], StepSize]  # (every rank's items of a step, a new run's first step) -> its units
    ref: object = None  # the reference values of the training items (a cache; KTO: with its labels); None: none
    eval_ref: object = None  # the eval items'
    nll_weight: float | None = None  # the chosen tokens' NLL in the loss (Sums.nll_weight)
    blocks: bool = False  # its items are blocks of rows whose metrics average per block (KTO)
    before: Callable | None = None  # (lm, block, reference, micro_batch) -> what a block's forwards read (KTO: z0)
    after: Callable | None = None  # (a block's sums, what `before` gave) -> the block's means (KTO)
    signs: Callable | None = None  # (sums, step, steps, held_out) -> the warning signs (guards.py) of pairs
    samples_from: Callable[[list], list] | None = None  # eval items -> the rows the samples answer (KTO)
    layout: data.Layout = data.Layout()  # its batches' layout (headcheck.bring_up): prompts shared, rows packed

    @property
    def shared(self) -> bool:  # pairs: each prompt once per pair (headcheck.decide_sharing)
        return self.layout.shared

    @property
    def packed(self) -> bool:  # each micro-batch as one packed row, no padding (headcheck.decide_packing)
        return self.layout.packed

    def new_sums(self) -> Sums:
        return Sums.of(self.metrics, self.nll_weight)


# -- pairs: DPO and the reference-free objectives -----------------------------------------------------------------
@dataclass
class PairForward:
    """A micro-batch of pairs as its loss reads it: the log-probs (the reference's too) and the forward's tokens."""

    logps: objectives.PairLogps
    pairs: int
    tokens: int
    computed: int  # the positions it computed, padding included
    # step 1 in a 16-bit dtype: the policy's (chosen, rejected) log-probs, (B,) each, of each pair forwarded on its
    # own (a second layout: its rounding beside the cache's drift, drift_signs); None otherwise
    alone: tuple | None = None


def pair_forward(lm: LM, pairs: list[data.TokenizedPair], ref: cache.RefCache | None, block, *, pad_id: int,
                 resolved: devices.Resolved, layout: data.Layout, reference: bool, prompts: bool, weighting: bool,
                 ld_alpha: float | None, first: bool = False) -> PairForward:
    """The policy's log-probs of a micro-batch of pairs, and the reference's (cached; live: the adapter off).
    prompts: the chosen rows' prompts' too (ORPO's NLL); weighting: WPO's weights; ld_alpha: LD-DPO's sums.
    first: step 1 against a cache, whose drift is measured (in a 16-bit dtype with each pair alone beside it)."""
    device = resolved.device
    alone = None  # before the batch's forward: its graph is not yet held while these run
    if first and reference and ref is not None and resolved.dtype != torch.float32 and len(pairs) > 1 \
            and not resolved.sharded:  # one pair alone is the batch; sharded: every rank's forwards must pair up
        alone = forward_alone(lm, pairs, pad_id, resolved, layout, ld_alpha)
    batch = (data.collate_shared if layout.shared else data.collate)(pairs, pad_id, layout.packed).to(device)
    ref_chosen = ref_rejected = None
    with devices.autocast(device, resolved.dtype):
        if reference and ref is not None:
            ref_chosen, ref_rejected = ref.chosen[batch.rows], ref.rejected[batch.rows]
        elif reference:  # ref_source=live: the same model with the adapter off, a forward more; for verification
            with torch.no_grad(), lm.model.disable_adapter():
                live = completion_logps(lm, batch, ld_alpha=ld_alpha).split()
            ref_chosen, ref_rejected = (side.logps.cpu() for side in live)
        out = completion_logps(lm, batch, prompts=prompts, weighting=weighting, ld_alpha=ld_alpha)
    chosen, rejected = out.split()  # (B,) each
    if reference:  # the cache's float64 values, in the policy's sums' dtype (float32 on mps) on its device
        ref_chosen, ref_rejected = (r.to(device, chosen.logps.dtype) for r in (ref_chosen, ref_rejected))
    weights = None if not weighting else objectives.wpo_weights(chosen.aligned, chosen.n_tokens,
                                                                         rejected.aligned, rejected.n_tokens)
    logps = objectives.PairLogps(chosen.logps, rejected.logps, chosen.n_tokens, rejected.n_tokens, ref_chosen,
                                 ref_rejected, chosen.prompt_logps, chosen.prompt_tokens, weights)
    return PairForward(logps, len(pairs), batch.num_tokens, batch.computed_tokens, alone)


def forward_alone(lm: LM, pairs: list[data.TokenizedPair], pad_id: int, resolved: devices.Resolved,
                  layout: data.Layout, ld_alpha: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's (chosen, rejected) log-probs, (B,) each, of each pair forwarded on its own (no gradients): the
    same numbers as the micro-batch's in exact arithmetic. 16-bit kernels that block by shape (GPUs; CPUs with
    AVX512-BF16 or AMX) round the two layouts differently: how much is this device's own rounding."""
    chosen, rejected = [], []
    # eval mode: no dropout (nor its random draws); at step 1 the adapter is the identity either way
    with torch.no_grad(), eval_mode(lm.model), devices.autocast(resolved.device, resolved.dtype):
        for pair in pairs:
            batch = (data.collate_shared if layout.shared else data.collate)([pair], pad_id, layout.packed)
            c, r = completion_logps(lm, batch.to(resolved.device), ld_alpha=ld_alpha).split()
            chosen.append(c.logps.detach())
            rejected.append(r.logps.detach())
    return torch.cat(chosen), torch.cat(rejected)  # (B,) each


def pair_loss(f: PairForward, size: StepSize, *, s: objectives.Settings, terms: list[tuple[str, float]],
              logged: objectives.Objective, metrics: tuple[Metric, ...], nll_weight: float | None
              ) -> tuple[torch.Tensor, Sums]:
    """A micro-batch's share of the step's loss: its per-pair terms' sum over the step's pairs, plus the NLL term's
    share of the mean over the step's NLL tokens; and its metrics (TRL's), detached. s, terms: the run's loss
    settings and (loss type, weight) terms; logged: the objective whose rewards it logs (objectives.primary)."""
    x, types = f.logps, [t for t, _ in terms]
    losses = objectives.combine(x, s, terms)  # (B,)
    loss = losses.sum() / size.items
    sums = Sums.of(metrics, nll_weight)
    sums.items, sums.tokens, sums.computed = f.pairs, f.tokens, f.computed
    sums.chosen_tokens, sums.rejected_tokens = int(x.chosen_tokens.sum()), int(x.rejected_tokens.sum())
    n = f.pairs
    sums.note(m.LOSS, losses.detach().sum().item(), n)
    for metric, values in objectives.pair_metrics(x, s, types, logged).items():  # (B,) each
        sums.note(metric, values.sum().item(), n)
    if nll_weight is not None:  # the chosen tokens' NLL term (sft, ORPO's own)
        loss = loss + objectives.per_token_loss(x, nll_weight, size.tokens)
        nll, nll_tokens = x.nll_logps()  # (B,) each
        sums.note(m.NLL_LOSS, -nll.detach().sum().item(), int(nll_tokens.sum()))
    if size.drift:
        drift, offset = objectives.start_drift(x, s, terms, losses)  # (B,) each
        sums.ref_drift, sums.ref_offset = drift.sum().item(), offset.sum().item()
        if f.alone is not None:  # this device's rounding between two layouts of the same pairs
            alone_chosen, alone_rejected = (a.to(x.chosen) for a in f.alone)
            sums.layout_drift = ((x.chosen.detach() - alone_chosen).abs()
                                 + (x.rejected.detach() - alone_rejected).abs()).sum().item()
    return loss, sums


def pair_size(pairs: list[data.TokenizedPair], first: bool, *, nll_prompt: bool, drift_at_start: bool) -> StepSize:
    """The step's pairs, and the tokens the NLL averages over as logps counts them: the chosen completions' (ORPO:
    and their prompts' but the first token, which nothing predicts)."""
    tokens = sum(len(p.prompt_ids) + len(p.chosen_ids) - 1 if nll_prompt else len(p.chosen_ids) for p in pairs)
    return StepSize(len(pairs), tokens, drift=first and drift_at_start)


def judged_limits(cfg: Config):
    """(the warning-sign limits the run's loss is judged by, the judged term's weight, its name): its one per-pair
    term's (None where that objective has none), or guards.SEVERAL for several summed or none (loss_type [sft])."""
    per_pair = [(term, weight) for term, weight in cfg.loss_terms if not objectives.OBJECTIVES[term].per_token]
    if len(per_pair) != 1:
        return guards.SEVERAL, 1.0, None
    name, weight = per_pair[0]
    return objectives.OBJECTIVES[name].limits, weight, name


def pair_signs(sums: Sums, step: int, steps: int, held_out: bool, *, cfg: Config, resolved: devices.Resolved,
               drift_at_start: bool) -> list[str]:
    """The warning signs (guards.py) in a window's (or held_out: an eval's) sums of pairs; at step 1 the drift
    line first (its sign, if the cache is not this policy's forward)."""
    if sums.empty:
        return []
    tokens, rejected_tokens = sums.chosen_tokens / sums.items, sums.rejected_tokens / sums.items
    means = sums.means(preference=True)  # the signs judge the preference loss: the NLL term has its own scale
    limits, weight, _ = judged_limits(cfg)
    thresholds = guards.thresholds(limits, cfg.beta, cfg.label_smoothing, tokens, weight)
    if not objectives.needs_reference(cfg.loss_type):
        tokens = rejected_tokens = 0.0  # the per-token signs read log-ratios to the reference: none here
    signs = guards.warning_signs(means, step, steps, cfg.beta, tokens, thresholds, rejected_tokens, held_out)
    if step == 1 and not held_out and drift_at_start:  # the drift line, first
        context = guards.context_signs(means, 1, steps, cfg.beta, thresholds, rejected_tokens)
        signs = [guards.with_context(sign, context) for sign in drift_signs(sums, resolved)] + signs
    return signs


def drift_signs(window: Sums, r: devices.Resolved) -> list[str]:
    """Log step 1's drift line, from its window (step 1 alone, every rank's pairs); its warning sign, if any: the
    cache is not this policy's forward."""
    other = [f"ref_dtype={devices.dtype_name(r.ref_dtype)} against the policy's {devices.dtype_name(r.dtype)}"
             ] if r.ref_dtype != r.dtype else []
    if r.ref_quantization != r.quantization:
        other.append(f"ref_quantization={r.ref_quantization} against the policy's {r.quantization}")
    tokens = window.chosen_tokens + window.rejected_tokens
    rounding = None if r.dtype == torch.float32 else guards.Rounding(
        window.layout_drift / max(1, tokens), devices.dtype_name(r.dtype), r.device.type)
    lines, sign = guards.drift_lines(window.ref_drift, window.ref_offset, window.items, tokens,
                                     r.quantization == "8bit", " and ".join(other) or None, rounding)
    for line in lines:
        log(line)
    if sign and r.sharded:  # a shard that differs between processes shows here first
        sign += ("; with fsdp, a process whose shard of the base differs from the weights precompute read (a "
                 "corrupted or mismatched checkpoint file on one machine) gives the same sign")
    return [sign] if sign else []


def pairs(cfg: Config, resolved: devices.Resolved, pad_id: int, ref: cache.RefCache | None = None,
          eval_ref: cache.RefCache | None = None, layout: data.Layout = data.Layout(),
          drift_at_start: bool = False) -> Objective:
    """DPO's entry, and the reference-free objectives' (SimPO, ORPO: no reference): the terms of cfg.loss_type."""
    types, terms, nll_weight = cfg.loss_type, cfg.loss_terms, objectives.nll_weight(cfg.loss_terms)
    metrics = (*m.PAIR_METRICS, *m.term_metrics(types), *([m.NLL_LOSS] if nll_weight is not None else []))
    drift_at_start = drift_at_start and ref is not None
    return Objective(
        "train", "pair", metrics,
        forward=functools.partial(pair_forward, pad_id=pad_id, resolved=resolved, layout=layout,
                                  reference=objectives.needs_reference(types), prompts=objectives.nll_prompt(types),
                                  weighting=cfg.use_weighting, ld_alpha=cfg.ld_alpha),
        loss=functools.partial(pair_loss, s=cfg.loss_settings, terms=terms, logged=objectives.primary(types),
                               metrics=metrics, nll_weight=nll_weight),
        size=functools.partial(pair_size, nll_prompt=objectives.nll_prompt(types), drift_at_start=drift_at_start),
        ref=ref, eval_ref=eval_ref, nll_weight=nll_weight,
        signs=functools.partial(pair_signs, cfg=cfg, resolved=resolved, drift_at_start=drift_at_start),
        layout=layout)


# -- SFT: prompt/completion rows ----------------------------------------------------------------------------------
def row_forward(lm: LM, rows: list[data.TokenizedCompletion], ref, block, *, pad_id: int,
                resolved: devices.Resolved, packed: bool = False):
    """A micro-batch's completion log-prob sums (B,), its forward's tokens and the positions it computed."""
    batch = data.collate_completions(rows, pad_id, packed).to(resolved.device)
    with devices.autocast(resolved.device, resolved.dtype):
        return completion_logps(lm, batch), batch.num_tokens, batch.computed_tokens


def row_loss(f, size: StepSize) -> tuple[torch.Tensor, Sums]:
    """The micro-batch's share of the mean NLL over the step's completion tokens, and its sums."""
    out, tokens, computed = f
    sums = Sums.of((m.LOSS,))
    sums.items, sums.tokens, sums.computed = len(out.logps), tokens, computed
    sums.note(m.LOSS, -out.logps.detach().sum().item(), int(out.n_tokens.sum()))
    return -out.logps.sum() / max(1, size.tokens), sums


def row_size(rows: list[data.TokenizedCompletion], first: bool) -> StepSize:
    """The step's loss is the mean over all its completion tokens (as TRL), every rank's. Position t-1 predicts
    token t, so a completion at position 0 (no prompt) has one target fewer than tokens (completion_mask[:, 1:])."""
    return StepSize(len(rows), sum(len(row.completion_ids) - (not row.prompt_ids) for row in rows))


def sft(resolved: devices.Resolved, pad_id: int, packed: bool = False) -> Objective:
    """SFT's entry: the completion tokens' mean NLL (TRL's SFTTrainer with completion_only_loss)."""
    return Objective("sft", "row", (m.LOSS,), functools.partial(row_forward, pad_id=pad_id, resolved=resolved,
                                                                 packed=packed), row_loss, row_size,
                     layout=data.Layout(packed=packed))


# -- KTO: blocks of unpaired rows (training/kto.py) ---------------------------------------------------------------
def unpaired(cfg: Config, resolved: devices.Resolved, pad_id: int, ref: kto.Reference,
             eval_ref: kto.Reference | None = None, packed: bool = False) -> Objective:
    """KTO's entry (and apo_zero_unpaired's): its items are blocks, its metrics each block's means."""
    return Objective(
        "train", "row", m.BLOCK_METRICS,
        forward=functools.partial(kto.forward, pad_id=pad_id, resolved=resolved, packed=packed),
        loss=functools.partial(kto.loss, formula=objectives.OBJECTIVES[cfg.loss_type[0]].formula, s=cfg.loss_settings),
        size=lambda blocks, first: StepSize(len(blocks)),
        ref=ref, eval_ref=eval_ref, blocks=True,
        before=functools.partial(kto.reference_point, cfg=cfg, pad_id=pad_id, resolved=resolved, packed=packed),
        after=functools.partial(kto.block_means, s=cfg.loss_settings),
        samples_from=None if eval_ref is None else functools.partial(kto.samples_from, desirable=eval_ref.desirable),
        layout=data.Layout(packed=packed))


def build(cfg: Config, resolved: devices.Resolved, pad_id: int, stage: str, ref=None, eval_ref=None,
          layout: data.Layout = data.Layout(), drift_at_start: bool = False) -> Objective:
    """The run's objective: SFT's (stage "sft"), KTO's (an unpaired loss_type; ref and eval_ref: kto.Reference),
    or the pairs' (DPO, the reference-free ones; ref and eval_ref: caches or None); its batches laid out as
    `layout` says (headcheck.bring_up)."""
    if stage == "sft":
        return sft(resolved, pad_id, layout.packed)
    if objectives.unpaired(cfg.loss_type):
        return unpaired(cfg, resolved, pad_id, ref, eval_ref, layout.packed)
    return pairs(cfg, resolved, pad_id, ref, eval_ref, layout, drift_at_start)
