"""Signs that a DPO run is going wrong, from the metrics train logs: pure functions, numbers in, messages out.

A warning names evidence of damage: step 1's cache that is not the policy's forward (drift_lines), likelihood
displacement (warning_signs, on a logged line's window or the held-out pairs), answers that collapse or drift from
the chosen ones (answers.py's collapse_sign, on the samples), non-finite losses (step.optimizer_step skips the update;
max_nonfinite_steps in a row stop the run). How far the run moved from its reference (the margin, an early
loss near 0, the rejected side's fall, the answers' KL) is context: shown beside a warning when past its own limit
(with_context), never a warning alone, for a run that learns its data moves far. Each warning ends with what to
try. Train logs each at the step where it shows; with early_stop_on_divergence=true it stops there (exit 2, the
last checkpoint kept).

The margin and early-loss limits depend on the objective: each entry of lowmem_dpo.objectives holds its own
(`Limits`, or None: none), and `thresholds` turns them and a run's beta, label smoothing and tokens per pair into
the numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from lowmem_dpo.objectives.metrics import ACCURACY, LOSS, MARGIN, REWARDS_CHOSEN, REWARDS_REJECTED
from lowmem_dpo.objectives.registry import Limits


@dataclass(frozen=True)
class Thresholds:
    # Context, never a warning on its own (a run that learns what its data asks moves far from its reference: its
    # margins grow and its rejected log-probs fall), shown beside a warning that evidence raises:
    # rewards/margins = beta * (chosen log-ratio - rejected log-ratio). Above 10 the sigmoid loss is below
    # 5e-5: the pairs are separated, and further growth comes from pushing the two log-probs apart.
    margin: float = 10.0
    margin_why: str = "the loss is already ~0; growth now only pushes log-probs apart"
    # The loss below this within the first `early_fraction` of the steps: the data is easy (a wrong reference shows
    # in step 1's drift line). None: no such note (a loss whose optimum is 0 reaches it by design).
    early_loss: float | None = 0.05
    early_fraction: float = 0.2
    # The rejected log-probs this many nats per token below the reference's, accuracy at least `saturated`: healthy
    # runs do it too (SmolLM2 with [sigmoid, sft] at lr 5e-4: -2.8 to -4.1 nats/token at their end).
    saturated: float = 0.95
    rejected_drop_per_token: float = 2.0
    # Evidence, a warning: likelihood displacement, the chosen log-probs below the reference's (train window or held
    # out). Alone when this many nats per token below (each chosen token 0.61 times as likely): SmolLM2's damaged
    # correctness runs reached -0.8 to -1.2 (train and held out), the runs whose answers held stayed above -0.02.
    chosen_drop_per_token: float = 0.5
    # And backed: `displaced_per_token` below, the preference learned and a context note past its limit. SmolLM2's
    # damaged length run (-8 +1 facts of 32) sat at -0.31 to -0.38, margins 17, rejected -5.7; the tiny demo reaches
    # -0.43 on a train window, -0.21 held out, with no context past its limits.
    displaced_per_token: float = 0.1


# Several preference terms summed (or sft alone): the margin note stays, at the sigmoid's limit; the loss is no
# known function of the margin, so no early-loss note.
SEVERAL = Limits(lambda beta, n: 10.0, "the pairs are separated well beyond what DPO needs; growth now only pushes "
                 "log-probs apart", None)
UNGUARDED = Thresholds(margin=math.inf, margin_why="", early_loss=None)


@dataclass(frozen=True)
class At:
    """Where a logged line's (or an eval's: held_out) metrics stand: optimizer step `step` of `steps`."""

    step: int
    steps: int
    held_out: bool = False


def thresholds(limits: Limits | None, beta: float, label_smoothing: float, tokens_per_pair: float,
               weight: float = 1.0) -> Thresholds:
    """The warning-sign limits of a run from its objective's `limits` (objectives' entry; SEVERAL for summed terms;
    None: an objective without limits, UNGUARDED), its weight in the loss (the early limit scales with it), beta,
    label smoothing and mean chosen tokens per pair."""
    if limits is None:
        return UNGUARDED
    return Thresholds(margin=limits.margin(beta, tokens_per_pair),
                      margin_why=limits.margin_why.format(tokens=tokens_per_pair),
                      early_loss=None if limits.early_loss is None else weight * limits.early_loss(label_smoothing))


def nonfinite(*values: float) -> bool:
    return not all(math.isfinite(v) for v in values)


def context_signs(means: dict, step: int, total_steps: int, beta: float, t: Thresholds = Thresholds(),
                  rejected_tokens_per_pair: float = 0.0) -> list[str]:
    """The context beyond its limits in one logged line's means (rewards/*, loss) at optimizer step `step` of
    `total_steps`: a reward margin far past separation, a loss near 0 early, the rejected log-probs far below the
    reference's. Never a warning alone (healthy runs that move far show them): warning_signs adds them to one."""
    notes = []
    margin = means[MARGIN.name]
    if margin > t.margin:
        notes.append(f"reward margin exploding: rewards/margins {margin:.2f} > {t.margin:g} ({t.margin_why})")
    if t.early_loss is not None and step <= t.early_fraction * total_steps and means[LOSS.name] < t.early_loss:
        notes.append(f"loss collapsing early: {means[LOSS.name]:.4f} < {t.early_loss:.4g} at step {step} of {total_steps} "
                     "(easy data)")
    if beta > 0 and rejected_tokens_per_pair > 0 and means.get(ACCURACY.name, 0.0) >= t.saturated:
        per_token = means[REWARDS_REJECTED.name] / beta / rejected_tokens_per_pair
        if per_token < -t.rejected_drop_per_token:
            notes.append(f"rejected log-probs {per_token:.2f} nats/token below the reference (beyond "
                         f"-{t.rejected_drop_per_token:g})")
    return notes


def with_context(sign: str, context: list[str], what_to_try: str = "") -> str:
    """A warning: its evidence, the context beyond its limits that backs it (each note as context_signs words it),
    and what to try (where the evidence does not already say it)."""
    beside = f"; beside it: {'; '.join(context)}" if context else ""
    return f"{sign}{beside}" + (f"; {what_to_try}" if what_to_try else "")


def warning_signs(means: dict, at: At, beta: float, chosen_tokens_per_pair: float, t: Thresholds = Thresholds(),
                  rejected_tokens_per_pair: float = 0.0) -> list[str]:
    """The warning sign that `means` (one logged line's rewards/*, loss; or at.held_out: an eval's) shows at
    optimizer step at.step of at.steps, with the context beyond its limits and what to try; [] when none. The one
    evidence of damage in the preference metrics: likelihood displacement, the chosen log-probs below the
    reference's, far below alone, or somewhat below with the preference learned and context past its limits
    (Thresholds): context backs evidence, never stands for it. `t`: thresholds() of the run's loss (the default is
    the sigmoid loss's). Token counts of 0: the signs per token against the reference are off."""
    if not (beta > 0 and chosen_tokens_per_pair > 0):
        return []
    per_token = means[REWARDS_CHOSEN.name] / beta / chosen_tokens_per_pair  # policy - reference, nats/token
    accuracy = means.get(ACCURACY.name, 0.0)
    context = context_signs(means, at.step, at.steps, beta, t, rejected_tokens_per_pair)
    # (a NaN passes neither: the loop's non-finite note says it)
    backed = accuracy >= t.saturated and per_token < -t.displaced_per_token and bool(context)
    if not (per_token < -t.chosen_drop_per_token or backed):
        return []
    why = ("the preference is learned and DPO now pushes log-probs down, the good answers' too"
           if accuracy >= t.saturated else "both completions are being pushed down")
    where = " on the held-out pairs" if at.held_out else ""
    sign = (f"likelihood displacement{where}: chosen log-probs {per_token:.3f} nats/token below the reference (limit "
            f"-{t.chosen_drop_per_token:g}; -{t.displaced_per_token:g} with accuracy >= {t.saturated:g} and context "
            f"past its limits), accuracy {accuracy:.2f}: {why}")
    return [with_context(sign, context, TRY_DISPLACEMENT)]


def sign_kind(sign: str) -> str:
    """A warning sign's kind: its text up to the numbers ("generations collapsing into repetition")."""
    return sign.split(":")[0]


# Step 1's cache drift sign (drift_lines): about the cache and the start, not what a checkpoint learned
START_OFFSET = "reference cache off this policy's forward"


def warned_steps(lines: list[dict]) -> dict[str, list[int]]:
    """Each kind of warning sign in metrics.jsonl's {"step", "warnings"} `lines` (other lines are skipped), with
    the steps it fired at, in the order each kind first fired."""
    kinds: dict[str, list[int]] = {}
    for line in lines:
        for sign in line.get("warnings") or ():
            kinds.setdefault(sign_kind(sign), []).append(line["step"])
    return kinds


def damage_since(lines: list[dict], step: int) -> dict[str, list[int]]:
    """The signs of damage (all but START_OFFSET) that judge step `step`'s checkpoint, warned_steps' form: its
    eval's, and its train lines' since the eval before (a sign between two checkpoints belongs to the next)."""
    since = max((x["step"] for x in lines if x["step"] < step and any(k.startswith("eval_") for k in x)), default=0)
    kinds = warned_steps([x for x in lines if since < x["step"] <= step])
    return {kind: steps for kind, steps in kinds.items() if kind != START_OFFSET}


def warnings_summary(lines: list[dict]) -> str | None:
    """The warning signs a run logged (metrics.jsonl's lines), in one line: each kind at the step it first fired
    and how often ("likelihood displacement at step 10 (2 times); ..."); None for a run without one."""
    kinds = warned_steps(lines)
    if not kinds:
        return None
    return "; ".join(f"{kind} at step {steps[0]}" + (f" ({len(steps)} times)" if len(steps) > 1 else "")
                     for kind, steps in kinds.items())


# What a warning asks the user to try (a warning names evidence of damage, then this; answers.py: the answers')
TRY_DISPLACEMENT = ("try loss_type [sigmoid, sft] (its sft term holds the chosen answers up), a lower learning_rate "
                    "or fewer steps")


# -- step 1: the reference cache against the policy's forward ------------------------------------------------
DRIFT_LOSS_BOUND = 1e-2  # |mean loss - its value at policy = reference| (ln 2 for sigmoid)
DRIFT_TOKEN_BOUND = 5e-4  # |policy - reference| of each completion's summed log-prob, added over the step and divided
# by its completion tokens (nats); not for an 8-bit base, whose LLM.int8 picks outlier columns per batch: 2-3e-4 on
# the tiny model, the loss bound alone there
ROUNDING_FACTOR = 3.0  # two layouts' rounding differ by about as much as the cache's and train's: 3x is room
# The drift line as drift_lines writes it: (nats per token, loss offset), for what reads it back from a log
DRIFT_LINE = re.compile(r"step 1: reference cache against the policy's own forward \(one model at step 1\): (\S+) nats "
                        r"per token \(bound [^)]*\), loss offset (\S+)")


@dataclass(frozen=True)
class Rounding:
    """A 16-bit run's own rounding at step 1: its pairs forwarded one at a time against train's batch."""

    per_token: float  # summed |batch - alone| over the completions / their tokens (nats)
    dtype: str  # bfloat16, float16
    device: str  # cpu, cuda, mps


def drift_lines(drift: float, offset: float, pairs: int, tokens: int, int8: bool = False,
                other_reference: str | None = None, rounding: Rounding | None = None
                ) -> tuple[list[str], str | None]:
    """Step 1's lines to log: the drift line (summed |policy - reference| over `tokens` completion tokens, summed
    loss offset over `pairs`); and when it is beyond DRIFT_LOSS_BOUND or DRIFT_TOKEN_BOUND (not for an 8-bit base:
    `int8`), the warning sign with what to do (None within them). other_reference: the reference's own settings where
    they differ from the policy's (ref_dtype, ref_quantization), chosen on purpose: then a note naming them and their
    cost, no warning. rounding (a 16-bit dtype): the device's own rounding between layouts; a drift within
    ROUNDING_FACTOR times it is that rounding: a note saying so and how float32 checks it, no warning. No pairs:
    ([], None)."""
    if pairs == 0:
        return [], None
    per_token, loss = drift / max(1, tokens), offset / pairs
    token_bound = "none for an 8-bit base" if int8 else f"{DRIFT_TOKEN_BOUND:g}"
    line = (f"step 1: reference cache against the policy's own forward (one model at step 1): {per_token:.2e} nats "
            f"per token (bound {token_bound}), loss offset {loss:+.2e} (bound {DRIFT_LOSS_BOUND:g})")
    if (per_token <= DRIFT_TOKEN_BOUND or int8) and abs(loss) <= DRIFT_LOSS_BOUND:
        return [line], None
    off = (f"{START_OFFSET}: {per_token:.2e} nats per token, the loss {loss:+.2e} off its "
           "start, so every pair's weight starts off by that much")
    if other_reference:
        return [line, f"note: step 1: {off}: the reference was computed with {other_reference}. Chosen for a more "
                      "precise reference, that is its cost at the start; else set them null and rerun precompute"], None
    check = ("precompute and train with dtype=float32 check it (0 there); precompute_batch_size at train's "
             "per_device_train_batch_size gives the cache train's batch shapes")
    if rounding is not None and per_token <= ROUNDING_FACTOR * rounding.per_token:
        return [line, f"note: step 1: {rounding.dtype} rounding on this {rounding.device}: the same pairs forwarded one "
                      f"at a time differ from train's batch by {rounding.per_token:.2e} nats per token, and the cache "
                      f"by {per_token:.2e} (within {ROUNDING_FACTOR:g} times that): the cache is this model's, its "
                      f"kernels round by batch layout. The start is off by that much (loss {loss:+.2e}); {check}"], None
    if rounding is not None:  # beyond this device's rounding between two layouts; precompute's may round more
        return [line], (f"{off}; this device's own {rounding.dtype} rounding between two batch layouts is "
                        f"{rounding.per_token:.2e} nats per token, and precompute's batches (other shapes) may round "
                        f"more: {check}. Else the cache was computed on another device or with other weights or "
                        "library versions than this run's: rerun precompute where train runs")
    return [line], (f"{off}; the usual cause is a cache computed on another device or with other weights or "
                    "library versions than this run's: rerun precompute where train runs")
