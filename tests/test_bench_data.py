"""bench/ helpers with logic of their own: the prompt-heavy rows of make_data.py stay within their token bounds
(counted by lowmem_dpo's own tokenization, as training sees them) and are deterministic; step_time.py's TRL setups
(best settings, command-line changes on top) and its --trl-runs parsing."""

import pytest
from conftest import import_bench


@pytest.fixture(scope="module")
def bench():
    return import_bench("make_data", "step_time", "trl_step")


def test_long_prompt_rows_fit_their_bounds(bench, tokenizer, tmp_path):
    import datasets

    from lowmem_dpo.data.encode import tokenize_rows

    make_data = bench[0]
    max_length = make_data.LONG_MAX_LENGTH
    rows = make_data.long_prompt_rows(12, seed=3, tokenizer=tokenizer)
    assert rows == make_data.long_prompt_rows(12, seed=3, tokenizer=tokenizer)
    assert rows != make_data.long_prompt_rows(12, seed=4, tokenizer=tokenizer)
    assert all(r["chosen"] != r["rejected"] for r in rows)
    data = tokenize_rows(datasets.Dataset.from_list(rows), tokenizer, max_length, None, progress=False)
    assert len(data.pairs) == 12 and not data.dropped
    assert not any(data.truncated.values())
    lo, hi = make_data.PROMPT_TOKENS
    for p in data.pairs:
        longer = max(len(p.chosen_ids), len(p.rejected_ids))
        assert 30 <= min(len(p.chosen_ids), len(p.rejected_ids)) and longer <= 120
        assert len(p.prompt_ids) + longer <= max_length
        # about 400: the drawn goal, lowered only as far as a long completion needs, plus one sentence over it
        assert min(lo, max_length - longer - 13) <= len(p.prompt_ids) <= hi + 10
        assert tokenizer.decode(p.prompt_ids).rstrip().endswith(".")  # the instruction closes the prompt
    kinds = ["positive" if "positive" in r["prompt"].splitlines()[-1] else "negative" for r in rows]
    assert kinds == ["positive", "negative"] * 6


def test_ensure_writes_each_kind_once(bench, tmp_path, monkeypatch):
    make_data = bench[0]
    monkeypatch.setattr(make_data, "long_prompt_rows", lambda n: [{"prompt": "p", "chosen": "a", "rejected": "b"}] * n)
    path = make_data.ensure(tmp_path / "long.jsonl", 3, kind="long-prompts")
    before = path.stat().st_mtime_ns
    assert make_data.ensure(path, 3, kind="long-prompts").stat().st_mtime_ns == before  # same rows: kept
    make_data.ensure(path, 4, kind="reviews")
    assert path.read_text().count("\n") == 4 and "Earlier reviews" in path.read_text()
    with pytest.raises(ValueError, match="unknown kind"):
        make_data.ensure(path, 3, kind="short")


def test_trl_best_settings_and_command_line_changes(bench, make_cfg):
    from lowmem_dpo.runtime.devices import cpu_has_native_bf16

    trl_step = bench[2]
    cfg = make_cfg(precompute_batch_size=24)
    native = cpu_has_native_bf16()
    best = trl_step.setup_changes(cfg, "cpu", "best", {})
    assert best["precompute_ref_log_probs"] is True and best["gradient_checkpointing"] is False
    assert best["bf16"] is native and best["precompute_ref_batch_size"] == 24
    assert ("model_init_kwargs" in best) is native
    assert best.keys() >= trl_step.BEST_KEYS
    changed = trl_step.setup_changes(cfg, "cpu", "best", {"gradient_checkpointing": True, "beta": 0.2})
    assert changed["gradient_checkpointing"] is True and changed["beta"] == 0.2
    assert changed["precompute_ref_log_probs"] is True
    assert trl_step.setup_changes(cfg, "cpu", "default", {"beta": 0.2}) == {"beta": 0.2}
    with pytest.raises(ValueError, match="unknown TRL setup"):
        trl_step.setup_changes(cfg, "cpu", "fast", {})


def test_trl_runs_and_sets_parsed(bench, capsys):
    step_time = bench[1]
    base = ["r.yaml", "--json", "o.json"]
    args = step_time.parse_args(base)
    assert args.trl_runs == ["default", "best"] and args.target_vs_best == step_time.TARGET_RATIO_VS_BEST
    args = step_time.parse_args(base + ["--trl-runs", "best", "--trl-set", "beta=0.2", "--trl-best-set",
                                        'model_init_kwargs={"dtype": "float32"}', "--target-vs-best", "0.6"])
    assert args.trl_runs == ["best"] and args.trl_sets == {"beta": 0.2} and args.target_vs_best == 0.6
    assert args.trl_best_sets == {"model_init_kwargs": {"dtype": "float32"}}
    with pytest.raises(SystemExit):
        step_time.parse_args(base + ["--trl-runs", "fastest"])
    assert "--trl-runs" in capsys.readouterr().err
