"""The training objectives as the loop runs them: an `Objective` is a loss, with one class for pairs (DPO and the
reference-free objectives: `Pairs`), one for rows (SFT: `Rows`) and one for blocks of unpaired rows (KTO:
training/kto.py's `Blocks`).

An objective holds its settings, the pad id and the run's resolved choices (`Batching`), and the reference values
of its items. Each class says what a micro-batch needs (`forward`: its items into log-probs, with the reference's
where it reads one; a dataclass), a function from those to the loss and the metric sums (`loss`: a `Loss`), and its
units (`size`: what a step's loss is a mean over, counted over every rank's items). `groups` splits this rank's
share of a step's items into the groups whose metrics it averages, and `group` takes one through them by
micro-batches, backward'ing each loss; KTO overrides `group`. The step (step.accumulate) hands it a `step.Pass`,
backs off on out of memory and sums the ranks.

    objective = Pairs.of(cfg, Batching(resolved, pad_id, layout), ref=ref, eval_ref=eval_ref)
    within = step.Pass(objective.ref, objective.size(pairs, False), micro_batch=16, backward=trainee.backward)
    for group in objective.groups(pairs, world):
        sums = objective.group(trainee.lm, group, within)       # lm: the policy's parts (logps.lm_of)
    out = objective.loss(objective.forward(trainee.lm, pairs, within), within.size)   # one micro-batch: a Loss
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.data import cache
from lowmem_dpo.model.logps import LM, SequenceLogps, completion_logps, eval_mode
from lowmem_dpo.objectives import metrics as metric_rows
from lowmem_dpo.objectives.metrics import Metric
from lowmem_dpo.runtime import devices, distributed
from lowmem_dpo.training import guards, signs
from lowmem_dpo.training.step import Pass, StepSize, Sums, item_tokens, micro_batches


@dataclass(frozen=True)
class Batching:
    """How an objective's micro-batches are made on this run's device: its resolved choices (device, dtype,
    sharding), the pad id, and the batches' layout (headcheck.bring_up: prompts shared, rows packed)."""

    resolved: devices.Resolved
    pad_id: int
    layout: data.Layout = data.Layout()
    # pairs' collate for the layout (data.collate_shared: each prompt once per pair), chosen once (__post_init__)
    collate: Callable = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "collate", data.collate_shared if self.layout.shared else data.collate)


@dataclass
class Loss:
    """One micro-batch's share of the step's loss (backward'ed) and its metric sums (detached)."""

    value: torch.Tensor  # ()
    sums: Sums


@dataclass(frozen=True, kw_only=True)
class Objective(ABC):
    """One training objective, as the loop runs it."""

    name: ClassVar[str] = "train"  # the stage, the progress bar's label: "train" (DPO, KTO) or "sft"
    unit: ClassVar[str] = "pair"  # what a data row is, in messages: "pair", "row"
    blocks: ClassVar[bool] = False  # its items are blocks of rows whose metrics average per block (KTO)
    batching: Batching
    ref: object = None  # the reference values of the training items (a cache; KTO: with its labels); None: none
    eval_ref: object = None  # the eval items'
    # Resolved once from its settings (a subclass's __post_init__), read at every micro-batch: the summed metrics it
    # logs, in the line's order (metrics.py rows), and the chosen tokens' NLL weight in the loss (Sums.nll_weight)
    metrics: tuple[Metric, ...] = field(default=(metric_rows.LOSS,), init=False)
    nll_weight: float | None = field(default=None, init=False)

    @property
    def layout(self) -> data.Layout:
        return self.batching.layout

    @property
    def shared(self) -> bool:  # pairs: each prompt once per pair (headcheck.decide_sharing)
        return self.layout.shared

    @property
    def packed(self) -> bool:  # each micro-batch as one packed row, no padding (headcheck.decide_packing)
        return self.layout.packed

    def new_sums(self) -> Sums:
        return Sums.of(self.metrics, self.nll_weight)

    @abstractmethod
    def forward(self, lm: LM, items: list, within: Pass):
        """A micro-batch of items as its loss reads it: the log-probs (and the reference's), the forward's tokens."""

    @abstractmethod
    def loss(self, output, size: StepSize) -> Loss:
        """A micro-batch's share of the step's loss, and its sums."""

    @abstractmethod
    def size(self, items: list, first: bool) -> StepSize:
        """What a step's loss over `items` (every rank's) is a mean over; first: a new run's first step."""

    def groups(self, items: list, world: distributed.World) -> list[list]:
        """This rank's items of a step, in the groups whose metrics the objective averages: one, every
        world-size-th item sorted by length (so each rank gets items of every length, distributed.shard)."""
        ordered = data.by_length(items, item_tokens)
        return [distributed.shard(ordered, world) if world.size > 1 else ordered]  # one process: no collective

    def group(self, lm: LM, items: list, within: Pass) -> Sums:
        """One group's micro-batches (groups), each forward'ed, its loss backward'ed (within.backward; None: no
        gradients) and its sums added."""
        sums = Sums.of(self.metrics, self.nll_weight)
        for batch in micro_batches(items, within.micro_batch):
            out = self.loss(self.forward(lm, batch, within), within.size)
            if within.backward is not None:
                within.backward(out.value)
            sums.add(out.sums)
        return sums

    def signs(self, sums: Sums, step: int, steps: int, held_out: bool) -> list[str]:
        """The warning signs (guards.py) in a window's (held_out: an eval's) sums; none but the pairs'."""
        return []

    def samples_from(self, items: list) -> list:
        """The eval items whose prompts the samples answer, scored against their chosen completions."""
        return items


# -- pairs: DPO and the reference-free objectives -----------------------------------------------------------------
@dataclass
class PairForward:
    """A micro-batch of pairs as its loss reads it: the log-probs (the reference's too) and the forward's tokens."""

    logps: objectives.PairLogps
    pairs: int
    tokens: int
    computed: int  # the positions it computed, padding included
    # step 1 in a 16-bit dtype: the policy's (chosen, rejected) log-probs, (B,) each, of each pair forwarded on its
    # own (a second layout: its rounding beside the cache's drift, signs.drift_signs); None otherwise
    alone: tuple | None = None


@dataclass(frozen=True, kw_only=True)
class Pairs(Objective):
    """DPO's objective, and the reference-free ones' (SimPO, ORPO: no reference): the terms of cfg.loss_type."""

    terms: objectives.Terms
    drift_at_start: bool = False  # a new run's step 1 measures the cache against its own forward (the drift line)
    # resolved from the terms (__post_init__): their loss types, whether the loss reads the reference's log-probs,
    # whether the NLL term covers the chosen rows' prompts (ORPO), the objective whose rewards it logs
    types: tuple[str, ...] = field(init=False)
    reference: bool = field(init=False)
    prompts: bool = field(init=False)
    logged: objectives.Objective = field(init=False)

    def __post_init__(self):
        types, nll_weight = tuple(self.terms.types), objectives.nll_weight(list(self.terms.terms))
        reference = objectives.needs_reference(types)
        resolved = dict(types=types, reference=reference, prompts=objectives.nll_prompt(types),
                        logged=objectives.primary(types), nll_weight=nll_weight,
                        drift_at_start=self.drift_at_start and reference and self.ref is not None,  # a cache's drift
                        metrics=(*metric_rows.PAIR_METRICS, *metric_rows.term_metrics(types),
                                 *([metric_rows.NLL_LOSS] if nll_weight is not None else [])))
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # a frozen dataclass's own fields, set once

    @classmethod
    def of(cls, cfg, batching: Batching, ref: cache.RefCache | None = None, eval_ref: cache.RefCache | None = None,
           drift_at_start: bool = False) -> "Pairs":
        return cls(batching=batching, terms=objectives.Terms.of(cfg), ref=ref, eval_ref=eval_ref,
                   drift_at_start=drift_at_start)

    def forward(self, lm: LM, items: list[data.TokenizedPair], within: Pass) -> PairForward:
        """The policy's log-probs of a micro-batch of pairs, and the reference's: the cache's rows (within.ref), or
        with ref_source=live the same model with the adapter off (live_reference). At step 1 against a cache in a
        16-bit dtype, each pair alone beside it (forward_alone)."""
        resolved, terms, layout = self.batching.resolved, self.terms, self.batching.layout
        alone = None  # before the batch's forward: its graph is not yet held while these run
        if within.size.drift and resolved.dtype != torch.float32 and len(items) > 1 and not resolved.sharded:
            alone = self.forward_alone(lm, items)  # one pair alone is the batch; sharded: the ranks' forwards pair
        batch = self.batching.collate(items, self.batching.pad_id, layout.packed).to(resolved.device)
        ref_chosen = ref_rejected = None  # a loss that reads no reference
        with devices.autocast(resolved.device, resolved.dtype):
            if self.reference and within.ref is not None:  # (B,) each, float64 on the CPU
                ref_chosen, ref_rejected = within.ref.chosen[batch.rows], within.ref.rejected[batch.rows]
            elif self.reference:
                ref_chosen, ref_rejected = self.live_reference(lm, batch)
            out = completion_logps(lm, batch, prompts=self.prompts, weighting=terms.weighting, ld_alpha=terms.ld_alpha)
        chosen, rejected = out.split()  # (B,) each
        if self.reference:  # the cache's float64 values, in the policy's sums' dtype (float32 on mps) on its device
            ref_chosen, ref_rejected = (r.to(resolved.device, chosen.logps.dtype) for r in (ref_chosen, ref_rejected))
        weights = None if not terms.weighting else objectives.wpo_weights(chosen.aligned, chosen.n_tokens,
                                                                          rejected.aligned, rejected.n_tokens)
        logps = objectives.PairLogps(chosen.logps, rejected.logps, chosen.n_tokens, rejected.n_tokens, ref_chosen,
                                     ref_rejected, chosen.prompt_logps, chosen.prompt_tokens, weights)
        return PairForward(logps, len(items), batch.num_tokens, batch.computed_tokens, alone)

    def live_reference(self, lm: LM, batch: data.Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """ref_source=live: the reference's (chosen, rejected) log-probs of a micro-batch, (B,) each on the CPU, from
        the same model with the adapter off: a forward more, for verification."""
        with torch.no_grad(), lm.model.disable_adapter():
            live = completion_logps(lm, batch, ld_alpha=self.terms.ld_alpha).split()
        return tuple(side.logps.cpu() for side in live)

    def forward_alone(self, lm: LM, items: list[data.TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (chosen, rejected) log-probs, (B,) each, of each pair forwarded on its own (no gradients):
        the same numbers as the micro-batch's in exact arithmetic. 16-bit kernels that block by shape (GPUs; CPUs
        with AVX512-BF16 or AMX) round the two layouts differently: how much is this device's own rounding."""
        resolved, layout, chosen, rejected = self.batching.resolved, self.batching.layout, [], []
        # eval mode: no dropout (nor its random draws); at step 1 the adapter is the identity either way
        with torch.no_grad(), eval_mode(lm.model), devices.autocast(resolved.device, resolved.dtype):
            for pair in items:
                batch = self.batching.collate([pair], self.batching.pad_id, layout.packed).to(resolved.device)
                chosen_side, rejected_side = completion_logps(lm, batch, ld_alpha=self.terms.ld_alpha).split()
                chosen.append(chosen_side.logps.detach())
                rejected.append(rejected_side.logps.detach())
        return torch.cat(chosen), torch.cat(rejected)  # (B,) each

    def loss(self, output: PairForward, size: StepSize) -> Loss:
        """A micro-batch's share of the step's loss: its per-pair terms' sum over the step's pairs, plus the NLL
        term's share of the mean over the step's NLL tokens; and its metrics (TRL's), detached."""
        x, terms, settings, nll_weight = output.logps, list(self.terms.terms), self.terms.settings, self.nll_weight
        losses = objectives.combine(x, settings, terms)  # (B,)
        loss = losses.sum() / size.items
        sums, n = Sums.of(self.metrics, nll_weight), output.pairs
        sums.items, sums.tokens, sums.computed = n, output.tokens, output.computed
        sums.chosen_tokens, sums.rejected_tokens = int(x.chosen_tokens.sum()), int(x.rejected_tokens.sum())
        sums.note(metric_rows.LOSS, losses.detach().sum().item(), n)
        for metric, values in objectives.pair_metrics(x, settings, self.types, self.logged).items():  # (B,) each
            sums.note(metric, values.sum().item(), n)
        if nll_weight is not None:  # the chosen tokens' NLL term (sft, ORPO's own)
            loss = loss + objectives.per_token_loss(x, nll_weight, size.tokens)
            nll, nll_tokens = x.nll_logps()  # (B,) each
            sums.note(metric_rows.NLL_LOSS, -nll.detach().sum().item(), int(nll_tokens.sum()))
        if size.drift:
            drift, offset = objectives.start_drift(x, settings, terms, losses)  # (B,) each
            sums.ref_drift, sums.ref_offset = drift.sum().item(), offset.sum().item()
            if output.alone is not None:  # this device's rounding between two layouts of the same pairs
                alone_chosen, alone_rejected = (a.to(x.chosen) for a in output.alone)
                sums.layout_drift = ((x.chosen.detach() - alone_chosen).abs()
                                     + (x.rejected.detach() - alone_rejected).abs()).sum().item()
        return Loss(loss, sums)

    def size(self, items: list[data.TokenizedPair], first: bool) -> StepSize:
        """The step's pairs, and the tokens the NLL averages over as logps counts them: the chosen completions'
        (ORPO: and their prompts' but the first token, which nothing predicts)."""
        tokens = sum(len(p.prompt_ids) + len(p.chosen_ids) - 1 if self.prompts else len(p.chosen_ids) for p in items)
        return StepSize(len(items), tokens, drift=first and self.drift_at_start)

    def signs(self, sums: Sums, step: int, steps: int, held_out: bool) -> list[str]:
        """The warning signs (guards.py) in a window's (or held_out: an eval's) sums of pairs; at step 1 the drift
        line first (its sign, if the cache is not this policy's forward)."""
        if sums.empty:
            return []
        at_start = step == 1 and not held_out and self.drift_at_start
        return signs.pair_signs(sums, guards.At(step, steps, held_out), self.terms,
                                self.batching.resolved if at_start else None)


# -- SFT: prompt/completion rows ----------------------------------------------------------------------------------
@dataclass
class RowForward:
    """A micro-batch of SFT rows: their completion log-prob sums and counts, the forward's tokens and positions."""

    logps: SequenceLogps
    tokens: int
    computed: int  # the positions it computed, padding included


def row_forward(lm: LM, items: list[data.TokenizedCompletion], batching: Batching) -> RowForward:
    """Prompt/completion rows through the policy (SFT's rows; KTO's completions and KL sequences): their completion
    log-prob sums (B,), the forward's tokens and the positions it computed (padding included)."""
    resolved = batching.resolved
    batch = data.collate_completions(items, batching.pad_id, batching.layout.packed).to(resolved.device)
    with devices.autocast(resolved.device, resolved.dtype):
        return RowForward(completion_logps(lm, batch), batch.num_tokens, batch.computed_tokens)


@dataclass(frozen=True, kw_only=True)
class Rows(Objective):
    """SFT's objective: the completion tokens' mean NLL (TRL's SFTTrainer with completion_only_loss)."""

    name: ClassVar[str] = "sft"
    unit: ClassVar[str] = "row"

    def forward(self, lm: LM, items: list[data.TokenizedCompletion], within: Pass) -> RowForward:
        """A micro-batch's completion log-prob sums (B,), its forward's tokens and the positions it computed."""
        return row_forward(lm, items, self.batching)

    def loss(self, output: RowForward, size: StepSize) -> Loss:
        """The micro-batch's share of the mean NLL over the step's completion tokens, and its sums."""
        out = output.logps
        sums = Sums.of((metric_rows.LOSS,))
        sums.items, sums.tokens, sums.computed = len(out.logps), output.tokens, output.computed
        sums.note(metric_rows.LOSS, -out.logps.detach().sum().item(), int(out.n_tokens.sum()))
        return Loss(-out.logps.sum() / max(1, size.tokens), sums)

    def size(self, items: list[data.TokenizedCompletion], first: bool) -> StepSize:
        """The step's loss is the mean over all its completion tokens (as TRL), every rank's. Position t-1
        predicts token t, so a completion at position 0 (no prompt) has one target fewer than tokens
        (completion_mask[:, 1:])."""
        return StepSize(len(items), sum(len(row.completion_ids) - (not row.prompt_ids) for row in items))
