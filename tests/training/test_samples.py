"""Sample generations (samples.py) and the degeneration measure behind the collapse sign (answers.repetition,
answers.collapse_sign): greedy against an argmax loop over the model's own forward, batched against one at a time,
EOS, the model's mode, the KV cache under gradient checkpointing, a 4-bit base with LoRA on the CPU, and the
samples.jsonl bookkeeping."""

from __future__ import annotations

import json
import logging
import warnings
from collections import Counter

import pytest
import torch
import transformers
from conftest import TINY_DATA

from lowmem_dpo import data
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.runtime import devices
from lowmem_dpo.training import answers, policy, samples

CPU = torch.device("cpu")


# -- repetition and the collapse sign ------------------------------------------------------------------------------
def rep_by_count(seq: list[int], n: int) -> float:
    """seq-rep-n counted the other way round: each n-gram seen before is a repeat (c - 1 repeats of an n-gram
    that occurs c times), over all n-grams."""
    counts = Counter(tuple(seq[i:i + n]) for i in range(len(seq) - n + 1))
    return sum(c - 1 for c in counts.values()) / sum(counts.values())


def test_repetition_by_hand():
    # [1,2,3,4,1,2,3,4], n=2: 12 23 34 41 12 23 34 -> 7 bigrams, 4 distinct: 3/7. n=4: 1234 2341 3412 4123 1234
    # -> 5, 4 distinct: 1/5. n=5: 4 distinct of 4: 0.
    seq = [1, 2, 3, 4, 1, 2, 3, 4]
    assert answers.repetition([seq], 2) == pytest.approx(3 / 7)
    assert answers.repetition([seq], 4) == pytest.approx(1 / 5)
    assert answers.repetition([seq]) == pytest.approx(1 / 5)  # n=4 by default
    assert answers.repetition([seq], 5) == 0.0
    assert answers.repetition([[7] * 10]) == pytest.approx(6 / 7)  # 7 4-grams, all the same
    # the mean over the sequences that have n tokens; shorter ones do not count
    assert answers.repetition([seq, [7] * 10, [1, 2, 3], []], 4) == pytest.approx((1 / 5 + 6 / 7) / 2)
    assert answers.repetition([[1, 2, 3], []], 4) == 0.0 and answers.repetition([]) == 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_repetition_matches_an_independent_count(n):
    g = torch.Generator().manual_seed(n)
    seqs = [torch.randint(0, 5, (int(k),), generator=g).tolist() for k in torch.randint(0, 30, (12,), generator=g)]
    counted = [rep_by_count(s, n) for s in seqs if len(s) >= n]
    assert len(counted) > 3
    assert answers.repetition(seqs, n) == pytest.approx(sum(counted) / len(counted))


# seq-rep-4 measured on the tiny model (guards.py): the untrained reference 0.16-0.40, the healthy demo 0.0,
# collapsed runs 0.71-0.98.
@pytest.mark.parametrize("base, now, fires", [
    (0.16, 0.0, False), (0.40, 0.0, False),  # healthy: below the reference
    (0.16, 0.40, False), (0.40, 0.40, False), (None, 0.40, False),  # the reference's own level
    (0.16, 0.71, True), (0.40, 0.71, True), (0.16, 0.98, True), (0.40, 0.98, True), (None, 0.71, True),  # collapse
    (0.0, 0.49, False),  # a rise, but half the 4-grams still new
    (0.60, 0.85, False),  # a reference that already repeats, and a rise too small to blame on training
])
def test_collapse_sign(base, now, fires):
    rep = answers.GEN_REPETITION
    sign = answers.collapse_sign(None if base is None else {rep: base}, {rep: now})
    assert (sign is not None) == fires
    if fires:
        start = 0.0 if base is None else base
        assert sign.startswith("generations collapsing into repetition")
        assert f"{now:.2f}" in sign and f"{start:.2f}" in sign
        assert sign.endswith(answers.TRY_ANSWERS)  # what to try, in one line
        assert "learning_rate" in sign and "[sigmoid, sft]" in sign and "samples.jsonl" in sign
        assert "best checkpoint by eval_gen/rouge_l" in sign


def test_collapsed_text_is_flagged_and_fluent_text_is_not(tokenizer):
    """Through the tokenizer: the collapsed completions seen on the tiny model against healthy ones."""
    def rep(texts):
        return answers.repetition([tokenizer(t, add_special_tokens=False).input_ids for t in texts])

    healthy = rep(["The lamp is great and bright.", "The soup is cold, sour and dirty; I would not order it."])
    collapsed = rep(["novel " * 16, "The pil pil pil pil pil pil pil pil pil pil pil pil"])
    assert healthy == 0.0 and collapsed > 0.7
    rep = answers.GEN_REPETITION
    assert answers.collapse_sign({rep: healthy}, {rep: collapsed}) is not None
    assert answers.collapse_sign({rep: healthy}, {rep: healthy}) is None


# Step 0's samples (the reference) against an eval's: (repetition, mean length, empty share) each, by hand.
@pytest.mark.parametrize("base, now, fires", [
    ((0.2, 12.0, 0.0), (0.0, 11.0, 0.0), None),  # healthy
    ((0.2, 12.0, 0.0), (0.0, 0.0, 1.0), "empty answers: 100% of the samples end at once against 0%"),  # EOS at once
    ((0.2, 12.0, 0.25), (0.0, 2.0, 0.75), "empty answers: 75% of the samples end at once against 25%"),
    ((0.2, 12.0, 0.0), (0.0, 2.5, 0.25), "short answers: 2.5 tokens on average against 12.0"),  # <= 1/4 of 12
    ((0.2, 12.0, 0.0), (0.0, 3.5, 0.25), None),  # above a quarter, and only a quarter empty
    ((0.2, 3.0, 0.0), (0.0, 0.5, 0.0), None),  # step 0 already this short: not a collapse it can measure
    ((0.2, 12.0, 0.0), (0.9, 30.0, 0.0), "into repetition"),  # the repetition sign first
    (None, (0.0, 0.0, 1.0), "empty answers: 100%"),  # no step-0 line: against none
])
def test_collapse_into_nothing_is_seen(base, now, fires):
    """A policy that answers with EOS at once scores seq-rep 0.0: the mean length and the empty answers see it."""
    keys = (answers.GEN_REPETITION, answers.GEN_LENGTH, answers.GEN_EMPTY)
    sign = answers.collapse_sign(None if base is None else dict(zip(keys, base)), dict(zip(keys, now)))
    assert (sign is None) == (fires is None)
    if fires:
        assert fires in sign and "samples.jsonl" in sign


def test_one_collapsed_answer_among_few_is_seen(tokenizer):
    """Each answer against the same prompt's at step 0: one "JAP. JAP. JAP." among four healthy ones moves the
    mean seq-rep-4 below its limit, yet the sign fires and says 1 of 4; an answer that repeated itself at step 0
    already, or one short healthy answer, does not count; an empty answer where step 0's was not does."""
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in (
        "Canberra is the capital of Australia.", "A spider has eight legs.", "Water boils at 100 degrees.",
        "JAP. " * 16)]
    base_rep, base_tokens = [0.0, 0.0, 0.0, 0.0], [len(x) for x in ids]
    assert answers.collapsed_answers(ids, base_rep, base_tokens) == (1, 4)
    assert answers.collapsed_answers(ids, [0.0, 0.0, 0.0, 0.9], base_tokens) == (0, 4)  # it looped at step 0 too
    assert answers.collapsed_answers([*ids[:3], []], base_rep, base_tokens) == (1, 4)  # into nothing
    assert answers.collapsed_answers([*ids[:3], []], base_rep, [*base_tokens[:3], 0]) == (0, 4)  # empty then too
    # an answer without a step-0 answer to its prompt (an older run's samples.jsonl) is not judged
    assert answers.collapsed_answers(ids, [0.0, 0.0, 0.0, None], [*base_tokens[:3], None]) == (0, 3)
    now = {**answers.generation_stats(ids), answers.GEN_COLLAPSED: 1, answers.GEN_ANSWERS: 4}
    assert now[answers.GEN_REPETITION] < answers.COLLAPSE_LEVEL  # the mean alone would say nothing
    sign = answers.collapse_sign({answers.GEN_REPETITION: 0.0, answers.GEN_LENGTH: 8.0, answers.GEN_EMPTY: 0.0}, now)
    assert sign.startswith("answers collapsing: 1 of 4 into repetition") and sign.endswith(answers.TRY_ANSWERS)
    many = {**now, answers.GEN_REPETITION: 0.8, answers.GEN_COLLAPSED: 3}
    assert answers.collapse_sign({answers.GEN_REPETITION: 0.0}, many).startswith(
        "generations collapsing into repetition: 3 of 4 answers collapsed; seq-rep-4 0.80")


def test_generation_stats_by_hand():
    stats = answers.generation_stats([[1, 2, 3, 4, 1, 2, 3, 4], [], [5], []])
    # seq-rep-4 of the first: 5 4-grams, 4 distinct -> 0.2 (the others are shorter than 4); lengths 8, 0, 1, 0
    assert stats == {answers.GEN_REPETITION: 0.2, answers.GEN_LENGTH: 2.25, answers.GEN_EMPTY: 0.5}


# -- greedy generation on real tiny models -------------------------------------------------------------------------
def cfg_for(tmp, **overrides):
    values = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), output_dir=str(tmp / "out"),
                  ref_cache_dir=str(tmp / "cache"), device="cpu", dtype="float32", max_length=64, seed=0,
                  lora_dropout=0.5, gradient_checkpointing="true")
    values.update(overrides)
    return build_config(values)


def policy_model(tmp, tiny_path, **overrides):
    """The training stages' policy (setup_model: LoRA with dropout 0.5, checkpointing on, training mode), its
    LoRA B moved off zero so the adapter changes what the model writes."""
    cfg = cfg_for(tmp, **overrides)
    model = policy.setup_model(cfg, devices.resolve(cfg), tiny_path)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory, tiny_path):
    return policy_model(tmp_path_factory.mktemp("lora"), tiny_path)


@pytest.fixture(scope="module")
def pairs(tokenizer):
    return data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(6)), tokenizer, 64, None,
                              progress=False).pairs


def argmax_loop(model, prompt: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """Greedy by hand: the whole sequence through the model's forward at every step (no cache, no padding)."""
    seq = list(prompt)
    model.eval()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())  # (T, V) -> last row
            if nxt == eos_id:
                break
            seq.append(nxt)
    return seq[len(prompt):]


def greedy(model, prompts, tokenizer, max_new_tokens=24, eos_id="tokenizer"):
    eos = tokenizer.eos_token_id if eos_id == "tokenizer" else eos_id
    return samples.greedy(model, prompts, max_new_tokens, eos, data.pad_token_id(tokenizer),
                          samples.Placement(CPU, torch.float32))


def test_greedy_is_the_argmax_of_the_model_and_batching_changes_nothing(lora_model, pairs, tokenizer):
    prompts = [p.prompt_ids for p in pairs]
    prompts[1] = prompts[1][:-3]  # lengths differ, so the batch is padded
    assert len({len(p) for p in prompts}) > 1
    batched = greedy(lora_model, prompts, tokenizer)
    assert batched == [greedy(lora_model, [p], tokenizer)[0] for p in prompts]
    lora_model.train()
    assert batched[:3] == [argmax_loop(lora_model, p, 24, tokenizer.eos_token_id) for p in prompts[:3]]
    assert sum(len(c) > 0 for c in batched) >= len(batched) - 1  # the comparisons are not of empty answers (the
    #                                                               prompt cut short may end at once)


def test_greedy_of_a_plain_transformers_model(tiny_path, tokenizer, pairs):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    model.generation_config.repetition_penalty = 5.0  # a checkpoint's own setting: greedy must ignore it
    model.generation_config.do_sample = True
    prompts = [p.prompt_ids for p in pairs[:2]]
    assert greedy(model, prompts, tokenizer) == [argmax_loop(model, p, 24, tokenizer.eos_token_id) for p in prompts]
    assert model.generation_config.repetition_penalty == 5.0  # and left as it was


def test_eos_cuts_the_completion(lora_model, pairs, tokenizer):
    prompt = pairs[0].prompt_ids
    (full,) = greedy(lora_model, [prompt], tokenizer, max_new_tokens=20, eos_id=None)
    assert len(full) == 20  # no EOS: every token
    stop = full[5]  # a token greedy writes: as the EOS it ends the completion at its first occurrence
    (cut,) = greedy(lora_model, [prompt, pairs[1].prompt_ids], tokenizer, max_new_tokens=20, eos_id=stop)[:1]
    assert cut == full[:full.index(stop)] and stop not in cut


def test_mode_restored_no_dropout_and_the_cache_is_used(lora_model, pairs, tokenizer):
    """Training mode (with LoRA dropout 0.5 and checkpointing on) before; generation runs without dropout (the
    same result twice), one token per forward after the prompt (the KV cache), nothing warned; each module's own
    mode after."""
    lora_model.train()
    frozen_part = lora_model.get_base_model().model.norm
    frozen_part.eval()  # a mixed state must come back as it was
    modes = {name: m.training for name, m in lora_model.named_modules()}
    assert any(getattr(m, "gradient_checkpointing", False) for m in lora_model.modules())
    lengths = []
    hook = lora_model.get_input_embeddings().register_forward_hook(lambda m, i, o: lengths.append(i[0].shape[1]))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = transformers.logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    prompts = [p.prompt_ids for p in pairs[:3]]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = greedy(lora_model, prompts, tokenizer, max_new_tokens=16, eos_id=None)
    finally:
        hook.remove()
        hf_logger.removeHandler(handler)
    assert lengths == [max(map(len, prompts))] + [1] * 15
    assert [str(w.message) for w in caught] == [] and [r.getMessage() for r in records] == []
    assert {name: m.training for name, m in lora_model.named_modules()} == modes
    assert greedy(lora_model, prompts, tokenizer, max_new_tokens=16, eos_id=None) == first
    frozen_part.train()


def test_a_4bit_base_with_lora_generates(tmp_path, tiny_path, tokenizer, pairs):
    import bitsandbytes as bnb

    model = policy_model(tmp_path, tiny_path, quantization="4bit")
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    prompts = [p.prompt_ids for p in pairs[:3]]
    out = greedy(model, prompts, tokenizer, max_new_tokens=12)
    assert out == [argmax_loop(model, p, 12, tokenizer.eos_token_id) for p in prompts]
    assert all(0 < len(c) <= 12 for c in out)


def test_generate_decodes_pairs_and_completions(lora_model, pairs, tokenizer):
    got = samples.generate(lora_model, pairs[:2], tokenizer, 12, samples.Placement(CPU, torch.float32))
    ids = greedy(lora_model, [p.prompt_ids for p in pairs[:2]], tokenizer, max_new_tokens=12)
    for s, p, i in zip(got, pairs, ids):
        assert s.ids == i
        assert s.prompt == tokenizer.decode(p.prompt_ids, skip_special_tokens=True) and "<s>" not in s.prompt
        assert s.completion == tokenizer.decode(i, skip_special_tokens=True)
        assert s.chosen == tokenizer.decode(p.chosen_ids, skip_special_tokens=True) and s.chosen.strip()
    sft_items = data.tokenize_completions(data.load_rows(str(TINY_DATA)).select(range(2)), tokenizer, 64, None,
                                          progress=False).pairs
    got = samples.generate(lora_model, sft_items, tokenizer, 12, samples.Placement(CPU, torch.float32))
    assert [s.chosen for s in got] == [tokenizer.decode(c.completion_ids, skip_special_tokens=True)
                                       for c in sft_items]
    assert samples.generate(lora_model, [], tokenizer, 12, samples.Placement(CPU, torch.float32)) == []


# -- samples.jsonl -------------------------------------------------------------------------------------------------
def sample(i: int) -> samples.Sample:
    return samples.Sample(prompt=f"prompt {i}", completion=f"comp\u00e9tion {i}", chosen=f"chosen {i}", ids=[i])


def read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_append_and_keep_until(tmp_path):
    path = tmp_path / "run" / "samples.jsonl"
    samples.keep_until(path, 10)  # no file: nothing to do, nothing made
    assert not path.exists()
    for step in (0, 10, 20):
        samples.append(path, step, [sample(step), sample(step + 1)])
    rows = read(path)
    assert [r["step"] for r in rows] == [0, 0, 10, 10, 20, 20]
    assert rows[1] == {"step": 0, "prompt": "prompt 1", "completion": "comp\u00e9tion 1", "chosen": "chosen 1"}
    with open(path, "a") as f:
        f.write('{"step": 30, "prompt": "cut off by a ki')  # a killed run's last line
    samples.keep_until(path, 10)
    assert read(path) == rows[:4]
    samples.append(path, 20, [sample(7)])  # the resumed run goes on
    assert [r["step"] for r in read(path)] == [0, 0, 10, 10, 20]
    samples.keep_until(path, -1)  # starting over
    assert path.read_text() == ""


def test_log_line():
    s = samples.Sample(prompt="Write a positive review\nof the lamp. " * 10, completion="The lamp is great. " * 20,
                       chosen="", ids=[])
    line = samples.log_line(30, s)
    assert line.startswith("sample at step 30: 'Write a positive review of the lamp.")
    assert "\n" not in line and len(line) <= 160 and "' -> 'The lamp is great." in line and "..." in line
    short = samples.log_line(0, samples.Sample("Hi", "there", "", []))
    assert short == "sample at step 0: 'Hi' -> 'there'"
