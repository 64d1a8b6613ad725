"""bench/gpu_check.py --smoke: the GPU check's whole flow (a run of each tool in its own process, the JSON it
writes, the profiled step's op table) on the tiny built-in model on this CPU, so the command is known to work
before a GPU is lent; and bench/step_work.py's comparison of the two tools' profiled steps."""

import json
import math
import subprocess
import sys

from conftest import REPO

from lowmem_dpo.training.guards import DRIFT_LOSS_BOUND, DRIFT_TOKEN_BOUND

FIELDS = ("tool", "recipe", "variant", "max_length", "cap_gib", "planned_gib", "allocated_gib", "reserved_gib",
          "device_used_gib", "oom", "median_step_s", "tokens_per_s", "step1_loss_minus_ln2")


def test_the_gpu_check_runs_end_to_end_on_the_tiny_model(tmp_path, lowmem_home):
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--recipes", "llama", "--lengths", "recipe",
                        "--steps", "3", "--grads", "--profile", "2", "--no-step-compare", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True and report["device"] == "cpu (--smoke)"
    runs = report["runs"]
    grads = runs.pop(2)  # the offloading check, after the recipe's own runs: on a CPU the same numbers exactly
    assert (grads["tool"], grads["variant"], grads.get("error")) == ("lowmem_dpo gradients", "offloading", None)
    assert grads["offloaded"]["packed"] == grads["offloaded"]["fetched"] > 0 and grads["tensors"] > 0
    assert grads["offloaded_vs_plain"]["rel_l2"] == grads["offloaded_vs_plain"]["max_abs_diff"] == 0.0
    assert grads["plain_again_vs_plain"]["max_abs_diff"] == 0.0 and grads["plain_again_vs_plain"]["max_abs"] > 0
    # --no-step-compare: the step comparison's run is ours again on a recipe of its own (the loans to come run
    # without it: gpu_check.PARTS 5-8), 10-20 s of this test
    assert [(r["tool"], r["recipe"], r["variant"]) for r in runs] == [
        ("lowmem_dpo", "llama3.1-8b-qlora-12gb", None), ("trl", "llama3.1-8b-qlora-12gb", None)]
    for r in runs:
        assert set(FIELDS) <= set(r) and r.get("error") is None, r
        assert r["oom"] is False and r["steps_done"] == 3
        # set before anything touches CUDA, as `python -m lowmem_dpo.train` does: on the first GPU run ours went
        # without it (the child asked CUDA for its free memory first) while TRL had it
        # (in the suite an earlier test's process set the variable, which the children inherit: "from the environment")
        assert "expandable_segments:True" in r["allocator"], r
        assert r["median_step_s"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["step1_loss_minus_ln2"]) < 1e-2  # both tools start at ln 2: the reference is the policy
    ours = runs[0]
    assert ours["max_length"] == 96 and ours["planned_gib"] > 0 and ours["micro_batch"] == 2
    # what the run applied, read from its session: its knobs as train turns them on a CPU (no offloading, no
    # streaming there), the budget it resolved (--smoke sets no cap: the planner's, the machine's RAM), the layout
    assert ours["activation_offloading"] is False and ours["streamed_layers"] == 0 and ours["fits"] is True
    assert ours["cap_gib"] is None and ours["budget_gib"] > 0
    assert ours["share_prompt"] in (True, False) and ours["mlp_tiles"] in (True, False)
    # host RAM: a CPU run pins and pages nothing (adamw_torch, no offloading); its resident peak is measured; and
    # step 1's drift line, read from the run's log: the cache is this forward's (0 here; a CPU with native bf16 may
    # round by batch shape, within the bounds)
    assert ours["host_planned_gib"] == 0 and ours["host_planned"] == {} and ours["peak_rss_gib"] > 0
    assert 0 <= ours["step1_drift_per_token"] <= DRIFT_TOKEN_BOUND
    assert abs(ours["step1_drift_loss_offset"]) <= DRIFT_LOSS_BOUND
    assert math.isclose(runs[1]["max_length"], ours["max_length"])
    # like for like (what bench/loan.py's comparisons are): no prompt cut by either tool, the same rows, so the same
    # real tokens per sequence, read from each tool's own steps; every step counted
    assert ours["tokens_per_sequence"] == runs[1]["tokens_per_sequence"] > 0.9 * 96
    assert ours["padding_free"] in (True, False) and ours["pairs_done"] == runs[1]["pairs_done"] == 3 * 2
    # --profile 2: each tool's second step, counted, its op table beside the JSON; ours does no more work than TRL
    profiled = {r["tool"]: r["profile"] for r in runs[:2]}
    for tool, prof in profiled.items():
        assert prof["matmul_4bit"] == 28 and prof["mm"] > 0 and prof["copy_"] > 0 and prof["op_events"] > 1000, tool
        table = tmp_path / f"gpu_check-prof-{tool}-llama3.1-8b-qlora-12gb-96.txt"
        assert "aten::mm" in table.read_text() and "Self CPU" in table.read_text()
    sys.path.insert(0, str(REPO / "bench"))  # bench/ is not a package: its folder on sys.path while it runs
    try:
        import step_work

        assert step_work.main(["--from", str(out), "--json", str(tmp_path / "step_work.json")]) == 0
    finally:
        sys.path.remove(str(REPO / "bench"))
    work = json.loads((tmp_path / "step_work.json").read_text())
    assert [(r["count"], r["ours"]) for r in work["comparison"]] == [
        (k, profiled["lowmem_dpo"][k]) for k in ("matmul_4bit", "mm", "copy_", "op_events")]
    assert work["met"] is True, work["comparison"]
