"""The preflight report: its numbers from the cached log-probs, and its warnings on data built to trigger them."""

import json
import statistics
import string

import pytest
import torch
from conftest import TINY_RECIPE, cached, write_jsonl

from lowmem_dpo import precompute, preflight
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.data import cache
from lowmem_dpo.model.tiny import preference_rows

PER_TOKEN = preflight.THRESHOLDS["per_token_margin_median_below"]
LENGTH = preflight.THRESHOLDS["length_ratio_median_above"]


def test_stats_by_hand():
    """Row 1 was skipped (NaN). Row 0: c=-6 over 3 tokens, r=-2 over 1: margin -4, per token -2+2=0, ratio 3.
    Row 2: c=-1 over 1, r=-4 over 2: margin 3, per token -1+2=1, ratio 0.5."""
    nan = float("nan")
    stats = preflight.pair_stats(torch.tensor([-6.0, nan, -1.0]), torch.tensor([-2.0, nan, -4.0]),
                                 torch.tensor([3, 0, 1], dtype=torch.int32), torch.tensor([1, 0, 2], dtype=torch.int32))
    assert stats["margin"].tolist() == [-4.0, 3.0]
    assert stats["per_token_margin"].tolist() == [0.0, 1.0]
    assert stats["length_ratio"].tolist() == [3.0, 0.5]
    d = preflight.distribution(stats["margin"])
    assert (d["min"], d["p50"], d["mean"], d["max"]) == (-4.0, -0.5, -0.5, 3.0)
    assert d["p25"] == -4.0 + 0.25 * 7  # linear interpolation between the two


def report_of(rows, tmp_path, make_cfg, name):
    cfg = make_cfg(dataset=str(write_jsonl(tmp_path / f"{name}.jsonl", rows)),
                   ref_cache_dir=str(tmp_path / f"{name}-cache"))
    precompute.run(cfg, progress=False)
    rep = json.loads((cache.Path(cfg.ref_cache_dir) / preflight.REPORT).read_text())
    ref = cached(cfg)[0]
    keep = torch.isfinite(ref.chosen)
    per_token = (ref.chosen / ref.chosen_tokens - ref.rejected / ref.rejected_tokens)[keep].tolist()
    ratio = (ref.chosen_tokens / ref.rejected_tokens)[keep].tolist()
    # the numbers, recomputed here from the cache
    assert rep["per_token_margin"]["p50"] == pytest.approx(statistics.median(per_token), abs=1e-4)
    assert rep["length_ratio"]["p50"] == pytest.approx(statistics.median(ratio), abs=1e-4)
    assert rep["pairs"] == int(keep.sum()) and rep["model_side"] == ref.side
    return rep, statistics.median(per_token), statistics.median(ratio), per_token


def has(rep, words):
    return any(words in w for w in rep["warnings"])


def test_warnings_on_data_built_to_trigger_them(make_cfg, tmp_path):
    """Long chosen vs short rejected trips the length warning. Then chosen made of the character the tiny model
    finds least likely (measured on the first data) vs rejected of the most likely one, at equal lengths, trips
    the per-token warning. Rows like the demo's trip neither."""
    prompt = "Write a positive review of the lamp.\n"
    chars = string.ascii_letters + string.digits + string.punctuation
    probe = [{"prompt": prompt, "chosen": ch * 12, "rejected": "The lamp is great."} for ch in chars]
    rep, per_token, ratio, per_char = report_of(probe, tmp_path, make_cfg, "long")
    assert ratio > LENGTH and has(rep, f"chosen/rejected token ratio {ratio:.2f} is above {LENGTH}")
    assert has(rep, "less likely per token") == (per_token < PER_TOKEN)

    order = sorted(range(len(chars)), key=per_char.__getitem__)
    low, high = chars[order[0]], chars[order[-1]]
    rows = [{"prompt": r["prompt"], "chosen": low * 12, "rejected": high * 12} for r in preference_rows(16, seed=3)]
    rep, per_token, ratio, _ = report_of(rows, tmp_path, make_cfg, "unlikely")
    assert per_token < PER_TOKEN and has(rep, f"median per-token margin {per_token:.3f} nats/token is below")
    assert ratio == 1.0 and rep["warnings"] and not has(rep, "much longer")

    rep, per_token, ratio, _ = report_of(preference_rows(64), tmp_path, make_cfg, "demo")
    assert per_token > PER_TOKEN and ratio < LENGTH and rep["warnings"] == []


def test_report_counts_truncation_and_is_refreshed_from_the_cache(make_cfg, tmp_path, capsys):
    rows = preference_rows(8)
    rows[0]["prompt"] = "Write a positive review of the lamp. " * 20  # skipped: prompt alone reaches max_length
    rows[1]["chosen"] = "The lamp is great and lovely. " * 20  # kept, chosen cut at max_length
    cfg = make_cfg(dataset=str(write_jsonl(tmp_path / "d.jsonl", rows)))
    precompute.run(cfg, progress=False)
    path = cache.Path(cfg.ref_cache_dir) / preflight.REPORT
    rep = json.loads(path.read_text())
    assert rep["skipped"] == {"prompt_too_long": 1} and rep["truncated"] == {"prompt": 0, "chosen": 1, "rejected": 0}
    assert rep["pairs"] == 7 and rep["rows"] == 8

    mtime = path.stat().st_mtime_ns
    precompute.run(cfg, progress=False)  # up to date: the same report, not rewritten
    assert path.stat().st_mtime_ns == mtime
    path.unlink()
    precompute.run(cfg, progress=False)  # up to date, report missing: written again from the cache
    assert json.loads(path.read_text()) == rep

    capsys.readouterr()
    args = [str(TINY_RECIPE), f"dataset={cfg.dataset[0].path}", f"ref_cache_dir={cfg.ref_cache_dir}",
            "device=cpu", "dtype=float32", "max_length=64"]
    assert run_cli(preflight.main, args, "preflight", preflight.__doc__) == 0
    out = capsys.readouterr().out
    assert out.startswith("preflight: 7 pairs of 8 rows (1 skipped: 1 prompt_too_long); truncated: 1 chosen")
    assert f"{rep['margin']['p50']:.3f}" in out
    assert run_cli(preflight.main, args[:-1] + ["max_length=48"], "preflight", preflight.__doc__) == 2
    err = capsys.readouterr().err  # cut shorter, the longest rows have other token ids: no values yet
    assert "has no reference values for" in err and "Compute them (only them) with:" in err
