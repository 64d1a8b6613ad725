"""Evaluation inside a training run: when to evaluate, the eval line, the samples, the best checkpoint.

    lowmem-dpo train RECIPE.yaml eval_fraction=0.1     # evaluate on 10% of the prompts, held out

The loop (loop.py) calls these with its session (session.Session):
- `at_start`: a new run's step-0 samples (the policy is still the reference) and their repetition, the baseline of
  the collapse warning; with eval_on_start (`on_start`), `evaluate` at step 0 instead;
- `evaluate` at every `due` step: the objective's eval metrics over the eval items with no gradients (its own
  micro-batches and chunked path), the samples and their repetition, one metrics.jsonl line ("eval_" keys);
- `best_after` when a checkpoint is saved at an evaluated step: the best so far by metric_for_best_model, in
  transformers' TrainerState keys (best_metric, best_global_step; best_model_checkpoint, its folder, follows from
  the step: session.best_folder);
- `load_best` at the end with load_best_model_at_end.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from lowmem_dpo.config.schema import Config
from lowmem_dpo.model.logps import eval_mode
from lowmem_dpo.objectives.metrics import EVAL_SHOWN, SAMPLE_METRICS, eval_name
from lowmem_dpo.runtime import distributed, files, oom, sharding
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.training import answers, checkpoint, content, guards, policy, samples, step
from lowmem_dpo.training.session import Session
from lowmem_dpo.training.step import Sums, rows_of


def due(cfg: Config, step: int, steps: int) -> bool:
    """Whether the run evaluates after optimizer step `step` of `steps`: every eval_steps (null: at every
    checkpoint, save_steps) and at the last step, when there is eval data."""
    if not cfg.has_eval:
        return False
    every = cfg.eval_steps if cfg.eval_steps is not None else cfg.save_steps
    return step == steps or bool(every) and step % every == 0


def with_backoff(session: Session, attempt, size: int, what: str, every_rank: bool = False):
    """attempt(size), retried at half the size (down to 1) on out-of-memory (oom.halving_on_oom): the eval's
    micro-batches and the samples' batch can meet a fuller GPU than the training step did. every_rank: every
    process runs it, and all retry when one runs out (the eval); else rank 0 alone (the samples)."""
    said = oom.Said(
        retrying=lambda n: f"out of memory in {what} at step {session.progress.step}: retrying {n} at a time",
        exhausted=f"out of memory in {what} at step {session.progress.step}, one at a time; lower eval_max_pairs, "
                  "eval_generations or max_new_tokens (the last checkpoint is intact)",
        collective=sharding.oom_message("eval_max_pairs, eval_generations or max_new_tokens",
                                        session.run.resolved.shard_offload, "the last checkpoint is intact")
        if session.run.resolved.sharded else None)
    return oom.halving_on_oom(attempt, size, session.run.resolved.device, said,
                              any_rank=distributed.any_rank if every_rank else None)


def sample_items(items: list, n: int) -> list:
    """The first n eval items with distinct prompts (several pairs may share one)."""
    seen, out = set(), []
    for item in items:
        if len(out) < n and tuple(item.prompt_ids) not in seen:
            seen.add(tuple(item.prompt_ids))
            out.append(item)
    return out


SAMPLE_BATCH = 16  # the most sample answers generated at once (halved on out-of-memory)


def sample_metrics(session: Session, step: int) -> dict:
    """Greedy samples for the first eval_generations distinct eval prompts, appended to output_dir/samples.jsonl
    with `step`; one shown in the log. Returns their repetition, mean length, share of empty answers, ROUGE-L
    against the chosen completions (answers.generation_stats) and KL from the reference ({} without samples)."""
    run = session.run
    path = Path(run.cfg.output_dir) / checkpoint.SAMPLES
    items = answer_items(session, step, path)
    if not items:
        return {}

    placement = samples.Placement(run.resolved.device, run.resolved.dtype, synced=run.resolved.sharded)

    def write(n: int) -> list:
        return [w for i in range(0, len(items), n) for w in samples.generate(
            session.trainee.model, items[i:i + n], run.tokenizer, run.cfg.max_new_tokens, placement,
            shown=[run.prompts.get(item.row) for item in items[i:i + n]])]

    # At most SAMPLE_BATCH answers at a time: more samples judge the answers better, not at more memory
    written = with_backoff(session, write, min(len(items), SAMPLE_BATCH), "the samples")
    answer_ids = [w.ids for w in written]
    if run.resolved.sharded:  # rank 0's answers on every rank: the KL's forwards follow them (one per answer)
        answer_ids = distributed.broadcast(answer_ids)
    kl = samples.kl_to_reference(session.trainee.model, items, answer_ids, run.resolved.device,
                                 run.resolved.dtype) if run.adapter_off_is_start else None
    if not run.world.main:  # fsdp: every rank ran the same forwards (samples_on_rank); rank 0 judges and writes
        return {}
    scores = {"rouge_l": [answers.rouge_l(w.ids, w.chosen_ids) for w in written],
              "repetition": [answers.repetition([w.ids]) for w in written], "tokens": [len(w.ids) for w in written],
              "content": content.content_scores([w.ids for w in written], [w.chosen_ids for w in written],
                                                [item.prompt_ids for item in items])}
    # step 0's answers to the same prompts, each score by prompt
    base = samples.scores_at(path, 0, scores) if step > 0 else dict.fromkeys(scores, {})
    samples.append(path, step, written, scores)
    log(samples.log_line(step, written[0]))
    stats = answers.generation_stats([w.ids for w in written], [w.chosen_ids for w in written], scores["rouge_l"])
    stats[answers.GEN_ANSWERS] = len(written)
    if step > 0:  # each answer against its own at step 0 (those it has)
        stats[answers.GEN_COLLAPSED], stats[answers.GEN_ANSWERS] = answers.collapsed_answers(
            [w.ids for w in written], [base["repetition"].get(w.prompt) for w in written],
            [base["tokens"].get(w.prompt) for w in written])
    base, base_content = base["rouge_l"], base["content"]
    se = answers.change_se([(score, base[w.prompt]) for score, w in zip(scores["rouge_l"], written) if w.prompt in base])
    if se is not None:
        stats[answers.GEN_ROUGE_L_SE] = round(se, 6)
    # what the answers hold beyond the chosen answers' shared phrasing (content.py), and its change's noise
    stats[answers.GEN_CONTENT] = round(sum(scores["content"]) / len(written), 6)
    se = answers.change_se([(score, base_content[w.prompt]) for score, w in zip(scores["content"], written)
                           if w.prompt in base_content])
    if se is not None:
        stats[answers.GEN_CONTENT_SE] = round(se, 6)
    if run.adapter_off_is_start:  # the reference is the model with its adapter disabled
        stats[answers.GEN_KL] = None if kl is None else round(kl, 6)
    return stats


def answer_items(session: Session, step: int, path: Path) -> list:
    """The eval items whose prompts an eval at `step` answers: the first eval_generations distinct ones; after step
    0, those step 0 answered (`path`: samples.jsonl), each judged against its own answer there (a resumed run given
    more steps would ask for more with eval_generations null: they would have no baseline)."""
    run = session.run
    pool = run.objective.samples_from(run.eval_items)  # KTO: the desirable rows
    items = sample_items(pool, policy.generations(run.cfg, run.steps))
    answered = set(samples.scores_at(path, 0, ["completion"])["completion"]) if step > 0 and run.world.main else None
    answered = distributed.broadcast(answered) if run.resolved.sharded else answered
    if answered:
        items = [item for item in items if run.prompts.get(item.row) in answered] or items
    return items


def samples_on_rank(session: Session) -> bool:
    """Whether this process writes the samples: rank 0; with the base sharded (fsdp) every rank, since each
    forward needs all of them (rank 0 alone keeps what they wrote)."""
    return session.run.world.main or session.run.resolved.sharded


def at_start(session: Session) -> dict | None:
    """A new run's step-0 line: the reference's samples and their repetition (None when there are no samples).
    A resumed run's samples.jsonl is its checkpoint's (a killed run's later samples, or those of a start-over
    killed before its first checkpoint, are dropped)."""
    path = Path(session.run.cfg.output_dir) / checkpoint.SAMPLES
    saved = None if session.progress.resumed_from is None else Path(session.progress.resumed_from) / checkpoint.SAMPLES
    if session.run.world.main and saved is not None and saved.is_file():
        files.atomic_write_bytes(path, saved.read_bytes())
    elif session.run.world.main:  # a new run; or a checkpoint from before samples were kept in it
        samples.keep_until(path, session.progress.step if session.progress.resumed_from is not None else -1)
    cfg = session.run.cfg
    if (session.progress.step > 0 or not session.run.eval_items or not policy.generations(cfg, session.run.steps)
            or cfg.eval_on_start):
        return None  # eval_on_start: the samples come with the step-0 eval (loop.steps)
    return {"step": 0, **sample_metrics(session, 0)}


def on_start(session: Session) -> bool:
    """Whether a new run evaluates before its first step (eval_on_start, with eval data)."""
    return session.run.cfg.eval_on_start and session.progress.step == 0 and bool(session.run.eval_items)


def evaluate(session: Session) -> tuple[dict, list[str]]:
    """The eval line of step session.progress.step: the objective's metrics over the eval items (at most
    eval_max_pairs; each rank its share, the sums added up), no gradients, in eval mode, by the training micro-batch
    (halved on out-of-memory); the samples' repetition and length (rank 0's: {} on the others); the time it took.
    And the objective's warning signs on those sums (held out: the same on every rank)."""
    t0 = time.perf_counter()
    with eval_mode(session.trainee.model):
        local = with_backoff(session, lambda n: step.accumulate(session, session.run.eval_items, n, grad=False),
                             session.progress.micro_batch, "the eval", True)
        summed = distributed.sum_stats(local)
        metrics = {eval_name(k): v for k, v in summed.means().items()}  # TRL's names: eval_loss, eval_rewards/...
        gen = sample_metrics(session, session.progress.step) if samples_on_rank(session) else {}
    line = {"step": session.progress.step, **{k: None if v is None or not math.isfinite(v) else round(v, 6)
                               for k, v in metrics.items()}, **gen,
            "eval_runtime": round(time.perf_counter() - t0, 3), "eval_pairs": rows_of(session.run.eval_items)}
    return line, signs_of(session, summed, held_out=True)


def signs_of(session: Session, sums: Sums, held_out: bool = False) -> list[str]:
    """The objective's warning signs in a window's sums (held_out: an eval's): pairs' (guards.py); [] for others."""
    return session.run.objective.signs(sums, session.progress.step, session.run.steps, held_out)


def baseline(metrics_lines: list[str]) -> dict | None:
    """The step-0 line (the reference's samples) from the run's metrics lines, if it was measured."""
    for text in metrics_lines:
        line = json.loads(text)
        if line.get("step") == 0 and line.get(answers.GEN_REPETITION) is not None:
            return line
    return None


def collapse_sign(metrics_lines: list[str], line: dict) -> str | None:
    """answers.collapse_sign of this eval's samples against step 0's in the run's metrics lines (none at step 0
    itself: eval_on_start)."""
    if line.get(answers.GEN_REPETITION) is None or line["step"] == 0:
        return None
    return answers.collapse_sign(baseline(metrics_lines), line)


# The eval's log line: the summary's metrics (each row's label), the samples' measures apart, as "answers"
SAMPLE_KEYS = {metric.eval for metric in SAMPLE_METRICS}


def log_line(metrics_lines: list[str], line: dict, cost: str = "") -> str:
    """`eval at step 80: loss 0.1655, accuracy 1, margin 2.712; answers: repetition 0, ROUGE-L 0.657 (0.714 at step
    0, ±0.057), KL 0.38, length 7`: what the eval measured (objectives.metrics.EVAL_SHOWN), the context beside the
    warnings (guards.py), with step 0's ROUGE-L and the noise of its change; then `cost` (cost_note)."""
    base, se = baseline(metrics_lines) or {}, line.get(answers.GEN_ROUGE_L_SE)
    preference, said = [], []
    for key, label in EVAL_SHOWN:
        if line.get(key) is None:
            continue
        text = f"{label} {line[key]:.4g}"
        if key == answers.GEN_ROUGE_L:
            then = ([f"{base[key]:.4g} at step 0"] if base.get(key) is not None else []) + (
                [f"±{se:.3f}"] if se is not None else [])
            text += f" ({', '.join(then)})" if then else ""
        (said if key in SAMPLE_KEYS else preference).append(text)
    parts = [", ".join(preference)] + (["answers: " + ", ".join(said)] if said else [])
    return f"eval at step {line['step']}: " + "; ".join(p for p in parts if p) + cost


def cost_note(session: Session, line: dict) -> str:
    """What an eval cost and the keys that set it: '; 12.3 s for 40 pairs and 8 answers of up to 64 tokens
    (eval_max_pairs, eval_generations, max_new_tokens)'."""
    run = session.run
    pool = run.objective.samples_from(run.eval_items)
    answered = len(sample_items(pool, policy.generations(run.cfg, run.steps)))
    what = f"{line['eval_pairs']} {run.objective.unit}s" + (
        f" and {answered} answers of up to {run.cfg.max_new_tokens} tokens" if answered else "")
    return f"; {line['eval_runtime']:.1f} s for {what} (eval_max_pairs, eval_generations, max_new_tokens)"


def better(value: float, best: float | None, greater: bool) -> bool:
    """Whether `value` beats the best so far (None: nothing yet); a non-finite value never does."""
    if not math.isfinite(value):
        return False
    return best is None or (value > best if greater else value < best)


def best_after(best: dict, step: int, cfg: Config, line: dict | None, metrics_lines: list[str] = ()) -> dict:
    """The best so far once step `step`'s checkpoint is saved (session.BEST_KEYS): this step when its
    metric_for_best_model (in `line`, its eval line; None: not evaluated) beats `best` and no sign of damage fired
    since the eval before (guards.damage_since, in `metrics_lines`, the run's so far: a damaged checkpoint is never
    the best, whatever its metric), else `best`."""
    if line is None or line.get("step") != step:
        return best
    value = line.get(cfg.best_metric_name)
    if value is None or not better(value, best["best_metric"], cfg.best_is_greater):
        return best
    warned = guards.damage_since([x for x in map(json.loads, metrics_lines) if isinstance(x.get("step"), int)], step)
    if warned:
        log(f"note: step {step}'s {cfg.best_metric_name} {value:.4f} would be the best so far, but it warned "
            f"({'; '.join(warned)}): not kept as the best")
        return best
    return {"best_metric": value, "best_global_step": step}


def load_best(session: Session) -> None:
    """load_best_model_at_end: the best checkpoint's adapter weights into the model, so the final adapter is
    the best one; logged with both values. Nothing to do when the last step is the best."""
    step, name = session.progress.best["best_global_step"], session.run.cfg.best_metric_name
    if step is None:
        warned = guards.warnings_summary(list(map(json.loads, session.progress.metrics_lines)))
        why = f"no checkpoint {'without a warning sign ' if warned else ''}has a finite {name}"
        log(f"warning: load_best_model_at_end: none is kept as the best ({why}); the final adapter is the last "
            "step's" + (", which warned too" if warned else ""))
        return
    if step == session.progress.step:
        log(f"the last step is the best ({name} {session.progress.best['best_metric']:.4f}): the final adapter is "
            "its own")
        return
    folder = checkpoint.folder(session.run.cfg.output_dir, step)  # by its step: where output_dir is now
    if not (folder / "adapter_model.safetensors").is_file():
        raise UserError(f"load_best_model_at_end: the best checkpoint {folder} (step {step}) is gone; the last "
                        f"step's adapter is in {checkpoint.complete(session.run.cfg.output_dir)[-1][1]}. Set "
                        "load_best_model_at_end=false to save it as the final adapter")
    checkpoint.load_adapter(folder, session.trainee)  # the compute copies too: a caller may run the model
    best = session.progress.best["best_metric"]
    log(f"load_best_model_at_end: the final adapter is step {step}'s ({name} {best:.4f}, from {folder})")
