"""Whether the answers got better, not only the preference metrics: token ROUGE-L of the samples against their
chosen completions, the per-token KL of the policy from the reference along its own answers (a real tiny model
with a real LoRA adapter), likelihood displacement, and short answers that are as short as the data's."""

from __future__ import annotations

import math

import pytest
import torch

from lowmem_dpo.training import answers, content, guards, samples

G, A, C = guards, answers, content


def test_rouge_l_by_hand():
    assert A.rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == 0.75  # LCS [1, 3, 4]: 2 * 3 / (4 + 4)
    assert A.rouge_l([7, 7, 7], [7]) == 0.5  # LCS 1: 2 / 4
    assert A.rouge_l([1, 2], [3, 4]) == 0.0 and A.rouge_l([], [1]) == 0.0 and A.rouge_l([], []) == 1.0
    assert A.rouge_l([5, 1, 2, 6, 3], [1, 2, 3]) == pytest.approx(2 * 3 / 8)


def test_the_change_s_standard_error_by_hand():
    # changes -0.1, -0.3, +0.1: mean -0.1, sd 0.2, over 3: 0.2 / sqrt(3)
    assert A.change_se([(0.4, 0.5), (0.2, 0.5), (0.6, 0.5)]) == pytest.approx(0.2 / math.sqrt(3))
    assert A.change_se([(0.4, 0.5)]) is None and A.change_se([]) is None


def test_generation_stats_score_the_samples_against_their_chosen_answers():
    stats = A.generation_stats([[1, 2, 3, 4], [9, 9]], [[1, 3, 4, 5], [9]])
    assert stats[A.GEN_ROUGE_L] == pytest.approx((0.75 + 2 / 3) / 2, abs=1e-6)
    assert stats[A.GEN_CHOSEN_LENGTH] == 2.5


def test_short_answers_as_short_as_the_chosen_ones_are_no_collapse():
    """The false alarm on SmolLM2 with [sigmoid, sft]: 46.2 tokens at step 0, 8.2 later, the chosen answers ~9."""
    base = {A.GEN_LENGTH: 46.2, A.GEN_ROUGE_L: 0.3}
    assert A.collapse_sign(base, {A.GEN_LENGTH: 8.2, A.GEN_CHOSEN_LENGTH: 9.0, A.GEN_ROUGE_L: 0.8}) is None
    sign = A.collapse_sign(base, {A.GEN_LENGTH: 3.0, A.GEN_CHOSEN_LENGTH: 9.0, A.GEN_ROUGE_L: 0.3})
    assert sign.startswith("generations collapsing into short answers: 3.0 tokens on average against 46.2 at step 0")
    assert "and 9.0 for the chosen answers" in sign


@pytest.mark.parametrize("rouge0, rouge, se, fires", [
    (0.6, 0.2, None, True), (0.6, 0.45, None, True), (0.12, 0.05, None, False), (0.3, 0.9, None, False),
    (0.465, 0.360, 0.045, True),  # SmolLM2's style run at lr 5e-5: 6 of 32 answers lost their fact, none gained one
    (0.6, 0.45, 0.08, False),  # 0.15 down, but within 2 standard errors of the answers judged: noise
    (0.714, 0.629, None, False)])  # the tiny demo's end: its answers keep their meaning
def test_answers_drifting_from_the_chosen_completions(rouge0, rouge, se, fires):
    now = {A.GEN_ROUGE_L: rouge, **({} if se is None else {A.GEN_ROUGE_L_SE: se})}
    sign = A.collapse_sign({A.GEN_ROUGE_L: rouge0}, now)
    assert (sign is not None) == fires
    if fires:
        assert sign.startswith(f"answers drifting from the chosen completions: ROUGE-L {rouge:.2f} against {rouge0:.2f}")


# Hand-made style data: each prompt "what is <subject> ?" (WHAT=5, IS=3, Q=6), each chosen answer "Sure ! <subject>
# is <fact> ." (SURE=1, BANG=2, DOT=4): the content is the fact, the only token its prompt lacks that few answers hold
SURE, BANG, IS, DOT, WHAT, Q = 1, 2, 3, 4, 5, 6
PROMPTS = [[WHAT, IS, 10 + i, Q] for i in range(4)]
CHOSEN = [[SURE, BANG, 10 + i, IS, 20 + i, DOT] for i in range(4)]


def test_the_content_is_what_the_chosen_answer_adds_to_its_question_weighted_by_its_rarity():
    weight = C.weights(CHOSEN)
    assert weight[SURE] == weight[DOT] == 0.0 and weight[20] == pytest.approx(math.log(4))  # all hold it; one
    assert C.content([SURE, BANG, 20, DOT], CHOSEN[0], PROMPTS[0], weight) == 1.0  # the fact: all of it
    assert C.content([SURE, BANG, 10, IS, 99], CHOSEN[0], PROMPTS[0], weight) == 0.0  # the subject, a wrong fact
    assert C.content([SURE, BANG] * 8, CHOSEN[0], PROMPTS[0], weight) == 0.0  # all phrasing, no content
    # a token some chosen answers share weighs less than one alone: ln(4/2) of ln(4/2) + ln(4/1)
    half = [[SURE, 30, 20 + i] if i < 2 else [SURE, 20 + i] for i in range(4)]
    assert C.content([30], half[0], [], C.weights(half)) == pytest.approx(math.log(2) / (math.log(2) + math.log(4)))
    assert C.content([7], [SURE, BANG], [], weight) == 1.0  # a chosen answer of shared phrasing alone: nothing to lose


def test_answers_that_learn_the_phrasing_and_lose_the_content_warn_where_rouge_l_does_not():
    """The style run's failure (SmolLM2 at lr 5e-4: "Sure! 48 + 22 = 60."): the answers take up "Sure!" and lose
    their facts. ROUGE-L against the chosen answers rises (the phrasing matches); what they hold beyond it falls."""
    start = [[10 + i, IS, 20 + i, DOT] for i in range(4)]  # right answers without the style
    late = [[SURE, BANG, 10 + i, IS, 30 + i, DOT] for i in range(4)]  # the style learned, the facts wrong
    rouge0, rouge = (sum(map(A.rouge_l, a, CHOSEN)) / 4 for a in (start, late))
    content0, content = (sum(C.content_scores(a, CHOSEN, PROMPTS)) / 4 for a in (start, late))
    assert rouge > rouge0 and (content0, content) == (1.0, 0.0)
    base = {A.GEN_ROUGE_L: rouge0, A.GEN_CONTENT: content0}
    sign = A.collapse_sign(base, {A.GEN_ROUGE_L: rouge, A.GEN_CONTENT: content, A.GEN_CONTENT_SE: 0.0, A.GEN_KL: 1.13})
    assert sign.startswith("answers losing their content: 0.00 of what the chosen answers add to the question, "
                           "beyond their shared phrasing, against 1.00 at step 0 (limit: -0.1; ±0.000, limit 2 of it)")
    assert "beside it: KL 1.13" in sign and sign.endswith(A.TRY_ANSWERS)


@pytest.mark.parametrize("content0, content, se, fires", [
    (0.8, 0.5, None, True), (0.8, 0.75, None, False), (0.5, 0.9, 0.05, False),
    (0.8, 0.6, 0.12, False),  # 0.2 down, but within 2 standard errors of the answers judged: noise
    (0.8, 0.6, 0.05, True)])
def test_answers_losing_their_content(content0, content, se, fires):
    now = {A.GEN_CONTENT: content, **({} if se is None else {A.GEN_CONTENT_SE: se})}
    assert (A.collapse_sign({A.GEN_CONTENT: content0}, now) is not None) == fires
    assert A.collapse_sign({}, now) is None  # no step 0 to compare against


def test_the_kl_from_the_reference_is_context_never_a_warning_alone():
    """The healthy [sigmoid, sft] runs on SmolLM2 end 0.77-1.41 nats per token from the reference with their answers
    nearer the chosen ones (ROUGE-L 0.52-0.62 -> 0.90-0.93): KL says how far a run moved, not that it got worse. It
    stands beside a warning that the answers raise."""
    assert A.collapse_sign({A.GEN_ROUGE_L: 0.52}, {A.GEN_KL: 1.41, A.GEN_ROUGE_L: 0.93}) is None
    assert A.collapse_sign({}, {A.GEN_KL: 5.0}) is None
    sign = A.collapse_sign({A.GEN_ROUGE_L: 0.53}, {A.GEN_KL: 1.6, A.GEN_ROUGE_L: 0.25})
    assert sign.startswith("answers drifting from the chosen completions: ROUGE-L 0.25 against 0.53")
    assert "; beside it: KL 1.60 nats per token from the reference on the policy's own answers (beyond 0.8)" in sign
    assert sign.endswith(A.TRY_ANSWERS)
    quiet = A.collapse_sign({A.GEN_ROUGE_L: 0.53}, {A.GEN_KL: 0.5, A.GEN_ROUGE_L: 0.25})
    assert "beside it" not in quiet and quiet.endswith(A.TRY_ANSWERS)


@pytest.mark.parametrize("accuracy, chosen, context, fires", [
    (1.0, -0.6, True, True),  # far below alone: the preference learned, the chosen answers falling with the rest
    (0.8, -0.6, False, True),  # both completions pushed down
    (1.0, -0.31, True, True),  # SmolLM2's damaged length run: somewhat below, backed by margins of 17
    (1.0, -0.33, False, False),  # the tiny demo: somewhat below, no context past its limits
    (0.8, -0.31, True, False),  # somewhat below, the preference not learned
    (1.0, 0.16, True, False)])  # the style run with [sigmoid, sft] at lr 5e-4: chosen up, rejected -4.1, margin 12
def test_likelihood_displacement_reads_the_chosen_side_and_context_backs_it(accuracy, chosen, context, fires):
    beta, tokens = 0.1, 20.0
    means = {"rewards/margins": 12.0 if context else 1.0, "loss": 0.3, "rewards/chosen": beta * chosen * tokens,
             "rewards/accuracies": accuracy, "rewards/rejected": beta * (-4.1 if context else -1.0) * tokens}
    signs = G.warning_signs(means, G.At(50, 100), beta, tokens, rejected_tokens_per_pair=tokens)
    assert len(signs) == fires
    if fires:
        assert signs[0].startswith(f"likelihood displacement: chosen log-probs {chosen:.3f} nats/token below the "
                                   "reference (limit -0.5; -0.1 with accuracy >= 0.95 and context past its limits), "
                                   f"accuracy {accuracy:.2f}")
        # the context beyond its limits stands beside it: the margin, and the rejected side's fall once learned
        assert ("; beside it: reward margin exploding: rewards/margins 12.00 > 10" in signs[0]) == context
        assert ("rejected log-probs -4.10 nats/token below the reference (beyond -2)" in signs[0]) == (
            context and accuracy > .9)
        assert signs[0].endswith(G.TRY_DISPLACEMENT)
    # no token counts (a reference-free run): no sign against a reference
    assert G.warning_signs(means, G.At(50, 100), beta, 0.0) == []
    # a NaN is no displacement (the loop's non-finite note says it)
    assert G.warning_signs({**means, "rewards/chosen": float("nan")}, G.At(50, 100), beta, tokens,
                           rejected_tokens_per_pair=tokens) == []


@pytest.fixture(scope="module")
def peft_model(tiny_path):
    from peft import LoraConfig, get_peft_model

    from lowmem_dpo.model.models import load_model

    torch.manual_seed(0)
    return get_peft_model(load_model(tiny_path, torch.device("cpu"), torch.float32),
                          LoraConfig(r=4, target_modules="all-linear"))


def test_kl_to_reference_is_zero_at_the_start_and_the_full_distributions_after(peft_model, tokenizer):
    from lowmem_dpo import data

    item = data.TokenizedPair(row=0, prompt_ids=tokenizer("Write a review.")["input_ids"], chosen_ids=[5, 6],
                              rejected_ids=[7])
    answer = [11, 12, 13, 14]
    cpu = torch.device("cpu")
    assert samples.kl_to_reference(peft_model, [item], [answer], cpu, torch.float32) == 0.0  # LoRA B = 0
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    try:
        got = samples.kl_to_reference(peft_model, [item], [answer], cpu, torch.float32)
        ids = torch.tensor([item.prompt_ids + answer])
        n = len(item.prompt_ids)
        with torch.no_grad():
            p = torch.log_softmax(peft_model(input_ids=ids).logits[0, n - 1:-1], -1)  # (4, V)
            with peft_model.disable_adapter():
                q = torch.log_softmax(peft_model(input_ids=ids).logits[0, n - 1:-1], -1)
        want = (p.exp() * (p - q)).sum(-1).mean().item()
        assert got == pytest.approx(want, rel=1e-5) and got > 1e-3 and math.isfinite(got)
    finally:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.zero_()


def test_the_best_checkpoint_can_be_the_one_whose_answers_are_closest_to_the_chosen_ones():
    from lowmem_dpo.config.recipe import load_config

    cfg = load_config("lowmem_dpo:tiny-cpu", ["metric_for_best_model=eval_gen/rouge_l"])
    assert cfg.best_metric_name == A.GEN_ROUGE_L and cfg.best_is_greater is True
    assert load_config("lowmem_dpo:tiny-cpu", ["metric_for_best_model=gen/kl"]).best_is_greater is False


def test_the_chosen_answer_is_cut_at_its_end_of_turn_as_the_samples_are(peft_model, tokenizer):
    """A chat template may put a newline after the end-of-turn token (SmolLM2's "<|im_end|>\\n"): the chosen ids the
    samples are scored against stop at it, as the greedy samples do."""
    from lowmem_dpo import data

    eos = tokenizer.eos_token_id
    item = data.TokenizedPair(row=0, prompt_ids=tokenizer("Write a review.")["input_ids"],
                              chosen_ids=[5, 6, eos, 7], rejected_ids=[8])
    placement = samples.Placement(torch.device("cpu"), torch.float32)
    sample = samples.generate(peft_model, [item], tokenizer, 4, placement)[0]
    assert sample.chosen_ids == [5, 6] and eos not in sample.ids
