"""Every metric a run logs, one row each: its metrics.jsonl name (TRL's), how it sums, whether larger is better (for
metric_for_best_model), where it is logged, its progress-bar label and the report panel that draws it. The loop's
sums (training/step.py's Sums), the log, the progress bar, guards, evaluation, config's metric_for_best_model
check and report's panels read these rows; code names a metric by its row (LOSS.name, MARGIN.eval), never by
spelling it (tests/objectives/test_metric_rows.py fails on a metric name spelled outside this module)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # a train line's key; an eval line has eval_NAME (`eval`)
    greater_is_better: bool | None  # None: not a metric_for_best_model
    # How it sums (`summed`): pair, nll and term metrics add their total and their count over micro-batches, the
    # steps of a log line's window and the ranks (Sums); the mean is total / count, what is counted being the
    # objective's unit (pairs; SFT's completion tokens; KTO's blocks). step: the optimizer step's own, not summed.
    # sample: eval's answers (rank 0's), not summed. term: logged by the objectives in logged_by; nll: logged when
    # the loss has the chosen tokens' NLL (objectives.nll_weight), which the loss adds at its weight (Sums.means)
    kind: str
    panel: str | None = None  # the report's panel title; None: not drawn
    label: str | None = None  # the report's summary label and the eval log line's; None: not in the summary
    doc: str = ""
    logged_by: tuple[str, ...] = ()  # kind term: the objectives (loss_type names) whose runs log it
    unpaired: bool = True  # an unpaired run (KTO) logs it too (its rows have no pair to be accurate about)
    bar: tuple[str, int] | None = None  # the progress bar's label and decimals (and the closing line's); None: not shown

    @property
    def eval(self) -> str:  # its key in an eval line
        return f"eval_{self.name}"

    @property
    def summed(self) -> bool:
        return self.kind not in ("step", "sample")


LOSS = Metric(name="loss", greater_is_better=False, kind="pair", panel="loss", label="loss",
              doc="the objective's loss, its terms weighted and summed", bar=("loss", 4))
REWARDS_CHOSEN = Metric(name="rewards/chosen", greater_is_better=True, kind="pair",
                        doc="beta * the chosen completion's log-ratio to the reference")
REWARDS_REJECTED = Metric(name="rewards/rejected", greater_is_better=False, kind="pair",
                          doc="beta * the rejected completion's log-ratio")
ACCURACY = Metric(name="rewards/accuracies", greater_is_better=True, kind="pair", panel="rewards/accuracies",
                  label="accuracy", doc="the share of pairs whose chosen reward is above the rejected one",
                  unpaired=False, bar=("acc", 2))
MARGIN = Metric(name="rewards/margins", greater_is_better=True, kind="pair", panel="rewards/margins", label="margin",
                doc="chosen minus rejected reward", bar=("margin", 3))
LOGPS_CHOSEN = Metric(name="logps/chosen", greater_is_better=True, kind="pair",
                      doc="the policy's log-prob sum of the chosen completion")
LOGPS_REJECTED = Metric(name="logps/rejected", greater_is_better=False, kind="pair",
                        doc="the policy's log-prob sum of the rejected completion")
NLL_LOSS = Metric(name="nll_loss", greater_is_better=False, kind="nll",
                  doc="the chosen tokens' mean NLL, which the loss adds with its weight (the sft term, ORPO's own): "
                  "logged when the loss has it")
LOG_ODDS_RATIO = Metric(name="log_odds_ratio", greater_is_better=True, kind="term",
                        doc="ORPO: the mean log s(log odds ratio), the term beta scales", logged_by=("orpo",))
LOG_ODDS_CHOSEN = Metric(name="log_odds_chosen", greater_is_better=True, kind="term",
                         doc="ORPO: the mean log odds ratio of chosen over rejected", logged_by=("orpo",))
KL = Metric(name="kl", greater_is_better=None, kind="term", panel="kl (KTO's z0)",
            doc="KTO: its reference point z0, the policy's KL estimate from the reference on the mismatched pairs "
            "(TRL's kl)", logged_by=("kto",), bar=("kl", 4))
GRAD_NORM = Metric(name="grad_norm", greater_is_better=None, kind="step", panel="grad_norm",
                   doc="the gradients' norm before clipping")
LEARNING_RATE = Metric(name="learning_rate", greater_is_better=None, kind="step", panel="learning_rate",
                       doc="the rate the step applied")
GEN_REPETITION = Metric(name="gen/repetition", greater_is_better=False, kind="sample", panel="eval_gen/repetition",
                        label="repetition", doc="seq-rep-4 of the sample generations (answers.repetition)")
GEN_ROUGE_L = Metric(name="gen/rouge_l", greater_is_better=True, kind="sample", panel="eval_gen/rouge_l",
                     label="ROUGE-L", doc="token ROUGE-L F1 of the samples against their held-out chosen completions "
                     "(answers.rouge_l)")
GEN_ROUGE_L_SE = Metric(name="gen/rouge_l_se", greater_is_better=None, kind="sample",
                        doc="the standard error of eval_gen/rouge_l's change from step 0, over the same prompts' "
                        "answers (answers.change_se): the answers' drift sign's noise")
GEN_CONTENT = Metric(name="gen/content", greater_is_better=None, kind="sample",
                     doc="the share of each held-out chosen completion's tokens beyond the phrasing the chosen "
                     "completions share that the sample holds, averaged (content.content)")
GEN_CONTENT_SE = Metric(name="gen/content_se", greater_is_better=None, kind="sample",
                        doc="the standard error of eval_gen/content's change from step 0, over the same prompts' "
                        "answers (answers.change_se): the content sign's noise")
GEN_KL = Metric(name="gen/kl", greater_is_better=False, kind="sample", panel="eval_gen/kl", label="KL",
                doc="per-token KL of the policy from the reference along its own samples (samples.kl_to_reference)")
GEN_LENGTH = Metric(name="gen/length", greater_is_better=None, kind="sample", label="length",
                    doc="the samples' mean length in tokens")
GEN_CHOSEN_LENGTH = Metric(name="gen/chosen_length", greater_is_better=None, kind="sample",
                           doc="the sampled prompts' chosen completions' mean length")
GEN_EMPTY = Metric(name="gen/empty", greater_is_better=False, kind="sample", label="empty",
                   doc="the share of samples that end at once")
GEN_COLLAPSED = Metric(name="gen/collapsed", greater_is_better=False, kind="sample", label="collapsed",
                       doc="the answers that collapsed against the same prompt's at step 0: into repetition, or into "
                       "nothing (answers.collapsed_answers)")
GEN_ANSWERS = Metric(name="gen/answers", greater_is_better=None, kind="sample",
                     doc="the answers judged at the eval (eval_generations, at most the distinct eval prompts)")

METRICS = (LOSS, REWARDS_CHOSEN, REWARDS_REJECTED, ACCURACY, MARGIN, LOGPS_CHOSEN, LOGPS_REJECTED, NLL_LOSS,
           LOG_ODDS_RATIO, LOG_ODDS_CHOSEN, KL, GRAD_NORM, LEARNING_RATE, GEN_REPETITION, GEN_ROUGE_L, GEN_ROUGE_L_SE,
           GEN_CONTENT, GEN_CONTENT_SE, GEN_KL, GEN_LENGTH, GEN_CHOSEN_LENGTH, GEN_EMPTY, GEN_COLLAPSED, GEN_ANSWERS)
BY_NAME = {metric.name: metric for metric in METRICS}
# a preference pair's, each run of pairs logs them
PAIR_METRICS = tuple(metric for metric in METRICS if metric.kind == "pair")
# KTO's, in TRL's KTOTrainer order: each a mean over a step's blocks of the block's own mean
BLOCK_METRICS = (LOSS, KL, REWARDS_CHOSEN, LOGPS_CHOSEN, REWARDS_REJECTED, LOGPS_REJECTED, MARGIN)
SAMPLE_METRICS = tuple(metric for metric in METRICS if metric.kind == "sample")


def eval_name(name: str) -> str:
    return f"eval_{name}"


def row_of(key: str) -> Metric | None:
    """The row of a metrics.jsonl key (a train line's, or an eval line's eval_ name); None for another key."""
    return BY_NAME.get(key.removeprefix("eval_"))  # no row's own name starts with eval_


def term_metrics(loss_types) -> tuple[Metric, ...]:
    """The metrics of kind term that a run of `loss_types` logs (its objectives' own)."""
    return tuple(metric for metric in METRICS if metric.kind == "term" and set(metric.logged_by) & set(loss_types))


def logged(name: str, loss_types, nll: bool, unpaired: bool = False) -> bool:
    """Whether a run of `loss_types` logs metric `name` (nll: its loss has an NLL term, objectives.nll_weight;
    unpaired: it trains on unpaired rows, KTO)."""
    metric = BY_NAME[name]
    if unpaired:
        return metric in BLOCK_METRICS or not metric.summed
    return metric in term_metrics(loss_types) if metric.kind == "term" else nll if metric.kind == "nll" else True


def train_key(metric: Metric) -> str | None:
    return None if metric.kind == "sample" else metric.name


# metric_for_best_model: an eval metric with a direction, by its eval name
EVAL_METRICS = {metric.eval: metric.greater_is_better for metric in METRICS
                if metric.greater_is_better is not None and metric.kind != "step"}
# the report's panels: (title, train key or None, eval key or None)
PANELS = tuple((metric.panel, train_key(metric), None if metric.kind == "step" else metric.eval)
               for metric in METRICS if metric.panel)
TRAIN_SHOWN = tuple((metric.name, metric.label) for metric in METRICS if metric.label and metric.kind == "pair")
EVAL_SHOWN = tuple((metric.eval, metric.label) for metric in METRICS if metric.label)
BAR = tuple(metric for metric in METRICS if metric.bar)


def bar_numbers(line: dict, prefix: str = "") -> dict[str, str]:
    """The progress bar's numbers from a metrics line (prefix "eval_": an eval line's), by the rows' bar labels."""
    return {prefix + metric.bar[0]: f"{line[prefix + metric.name]:.{metric.bar[1]}f}" for metric in BAR
            if line.get(prefix + metric.name) is not None}


def closing_note(line: dict) -> str:
    """The last train line as the closing log line shows it (': loss 0.6931, rewards/accuracies 0.50'), or ''."""
    shown = [f"{metric.name} {line[metric.name]:.{metric.bar[1]}f}" for metric in BAR
             if line.get(metric.name) is not None]
    return ": " + ", ".join(shown) if line.get(LOSS.name) is not None else ""
