"""report_to=tensorboard: metrics.jsonl's scalars, also as TensorBoard event files in output_dir/runs.

    writer = open_writer(cfg.report_to, Path(cfg.output_dir))   # None for report_to=none
    writer.add(line)                                            # each metrics.jsonl line as it is written
    writer.close()
    tensorboard --logdir OUTPUT_DIR/runs

Tag names follow transformers' TensorBoardCallback, so runs compare with HF/TRL runs: a train key as
"train/<key>" (train/loss, train/rewards/margins), an eval key without its eval_ prefix as "eval/<key>"
(eval/loss, eval/gen/repetition), each at global step line["step"]. tensorboard is optional (the `tensorboard`
extra), imported only when report_to asks for it.
"""

from __future__ import annotations

from pathlib import Path

from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError

EVENTS_DIR = "runs"  # under output_dir, as transformers' default logging_dir


def tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key: "eval_loss" -> "eval/loss", "loss" -> "train/loss"."""
    return f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}"


def scalars(line: dict) -> dict[str, float]:
    """The line's numeric values but its step, by tag (null, text and booleans left out)."""
    return {tag(k): float(v) for k, v in line.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Writer:
    """A TensorBoard event writer fed metrics.jsonl lines."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        module = devices.import_optional("torch.utils.tensorboard", "report_to=tensorboard needs tensorboard",
                                         "tensorboard")
        self.log_dir = Path(log_dir)
        # purge_step: TensorBoard hides the events already in log_dir at this step and after (a resumed run's
        # steps after its checkpoint, or all of an earlier run's with 0), so no step shows twice.
        self._writer = module.SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def add(self, line: dict) -> None:
        """Every numeric value of `line` but "step" as a scalar at global step line["step"]."""
        for name, value in scalars(line).items():
            self._writer.add_scalar(name, value, global_step=line["step"])
        self._writer.flush()  # a line is on disk when add returns, as metrics.jsonl's is

    def close(self) -> None:
        self._writer.close()


def open_writer(report_to: str, out_dir: Path, purge_step: int | None = None) -> Writer | None:
    """The writer report_to asks for: None for "none", a Writer into out_dir/runs for "tensorboard" (a UserError
    saying what to install when tensorboard is missing), hiding earlier events from `purge_step` on."""
    if report_to == "none":
        return None
    if report_to == "tensorboard":
        return Writer(Path(out_dir) / EVENTS_DIR, purge_step)
    raise UserError(f"report_to={report_to}: unknown; one of none, tensorboard")
