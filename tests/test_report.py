"""The report stage (curves.png and the summary) and the TensorBoard writer, on run folders written here in the
formats train writes: metrics.jsonl (train and eval lines), trainer_state.json, samples.jsonl."""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path

import pytest

from lowmem_dpo import __main__ as one
from lowmem_dpo import report
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import answers
from lowmem_dpo.training.trackers import open_trackers

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]


# -- a run folder as train writes it -------------------------------------------------------------------------------
def train_line(step: int, kind: str, rng: random.Random, total: int) -> dict:
    progress = step / total
    line = {"step": step, "loss": math.log(2) * math.exp(-2 * progress) + rng.uniform(-0.02, 0.02),
            "grad_norm": rng.uniform(0.5, 2.0), "learning_rate": 1e-3 * 0.5 * (1 + math.cos(math.pi * progress)),
            "step_time_s": rng.uniform(0.05, 0.1), "tokens_per_s": rng.uniform(4000, 6000)}
    if kind == "dpo":
        chosen, rejected = 0.4 * progress + rng.uniform(0, 0.05), -0.3 * progress - rng.uniform(0, 0.05)
        line.update({"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                     "rewards/accuracies": min(1.0, 0.5 + progress), "logps/chosen": -40 + 4 * progress,
                     "logps/rejected": -42 - 3 * progress})
    return line


def eval_line(step: int, kind: str, rng: random.Random, repetition: float) -> dict:
    line = {"step": step, "eval_loss": 0.7 - 0.005 * step + rng.uniform(-0.03, 0.03),
            "eval_gen/repetition": repetition, "eval_gen/length": rng.uniform(20, 48),
            "eval_runtime": rng.uniform(0.5, 1.0), "eval_pairs": 40}
    if kind == "dpo":
        chosen, rejected = 0.01 * step, -0.01 * step - 0.05
        line.update({"eval_rewards/chosen": chosen, "eval_rewards/rejected": rejected,
                     "eval_rewards/margins": chosen - rejected, "eval_rewards/accuracies": rng.uniform(0.6, 1.0),
                     "eval_logps/chosen": -40.0 + step / 10, "eval_logps/rejected": -42.0 - step / 10})
    return line


def write_run(out: Path, kind: str = "dpo", state: bool = True, samples: bool = True,
              repetition: tuple[float, float] = (0.25, 0.1), total: int = 30) -> list[dict]:
    """A finished run in `out`: train lines at step 1 and every 5, evals every 10 (and step 0's samples'
    measures), one window with a null grad_norm; its metrics lines, in file order."""
    rng = random.Random(0)
    rep0, rep_last = repetition
    lines = [{"step": 0, "eval_gen/repetition": rep0, "eval_gen/length": 48.0}]
    for step in [1] + list(range(5, total + 1, 5)):
        lines.append(train_line(step, kind, rng, total))
        if step == 15:
            lines[-1]["grad_norm"] = None  # a window of non-finite steps
        if step % 10 == 0:
            rep = rep0 + (rep_last - rep0) * step / total
            lines.append(eval_line(step, kind, rng, rep))
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    if state:
        evals = [x for x in lines if "eval_loss" in x]
        best = min(evals, key=lambda x: x["eval_loss"])
        (out / "trainer_state.json").write_text(json.dumps({
            "global_step": total, "max_steps": total, "best_metric": best["eval_loss"], "best_global_step": best["step"],
            "best_model_checkpoint": str(out / "checkpoints" / f"checkpoint-{best['step']}"),
            "metric_for_best_model": "eval_loss", "greater_is_better": False, "log_history": lines}))
    if samples:
        rows = [{"step": step, "prompt": f"Write a {mood} review of the film number {step}.\n",
                 "completion": f"A {mood} film, step {step}. " * 12, "chosen": f"It was {mood}."}
                for step in range(0, total + 1, 10) for mood in ("positive", "negative")]
        (out / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows), encoding="utf-8")
    return lines


def run_report(out: Path, capsys) -> tuple[int, str, str]:
    rc = run_cli(report.main, [str(out)], "report", report.__doc__, usage="OUTPUT_DIR")
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def number(text: str, label: str) -> float:
    """The number printed after `label` in the summary line `text`."""
    m = re.search(rf"(?:^|[ (]){re.escape(label)} ([-+0-9.e]+|n/a)", text)
    assert m, (label, text)
    return float(m.group(1))


def summary_line(out: str, start: str) -> str:
    found = [line for line in out.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, out)
    return found[0]


def png_shape(path: Path) -> tuple[int, ...]:
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert 10_000 < len(data) < 5_000_000  # panels of lines and text, not an empty canvas
    return imread(path).shape


def expected_shape(n_panels: int) -> tuple[int, int, int]:
    rows = math.ceil(n_panels / report.COLUMNS)
    return (round(rows * report.PANEL_INCHES[1] * report.DPI), round(report.COLUMNS * report.PANEL_INCHES[0] *
                                                                     report.DPI), 4)


# -- the report ----------------------------------------------------------------------------------------------------
def test_dpo_run_curves_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    lines = write_run(out)
    rc, stdout, err = run_report(out, capsys)
    assert rc == 0, err
    titles = [p[0] for p in report.panels(report.load_run(out))]
    assert titles == ["loss", "rewards/accuracies", "rewards/margins", "grad_norm", "learning_rate",
                      "eval_gen/repetition"]
    assert png_shape(out / "curves.png") == expected_shape(6)

    train = [x for x in lines if "loss" in x]
    scored = [x for x in lines if "eval_loss" in x]
    assert summary_line(stdout, "steps:") == f"steps: {train[-1]['step']} of {train[-1]['step']}"
    t = summary_line(stdout, f"train (step {train[-1]['step']}):")
    for key, label in (("loss", "loss"), ("rewards/accuracies", "accuracy"), ("rewards/margins", "margin")):
        assert number(t, label) == pytest.approx(train[-1][key], rel=1e-3)
    e = summary_line(stdout, f"eval (step {scored[-1]['step']}, {scored[-1]['eval_pairs']} pairs):")
    for key, label in (("eval_loss", "loss"), ("eval_rewards/accuracies", "accuracy"),
                       ("eval_rewards/margins", "margin"), ("eval_gen/repetition", "repetition"),
                       ("eval_gen/length", "length")):
        assert number(e, label) == pytest.approx(scored[-1][key], rel=1e-3)
    best = min(scored, key=lambda x: x["eval_loss"])
    b = summary_line(stdout, "best:")
    assert number(b, "eval_loss") == pytest.approx(best["eval_loss"], rel=1e-3)
    assert f"at step {best['step']} ({out / 'checkpoints'}/checkpoint-{best['step']})" in b
    r = summary_line(stdout, "repetition:")
    assert number(r, "repetition:") == pytest.approx(lines[0]["eval_gen/repetition"], rel=1e-3)
    assert number(r, "->") == pytest.approx(scored[-1]["eval_gen/repetition"], rel=1e-3)
    assert "warning" not in r  # repetition fell: a healthy run
    s = summary_line(stdout, f"last sample (step {scored[-1]['step']}):")
    assert '"Write a negative review of the film number 30."' in s and s.endswith('…"')
    assert summary_line(stdout, "curves:") == f"curves: {out / 'curves.png'}"


def test_sft_run_leaves_out_the_rewards_and_an_old_run_has_no_best(tmp_path, capsys):
    out = tmp_path / "sft"
    lines = write_run(out, kind="sft", state=False, samples=False)
    rc, stdout, err = run_report(out, capsys)
    assert rc == 0, err
    titles = [p[0] for p in report.panels(report.load_run(out))]
    assert titles == ["loss", "grad_norm", "learning_rate", "eval_gen/repetition"]
    assert png_shape(out / "curves.png") == expected_shape(4)
    train = [x for x in lines if "loss" in x]
    t = summary_line(stdout, "train (step")
    assert number(t, "loss") == pytest.approx(train[-1]["loss"], rel=1e-3)
    assert "accuracy" not in t and "margin" not in t
    assert summary_line(stdout, "steps:") == f"steps: {train[-1]['step']}"  # no trainer_state: no max_steps
    assert "no trainer_state.json" in summary_line(stdout, "best:")
    assert "last sample" not in stdout


def green_pixels(path: Path) -> int:
    """Pixels of the best-step marker's colour (matplotlib's tab:green)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    rgb = imread(path)[..., :3]
    return int((np.abs(rgb - np.array(to_rgb("tab:green"))).max(axis=-1) < 0.03).sum())


def test_the_best_step_is_marked_on_the_eval_panels(tmp_path, capsys):
    marked, plain = tmp_path / "marked", tmp_path / "plain"
    write_run(marked)
    write_run(plain, state=False)
    assert run_report(marked, capsys)[0] == 0 and run_report(plain, capsys)[0] == 0
    assert green_pixels(plain / "curves.png") == 0
    assert green_pixels(marked / "curves.png") > 100


def test_collapse_is_flagged_in_the_summary(tmp_path):
    base = 0.2
    now = max(answers.COLLAPSE_LEVEL, base + answers.COLLAPSE_RISE) + 0.1
    write_run(tmp_path / "collapsed", repetition=(base, now))
    line = report.repetition_line(report.load_run(tmp_path / "collapsed"))
    assert "warning: generations collapsing into repetition" in line
    assert number(line, "->") == pytest.approx(now, rel=1e-3)
    write_run(tmp_path / "healthy", repetition=(base, base + 0.05))
    assert "warning" not in report.repetition_line(report.load_run(tmp_path / "healthy"))


def test_without_matplotlib_the_summary_prints_then_exit_2(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    write_run(out)
    # Simulates a machine without the optional matplotlib: None in sys.modules makes its import fail.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rc, stdout, err = run_report(out, capsys)
    assert rc == 2
    assert "curves.png needs matplotlib: pip install 'lowmem_dpo[report]'" in err
    assert "train (step 30)" in stdout and summary_line(stdout, "curves:") == "curves: not drawn"
    assert not (out / "curves.png").exists()


@pytest.mark.parametrize("case", ["no folder", "no metrics", "bad json", "no step", "step not int", "bad sample",
                                  "empty"])
def test_bad_run_folders_exit_2_with_one_message(tmp_path, capsys, case):
    out = tmp_path / "run"
    if case != "no folder":
        write_run(out)
    metrics, samples = out / "metrics.jsonl", out / "samples.jsonl"
    lines = metrics.read_text().splitlines(keepends=True) if metrics.exists() else []
    expected = {"no folder": "no such folder",
                "no metrics": "no metrics.jsonl; is this a run's output_dir? Run lowmem-dpo train",
                "bad json": f"{metrics}:3: not a JSON line",
                "no step": f"{metrics}:3: not a line of this file (no step)",
                "step not int": f"{metrics}:3: not a line of this file (step '5' is not an integer)",
                "bad sample": f"{samples}:2: not a line of this file (no completion)", "empty": "empty"}[case]
    if case == "no metrics":
        metrics.unlink()
    elif case in ("bad json", "no step", "step not int"):
        broken = {"bad json": lines[2][:20] + "\n", "no step": json.dumps({"loss": 0.5}) + "\n",
                  "step not int": json.dumps({"step": "5", "loss": 0.5}) + "\n"}[case]
        metrics.write_text("".join(lines[:2] + [broken] + lines[3:]))
    elif case == "bad sample":
        rows = samples.read_text().splitlines(keepends=True)
        samples.write_text(rows[0] + json.dumps({"step": 0, "prompt": "p"}) + "\n" + "".join(rows[2:]))
    elif case == "empty":
        metrics.write_text("\n")
    rc, stdout, err = run_report(out, capsys)
    assert rc == 2
    assert expected in err and err.startswith("lowmem_dpo.report: error:") and len(err.splitlines()) == 1
    assert not (out / "curves.png").exists()


def test_the_command_runs_and_fails_cleanly(tmp_path, capsys):
    """The module's own __main__, as lowmem-dpo report runs it (runpy; test_doc_blocks.py runs the docs' report
    commands so too)."""
    out = tmp_path / "run"
    write_run(out)
    assert one.main(["report", str(out)]) == 0
    assert f"curves: {out / 'curves.png'}" in capsys.readouterr().out
    assert (out / "curves.png").read_bytes()[:8] == PNG_SIGNATURE
    assert one.main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "Traceback" not in err


def test_help_shows_the_command(capsys):
    assert run_cli(report.main, ["--help"], "report", report.__doc__, usage="OUTPUT_DIR") == 0
    shown = capsys.readouterr().out
    assert "lowmem-dpo report OUTPUT_DIR" in shown and "usage: lowmem-dpo report" in shown
    assert "keys (type, default" not in shown  # not a recipe stage


# -- TensorBoard ---------------------------------------------------------------------------------------------------
def test_tensorboard_scalars_read_back_equal_the_lines(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert open_trackers(["none"], tmp_path, None, {}) is None and open_trackers([], tmp_path, None, {}) is None
    lines = write_run(tmp_path / "src")
    writer = open_trackers(["tensorboard"], tmp_path, None, {})
    for line in lines:
        writer.add(line)
    writer.close()
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        for key, value in line.items():
            if key != "step" and value is not None:
                name = "eval/" + key.removeprefix("eval_") if key.startswith("eval_") else "train/" + key
                expected.setdefault(name, []).append((line["step"], value))
    acc = EventAccumulator(str(tmp_path / "runs"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(expected)
    assert {"train/loss", "train/rewards/margins", "eval/loss", "eval/gen/repetition"} <= set(expected)
    for name, points in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in points], name
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), name  # stored as float32


def test_tensorboard_missing_is_a_user_error(tmp_path, monkeypatch):
    # Simulates a machine without the optional tensorboard: None in sys.modules makes its import fail.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match="report_to=tensorboard needs tensorboard: pip install tensorboard"):
        open_trackers(["tensorboard"], tmp_path, None, {})
    assert not (tmp_path / "runs").exists()


def test_the_warnings_train_wrote_are_listed_with_their_first_step(tmp_path):
    """train writes each warning to metrics.jsonl as {"step", "warnings"} (loop.warn); the summary names each kind
    at the step it first fired, and the curves' readers skip those lines."""
    lines = write_run(tmp_path / "run")
    extra = [{"step": 10, "warnings": ["likelihood displacement: chosen log-probs -0.61 nats/token below ..."]},
             {"step": 20, "warnings": ["likelihood displacement: chosen log-probs -0.70 ...",
                                       "answers drifting from the chosen completions: ROUGE-L 0.25 against 0.53 ..."]}]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines + extra))
    run = report.load_run(tmp_path / "run")
    assert report.warnings_line(run) == ("warnings: likelihood displacement at step 10 (2 times); answers drifting "
                                         "from the chosen completions at step 20 (the train log has the numbers)")
    assert len(run.train) == len([x for x in lines if "loss" in x])  # the warnings are not train lines
    write_run(tmp_path / "quiet")
    assert report.warnings_line(report.load_run(tmp_path / "quiet")) == "warnings: none"
