"""Signs that a run's answers are going wrong, from the samples each eval writes (evaluation.sample_metrics): pure
functions, token ids and numbers in, messages out. guards.py holds the preference metrics' signs; the same rules
hold here: a warning names evidence of damage (answers that collapse into repetition or nothing, that drift from
the chosen ones or lose their content), the answers' KL from the reference is context, and each warning ends with
what to try.

    stats = generation_stats(answers, chosen)       # repetition, length, empty share, ROUGE-L against the chosen
    sign = collapse_sign(step_0_line, eval_line)    # a warning, or None
"""

from __future__ import annotations

import math

import lowmem_dpo.objectives.metrics as rows
from lowmem_dpo.training.guards import with_context

# -- degeneration of the generations-----------------------------------------------------------------------------
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
