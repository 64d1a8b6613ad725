"""What the answers say beyond the phrasing the data teaches: a sign that sees a run learn the chosen side's
style while its answers lose their content, which ROUGE-L against the chosen answers rewards (the style counts).

An answer's content score is the share of its chosen completion's content that it holds: the chosen completion's
distinct tokens that its prompt lacks (what the answer adds to the question), each weighted by its rarity among
the judged held-out chosen completions, ln(N / the completions that hold it) (inverse document frequency). The
phrasing every chosen answer shares ("Sure", "!") weighs 0, a token only one holds ("Vienna", "77") the most. For
"What is the capital of Austria?" and "Sure! The capital of Austria is Vienna." the answer must say "Vienna";
"Sure! The answer is: Austria" holds little of it, "Sure!Sure!Sure!" none. No labels: the held-out chosen
completions, as eval_gen/rouge_l reads them. Pure functions: evaluation.sample_metrics logs the mean
(eval_gen/content) and the noise of its change from step 0 (eval_gen/content_se); answers.content_sign warns (by
the drift sign's limits).
"""

from __future__ import annotations

import math


def weights(chosen: list[list[int]]) -> dict[int, float]:
    """Each token's rarity among the `chosen` completions: ln(N / how many hold it); 0 for one all of them hold."""
    held: dict[int, int] = {}
    for seq in chosen:
        for t in set(seq):
            held[t] = held.get(t, 0) + 1
    return {t: math.log(len(chosen) / n) for t, n in held.items()}


def content(answer: list[int], chosen: list[int], prompt: list[int], weight: dict[int, float]) -> float:
    """The weighted share of the chosen completion's tokens that its prompt lacks which the answer holds; 1.0 when
    they weigh nothing (a chosen answer of shared phrasing alone: nothing to lose, the same at every step)."""
    wanted = set(chosen) - set(prompt)
    total = sum(weight.get(t, 0.0) for t in wanted)
    return sum(weight.get(t, 0.0) for t in wanted & set(answer)) / total if total > 0 else 1.0


def content_scores(answers: list[list[int]], chosen: list[list[int]], prompts: list[list[int]]) -> list[float]:
    """Each answer's content score against its own chosen completion and prompt, the weights from all of
    `chosen`."""
    weight = weights(chosen)
    return [content(a, c, p, weight) for a, c, p in zip(answers, chosen, prompts)]
