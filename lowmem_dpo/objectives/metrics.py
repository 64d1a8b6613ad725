"""Every metric a run logs, one row each: its metrics.jsonl name (TRL's), whether larger is better (for
metric_for_best_model), where it is logged, and the report panel that draws it. train's step statistics, eval,
config's metric_for_best_model check and report's panels read these rows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # a train line's key; an eval line has eval_NAME
    greater_is_better: bool | None  # None: not a metric_for_best_model
    kind: str  # pair: a mean over a step's pairs (train.StepStats); step: the optimizer step's; sample: eval's
    # samples; term: a mean over the pairs, logged by the objectives that name it in logged_by; nll: logged when
    # the loss has the chosen tokens' NLL (objectives.nll_weight)
    panel: str | None = None  # the report's panel title; None: not drawn
    label: str | None = None  # the report's summary label; None: not in the summary
    doc: str = ""
    logged_by: tuple[str, ...] = ()  # kind term: the objectives (loss_type names) whose runs log it
    unpaired: bool = True  # an unpaired run (KTO) logs it too (its rows have no pair to be accurate about)


METRICS = (
    Metric("loss", False, "pair", "loss", "loss", "the objective's loss, its terms weighted and summed"),
    Metric("rewards/chosen", True, "pair", doc="beta * the chosen completion's log-ratio to the reference"),
    Metric("rewards/rejected", False, "pair", doc="beta * the rejected completion's log-ratio"),
    Metric("rewards/accuracies", True, "pair", "rewards/accuracies", "accuracy",
           "the share of pairs whose chosen reward is above the rejected one", unpaired=False),
    Metric("rewards/margins", True, "pair", "rewards/margins", "margin", "chosen minus rejected reward"),
    Metric("logps/chosen", True, "pair", doc="the policy's log-prob sum of the chosen completion"),
    Metric("logps/rejected", False, "pair", doc="the policy's log-prob sum of the rejected completion"),
    Metric("nll_loss", False, "nll", doc="the chosen tokens' mean NLL, which the loss adds with its weight (the "
           "sft term, ORPO's own): logged when the loss has it"),
    Metric("log_odds_ratio", True, "term", doc="ORPO: the mean log s(log odds ratio), the term beta scales",
           logged_by=("orpo",)),
    Metric("log_odds_chosen", True, "term", doc="ORPO: the mean log odds ratio of chosen over rejected",
           logged_by=("orpo",)),
    Metric("kl", None, "term", "kl (KTO's z0)", doc="KTO: its reference point z0, the policy's KL estimate from the reference "
           "on the mismatched pairs (TRL's kl)", logged_by=("kto",)),
    Metric("grad_norm", None, "step", "grad_norm", doc="the gradients' norm before clipping"),
    Metric("learning_rate", None, "step", "learning_rate", doc="the rate the step applied"),
    Metric("gen/repetition", False, "sample", "eval_gen/repetition", "repetition",
           "seq-rep-4 of the sample generations (guards.repetition)"),
    Metric("gen/rouge_l", True, "sample", "eval_gen/rouge_l", "ROUGE-L",
           "token ROUGE-L F1 of the samples against their held-out chosen completions (guards.rouge_l)"),
    Metric("gen/rouge_l_se", None, "sample", doc="the standard error of eval_gen/rouge_l's change from step 0, over "
           "the same prompts' answers (guards.change_se): the answers' drift sign's noise"),
    Metric("gen/kl", False, "sample", "eval_gen/kl", "KL",
           "per-token KL of the policy from the reference along its own samples (samples.kl_to_reference)"),
    Metric("gen/length", None, "sample", label="length", doc="the samples' mean length in tokens"),
    Metric("gen/chosen_length", None, "sample", doc="the sampled prompts' chosen completions' mean length"),
    Metric("gen/empty", False, "sample", label="empty", doc="the share of samples that end at once"),
)
PAIR_METRICS = tuple(m.name for m in METRICS if m.kind == "pair")  # train.StepStats sums these


def eval_name(name: str) -> str:
    return f"eval_{name}"


def term_metric_names(loss_types) -> tuple[str, ...]:
    """The metrics of kind term that a run of `loss_types` logs (its objectives' own)."""
    return tuple(m.name for m in METRICS if m.kind == "term" and set(m.logged_by) & set(loss_types))


def logged(name: str, loss_types, nll: bool, unpaired: bool = False) -> bool:
    """Whether a run of `loss_types` logs metric `name` (nll: its loss has an NLL term, objectives.nll_weight;
    unpaired: it trains on unpaired rows, KTO)."""
    m = next(m for m in METRICS if m.name == name)
    if unpaired and not m.unpaired:
        return False
    return name in term_metric_names(loss_types) if m.kind == "term" else nll if m.kind == "nll" else True


def train_key(m: Metric) -> str | None:
    return None if m.kind == "sample" else m.name


# metric_for_best_model: an eval metric with a direction, by its eval name
EVAL_METRICS = {eval_name(m.name): m.greater_is_better for m in METRICS
                if m.greater_is_better is not None and m.kind != "step"}
# the report's panels: (title, train key or None, eval key or None)
PANELS = tuple((m.panel, train_key(m), None if m.kind == "step" else eval_name(m.name)) for m in METRICS if m.panel)
TRAIN_SHOWN = tuple((m.name, m.label) for m in METRICS if m.label and m.kind == "pair")
EVAL_SHOWN = tuple((eval_name(m.name), m.label) for m in METRICS if m.label)
