"""ld_alpha (LD-DPO) in a real run: the reference's LD-weighted sums are the cache's own values (a change of
ld_alpha computes them anew, under another model side), train weights the policy's the same way, so step 1 is
ln 2; and what LD-DPO cannot weight is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TINY_DATA, cached, sequences_of, write_jsonl

from lowmem_dpo import precompute, train
from lowmem_dpo.runtime.errors import ConfigError


def test_ld_alpha_keys_the_cache_and_starts_at_ln2(make_cfg, tmp_path, capsys):
    # the demo's completions are near one length: half the rejected ones longer, so LD-DPO's weights bite
    rows = [json.loads(x) for x in open(TINY_DATA)][:64]
    for i, row in enumerate(rows):
        row["rejected"] += " It really is, truly, every single day." * (i % 2)
    mine = write_jsonl(tmp_path / "rows.jsonl", rows)
    plain = make_cfg(dataset=str(mine), eval_fraction=0.0)
    precompute.run(plain, progress=False)
    capsys.readouterr()
    cfg = make_cfg(dataset=str(mine), ld_alpha=0.3, max_steps=1, eval_fraction=0.0)
    precompute.run(cfg, progress=False)
    # the plain side's values keep no token log-probs: every sequence once more, into the per-token side
    assert f"computed {len(sequences_of(cfg))} sequences, reused 0" in capsys.readouterr().err
    weighted, sums = cached(cfg)[0], cached(plain)[0]
    longer = torch.tensor([i % 2 == 1 for i in range(64)])
    assert (weighted.rejected[longer] > sums.rejected[longer]).all()  # less of a negative tail counted
    # equal lengths: nothing beyond (the token log-probs summed again: float32's rounding)
    assert torch.allclose(weighted.chosen[~longer], sums.chosen[~longer], rtol=1e-6, atol=1e-5)
    other = make_cfg(dataset=str(mine), ld_alpha=0.7, eval_fraction=0.0)
    precompute.run(other, progress=False)  # another ld_alpha reads the same token log-probs
    assert f"computed 0 sequences, reused {len(sequences_of(cfg))}" in capsys.readouterr().err
    train.run(cfg, progress=False)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert step["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["sft", "simpo", "orpo"])
def test_what_ld_alpha_cannot_weight_is_refused(make_cfg, loss_type):
    with pytest.raises(ConfigError, match=f"ld_alpha=0.5 with loss_type={loss_type}: LD-DPO weights"):
        make_cfg(ld_alpha=0.5, loss_type=["sigmoid", loss_type] if loss_type == "sft" else [loss_type])
