"""bench/loan.py --smoke: the next GPU loan's script, its whole flow on the tiny built-in model on this CPU (one
recipe): like-for-like runs of both tools, the longest run at its true length, the real-lengths epoch, the JSON."""

import json
import subprocess
import sys

from conftest import REPO


def test_the_loan_script_runs_end_to_end_on_the_tiny_model(tmp_path, lowmem_home):
    out = tmp_path / "loan.json"
    # one recipe, one length: 4096 runs the same code at another length and pairs per micro-batch (~15 s more)
    p = subprocess.run([sys.executable, "bench/loan.py", "--smoke", "--recipes", "llama", "--lengths", "2048",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["skipped"] == [] and report["budget_s"] is None
    runs = report["runs"]
    assert [(r["tool"], r["variant"]) for r in runs] == [
        ("lowmem_dpo", "max_length=2048 pairs=2"), ("trl", "max_length=2048 pairs=2"),
        ("lowmem_dpo", "longest"), ("lowmem_dpo", "real lengths"), ("trl", "real lengths")]
    for r in runs:
        assert r.get("error") is None, r
        assert r["epoch_s"] > 0 and r["real_tokens"] > 0 and r["computed_tokens"] >= r["real_tokens"]
    ours, trl = runs[:2]  # at --smoke's stand-in for 2048 (128 tokens), 2 pairs a micro-batch, 4 steps
    assert ours["max_length"] == trl["max_length"] == 128
    assert ours["micro_batch"] == 2 and ours["pairs_done"] == trl["pairs_done"] == 8
    # like for like: no prompt cut by either tool, the same rows, so the same real tokens per sequence
    assert ours["tokens_per_sequence"] == trl["tokens_per_sequence"] > 0.9 * 128
    longest = runs[2]
    assert longest["max_length"] == 512 and longest["steps_done"] == 1
    assert 0.9 * 512 < longest["tokens_per_sequence"] <= 512  # truly that long: no prompt cut
    assert longest["step1_loss_minus_ln2"] is not None and abs(longest["step1_loss_minus_ln2"]) < 1e-3
    ours, trl = runs[3], runs[4]
    assert ours["pairs_done"] == trl["pairs_done"] > 0 and ours["real_tokens"] == trl["real_tokens"]
    assert ours["computed_tokens"] < trl["computed_tokens"]  # packed against TRL's padding
    assert report["real_lengths_rows"]["chosen_rejected_differ"] > 0
