"""report_to: metrics.jsonl's scalars also to TensorBoard, trackio and Weights & Biases, each an optional extra
imported only when asked for.

    trackers = open_trackers(cfg, out_dir, purge_step, setup)   # None when report_to names none
    trackers.add(line)                                           # each metrics.jsonl line as it is written
    trackers.close()

- tensorboard: event files in output_dir/runs (tensorboard --logdir OUTPUT_DIR/runs).
- trackio: its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`), project
  TRACKIO_PROJECT (default lowmem_dpo), the run named run_name (default output_dir's name).
- wandb: output_dir/wandb; WANDB_MODE=offline logs there without the network (`wandb sync` uploads later);
  project WANDB_PROJECT (default lowmem_dpo), the run named run_name.

Tag names follow transformers' callbacks, so runs compare with HF/TRL runs: a train key as "train/<key>"
(train/loss, train/rewards/margins), an eval key without its eval_ prefix as "eval/<key>" (eval/loss,
eval/gen/repetition), each at global step line["step"]. trackio and wandb get the config and the run's resolved
setup (device, dtype, the planner's micro-batch, ...) once at the start, as TRL's do.

A missing package stops the run before it starts, naming the pip command. A tracker that fails later (a service
gone, a disk) is dropped with one warning line: metrics.jsonl, which holds every line, is never at stake.
"""

from __future__ import annotations

import os
from pathlib import Path

from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError, log

EVENTS_DIR = "runs"  # under output_dir, as transformers' default logging_dir
PROJECT = "lowmem_dpo"  # trackio's and wandb's project unless TRACKIO_PROJECT / WANDB_PROJECT name another


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


class Trackio:
    """trackio's run, fed metrics.jsonl lines."""

    def __init__(self, name: str, config: dict, resumed: bool):
        self._trackio = devices.import_optional("trackio", "report_to=trackio needs trackio", "'lowmem_dpo[trackio]'")
        # a resumed run continues its trackio run; a new one is a new run, whatever its name
        self._trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config,
                           resume="allow" if resumed else "never")

    def add(self, line: dict) -> None:
        self._trackio.log(scalars(line), step=line["step"])

    def close(self) -> None:
        self._trackio.finish()


class Wandb:
    """A Weights & Biases run in out_dir/wandb, fed metrics.jsonl lines."""

    def __init__(self, out_dir: Path, name: str, config: dict):
        wandb = devices.import_optional("wandb", "report_to=wandb needs wandb", "'lowmem_dpo[wandb]'")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, dir=str(out_dir),
                               config=config)

    def add(self, line: dict) -> None:
        self._run.log(scalars(line), step=line["step"])

    def close(self) -> None:
        self._run.finish()


def said(e: Exception) -> str:
    """An exception in one short line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


class Trackers:
    """The trackers report_to names; one that fails is dropped with a warning, the run goes on."""

    def __init__(self, writers: dict):
        self.writers = writers  # report_to name -> its writer

    def _each(self, what: str, call) -> None:
        for name, writer in list(self.writers.items()):
            try:
                call(writer)
            except Exception as e:  # a tracker's trouble never stops training: metrics.jsonl has every line
                log(f"warning: report_to={name} failed to {what} ({said(e)}); it gets nothing more, metrics.jsonl "
                    "has every line")
                del self.writers[name]

    def add(self, line: dict) -> None:
        self._each("log a line", lambda w: w.add(line))

    def close(self) -> None:
        self._each("close", lambda w: w.close())


def open_trackers(report_to: list[str], out_dir: Path, run_name: str | None, config: dict,
                  purge_step: int | None = None, resumed: bool = False) -> Trackers | None:
    """The trackers report_to names (None: none), each started; a missing package is a UserError naming the pip
    command, a service that does not answer one warning (that tracker left out). config: what trackio and wandb
    record of the run."""
    names = [n for n in dict.fromkeys(report_to) if n != "none"]
    if not names:
        return None
    name = run_name or Path(out_dir).resolve().name
    start = {"tensorboard": lambda: Writer(Path(out_dir) / EVENTS_DIR, purge_step),
             "trackio": lambda: Trackio(name, config, resumed), "wandb": lambda: Wandb(Path(out_dir), name, config)}
    writers = {}
    for n in names:
        try:
            writers[n] = start[n]()
        except UserError:
            raise
        except Exception as e:  # its service or its files: a warning, and the run goes on without it
            log(f"warning: report_to={n} could not start ({said(e)}); the run goes on without it (metrics.jsonl "
                "has every line)")
    return Trackers(writers)
