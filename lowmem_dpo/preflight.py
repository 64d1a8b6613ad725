"""Preflight report: does DPO look well posed on this data, judged from the reference's cached log-probs.

    lowmem-dpo preflight RECIPE.yaml [key=value ...]   # print the report of an existing cache

Precompute writes the report at its end, as `preflight.json` in ref_cache_dir, and prints its summary, also when
it had nothing to compute. Nothing here loads a model.

Per kept pair (c, r: the reference's summed completion log-probs of chosen and rejected; nc, nr: their token
counts), the report gives the distribution (mean, min, 5/25/50/75/95th percentiles, max) of
  - margin            c - r                  nats; what DPO's implicit reward starts from
  - per_token_margin  c / nc - r / nr        nats per token
  - length_ratio      nc / nr
and the rows skipped and truncated by tokenization (data.SKIPS, data.TRUNCATIONS), of the training rows; with
eval_dataset, the eval rows' counts too ("eval"). It warns, with the numbers,
when (thresholds in THRESHOLDS):
  - the median per_token_margin is below -0.5: the reference finds each chosen token e^0.5 = 1.6x less likely
    than a rejected one. DPO then has to pull the policy far from the reference before the preference shows,
    the regime where it collapses (loss to 0, degenerate text): run SFT on the chosen completions first.
  - the median length_ratio is above 1.5: chosen is systematically much longer than rejected, so summed
    log-probs mix length into the preference; consider loss_type=ipo (length-normalised) or balancing lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lowmem_dpo import objectives
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config, require
from lowmem_dpo.data import cache
from lowmem_dpo.objectives import kto
from lowmem_dpo.runtime import devices, files
from lowmem_dpo.runtime.errors import log
from lowmem_dpo.training import inputs

REPORT = cache.REPORT
QUANTILES = {"p5": 0.05, "p25": 0.25, "p50": 0.5, "p75": 0.75, "p95": 0.95}
KL_MATCHED = 0.25  # the share of KTO's KL sequences under their partner's own prompt past which preflight warns
THRESHOLDS = {
    "per_token_margin_median_below": -0.5,  # nats/token: chosen tokens e^0.5 = 1.6x less likely than rejected
    "length_ratio_median_above": 1.5,  # chosen tokens / rejected tokens
}


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor, chosen_tokens: torch.Tensor,
               rejected_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """(num_rows,) cache tensors -> (pairs,) float64 margin, per_token_margin and length_ratio of the rows the
    cache holds (skipped rows are NaN there and left out)."""
    keep = torch.isfinite(chosen) & torch.isfinite(rejected)
    c, r = chosen[keep].double(), rejected[keep].double()
    nc, nr = chosen_tokens[keep].double().clamp(min=1), rejected_tokens[keep].double().clamp(min=1)
    return {"margin": c - r, "per_token_margin": c / nc - r / nr, "length_ratio": nc / nr}


def distribution(x: torch.Tensor) -> dict[str, float]:
    """mean, min, the QUANTILES and max of a non-empty 1-D tensor, rounded for reading."""
    q = torch.quantile(x.double(), torch.tensor(list(QUANTILES.values()), dtype=torch.float64))
    out = {"mean": x.mean().item(), "min": x.min().item(), **dict(zip(QUANTILES, q.tolist())), "max": x.max().item()}
    return {k: round(v, 4) for k, v in out.items()}


def ill_posed(report: dict, thresholds: dict = THRESHOLDS) -> list[str]:
    """Warnings, with their numbers, for a report's distributions (see the module doc)."""
    warnings = []
    per_token, limit = report["per_token_margin"]["p50"], thresholds["per_token_margin_median_below"]
    if per_token < limit:
        warnings.append(
            f"the reference finds chosen far less likely per token than rejected: median per-token margin "
            f"{per_token:.3f} nats/token is below {limit} ({report['share_chosen_less_likely_per_token']:.0%} of "
            f"pairs below 0; median summed margin {report['margin']['p50']:.1f} nats). DPO would have to move the "
            "policy far from the reference first: run SFT on the chosen completions, then DPO from that model "
            "(lowmem-dpo sft, then model_name_or_path=its output_dir)")
    ratio, limit = report["length_ratio"]["p50"], thresholds["length_ratio_median_above"]
    if ratio > limit:
        warnings.append(
            f"chosen is systematically much longer than rejected: median chosen/rejected token ratio {ratio:.2f} is "
            f"above {limit} (chosen longer in {report['share_chosen_longer']:.0%} of pairs). Summed log-probs then "
            "fold length into the preference: consider loss_type=ipo (length-normalised) or balancing lengths")
    return warnings


def report(ref: cache.RefCache, eval_ref: cache.RefCache | None = None, thresholds: dict = THRESHOLDS,
           lost: str | None = None) -> dict:
    """The preflight report of the dataset's rows (ref: their cached values and tokenization counts); eval_ref:
    eval_dataset's, counted only; lost: what tokenization lost past the recipe's limits (inputs.losses), warned
    first."""
    stats = pair_stats(ref.chosen, ref.rejected, ref.chosen_tokens, ref.rejected_tokens)
    counts = ref.counts
    out = {
        "model_side": ref.side,
        "rows": counts["num_rows"],
        "pairs": len(stats["margin"]),
        "skipped": {reason: len(rows) for reason, rows in counts["skipped"].items()},
        "truncated": counts.get("truncated"),
        **{name: distribution(x) for name, x in stats.items()},
        "share_chosen_less_likely_per_token": round((stats["per_token_margin"] < 0).double().mean().item(), 4),
        "share_chosen_longer": round((stats["length_ratio"] > 1).double().mean().item(), 4),
        "thresholds": dict(thresholds),
    }
    if eval_ref is not None:  # eval_dataset's rows: counted, not part of the distributions
        ev = eval_ref.counts
        out["eval"] = {"rows": ev["num_rows"], "pairs": ev["num_pairs"], "skipped": len(ev["dropped_rows"])}
    out["warnings"] = ([f"dataset: {lost}"] if lost else []) + ill_posed(out, thresholds)
    return out


def summary_lines(rep: dict) -> list[str]:
    """The report as a few log lines: counts, the three distributions, then the warnings."""
    skipped = sum(rep["skipped"].values())
    head = f"preflight: {rep['pairs']} pairs of {rep['rows']} rows"
    if skipped:
        head += f" ({skipped} skipped: " + ", ".join(f"{n} {reason}" for reason, n in rep["skipped"].items()) + ")"
    cut = rep["truncated"]
    head += ("; truncation not recorded in this cache" if cut is None else
             f"; truncated: {cut['chosen']} chosen, {cut['rejected']} rejected, {cut['prompt']} prompts")
    if rep.get("eval"):
        head += f"; eval: {rep['eval']['pairs']} pairs of {rep['eval']['rows']} rows"
    keys = ["mean", *QUANTILES]
    lines = [head, "  " + " " * 34 + "".join(f"{k:>9}" for k in keys)]
    for name, label in (("margin", "margin c-r (nats)"), ("per_token_margin", "per-token margin (nats/token)"),
                        ("length_ratio", "length ratio c/r (tokens)")):
        lines.append(f"  {label:<34}" + "".join(f"{rep[name][k]:>9.3f}" for k in keys))
    lines += [f"warning: {w}" for w in rep["warnings"]]
    if not rep["warnings"]:
        t = rep["thresholds"]
        lines.append(f"preflight: no warning (median per-token margin {rep['per_token_margin']['p50']:.3f} is not "
                     f"below {t['per_token_margin_median_below']}, median length ratio "
                     f"{rep['length_ratio']['p50']:.2f} not above {t['length_ratio_median_above']})")
    return lines


def save(cache_dir: Path, rep: dict) -> dict:
    """Write the report as cache_dir/preflight.json (atomically, only when it changed, so an unchanged cache's
    files keep their times; a folder that cannot be written is only logged); returns it."""
    path = Path(cache_dir) / REPORT
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    if old != rep:
        try:
            files.atomic_write_json(path, rep)
        except OSError as e:  # a read-only cache folder still serves train; the report is printed anyway
            log(f"warning: could not save the preflight report to {path}: {e}")
    return rep


def unpaired_lines(rows: list, settings, needs_kl: bool) -> list[str]:
    """KTO's rows (data.unpaired's) instead of pairs: how many of each class, and warnings: the class weights
    (s: Settings) outside KTO's advice for them (objectives.kto.weight_advice, as TRL 1.16 warns); KL sequences
    whose partner row has the same prompt (data in prompt order: a block of one prompt's completions estimates
    z0 on matched pairs)."""
    desirable = [row.desirable for row in rows]
    good = sum(desirable)
    lines = [f"preflight: {len(desirable)} unpaired training rows: {good} desirable, {len(desirable) - good} "
             f"undesirable (desirable_weight={settings.desirable_weight}, "
             f"undesirable_weight={settings.undesirable_weight})"]
    advice = kto.weight_advice(good, len(desirable) - good, settings)
    if advice is not None:
        (d_low, d_high), (u_low, u_high) = advice
        lines.append(f"warning: the classes are unbalanced past KTO's advice (desirable_weight x desirable rows / "
                     f"(undesirable_weight x undesirable rows) in [1, 4/3], the paper's eq. 8): set desirable_weight "
                     f"in [{d_low}, {d_high}] or undesirable_weight in [{u_low}, {u_high}], not both")
    matched = sum(row.kl_matched for row in rows)
    if needs_kl and matched > len(rows) * KL_MATCHED:
        lines.append(f"warning: {matched} of the {len(rows)} KL sequences pair a row with a completion of its own "
                     f"prompt (its block's rows share prompts: the data is in prompt order), so z0 is estimated on "
                     f"matched pairs; shuffle the rows (the KL partners are the neighbours within each block of "
                     f"per_device_train_batch_size, as TRL's)")
    return lines


def run(cfg, recipe: str | None = None) -> dict:
    """The report of the recipe's rows from the cache (refused, with the command that fills it, when rows lack
    values)."""
    require(cfg, "preflight")
    resolved = devices.resolve(cfg)
    prepared = inputs.prepare(cfg, resolved)
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress=False, limits=False)  # warned, not refused
    ref, eval_ref = inputs.cached_reference(cfg, prepared, inputs.run_side(cfg, resolved, prepared), dataset, recipe)
    return save(Path(cfg.ref_cache_dir), report(ref, eval_ref, lost=inputs.losses(cfg, dataset.tok)))


def main(argv: list[str]) -> int:
    cfg = load_config(argv[0], argv[1:])
    if not objectives.needs_reference(cfg.loss_type):
        log(f"loss_type={cfg.loss_type} reads no reference: no cache, so no report (it judges the reference's "
            "log-probs)")
        return 0
    if objectives.unpaired(cfg.loss_type):
        prepared = inputs.prepare(cfg, devices.resolve(cfg))
        dataset = inputs.load_data(cfg, prepared.tokenizer, progress=False, limits=False)
        lost = inputs.losses(cfg, dataset.tok)
        print("\n".join(([f"warning: dataset: {lost}"] if lost else []) + unpaired_lines([dataset.unpaired["train"][v.row] for v in dataset.train], cfg.loss_settings,
                                        objectives.needs_kl(cfg.loss_type))))
        return 0
    rep = run(cfg, recipe=argv[0])
    print("\n".join(summary_lines(rep)))
    log(f"report saved to {Path(cfg.ref_cache_dir) / REPORT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "preflight", __doc__))
