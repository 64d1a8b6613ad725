"""bench/loan.py --smoke: the next GPU loan's script on the tiny built-in model on this CPU (one recipe): the longest
run at its true length and the real-lengths epoch of both tools, the JSON. Its comparisons are gpu_check.py's ours
and TRL children, which tests/test_gpu_check.py runs; the whole script's rehearsal is bench/results/loan_smoke.json."""

import json
import subprocess
import sys

from conftest import REPO


def test_the_loan_script_runs_end_to_end_on_the_tiny_model(tmp_path, lowmem_home):
    out = tmp_path / "loan.json"
    p = subprocess.run([sys.executable, "bench/loan.py", "--smoke", "--recipes", "llama", "--parts", "longest,real",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["skipped"] == [] and report["budget_s"] is None
    runs = report["runs"]
    assert [(r["tool"], r["variant"]) for r in runs] == [
        ("lowmem_dpo", "longest"), ("lowmem_dpo", "real lengths"), ("trl", "real lengths")]
    for r in runs:
        assert r.get("error") is None, r
        assert r["epoch_s"] > 0 and r["real_tokens"] > 0 and r["computed_tokens"] >= r["real_tokens"]
    longest = runs[0]
    assert longest["max_length"] == 512 and longest["steps_done"] == 1
    assert 0.9 * 512 < longest["tokens_per_sequence"] <= 512  # truly that long: no prompt cut
    assert longest["step1_loss_minus_ln2"] is not None and abs(longest["step1_loss_minus_ln2"]) < 1e-3
    ours, trl = runs[1], runs[2]
    assert ours["pairs_done"] == trl["pairs_done"] > 0 and ours["real_tokens"] == trl["real_tokens"]
    assert ours["computed_tokens"] < trl["computed_tokens"]  # packed against TRL's padding
    assert report["real_lengths_rows"]["chosen_rejected_differ"] > 0
