"""The plan on several cards (torchrun, `plan --nproc N`): each process on its own card, data parallel (the whole
model on each) or fsdp (the base sharded over them: weights.card_weight_bytes), with the budget per card.

    plan = on_cards(arch, cfg, budget, processes=2)            # search.Plan: its setup says sharded or not
    for name, plan in alternatives(arch, cfg, budget, 2): ...  # data parallel, fsdp, fsdp with offload
    sharded_as_planned(cfg, resolved, plan)                    # a stage's fsdp as its plan decides (devices.Resolved)
    report_fit(cfg, resolved, arch, plan, budget)              # train's verdict: its peak in the reasons, or a warning

fsdp=true shards and fsdp=false does not. fsdp=auto: data parallel where it fits one card with the knobs a stage
turns by itself short of streaming; else sharded; then, with fsdp_offload_params=auto, the shards in CPU RAM. A
sharded run streams no layers (FSDP already brings each layer to the card for its forward).
"""

from __future__ import annotations

import dataclasses

from lowmem_dpo import objectives
from lowmem_dpo.config.coerce import AUTO
from lowmem_dpo.config.schema import Config
from lowmem_dpo.memory.arch import Arch
from lowmem_dpo.memory.search import KNOBS, STAGES, Plan, choose
from lowmem_dpo.memory.setup import Setup, setup_from_config
from lowmem_dpo.runtime import devices, distributed, heap
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.units import fmt


def _setup(cfg, budget: int, processes: int, prompt_tokens: int | None) -> Setup:
    """The recipe's setup on `processes` processes, for data whose shortest prompt is prompt_tokens (None: not known)."""
    return dataclasses.replace(setup_from_config(cfg, budget, processes), prompt_tokens=prompt_tokens)


def _plan(arch: Arch, setup: Setup, budget: int, knobs, stages, sharded: bool, offload: bool) -> Plan:
    """search.choose's plan of `setup`, its base sharded or not and the shards offloaded or not (a sharded run
    streams no layers)."""
    setup = dataclasses.replace(setup, sharded=sharded, shard_offload=offload)
    return choose(arch, setup, budget, tuple(k for k in knobs if k != "stream") if sharded else knobs, stages)


def on_cards(arch: Arch, cfg, budget: int, processes: int = 1, knobs=KNOBS, stages=STAGES,
             prompt_tokens: int | None = None) -> Plan:
    """The plan a run of `processes` processes applies (one: search.choose as it is), per card; fsdp and
    fsdp_offload_params decided as the module doc says, the reason in the plan's steps. prompt_tokens: the data's
    shortest prompt, where known (plan --prompt-tokens)."""
    setup = _setup(cfg, budget, processes, prompt_tokens)

    def plan(knobs, sharded: bool, offload: bool) -> Plan:
        return _plan(arch, setup, budget, knobs, stages, sharded, offload)

    offload_asked = cfg.fsdp_offload_params is True
    if processes < 2 or cfg.fsdp is False:
        return plan(knobs, False, False)
    if cfg.fsdp is AUTO:
        whole = plan(tuple(k for k in knobs if k != "stream"), False, False)
        if whole.fits or unshardable(cfg, stages):
            why = unshardable(cfg, stages) or "the whole model fits each process's budget"
            return _note(whole if whole.fits else plan(knobs, False, False), f"fsdp=false (auto: {why}; data parallel)")
    sharded = plan(knobs, True, offload_asked)
    if cfg.fsdp is True and (sharded.fits or cfg.fsdp_offload_params is not AUTO):
        return sharded
    if sharded.fits or cfg.fsdp_offload_params is not AUTO:
        why = "fits only sharded" if sharded.fits else "does not fit one card; nor sharded"
        return _note(sharded, f"fsdp=true (auto: the run {why} over {processes} processes)", fsdp=True)
    offloaded = plan(knobs, True, True)
    streamed = plan(knobs, False, False)  # data parallel with the stream knob: what one card would do
    if not offloaded.fits and streamed.fits:
        return _note(streamed, f"fsdp=false (auto: sharded, the run does not fit {processes} processes; data "
                               "parallel fits with streamed layers)")
    return _note(offloaded, f"fsdp=true fsdp_offload_params=true (auto: the run fits {processes} processes only with "
                            "the shards in CPU RAM)" if offloaded.fits else
                 f"fsdp=true fsdp_offload_params=true (auto: nothing fits {processes} processes; this comes closest)",
                 fsdp=cfg.fsdp is AUTO, offload=True)


def unshardable(cfg, stages=STAGES) -> str | None:
    """Why this run's `stages` cannot be sharded (auto keeps them data parallel; sharded_as_planned refuses
    them with fsdp=true), or None: an 8-bit base (train's, or precompute's reference), or KTO in train."""
    bases = {"train": cfg.quantization, "precompute": cfg.reference_quantization}
    if any(bases[stage] == "8bit" for stage in stages):
        return "an 8-bit base cannot be sharded (FSDP2 does not shard LLM.int8's weights)"
    if "train" in stages and objectives.unpaired(cfg.loss_type):
        return (f"loss_type={','.join(cfg.loss_type)} does not run sharded yet (its blocks' forwards are not paired "
                "across processes)")
    return None


def _note(plan: Plan, step: str, fsdp: bool = False, offload: bool = False) -> Plan:
    overrides = {**plan.overrides, **({"fsdp": "true"} if fsdp else {}),
                 **({"fsdp_offload_params": "true"} if offload else {})}
    earlier = [line for line in plan.steps if line != "fits as given"]
    return dataclasses.replace(plan, overrides=overrides, steps=[step] + earlier)


def alternatives(arch: Arch, cfg, budget: int, processes: int, knobs=KNOBS, stages=STAGES,
                 prompt_tokens: int | None = None) -> list[tuple[str, Plan]]:
    """Each way to run on `processes` cards, per card, for `plan --nproc`: data parallel (as search.choose plans
    it, streaming included), fsdp, fsdp with the shards in CPU RAM."""
    setup = _setup(cfg, budget, processes, prompt_tokens)
    return [(name, _plan(arch, setup, budget, knobs, stages, sharded, offload))
            for name, sharded, offload in (("data parallel", False, False), ("fsdp", True, False),
                                           ("fsdp + offload", True, True))]


def sharded_as_planned(cfg: Config, resolved: devices.Resolved, plan, stage: str = "train") -> None:
    """On several processes, fsdp=auto shards where the plan (on_cards) does, and fsdp_offload_params=auto
    puts the shards in CPU RAM where it does, a line saying why; no plan (a model the planner does not model):
    data parallel. Refused before anything loads: a sharded KTO run (its blocks' forwards are not paired across
    processes) and an 8-bit base (FSDP2 does not shard LLM.int8's weights)."""
    auto_fsdp, auto_offload = cfg.fsdp == "auto", cfg.fsdp_offload_params == "auto"
    if distributed.world().distributed and (auto_fsdp or auto_offload):
        step = plan.steps[0] if plan is not None and plan.steps[0].startswith("fsdp") else None
        why = step.partition("(")[2].rstrip(")") if step else "auto: no memory plan for this model"
        if auto_fsdp:
            resolved.sharded = plan is not None and plan.setup.sharded
        resolved.shard_offload = resolved.sharded and (cfg.fsdp_offload_params is True or (
            auto_offload and plan is not None and plan.setup.shard_offload))
        if auto_fsdp:
            line = devices.fsdp_line(resolved.sharded, why, resolved.shard_offload)
        elif resolved.shard_offload:  # fsdp=true from the recipe (its line is logged), the offload the plan's
            line = f"fsdp_offload_params=true ({why}): the shards in CPU RAM"
        else:
            line = None
        if line and stage == "train":  # train logs its reasons in one block
            resolved.reasons.append(line)
        elif line:
            log(line)
    if not resolved.sharded:
        return
    problem = unshardable(cfg, (stage,))
    if problem:
        raise UserError(f"fsdp: {problem}; set fsdp=false (data parallel)")


def report_fit(cfg: Config, resolved: devices.Resolved, arch, applied, budget: int) -> None:
    """The planner's verdict on train as applied: its peak in the reasons (and on a CPU, the heap's choice that
    follows), or a warning that it does not fit, with the knobs train cannot turn that would make it."""
    stream = applied.streams.get("train")
    advice = on_cards(arch, cfg, budget, distributed.world().size, stages=("train",))  # train's knobs and others
    better = {k: v for k, v in advice.overrides.items() if applied.overrides.get(k) != v}
    peak = (stream.device_peak if stream else applied.prediction.train.peak_bytes)
    if not applied.fits or (stream and better):
        log(f"warning: the planner predicts this run does not fit {fmt(budget)} as configured"
            + (f" (train peak {fmt(peak)} even with every knob it can turn)" if not applied.fits else
               f" without streaming {stream.layers} decoder layers from CPU RAM")
            + ("; it would with: " + " ".join(f"{k}={v}" for k, v in better.items()) if better and advice.fits
               else "; lower max_length or per_device_train_batch_size")
            + " (lowmem-dpo plan shows the terms)")
    else:
        resolved.reasons.append(f"planner: train peak {fmt(peak)} of a {fmt(budget)} budget")
        kept = resolved.device.type == "cpu" and heap.keep_freed_blocks(peak, applied.prediction.train.transient,
                                                                         budget)
        if kept:  # the heap's line from devices.resolve, replaced
            resolved.reasons = [kept if line.startswith(heap.LINE) else line for line in resolved.reasons]
