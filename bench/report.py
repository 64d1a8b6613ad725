"""bench/step_time.py's report: the Markdown tables and the bar plot of a run's JSON."""

from __future__ import annotations

import statistics
from pathlib import Path


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


# (JSON key, table label, plot label, plot colour) of each implementation a run may hold
IMPLEMENTATIONS = (
    ("ours", "lowmem_dpo (cached ref)", "lowmem_dpo", "tab:blue"),
    ("trl", "TRL DPOTrainer (defaults: live ref, checkpointing)", "TRL\ndefaults", "tab:orange"),
    ("trl_best", "TRL DPOTrainer (at its best: precomputed ref, no checkpointing, bf16 if native)", "TRL\nat its best",
     "tab:red"),
)
# (JSON key of ours / TRL, of its target, of the verdict, what it is against) per TRL setup
RATIOS = (
    ("ratio_median_step", "target_ratio", "meets_target", "TRL defaults"),
    ("ratio_median_step_vs_trl_best", "target_ratio_vs_trl_best", "meets_target_vs_trl_best", "TRL at its best"),
)


def rate(d: dict, prefix: str = "", suffix: str = "", spec: str = "") -> tuple[str, bool]:
    """d's `{prefix}sequences_per_s{suffix}` formatted with `spec`, and False; a result measured before the
    reference cache was keyed per sequence has `{prefix}rows_per_s{suffix}` instead (a cache row was a pair):
    that one labelled pairs/s, and True."""
    new, old = f"{prefix}sequences_per_s{suffix}", f"{prefix}rows_per_s{suffix}"
    if new in d or old not in d:
        value = d.get(new)
        return ("-" if value is None else format(value, spec)), False
    value = d[old]
    return ("-" if value is None else f"{format(value, spec)} pairs/s"), True


OLD_RATES = ("pairs/s: a result measured before the reference cache was keyed per sequence, in its cache rows "
             "(one pair each; a pair is two sequences)")


def ratio_notes(dev: str, r: dict) -> list[str]:
    """One line per ratio the device's run holds: ours / TRL median step against its target."""
    notes = []
    for ratio, target, verdict, against in RATIOS:
        if ratio in r:
            word = "meets" if r[verdict] else "MISSES"
            notes.append(f"{dev}: ours / {against} median step = {r[ratio]:.3f} ({word} the <= {r[target]} target)")
    return notes


def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cpu_affinity']} usable cores, "
             f"torch {report['machine']['torch']} ({report['machine']['torch_threads']} threads), "
             f"transformers {report['machine']['transformers']}, peft {report['machine']['peft']}, "
             f"trl {report['machine']['trl']}", "",
             "| device | implementation | median step s | min s | max s | tokens/s | peak mem MiB (delta) | "
             "precompute sequences/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    notes, old_rates = [], False
    for dev, r in report["devices"].items():
        if not r.get("available") or "error" in r:
            status, why = ("not available", r.get("reason")) if not r.get("available") else ("failed", r["error"])
            lines.append(f"| {dev} | {status} | - | - | - | - | - | - |")
            notes.append(f"{dev}: {why}")
            continue
        pre = r["precompute"]
        for name, label, _, _ in IMPLEMENTATIONS:
            s = r.get(name)
            if s is None:
                continue
            if "error" in s:
                lines.append(f"| {dev} | {label} | failed | | | | | |")
                notes.append(f"{dev} {label}: {s['error']}")
                continue
            pm = s["peak_memory"]
            (forward, old), (wall, _) = rate(pre), rate(pre, suffix="_wall")
            wall = f"{wall} wall" if pre["rebuilt"] else "cache reused: an earlier build's"
            pre_col = (f"{forward} ({wall})" if name == "ours" else "-")
            old_rates |= old and name == "ours"
            lines.append(f"| {dev} | {label} | {s['median_step_s']:.3f} | {s['min_step_s']:.3f} | {s['max_step_s']:.3f} | "
                         f"{s['tokens_per_s']:,.0f} | {_mib(pm['peak_bytes'])} ({_mib(pm['peak_delta_bytes'])}) | "
                         f"{pre_col} |")
        notes += ratio_notes(dev, r)
    if old_rates:
        notes.append(OLD_RATES)
    lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines + limits_table(report)) + "\n"


def _g(flops) -> str:
    return "-" if flops is None else f"{flops / 1e9:,.0f}"


def limits_table(report: dict) -> list[str]:
    """Precompute against a bare forward, and the train step's counted FLOP/s against the matmul peak."""
    goals = {r["precompute_vs_bare_forward"].get("goal", 0.9) for r in report["devices"].values()
             if r.get("precompute_vs_bare_forward")} or {0.9}
    lines = ["", "| device | precompute sequences/s (units_logps) | bare forward sequences/s | precompute / bare "
             f"(goal >= {max(goals):g}) "
             "| step GFLOP (counted) | step GFLOP/s | matmul GFLOP/s bf16 / fp32 | step / matmul (dtype) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows, old_rates = 0, False
    for dev, r in report["devices"].items():
        vs, step, peak = r.get("precompute_vs_bare_forward"), r.get("train_step_vs_matmul_peak"), r.get("matmul_peak")
        if not (vs or step):
            continue
        rows += 1
        if vs and "error" in vs:
            pre = "failed | - | -"
        elif vs:
            (ours, old), (bare, _) = rate(vs, "ours_", spec=".1f"), rate(vs, "bare_", spec=".1f")
            pre = f"{ours} | {bare} | {vs['ratio']:.2f}"
            old_rates |= old
        else:
            pre = "- | - | -"
        if step:
            flops = r["ours"]["flops"]
            per_step = statistics.median(flops["flops_per_step"])
            ratio = "-" if step["ratio"] is None else f"{step['ratio']:.2f} ({step['dtype']})"
            if step.get("ratio_back_to_back") is not None:
                ratio += f"; back to back {step['ratio_back_to_back']:.2f}"
            mm = f"{_g(peak['bfloat16']['peak_flop_per_s'])} / {_g(peak['float32']['peak_flop_per_s'])}"
            train = f"{_g(per_step)} | {_g(step['achieved_flop_per_s'])} | {mm} | {ratio}"
        else:
            train = "- | - | - | -"
        lines.append(f"| {dev} | {pre} | {train} |")
    if not rows:
        return []
    old = [f"- {OLD_RATES}; there precompute / bare is precompute.rows_logps against a bare forward of the "
           "same pairs."] if old_rates else []
    return lines + ["", "- precompute / bare: sequences/s of precompute.units_logps over precompute's batches "
                    "against a bare `model(input_ids, attention_mask).logits` of the same model on the same "
                    "sequences, one per row (medians of repeats, timed back to back)."] + old + [
                    "- step GFLOP: FlopCounterMode over step.optimizer_step (matmuls and attention only); "
                    "step GFLOP/s = counted FLOPs per token x median tokens per step / median step s; matmul GFLOP/s: the "
                    "fastest median of torch.mm over square and model-shaped matrices; back to back: the "
                    "counted steps timed again, each followed by one square-matmul timing (median of the "
                    "per-step ratios)."]


def limits_bars(report: dict) -> list[tuple[str, float]]:
    """(label, ratio) for the plot's second panel: precompute / bare forward and step / matmul peak per device."""
    bars = []
    for dev, r in report["devices"].items():
        if "ratio" in r.get("precompute_vs_bare_forward", {}):
            bars.append((f"{dev}\nprecompute /\nbare forward", r["precompute_vs_bare_forward"]["ratio"]))
        step = r.get("train_step_vs_matmul_peak")
        if step and step["ratio"] is not None:
            bars.append((f"{dev}\nstep FLOP/s /\n{step['dtype']} matmul", step["ratio"]))
    return bars


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, medians, lows, highs, colors = [], [], [], [], []
    for dev, r in report["devices"].items():
        if not r.get("available") or "error" in r:
            continue
        for name, _, label, color in IMPLEMENTATIONS:
            s = r.get(name)
            if not s or "error" in s:
                continue
            labels.append(f"{dev}\n{label}")
            medians.append(s["median_step_s"])
            lows.append(s["median_step_s"] - s["min_step_s"])
            highs.append(s["max_step_s"] - s["median_step_s"])
            colors.append(color)
    if not medians:
        return "no numbers to plot"
    limit_bars = limits_bars(report)
    width = 1.8 + 1.6 * len(medians)
    if limit_bars:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(width + 1.8 + 1.6 * len(limit_bars), 4.5),
                                      gridspec_kw={"width_ratios": [len(medians), len(limit_bars)]})
        names, values = zip(*limit_bars)
        ax2.bar(range(len(values)), values, color="tab:green")
        ax2.set_xticks(range(len(values)), names, fontsize=8)
        ax2.axhline(0.9, color="gray", linestyle="--", linewidth=1)
        ax2.set_ylabel("ratio to the limit")
        ax2.set_title("against the machine\n(dashed: precompute goal 0.9)")
        for i, v in enumerate(values):
            ax2.text(i, v / 2, f"{v:.2f}", ha="center", va="center", color="white", fontweight="bold")
    else:
        fig, ax = plt.subplots(figsize=(width, 4))
    ax.bar(range(len(medians)), medians, yerr=[lows, highs], capsize=6, color=colors)
    ax.set_xticks(range(len(medians)), labels)
    ax.set_ylabel("median optimizer step (s); bars: min..max")
    title = "DPO+LoRA step time"
    for ratio, _, _, against in RATIOS:
        ratios = [f"{d}: {r[ratio]:.2f}" for d, r in report["devices"].items() if ratio in r]
        if ratios:
            title += f"\nours / {against}: " + ", ".join(ratios)
    ax.set_title(title)
    for i, m in enumerate(medians):
        ax.text(i, m / 2, f"{m:.2f} s", ha="center", va="center", color="white", fontweight="bold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
