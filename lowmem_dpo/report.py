"""Draw a run's curves and print its summary: did DPO work?

    lowmem-dpo report OUTPUT_DIR          # e.g. runs/tiny, after train or sft

Reads OUTPUT_DIR/metrics.jsonl (train and eval lines), trainer_state.json (the best checkpoint; absent in older
runs) and samples.jsonl (the generations; absent without eval). Writes OUTPUT_DIR/curves.png (matplotlib, the
`report` extra): loss and eval loss, reward margins, preference accuracies, grad_norm, learning rate and the
generations' repetition, one panel each (a panel with no data, e.g. the rewards of an SFT run, is left out), with
the best step marked on the eval panels. Prints the summary to stdout: steps run, the last train and eval
metrics, the best checkpoint, the repetition at step 0 against the last (with the collapse sign), the last
sample and where the picture is.
"""

# A stage on the top floor: it reads a run's files and imports no other stage. The only training knowledge it
# needs is answers.collapse_sign, the same warning the train log raises.

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.objectives.metrics import EVAL_SHOWN, LOSS, PANELS, TRAIN_SHOWN
from lowmem_dpo.runtime import devices, files, folders
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import answers, guards
from lowmem_dpo.training.output import KIND, PICTURE, earlier_run

NO_MATPLOTLIB = ("curves.png needs matplotlib", "'lowmem_dpo[report]'")  # devices.import_optional's message

COLUMNS = 2  # panels per row
PANEL_INCHES = (6.0, 3.2)  # width, height of one panel
DPI = 100

SAMPLE_CHARS = (80, 120)  # prompt, completion: longer ones are shortened in the summary


@dataclass
class Run:
    """What a run's output_dir says about it."""

    out_dir: Path
    train: list[dict] = field(default_factory=list)  # metrics.jsonl lines with "loss"
    evals: list[dict] = field(default_factory=list)  # metrics.jsonl lines with an eval_ key (step 0's included)
    state: dict | None = None  # trainer_state.json; None for a run written before it existed
    samples: list[dict] = field(default_factory=list)  # samples.jsonl lines
    warnings: list[dict] = field(default_factory=list)  # metrics.jsonl's {"step", "warnings"} lines

    @property
    def best_step(self) -> int | None:
        return (self.state or {}).get("best_global_step")


# -- reading -------------------------------------------------------------------------------------------------------
def read_jsonl(path: Path, required: tuple[str, ...] = ("step",)) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line (blank lines skipped); a line that is not an object with an
    integer "step" (and the other `required` keys) is a UserError naming file:line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{number}: not a JSON line ({e.msg}); fix or delete that line") from None
            missing = [k for k in required if not isinstance(obj, dict) or k not in obj]
            if missing or isinstance(obj["step"], bool) or not isinstance(obj["step"], int):
                what = f"no {', '.join(missing)}" if missing else f"step {obj['step']!r} is not an integer"
                raise UserError(f"{path}:{number}: not a line of this file ({what}); fix or delete that line")
            out.append(obj)
    return out


def load_run(out_dir: Path) -> Run:
    """The run in `out_dir`: metrics.jsonl (required), trainer_state.json and samples.jsonl (when present)."""
    out_dir = Path(out_dir)
    metrics = out_dir / "metrics.jsonl"
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: no such folder; give a run's output_dir (run lowmem-dpo train "
                        "RECIPE.yaml first)")
    if not metrics.is_file():
        raise UserError(f"{out_dir}: no metrics.jsonl; is this a run's output_dir? Run lowmem-dpo train "
                        "RECIPE.yaml (or sft) first")
    lines = read_jsonl(metrics)
    if not lines:
        raise UserError(f"{metrics}: empty; the run has not logged a step yet")
    run = Run(out_dir, train=[x for x in lines if LOSS.name in x],
              evals=[x for x in lines if any(k.startswith("eval_") for k in x)],
              warnings=[x for x in lines if "warnings" in x])
    state_path = out_dir / "trainer_state.json"
    if state_path.is_file():
        try:
            run.state = json.loads(state_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise UserError(f"{state_path}: not JSON ({e.msg} at line {e.lineno}); delete it or rerun train") from None
        if not isinstance(run.state, dict):
            raise UserError(f"{state_path}: not a JSON object; delete it or rerun train")
    if (out_dir / "samples.jsonl").is_file():
        run.samples = read_jsonl(out_dir / "samples.jsonl", ("step", "prompt", "completion"))
    return run


def series(lines: list[dict], key: str | None) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the lines that have a number for it (null and absent left out)."""
    steps, values = [], []
    for line in lines if key else ():
        v = line.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            steps.append(line["step"])
            values.append(float(v))
    return steps, values


# -- the picture ---------------------------------------------------------------------------------------------------
def panels(run: Run) -> list[tuple[str, tuple, tuple]]:
    """The panels to draw: (title, train (steps, values), eval (steps, values)) for each of PANELS with data."""
    out = []
    for title, train_key, eval_key in PANELS:
        train, evals = series(run.train, train_key), series(run.evals, eval_key)
        if train[0] or evals[0]:
            out.append((title, train, evals))
    return out


def figure_size(n_panels: int) -> tuple[float, float]:
    """The picture's size in inches for `n_panels` panels (COLUMNS to a row)."""
    rows = max(1, math.ceil(n_panels / COLUMNS))
    return PANEL_INCHES[0] * COLUMNS, PANEL_INCHES[1] * rows


def draw(run: Run, path: Path) -> None:
    """Draw the run's panels into `path` (PNG, written atomically). Needs matplotlib (UserError without)."""
    devices.import_optional("matplotlib", *NO_MATPLOTLIB)
    # A Figure made without pyplot has no window and no display: savefig renders the PNG with Agg.
    from matplotlib.figure import Figure

    todo = panels(run)
    fig = Figure(figsize=figure_size(len(todo)), dpi=DPI, layout="constrained")
    axes = list(fig.subplots(max(1, math.ceil(len(todo) / COLUMNS)), COLUMNS, squeeze=False).flat)
    for ax, (title, train, evals) in zip(axes, todo):
        if train[0]:
            ax.plot(*train, label="train", color="tab:blue", linewidth=1.2)
        if evals[0]:
            ax.plot(*evals, label="eval", color="tab:orange", marker="o", markersize=3, linewidth=1.2)
            if run.best_step is not None:
                ax.axvline(run.best_step, color="tab:green", linestyle="--", linewidth=1,
                           label=f"best (step {run.best_step})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(todo):]:  # the empty cell of an odd count
        ax.set_visible(False)
    fig.suptitle(str(run.out_dir))
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    files.atomic_write_bytes(path, buf.getvalue())


# -- the summary ---------------------------------------------------------------------------------------------------
def _num(v) -> str:
    return "n/a" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _shown(line: dict, keys: tuple) -> str:
    return ", ".join(f"{label} {_num(line[k])}" for k, label in keys if k in line)


def _short(text: str, limit: int) -> str:
    """`text` on one line (whitespace runs as one space), cut to `limit` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def best_line(state: dict | None) -> str:
    if state is None:
        return "best: unknown (no trainer_state.json: a run written before it existed)"
    if state.get("best_metric") is None:
        return "best: none yet (no eval has run)"
    return (f"best: {state.get('metric_for_best_model')} {_num(state['best_metric'])} at step "
            f"{state.get('best_global_step')} ({state.get('best_model_checkpoint') or 'checkpoint not kept'})")


def repetition_line(run: Run) -> str | None:
    """The generations' repetition, mean length and empty answers at step 0 (the reference) against the last
    eval, with the collapse sign."""
    measured = [x for x in run.evals if x.get(answers.GEN_REPETITION) is not None]
    if not measured:
        return None
    base = measured[0] if measured[0]["step"] == 0 else None
    last = measured[-1]
    text = "; ".join(f"{label}: {_num((base or {}).get(key))} at step 0 -> {_num(last.get(key))} at step {last['step']}"
                     for key, label in ((answers.GEN_REPETITION, "repetition"), (answers.GEN_LENGTH, "length"),
                                        (answers.GEN_EMPTY, "empty answers"), (answers.GEN_ROUGE_L, "ROUGE-L vs chosen"),
                                        (answers.GEN_KL, "KL from the reference"))
                     if key in last or key in (base or {}))
    sign = answers.collapse_sign(base, last)
    return f"{text}; warning: {sign}" if sign else text


def warnings_line(run: Run) -> str:
    """Each warning sign train logged, by its text up to the numbers, at the step it first fired and how often."""
    summary = guards.warnings_summary(run.warnings)
    return f"warnings: {summary} (the train log has the numbers)" if summary else "warnings: none"


def summary_lines(run: Run, picture: Path | None) -> list[str]:
    """The printed summary, one item a line."""
    last = max([x["step"] for x in run.train + run.evals] or [0])
    steps = (run.state or {}).get("global_step", last)
    total = (run.state or {}).get("max_steps")
    lines = [f"run: {run.out_dir}", f"steps: {steps}" + (f" of {total}" if total else "")]
    if run.train:
        lines.append(f"train (step {run.train[-1]['step']}): {_shown(run.train[-1], TRAIN_SHOWN)}")
    scored = [x for x in run.evals if LOSS.eval in x]  # the step-0 line holds only the samples' measures
    if scored:
        e = scored[-1]
        pairs = f", {e['eval_pairs']} pairs" if e.get("eval_pairs") is not None else ""
        lines.append(f"eval (step {e['step']}{pairs}): {_shown(e, EVAL_SHOWN)}")
    else:
        lines.append("eval: none (set eval_dataset or eval_fraction to evaluate)")
    lines.append(best_line(run.state))
    lines.append(warnings_line(run))
    rep = repetition_line(run)
    if rep:
        lines.append(rep)
    if run.samples:
        sample = run.samples[-1]
        prompt, completion = (json.dumps(_short(sample[k], n), ensure_ascii=False)
                              for k, n in zip(("prompt", "completion"), SAMPLE_CHARS))
        lines.append(f"last sample (step {sample['step']}): {prompt} -> {completion}")
    lines.append(f"curves: {picture}" if picture else "curves: not drawn")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise UserError(f"expected one OUTPUT_DIR, got {len(argv)} arguments; usage: lowmem-dpo report "
                        "OUTPUT_DIR")
    run = load_run(Path(argv[0]))
    picture = run.out_dir / PICTURE
    if picture.exists() and folders.read_marker(run.out_dir) is None and not any(  # nothing of a user's replaced
            earlier_run(run.out_dir, k) for k in KIND.values()):
        raise UserError(f"{run.out_dir} holds a {PICTURE} and is not a run folder this tool wrote (no "
                        f"{folders.MARKER}): drawing would replace it; move that file away and rerun")
    try:
        draw(run, picture)
        missing = None
    except UserError as e:  # no matplotlib: the summary still helps; the exit code says what is missing
        missing, picture = e, None
    print("\n".join(summary_lines(run, picture)))
    if missing is not None:
        raise missing
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "report", __doc__, usage="OUTPUT_DIR"))
