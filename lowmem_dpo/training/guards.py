"""Signs that a DPO run is going wrong, from the metrics train logs: pure functions, numbers in, messages out.

A warning names evidence of damage: step 1's cache that is not the policy's forward (drift_lines), likelihood
displacement (warning_signs, on a logged line's window or the held-out pairs), answers that collapse or drift from
the chosen ones (collapse_sign, on the samples), non-finite losses (step.optimizer_step skips the update;
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

import lowmem_dpo.objectives.metrics as rows
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


def warning_signs(means: dict, step: int, total_steps: int, beta: float, chosen_tokens_per_pair: float,
                  t: Thresholds = Thresholds(), rejected_tokens_per_pair: float = 0.0,
                  held_out: bool = False) -> list[str]:
    """The warning sign that `means` (one logged line's rewards/*, loss; or held_out: an eval's) shows at optimizer
    step `step` of `total_steps`, with the context beyond its limits and what to try; [] when none. The one evidence
    of damage in the preference metrics: likelihood displacement, the chosen log-probs below the reference's, far
    below alone, or somewhat below with the preference learned and context past its limits (Thresholds): context
    backs evidence, never stands for it. `t`: thresholds() of the run's loss (the default is the sigmoid loss's).
    Token counts of 0: the signs per token against the reference are off."""
    if not (beta > 0 and chosen_tokens_per_pair > 0):
        return []
    per_token = means[REWARDS_CHOSEN.name] / beta / chosen_tokens_per_pair  # policy - reference, nats/token
    accuracy = means.get(ACCURACY.name, 0.0)
    context = context_signs(means, step, total_steps, beta, t, rejected_tokens_per_pair)
    # (a NaN passes neither: the loop's non-finite note says it)
    backed = accuracy >= t.saturated and per_token < -t.displaced_per_token and bool(context)
    if not (per_token < -t.chosen_drop_per_token or backed):
        return []
    why = ("the preference is learned and DPO now pushes log-probs down, the good answers' too"
           if accuracy >= t.saturated else "both completions are being pushed down")
    where = " on the held-out pairs" if held_out else ""
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


# -- degeneration of the generations ------------------------------------------------------------------------------
# seq-rep-n (Welleck et al. 2019, section 5): the share of a sequence's n-grams that repeat an earlier one. On the
# tiny model (48 greedy tokens, 4 prompts): the untrained reference 0.16-0.40, the healthy demo 0.0, runs pushed
# into collapse (lr 3e-2 or 1e-1, 200 steps) 0.71-0.98 ("novel novel novel"). A rise over step 0 and a high level:
# a reference that already repeats itself is not flagged for staying so.
COLLAPSE_RISE = 0.3  # seq-rep-4 this far above step 0's (the reference's) ...
COLLAPSE_LEVEL = 0.5  # ... and at least this high: at least half the 4-grams repeat
COLLAPSE_N = 4
# The other collapse, to nothing (seq-rep-n scores an EOS at once 0.0): the share of empty answers up by half of all
# samples, or the mean length down to a quarter of step 0's (when step 0 wrote at least a few tokens).
EMPTY_RISE = 0.5
SHORT_FRACTION = 0.25
SHORT_MIN_START = 4.0
# A short answer is no collapse when it is at least this share of the held-out chosen completions' length: data
# whose chosen answers are short teaches short answers ([sigmoid, sft] on SmolLM2 went from 46 tokens to 8).
CHOSEN_FRACTION = 0.5
# Calibrated on SmolLM2-135M-Instruct (bench/signs.py, bench/README.md): runs whose 32 held-out answers lost their
# facts warn, those whose answers held and the tiny demo stay quiet. Drift: ROUGE-L against the chosen answers this
# far below step 0's (held: 0.56 -> 0.51 at worst, the demo 0.71 -> 0.63; worse: 0.46 -> 0.36, 6 of 32 answers lost
# their fact, none gained one); content_sign's eval_gen/content too (6 runs checked at 16 answers) ...
DRIFT_DROP = 0.1
# ... and this many standard errors of the change over the same prompts (eval_gen/rouge_l_se: 0.046 with 32 answers)
DRIFT_SE = 2.0
# Context, beside a warning: the policy's own answers this many nats per token (KL) from the reference. Runs whose
# answers got better ended at 0.85-1.48 ([sigmoid, sft] at lr 5e-4); the damaged style run 1.73; the demo 0.48.
KL_LIMIT = 0.8
# The samples' measures in metrics.jsonl (evaluation.sample_metrics), and what the collapse sign reads.
GEN_REPETITION, GEN_LENGTH, GEN_EMPTY = rows.GEN_REPETITION.eval, rows.GEN_LENGTH.eval, rows.GEN_EMPTY.eval
GEN_ROUGE_L, GEN_CHOSEN_LENGTH, GEN_KL = rows.GEN_ROUGE_L.eval, rows.GEN_CHOSEN_LENGTH.eval, rows.GEN_KL.eval
GEN_ROUGE_L_SE, GEN_COLLAPSED, GEN_ANSWERS = rows.GEN_ROUGE_L_SE.eval, rows.GEN_COLLAPSED.eval, rows.GEN_ANSWERS.eval
GEN_CONTENT, GEN_CONTENT_SE = rows.GEN_CONTENT.eval, rows.GEN_CONTENT_SE.eval
# What a warning asks the user to try, one line each (a warning names evidence of damage, then this).
TRY_DISPLACEMENT = ("try loss_type [sigmoid, sft] (its sft term holds the chosen answers up), a lower learning_rate "
                    "or fewer steps")
TRY_ANSWERS = (f"try the best checkpoint by {GEN_ROUGE_L} (metric_for_best_model: {GEN_ROUGE_L}), fewer steps or a "
               "lower learning_rate, and for DPO loss_type [sigmoid, sft]; output_dir/samples.jsonl has the answers")


def repetition(seqs: list[list[int]], n: int = COLLAPSE_N) -> float:
    """Mean seq-rep-n over the sequences of at least n tokens: 1 - distinct n-grams / n-grams of each; 0.0 when
    none has n tokens."""
    reps = []
    for seq in seqs:
        grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
        if grams:
            reps.append(1.0 - len(set(grams)) / len(grams))
    return sum(reps) / len(reps) if reps else 0.0


def rouge_l(answer: list[int], reference: list[int]) -> float:
    """ROUGE-L F1 of two token sequences (Lin 2004): the longest common subsequence's share of each, their
    harmonic mean; 1.0 for two empty ones, 0.0 when one is empty."""
    if not answer or not reference:
        return float(not answer and not reference)
    row = [0] * (len(reference) + 1)  # LCS lengths of answer[:i] against every prefix of reference
    for a in answer:
        diagonal = 0
        for j, b in enumerate(reference, 1):
            diagonal, row[j] = row[j], diagonal + 1 if a == b else max(row[j], row[j - 1])
    lcs = row[-1]
    return 0.0 if lcs == 0 else 2 * lcs / (len(answer) + len(reference))


def change_se(pairs: list[tuple[float, float]]) -> float | None:
    """The standard error of the mean change over (now, step 0) pairs of one prompt's scores: sd / sqrt(n), the
    noise of eval_gen/rouge_l's change from step 0; None under 2 pairs."""
    if len(pairs) < 2:
        return None
    diffs = [a - b for a, b in pairs]
    mean = sum(diffs) / len(diffs)
    return math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))


def collapsed_answers(seqs: list[list[int]], base_repetition: list[float | None],
                      base_tokens: list[int | None]) -> tuple[int, int]:
    """(answers collapsed, answers judged) against the same prompt's at step 0 (its seq-rep-4 and length; None:
    not judged): into repetition (the mean sign's limits, on each answer alone) or into nothing (empty where step 0's
    was not). One broken answer among few moves the means little (a user's "JAP. JAP. JAP." was 1 of 4)."""
    collapsed = judged = 0
    for seq, rep0, tokens0 in zip(seqs, base_repetition, base_tokens):
        if rep0 is None or tokens0 is None:
            continue
        rep, judged = repetition([seq]), judged + 1
        collapsed += (rep >= COLLAPSE_LEVEL and rep - rep0 >= COLLAPSE_RISE) or (not seq and tokens0 > 0)
    return collapsed, judged


def generation_stats(seqs: list[list[int]], chosen: list[list[int]] | None = None,
                     scores: list[float] | None = None) -> dict[str, float]:
    """The samples' measures: seq-rep-4, mean length in tokens, and the share of empty answers (EOS at once); with
    `chosen` (each sample's held-out chosen completion, without EOS) their mean token ROUGE-L against it and the
    chosen completions' mean length. scores: each sample's rouge_l against its chosen where already computed."""
    out = {GEN_REPETITION: round(repetition(seqs), 6),
           GEN_LENGTH: round(sum(len(s) for s in seqs) / max(1, len(seqs)), 3),
           GEN_EMPTY: round(sum(not s for s in seqs) / max(1, len(seqs)), 6)}
    if chosen is not None:
        scores = scores if scores is not None else list(map(rouge_l, seqs, chosen))
        out[GEN_ROUGE_L] = round(sum(scores) / max(1, len(seqs)), 6)
        out[GEN_CHOSEN_LENGTH] = round(sum(map(len, chosen)) / max(1, len(chosen)), 3)
    return out


def collapse_sign(base: dict | None, now: dict) -> str | None:
    """The warning sign when the generations (`now`: generation_stats' keys) get worse against step 0's (`base`;
    None, or a line without a measure: compared against none): collapsing into repetition, empty answers or ones a
    quarter as long; drifting from the chosen answers (drift_sign); losing their content (content_sign).
    With the KL from the reference beside it when that is past KL_LIMIT, and what to try. None otherwise."""
    base = base or {}
    sign = _collapse(base, now) or drift_sign(base, now) or content_sign(base, now)
    if sign is None:
        return None
    kl = now.get(GEN_KL)
    context = [f"KL {kl:.2f} nats per token from the reference on the policy's own answers (beyond {KL_LIMIT:g})"
               ] if kl is not None and kl > KL_LIMIT else []
    return with_context(sign, context, TRY_ANSWERS)


def _collapse(base: dict, now: dict) -> str | None:
    rep, start = now.get(GEN_REPETITION), base.get(GEN_REPETITION) or 0.0
    collapsed, answers = now.get(GEN_COLLAPSED), now.get(GEN_ANSWERS)
    k_of_n = f"{collapsed:g} of {answers:g} answers collapsed; " if collapsed and answers else ""
    if rep is not None and rep - start >= COLLAPSE_RISE and rep >= COLLAPSE_LEVEL:
        return (f"generations collapsing into repetition: {k_of_n}seq-rep-{COLLAPSE_N} {rep:.2f} against {start:.2f} "
                f"at step 0 (limits: +{COLLAPSE_RISE:g} and >= {COLLAPSE_LEVEL:g})")
    empty, empty0 = now.get(GEN_EMPTY), base.get(GEN_EMPTY) or 0.0
    if empty is not None and empty - empty0 >= EMPTY_RISE:
        return (f"generations collapsing into empty answers: {k_of_n}{empty:.0%} of the samples end at once against "
                f"{empty0:.0%} at step 0 (limit: +{EMPTY_RISE:.0%})")
    length, length0, chosen = now.get(GEN_LENGTH), base.get(GEN_LENGTH), now.get(GEN_CHOSEN_LENGTH)
    if (length is not None and length0 is not None and length0 >= SHORT_MIN_START and length <= SHORT_FRACTION * length0
            and (chosen is None or length < CHOSEN_FRACTION * chosen)):  # as long as the chosen answers: no collapse
        return (f"generations collapsing into short answers: {length:.1f} tokens on average against {length0:.1f} at "
                f"step 0 (limit: {SHORT_FRACTION:g} of it){_chosen(chosen)}")
    if collapsed and answers:  # one broken answer is evidence too: the means above see only many
        return (f"answers collapsing: {collapsed:g} of {answers:g} into repetition (each seq-rep-{COLLAPSE_N} >= "
                f"{COLLAPSE_LEVEL:g} and +{COLLAPSE_RISE:g} over the same prompt's answer at step 0) or into nothing "
                "(empty where step 0's was not)")
    return None


def _chosen(length: float | None) -> str:
    return "" if length is None else f" and {length:.1f} for the chosen answers"


def drift_sign(base: dict, now: dict) -> str | None:
    """The sign when the samples drift from what the data prefers: token ROUGE-L against the chosen completions
    far below step 0's (preference metrics can look perfect while the answers get worse). None otherwise. The KL
    from the reference is no such sign: a run that learns its data moves far from the reference (context)."""
    fell = _fell(base, now, GEN_ROUGE_L, GEN_ROUGE_L_SE)
    return None if fell is None else (f"answers drifting from the chosen completions: ROUGE-L {fell[0]:.2f} against "
                                      f"{fell[1]:.2f} at step 0 (limit: -{DRIFT_DROP:g}{fell[2]}), whatever the "
                                      "preference metrics say")


def content_sign(base: dict, now: dict) -> str | None:
    """The sign when the answers lose what the chosen answers add to the question beyond their shared phrasing
    (eval_gen/content, content.py), which ROUGE-L misses; by the drift sign's limits. None otherwise."""
    fell = _fell(base, now, GEN_CONTENT, GEN_CONTENT_SE)
    return None if fell is None else (f"answers losing their content: {fell[0]:.2f} of what the chosen answers add "
                                      f"to the question, beyond their shared phrasing, against {fell[1]:.2f} at step "
                                      f"0 (limit: -{DRIFT_DROP:g}{fell[2]}), whatever ROUGE-L says")


def _fell(base: dict, now: dict, key: str, se_key: str) -> tuple[float, float, str] | None:
    """(now's `key`, step 0's, its noise in words) when it is DRIFT_DROP below step 0's and DRIFT_SE standard
    errors of the change (`se_key`, where the line has it: a drop within the answers' noise is no evidence)."""
    v, v0, se = now.get(key), base.get(key), now.get(se_key)
    if v is None or v0 is None or v > v0 - DRIFT_DROP or (se is not None and v0 - v < DRIFT_SE * se):
        return None
    return v, v0, "" if se is None else f"; ±{se:.3f}, limit {DRIFT_SE:g} of it"


# Step 1's drift between the cached reference and the policy's own forward. On this CPU (AVX2) 0 in float32 and
# bfloat16, 4-bit or not (tests/test_train.py); a cache of another dtype or quantization 1-2e-3 nats per token off.
# 16-bit kernels that block by shape round by batch layout (a card: ~1e-5 to 3e-5; a user's AVX512-BF16 CPU 3.7e-2
# with SmolLM2-135M, 3.6e-3 with precompute_batch_size at train's micro-batch): so a 16-bit step 1 also forwards its
# pairs one at a time (Rounding), and a drift within ROUNDING_FACTOR times that is said as rounding, not a warning.
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
