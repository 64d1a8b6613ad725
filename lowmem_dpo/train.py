"""Train a LoRA DPO policy against cached reference log-probs: one model resident, no reference forward.

    python -m lowmem_dpo.precompute lowmem_dpo:tiny-cpu   # once
    python -m lowmem_dpo.train lowmem_dpo:tiny-cpu [key=value ...]

Writes to output_dir: config.yaml (resolved), metrics.jsonl (one JSON object per logged step, TRL key names),
and the final PEFT adapter (adapter_config.json, adapter_model.safetensors). When model_name_or_path (or
sft_adapter) names an SFT LoRA adapter, that adapter is the one trained (adapters.py).
"""

# This module is DPO's part of a run: what a data item is (a preference pair) and how a micro-batch becomes the
# DPO loss and its metrics (`DPO`). The loop itself (micro-batches, out-of-memory back-off, non-finite guard,
# metrics, checkpoints, resume, the final save) is loop.py's, shared with sft.py.

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowmem_dpo import data, objectives
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config, require
from lowmem_dpo.config.schema import Config
from lowmem_dpo.data import cache
from lowmem_dpo.model import adapters, headcheck
from lowmem_dpo.model.logps import batch_logps
from lowmem_dpo.objectives.metrics import PAIR_METRICS as METRIC_KEYS
from lowmem_dpo.objectives.metrics import term_metric_names
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.training import guards, inputs, kto, loop, output, policy, resuming
from lowmem_dpo.training.session import RunSetup, Session
from lowmem_dpo.training.session import start as start_session


@dataclass
class StepStats:
    """DPO metric sums over the pairs of a step (or of a log line's window); the means are TRL's metrics."""

    sums: dict = field(default_factory=lambda: dict.fromkeys(METRIC_KEYS, 0.0))
    pairs: int = 0
    tokens: int = 0
    chosen_tokens: int = 0  # completion tokens of the chosen sides (the per-token guards)
    rejected_tokens: int = 0  # and of the rejected sides
    nll: float = 0.0  # summed -log pi of the chosen completions (ORPO: and their prompts): the NLL's numerator
    nll_tokens: int = 0  # the tokens nll sums
    # the chosen NLL's weight in the loss (objectives.nll_weight: sft, ORPO's own; sums["loss"] excludes it), or
    # None without one; not a sum (distributed.sum_stats)
    nll_weight: float | None = field(default=None, metadata={"sum": False})
    # the reference values against this forward (objectives.start_drift; measured at step 1 only, else 0): summed
    # |policy - reference| over the completions (nats), and summed loss minus its value at policy = reference. At
    # step 1 the two are one model, so these measure how far the cache is from the policy's forward (the drift line).
    ref_drift: float = 0.0
    ref_offset: float = 0.0

    def add(self, other: "StepStats") -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.pairs += other.pairs
        self.tokens += other.tokens
        self.chosen_tokens += other.chosen_tokens
        self.rejected_tokens += other.rejected_tokens
        self.nll += other.nll
        self.nll_tokens += other.nll_tokens
        self.ref_drift += other.ref_drift
        self.ref_offset += other.ref_offset

    def means(self) -> dict:
        """TRL's metrics; with an NLL term, also nll_loss (the mean NLL per chosen token), which the loss adds
        with its weight."""
        out = {k: v / max(1, self.pairs) for k, v in self.sums.items()}
        if self.nll_weight is not None:
            out["nll_loss"] = self.nll / max(1, self.nll_tokens)
            out["loss"] += self.nll_weight * out["nll_loss"]
        return out

    @property
    def empty(self) -> bool:
        return self.pairs == 0


def new_stats(cfg: Config) -> StepStats:
    """Empty sums of every metric this run logs: TRL's, and its terms' own (ORPO's log odds), the same keys on
    every rank (distributed.sum_stats), whatever pairs a rank gets."""
    return StepStats(sums=dict.fromkeys((*METRIC_KEYS, *term_metric_names(cfg.loss_type)), 0.0),
                     nll_weight=objectives.nll_weight(cfg.loss_terms))


def reference_logps(model, batch: data.Batch, ref: cache.RefCache | None, ld_alpha: float | None = None):
    """(chosen, rejected) reference log-prob sums for this batch, (B,) each, on the CPU (ld_alpha: LD-DPO's)."""
    if ref is not None:
        return ref.chosen[batch.rows], ref.rejected[batch.rows]
    # ref_source=live: the same model with the adapter off. Costs a forward pass; for verification.
    with torch.no_grad(), model.disable_adapter():
        chosen, rejected = batch_logps(model, batch, ld_alpha=ld_alpha).split()
    return chosen.logps.cpu(), rejected.logps.cpu()


def judged_limits(cfg: Config):
    """(the warning-sign limits the run's loss is judged by, the judged term's weight, its name): its one per-pair
    term's (None where that objective has none), or guards.SEVERAL for several summed or none (loss_type [sft])."""
    per_pair = [(term, weight) for term, weight in cfg.loss_terms if not objectives.OBJECTIVES[term].per_token]
    if len(per_pair) != 1:
        return guards.SEVERAL, 1.0, None
    name, weight = per_pair[0]
    return objectives.OBJECTIVES[name].limits, weight, name


def forward_pairs(model, cfg: Config, pairs: list[data.TokenizedPair], ref, pad_id: int,
                  resolved: devices.Resolved, shared: bool = False,
                  drift: bool = False) -> tuple[torch.Tensor, objectives.PairLogps, StepStats]:
    """The per-pair terms' losses (B,) of one micro-batch of pairs, its log-probs (the per-token terms'), and its
    metric sums (detached). shared: each prompt once (data.collate_shared), the same log-probs. drift: also the
    reference values against this forward (StepStats.ref_drift, ref_offset), which step 1 logs."""
    device, types = resolved.device, cfg.loss_type
    batch = (data.collate_shared if shared else data.collate)(pairs, pad_id).to(device)
    reference = objectives.needs_reference(types)  # SimPO, ORPO, sft alone: no reference at all
    with devices.autocast(resolved.device, resolved.dtype):
        ref_chosen, ref_rejected = reference_logps(model, batch, ref, cfg.ld_alpha) if reference else (None, None)
        policy_logps = batch_logps(model, batch, prompts=objectives.nll_prompt(types),  # ORPO: prompts' too
                                   weighting=cfg.use_weighting, ld_alpha=cfg.ld_alpha)
    chosen, rejected = policy_logps.split()  # (B,) each
    if reference:  # the cache's float64 values, in the policy's sums' dtype (float32 on mps) on its device
        ref_chosen, ref_rejected = (r.to(device, chosen.logps.dtype) for r in (ref_chosen, ref_rejected))
    weights = None if not cfg.use_weighting else objectives.wpo_weights(chosen.aligned, chosen.n_tokens,
                                                                         rejected.aligned, rejected.n_tokens)
    logps = objectives.PairLogps(chosen.logps, rejected.logps, chosen.n_tokens, rejected.n_tokens,
                                 ref_chosen, ref_rejected,
                                 chosen.prompt_logps, chosen.prompt_tokens, weights)
    losses = objectives.combine(logps, cfg.loss_settings, cfg.loss_terms)  # (B,)
    r_chosen, r_rejected = objectives.rewards(logps, cfg.loss_settings, types)
    logps_chosen, logps_rejected = objectives.logged_logps(logps, types)
    stats = new_stats(cfg)
    stats.pairs, stats.tokens, stats.chosen_tokens = len(pairs), batch.num_tokens, int(chosen.n_tokens.sum())
    stats.rejected_tokens = int(rejected.n_tokens.sum())
    if reference and drift:
        ref_drift, offset = objectives.start_drift(logps, cfg.loss_settings, cfg.loss_terms, losses)  # (B,) each
        stats.ref_drift, stats.ref_offset = ref_drift.sum().item(), offset.sum().item()
    nll, nll_tokens = logps.nll_logps()  # (B,) each
    stats.nll, stats.nll_tokens = -nll.detach().sum().item(), int(nll_tokens.sum())
    sums = stats.sums
    sums["loss"] += losses.detach().sum().item()
    sums["rewards/chosen"] += r_chosen.sum().item()
    sums["rewards/rejected"] += r_rejected.sum().item()
    sums["rewards/accuracies"] += (r_chosen > r_rejected).float().sum().item()
    sums["rewards/margins"] += (r_chosen - r_rejected).sum().item()
    sums["logps/chosen"] += logps_chosen.sum().item()
    sums["logps/rejected"] += logps_rejected.sum().item()
    for name, values in objectives.term_metrics(logps, cfg.loss_settings, types).items():
        sums[name] += values.sum().item()
    return losses, logps, stats


def train_step(trainee: policy.Trainee, cfg: Config, group: list[list[data.TokenizedPair]], ref, pad_id: int,
               resolved: devices.Resolved, shared: bool = False, step_pairs: list | None = None,
               drift: bool = False) -> StepStats:
    """Forward+backward of the trainee's model over the micro-batches of one optimizer step (trainee.backward:
    scaled in float16); gradients accumulate in its params. The loss is the mean over all the step's pairs whatever
    the split (the out-of-memory back-off changes it), and the sft term the mean over all its chosen tokens.
    step_pairs: every pair of the step when `group` holds this rank's share of them (loop.rank_share), whose
    gradients the ranks sum; default: the group's pairs. drift: forward_pairs' drift, for step 1."""
    stats = new_stats(cfg)
    step_pairs = step_pairs if step_pairs is not None else [p for pairs in group for p in pairs]
    n_pairs = len(step_pairs)
    # the tokens the NLL averages over, as logps counts them: the chosen completions' (ORPO: and prompts' but the
    # first token, which nothing predicts)
    nll_tokens = sum(len(p.prompt_ids) + len(p.chosen_ids) - 1 if objectives.nll_prompt(cfg.loss_type)
                     else len(p.chosen_ids) for p in step_pairs)
    for pairs in group:
        losses, logps, batch_stats = forward_pairs(trainee.model, cfg, pairs, ref, pad_id, resolved, shared, drift)
        trainee.backward(losses.sum() / n_pairs + objectives.per_token_loss(logps, cfg.loss_terms, nll_tokens))
        stats.add(batch_stats)
    return stats


@torch.no_grad()
def eval_stats(model, cfg: Config, group: list[list[data.TokenizedPair]], ref, pad_id: int,
               resolved: devices.Resolved, shared: bool = False) -> StepStats:
    """train_step's metric sums over held-out pairs, with no gradients."""
    stats = new_stats(cfg)
    for pairs in group:
        stats.add(forward_pairs(model, cfg, pairs, ref, pad_id, resolved, shared)[2])
    return stats


@dataclass
class DPO:
    """DPO's part of the loop (session.Objective): pairs, the loss against the reference, the warning signs."""

    cfg: Config
    ref: cache.RefCache | None  # None: ref_source=live, or an objective without a reference (SimPO, ORPO)
    eval_ref: cache.RefCache | None = None  # the eval pairs' reference (the same cache part, or its eval part)
    shared: bool = False  # each prompt once per pair (headcheck.decide_sharing)
    name: str = "train"
    unit: str = "pair"

    def new_stats(self) -> StepStats:
        return new_stats(self.cfg)

    def accumulate_gradients(self, session: Session, pairs: list[data.TokenizedPair], micro_batch: int) -> StepStats:
        batches = loop.micro_batches(loop.rank_share(session, pairs), micro_batch)
        run = session.run
        # (measured again on an out-of-memory retry of the step: every rank retries it, with fresh sums)
        return train_step(session.trainee, run.cfg, batches, self.ref, run.pad_id, run.resolved, self.shared,
                          step_pairs=pairs, drift=session.progress.step == 0 and self.measures_drift(session))

    def measures_drift(self, session: Session) -> bool:
        """Whether a new run's step 1 measures the cache against its own forward (the drift line): the policy is
        the reference there, so the cache should hold its forward's values; not so for a continued SFT adapter with
        lora_dropout, whose B is not 0: the dropout draws noise into it."""
        run = session.run
        return (self.ref is not None and session.progress.resumed_from is None
                and (run.adapter_off_is_start or not run.cfg.lora_dropout))

    def eval_stats(self, session: Session, pairs: list[data.TokenizedPair], micro_batch: int) -> StepStats:
        batches = loop.micro_batches(loop.rank_share(session, pairs), micro_batch)
        run = session.run
        return eval_stats(session.trainee.model, run.cfg, batches, self.eval_ref, run.pad_id, run.resolved, self.shared)

    def eval_metrics(self, stats: StepStats) -> dict[str, float]:
        return {f"eval_{k}": v for k, v in stats.means().items()}  # TRL's names: eval_loss, eval_rewards/...

    def warning_signs(self, session: Session, stats: StepStats, held_out: bool = False) -> list[str]:
        cfg = session.run.cfg
        if stats.empty:
            return []
        tokens, rejected_tokens = stats.chosen_tokens / stats.pairs, stats.rejected_tokens / stats.pairs
        means = stats.means()
        if stats.nll_weight is not None:  # the signs judge the preference loss: the NLL term has its own scale
            means["loss"] -= stats.nll_weight * means["nll_loss"]
        limits, weight, _ = judged_limits(cfg)
        thresholds = guards.thresholds(limits, cfg.beta, cfg.label_smoothing, tokens, weight)
        if not objectives.needs_reference(cfg.loss_type):
            tokens = rejected_tokens = 0.0  # the per-token signs read log-ratios to the reference: none here
        signs = guards.warning_signs(means, session.progress.step, session.run.steps, cfg.beta, tokens, thresholds,
                                     rejected_tokens, held_out)
        if session.progress.step == 1 and not held_out and self.measures_drift(session):  # the drift line, first
            context = guards.context_signs(means, 1, session.run.steps, cfg.beta, thresholds, rejected_tokens)
            signs = [guards.with_context(sign, context) for sign in self.drift_signs(session, stats)] + signs
        return signs

    def drift_signs(self, session: Session, window: StepStats) -> list[str]:
        """Log step 1's drift line, from its window (step 1 alone, every rank's pairs); its warning sign, if any:
        the cache is not this policy's forward."""
        r = session.run.resolved
        other = [f"ref_dtype={devices.dtype_name(r.ref_dtype)} against the policy's {devices.dtype_name(r.dtype)}"
                 ] if r.ref_dtype != r.dtype else []
        if r.ref_quantization != r.quantization:
            other.append(f"ref_quantization={r.ref_quantization} against the policy's {r.quantization}")
        lines, sign = guards.drift_lines(window.ref_drift, window.ref_offset, window.pairs,
                                         window.chosen_tokens + window.rejected_tokens, r.quantization == "8bit",
                                         " and ".join(other) or None)
        for line in lines:
            log(line)
        return [sign] if sign else []

    def bar_numbers(self, line: dict) -> dict[str, str]:
        return {"loss": f"{line['loss']:.4f}", "acc": f"{line['rewards/accuracies']:.2f}",
                "margin": f"{line['rewards/margins']:.3f}"}

    def opening_lines(self, session: Session) -> list[str]:
        cfg = session.run.cfg
        reference = (f"cached in {cfg.ref_cache_dir}" if self.ref is not None
                     else "live (adapter disabled), costs a forward" if objectives.needs_reference(cfg.loss_type)
                     else f"none (loss_type={cfg.loss_type} reads no reference: no cache, no precompute)")
        limits, _, judged = judged_limits(cfg)
        still = ("likelihood displacement and the answers' signs still warn"
                 if objectives.needs_reference(cfg.loss_type) else "the answers' signs still warn")
        unguarded = [] if limits is not None else [
            f"warning signs: loss_type={judged} declares no margin or early-loss limits, so that context is not shown "
            f"beside a warning ({still})"]
        return unguarded + [
                f"reference: {reference}; prompts: {'once per pair (share_prompt)' if self.shared else 'twice'}",
                f"training {sum(p.numel() for p in session.trainee.params):,} LoRA parameters for {session.run.steps} "
                f"steps of {session.progress.micro_batch} x {session.progress.grad_accum} pairs "
                f"({len(session.run.items)} pairs in the data)"]

    def closing_note(self, line: dict) -> str:
        if not line or line.get("loss") is None:
            return ""
        return f": loss {line['loss']:.4f}, rewards/accuracies {line['rewards/accuracies']:.2f}"


def setup(cfg: Config, recipe: str | None = None, progress: bool = True) -> Session:
    """Check the cache, tokenize, load the model with its one adapter (fresh, or the SFT adapter continued), build
    the optimizer; with resume=auto and a checkpoint in output_dir (or resume=PATH), continue from it."""
    require(cfg, "train")
    output.check_output_dir(cfg, "train")  # a folder of other files is refused before anything loads
    resolved = devices.resolve(cfg)
    for note in cfg.no_effect():
        log(f"warning: {note}")
    prepared = inputs.prepare(cfg, resolved)
    adapters.check_mode(cfg, prepared.source, resolved.quantization)
    resume = resuming.find_resume(cfg)  # before anything heavy: a bad path or changed settings fail fast
    stream = policy.apply_plan(adapters.planned_lora(cfg, prepared.source), resolved, prepared.model_path)
    policy.check_bitsandbytes(resolved)
    log(prepared.source.description)
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress)  # logs the rows it skips and the eval split
    side = inputs.run_side(cfg, resolved, prepared)
    # Before anything heavy loads: rows without a reference value are refused in seconds.
    ref, eval_ref = reference_caches(cfg, prepared, side, dataset, recipe)
    trains_on = {**inputs.run_inputs(prepared.fingerprint, dataset.train),
                 "reference cache": None if ref is None else side.identity}
    resuming.check_before_load(cfg, resume, trains_on, len(dataset.train))
    model = policy.setup_model(cfg, resolved, prepared.model_path, stream, source=prepared.source)
    pad_id = data.pad_token_id(prepared.tokenizer)
    # sharing decided on the same rows as precompute's (every row of dataset): the two agree on the layout
    shared = headcheck.bring_up(model, cfg, resolved, pad_id, dataset.train[:1], dataset.tok.pairs, train=True)
    if ref is not None and side.twin is not None:  # 16-bit: the values of this run's layout first
        ref, eval_ref = reference_caches(cfg, prepared, side.preferring(shared), dataset, recipe)
        if ref.shared != shared:
            log(f"note: reference values were computed {'with' if ref.shared else 'without'} share_prompt and "
                f"this run {'shares' if shared else 'does not share'} prompts: in "
                f"{devices.dtype_name(resolved.dtype)} the two forwards round differently, so step 1 may sit ~1e-3 "
                f"off ln 2; {cache.rebuild_command(cfg, recipe)} share_prompt={str(shared).lower()} computes this "
                "run's own")
    objective, items = DPO(cfg, ref, eval_ref, shared), dataset.train
    if objectives.unpaired(cfg.loss_type):
        objective = kto.KTO(cfg, ref, kto.labels(dataset.unpaired["train"]), eval_ref,
                            kto.labels(dataset.unpaired[dataset.eval_part]) if dataset.eval_part else None)
        items = kto.blocks(dataset.train, cfg.per_device_train_batch_size)
    run = RunSetup(cfg, resolved, objective, items, pad_id, trains_on, dataset.eval, prepared.tokenizer,
                   dataset.prompts, adapter_off_is_start=adapters.adapter_off_is_start(cfg, prepared.source))
    return start_session(run, model, resume)


def reference_caches(cfg: Config, prepared: inputs.Inputs, side: cache.Side, dataset: inputs.Data,
                     recipe: str | None) -> tuple:
    """The reference values of the dataset's rows and of the eval rows (inputs.cached_reference; None, None with
    ref_source=live)."""
    if cfg.ref_source != "cache" or not objectives.needs_reference(cfg.loss_type):
        return None, None
    ref, eval_ref = inputs.cached_reference(cfg, prepared, side, dataset, recipe)
    return ref, (eval_ref or ref if dataset.eval else None)


def run(cfg: Config, recipe: str | None = None, progress: bool = True) -> loop.TrainResult:
    """Train and save the adapter to cfg.output_dir; checkpoints every save_steps; resumes per cfg.resume."""
    return loop.run(setup(cfg, recipe, progress), progress)


def main(argv: list[str]) -> int:
    run(load_config(argv[0], argv[1:]), recipe=argv[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "train", __doc__))
