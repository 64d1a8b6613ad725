"""bench/real_lengths.py: rows with a real preference set's lengths (the Llama 2 paper's Table 6 means), and its
--smoke, the whole flow (each tool's epoch in a process of its own, the report) on the tiny model on this CPU."""

import json
import statistics
import subprocess
import sys

from conftest import REPO, import_bench


def test_the_drawn_lengths_have_the_cited_means_and_heavy_tails():
    """20,000 draws: each part's mean within 3% of Table 6's row (prompt 108.2, response 216.9 tokens), a right
    tail (p99 several times the median), chosen and rejected of unequal length; the same seed, the same draws."""
    (real_lengths,) = import_bench("real_lengths")
    draws = real_lengths.draw_lengths(20_000, "total", seed=0)
    assert draws == real_lengths.draw_lengths(20_000, "total", seed=0)
    prompt, chosen, rejected = (sorted(part) for part in zip(*draws))
    for values, mean in ((prompt, 108.2), (chosen, 216.9), (rejected, 216.9)):
        assert abs(statistics.fmean(values) / mean - 1) < 0.03
        assert values[int(0.99 * len(values))] > 3 * values[len(values) // 2]
    assert sum(c != r for _, c, r in draws) > 0.95 * len(draws)
    assert real_lengths.draw_lengths(10, "anthropic-helpful") != real_lengths.draw_lengths(10, "total")


def test_the_rows_take_their_drawn_lengths_in_the_models_tokens(tokenizer):
    """Each part's token count is its drawn length, give or take the last sentence (~8 tokens), the prompt's
    instruction included."""
    (real_lengths,) = import_bench("real_lengths")
    rows = real_lengths.real_rows(40, tokenizer)
    for row, drawn in zip(rows, real_lengths.draw_lengths(40)):
        got = [len(tokenizer(row[k], add_special_tokens=False)["input_ids"]) for k in ("prompt", "chosen", "rejected")]
        for g, d in zip(got, drawn):
            assert d <= g + 1 and g <= max(d, 12) + 12, (got, drawn)


def test_the_bench_runs_end_to_end_on_the_tiny_model(tmp_path, lowmem_home):
    out = tmp_path / "real_lengths.json"
    p = subprocess.run([sys.executable, "bench/real_lengths.py", "--smoke", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows["rows"] % report["pairs_per_step"] == 0 and rows["at_max_length"] > 0
    assert rows["chosen_rejected_differ"] > rows["rows"] // 2 and rows["sequence"]["max"] == report["max_length"]
    ours, trl = report["ours"], report["trl"]
    for side in (ours, trl):  # one whole epoch of the same pairs, the first step's time included
        assert side["pairs"] == rows["rows"] and side["steps"] * report["pairs_per_step"] == side["pairs"]
        assert side["epoch_s"] > side["epoch_s_after_step_1"] > 0
    assert ours["real_tokens_per_pair"] == trl["real_tokens_per_pair"]  # the same rows, the same truncation
    assert ours["ran_with"]["padding_free"] is True and ours["computed_tokens_per_pair"] < trl["computed_tokens_per_pair"]
    assert ours["ran_with"]["heap"].startswith("CPU heap: freed blocks kept")
    assert trl["ran_with"]["settings"]["precompute_ref_log_probs"] is True
    assert report["ratio_epoch"] == round(ours["epoch_s"] / trl["epoch_s"], 4)
    assert "ratio" in p.stdout and report["source"]["cited"].startswith("Llama 2")
