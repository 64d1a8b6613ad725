"""Which layout of a run's model side precompute writes and train reads (sides.CacheLayout): the settings in, the
layout out, and the note train logs when it reads the other one."""

import pytest

from lowmem_dpo.data import sides

WEIGHTS = {"model": "m", "adapter": None}


@pytest.mark.parametrize("share_prompt, both, unshared_only, shared_only", [
    ("auto", [False, True], [False], [True]),  # either layout serves: the store's first complete one
    (True, [True], [], [True]),  # share_prompt=true: only the shared one
    (False, [False], [False], []),
])
def test_a_16_bit_run_serves_a_complete_layout_its_setting_allows(share_prompt, both, unshared_only, shared_only):
    choice = sides.CacheLayout(two_layouts=True, share_prompt=share_prompt)
    assert choice.asked == (None if share_prompt == "auto" else share_prompt)
    assert choice.complete({False: [], True: []}) == both
    assert choice.complete({False: [], True: [3]}) == unshared_only
    assert choice.complete({False: [0, 2], True: []}) == shared_only
    assert choice.complete({False: [1], True: [1]}) == []
    assert (choice.of_forward(True), choice.of_forward(False)) == (True, False)  # written and read first
    assert choice.reuse_twin is False


def test_float32_has_one_layout_whatever_share_prompt_says():
    choice = sides.CacheLayout(two_layouts=False, share_prompt=True, unpaired=True)
    assert choice.asked is None and choice.reuse_twin is True
    assert choice.complete({None: []}) == [None] and choice.complete({None: [4]}) == []
    assert choice.of_forward(True) is None and choice.of_forward(False) is None
    assert choice.note(None, True, "float32", "lowmem-dpo precompute R") is None


def test_train_notes_the_other_layout_in_words():
    choice = sides.CacheLayout(two_layouts=True, share_prompt="auto")
    assert choice.note(True, True, "bfloat16", "lowmem-dpo precompute R") is None
    assert choice.note(True, False, "bfloat16", "lowmem-dpo precompute R") == (
        "note: reference values were computed with share_prompt and this run does not share prompts: in bfloat16 "
        "the two forwards round differently, so step 1 may sit ~1e-3 off ln 2; lowmem-dpo precompute R "
        "share_prompt=false computes this run's own")
    assert choice.note(False, True, "float16", "C") == (
        "note: reference values were computed without share_prompt and this run shares prompts: in float16 the two "
        "forwards round differently, so step 1 may sit ~1e-3 off ln 2; C share_prompt=true computes this run's own")


@pytest.mark.parametrize("dtype, settings, expected", [
    ("bfloat16", {"share_prompt": "true"}, (True, True, False)),
    ("bfloat16", {"loss_type": ["kto"]}, (True, "auto", True)),
    ("float32", {"share_prompt": "false"}, (False, False, False)),
])
def test_a_run_s_choice_reads_its_config_and_side(make_cfg, dtype, settings, expected):
    side = sides.run_side(WEIGHTS, dtype, "none")
    choice = sides.CacheLayout.of_run(side, make_cfg(dtype=dtype, **settings))
    assert (choice.two_layouts, choice.share_prompt, choice.unpaired) == expected
    assert side.twin is not None if dtype == "bfloat16" else side.twin is None
