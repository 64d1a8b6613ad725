"""Evaluation in a run: the eval numbers against a recomputation with the model's own forward, the best checkpoint
through pruning, load_best_model_at_end and an interrupted run, samples, and the collapse warning."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_DATA, TINY_RECIPE, forward_sequences, write_jsonl
from safetensors.torch import load_file

from lowmem_dpo import data, precompute, sft, train
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import answers, checkpoint, evaluation, loop


def lines(path):
    return [json.loads(line) for line in open(path)]


def eval_lines(out_dir):
    return [m for m in lines(out_dir / "metrics.jsonl") if "eval_pairs" in m]


def own_logps(model, prompt_ids, completion_ids) -> float:
    """A completion's log-prob sum from a plain forward of one unpadded sequence (no lowmem_dpo.model.logps)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, V)
    n = len(completion_ids)
    return logp[-n:].gather(-1, ids[0, -n:, None]).sum().item()


def policy(tiny_path, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


@pytest.fixture(scope="module")
def split_files(tmp_path_factory):
    """The shipped rows cut in two files: 344 to train on, 40 held out."""
    rows = [json.loads(line) for line in open(TINY_DATA)]
    d = tmp_path_factory.mktemp("split")
    return write_jsonl(d / "train.jsonl", rows[:344]), write_jsonl(d / "eval.jsonl", rows[344:])


def test_short_runs_log_often_and_answer_fewer_prompts():
    """logging_steps and eval_generations null scale with the run: about 20 lines (every 1 to 10 steps), and 8
    answers per 25 steps (8 to 32); a recipe's own values stand."""
    from lowmem_dpo.training import policy

    cfg = load_config(TINY_RECIPE, ["logging_steps=null", "eval_generations=null"])
    assert [policy.logging_every(cfg, n) for n in (16, 20, 21, 100, 1000)] == [1, 1, 2, 5, 10]
    assert [policy.generations(cfg, n) for n in (1, 16, 25, 26, 60, 100, 1000)] == [8, 8, 8, 16, 24, 32, 32]
    own = load_config(TINY_RECIPE, ["logging_steps=7", "eval_generations=0"])
    assert (policy.logging_every(own, 16), policy.generations(own, 1000)) == (7, 0)


def test_the_best_so_far_moves_only_to_a_better_evaluated_step():
    """evaluation.best_after, at a checkpoint: the step becomes the best only when it was evaluated at that step
    and its metric beats the best in the metric's direction (eval_loss: lower; eval_rewards/accuracies: higher);
    a tie or a non-finite value keeps the earlier best, and so does a step where a warning sign fired."""
    loss = load_config(TINY_RECIPE, [])
    assert (loss.best_metric_name, loss.best_is_greater) == ("eval_loss", False)
    accuracy = load_config(TINY_RECIPE, ["metric_for_best_model=rewards/accuracies"])
    assert (accuracy.best_metric_name, accuracy.best_is_greater) == ("eval_rewards/accuracies", True)
    none = {"best_metric": None, "best_global_step": None}
    at_20 = {"best_metric": 0.5, "best_global_step": 20}
    line = {"step": 40, "eval_loss": 0.4, "eval_rewards/accuracies": 0.4}
    assert evaluation.best_after(none, 40, loss, line) == {"best_metric": 0.4, "best_global_step": 40}
    assert evaluation.best_after(at_20, 40, loss, line) == {"best_metric": 0.4, "best_global_step": 40}
    assert evaluation.best_after(at_20, 40, accuracy, line) is at_20  # 0.4 < 0.5 where higher is better
    assert evaluation.best_after(at_20, 40, loss, {**line, "eval_loss": 0.5}) is at_20  # a tie: the earlier
    assert evaluation.best_after(at_20, 40, loss, {**line, "eval_loss": math.nan}) is at_20
    assert evaluation.best_after(none, 40, loss, {**line, "eval_loss": math.inf}) is none
    assert evaluation.best_after(at_20, 40, loss, None) is at_20  # step 40 was not evaluated
    assert evaluation.best_after(at_20, 60, loss, line) is at_20  # the line is another step's
    # a step whose eval, or whose train lines since the eval before, warned is never the best, however good its
    # metric; a warning before that eval, or step 1's cache drift (the start's offset), does not count
    warned = [json.dumps(x) for x in (
        {"step": 1, "warnings": ["reference cache off this policy's forward: 1.2e-02 nats per token ..."]},
        {"step": 20, "eval_loss": 0.5},
        {"step": 33, "warnings": ["likelihood displacement: chosen log-probs -0.61 nats/token ..."]},
        {"step": 40, "eval_loss": 0.4},
        {"step": 40, "warnings": ["generations collapsing into repetition: seq-rep-4 0.91 ..."]})]
    assert evaluation.best_after(at_20, 40, loss, line, warned[:4]) is at_20  # step 33's train line
    assert evaluation.best_after(at_20, 40, loss, line, warned[:2] + warned[3:]) is at_20  # its eval's
    assert evaluation.best_after(none, 60, loss, {**line, "step": 60}, warned) == {"best_metric": 0.4,
                                                                                    "best_global_step": 60}
    assert evaluation.best_after(none, 20, loss, {**line, "step": 20}, warned[:2])["best_global_step"] == 20


def test_dpo_eval_metrics_equal_a_recomputation(make_cfg, split_files, tiny_path, tokenizer):
    """eval_loss and TRL's eval_rewards/eval_logps at steps 2 and 4 equal those recomputed here from the saved
    adapters, the model's own forward per sequence and the reference with the adapter off."""
    train_file, eval_file = split_files
    cfg = make_cfg(dataset=str(train_file), eval_dataset=str(eval_file), max_steps=4, save_steps=2, beta=0.2,
                   eval_generations=2, max_new_tokens=8)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    out = Path(cfg.output_dir)
    got = eval_lines(out)
    assert [m["step"] for m in got] == [2, 4]
    pairs = data.tokenize_rows(data.load_rows(str(eval_file)), tokenizer, 64, None, progress=False).pairs
    assert all(m["eval_pairs"] == len(pairs) == 40 for m in got)
    for line, adapter_dir in zip(got, [out / "checkpoints" / "checkpoint-2", out]):
        model = policy(tiny_path, adapter_dir)
        logps = torch.tensor([[own_logps(model, p.prompt_ids, c) for c in (p.chosen_ids, p.rejected_ids)]
                              for p in pairs])  # (P, 2)
        with model.disable_adapter():
            ref = torch.tensor([[own_logps(model, p.prompt_ids, c) for c in (p.chosen_ids, p.rejected_ids)]
                                for p in pairs])  # (P, 2)
        rewards = cfg.beta * (logps - ref)  # (P, 2)
        margins = rewards[:, 0] - rewards[:, 1]
        want = {"eval_loss": -torch.nn.functional.logsigmoid(margins).mean(),
                "eval_rewards/chosen": rewards[:, 0].mean(), "eval_rewards/rejected": rewards[:, 1].mean(),
                "eval_rewards/accuracies": (margins > 0).float().mean(), "eval_rewards/margins": margins.mean(),
                "eval_logps/chosen": logps[:, 0].mean(), "eval_logps/rejected": logps[:, 1].mean()}
        for key, value in want.items():
            assert line[key] == pytest.approx(value.item(), abs=2e-5), (line["step"], key)
    assert got[0]["eval_loss"] != got[1]["eval_loss"]


def test_eval_on_start_evaluates_the_reference_at_step_0(make_cfg, split_files):
    """eval_on_start (transformers' name): one eval line at step 0, before any update, where the policy is the
    reference: eval_loss ln 2, zero rewards; its samples once (not also the plain step-0 samples)."""
    train_file, eval_file = split_files
    cfg = make_cfg(dataset=str(train_file), eval_dataset=str(eval_file), max_steps=2, save_steps=0,
                   eval_generations=3, max_new_tokens=8, eval_on_start=True)
    precompute.run(cfg, progress=False)
    train.run(cfg, progress=False)
    out = Path(cfg.output_dir)
    got = eval_lines(out)
    assert [m["step"] for m in got] == [0, 2]
    # each answer's ROUGE-L is in samples.jsonl; the line's mean is theirs, and the noise of its change from step 0
    # is the standard error of the same prompts' changes
    rows = lines(out / "samples.jsonl")
    at = {s: [r["rouge_l"] for r in rows if r["step"] == s] for s in (0, 2)}
    assert got[1]["eval_gen/rouge_l"] == pytest.approx(sum(at[2]) / 3, abs=1e-5)
    assert got[1]["eval_gen/rouge_l_se"] == pytest.approx(answers.change_se(list(zip(at[2], at[0]))), abs=1e-5)
    assert "eval_gen/rouge_l_se" not in got[0]
    assert got[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    # a completion that another row also holds is computed once, in that row's forward: float32 may round it an
    # ulp apart from this row's, which can tip the accuracy of the 6 of 40 eval pairs that hold one
    assert got[0]["eval_rewards/margins"] == pytest.approx(0, abs=1e-6) and got[0]["eval_rewards/accuracies"] <= 6 / 40
    assert got[0]["eval_gen/repetition"] is not None and got[1]["eval_loss"] != got[0]["eval_loss"]
    assert [r["step"] for r in rows] == [0, 0, 0, 2, 2, 2]


def test_sft_eval_loss_equals_a_recomputation(make_cfg, split_files, tiny_path, tokenizer):
    """SFT's eval_loss is the mean NLL per completion token of the held-out rows, under the final adapter."""
    train_file, eval_file = split_files
    cfg = make_cfg(dataset=str(train_file), eval_dataset=str(eval_file), max_steps=3, save_steps=0,
                   eval_generations=0)
    sft.run(cfg, progress=False)
    (line,) = eval_lines(Path(cfg.output_dir))
    items = data.tokenize_completions(data.load_rows(str(eval_file), required=("prompt",)), tokenizer, 64, None,
                                      progress=False).pairs
    model = policy(tiny_path, cfg.output_dir)
    nll = -sum(own_logps(model, i.prompt_ids, i.completion_ids) for i in items)
    assert line["step"] == 3 and line["eval_pairs"] == len(items)
    assert line["eval_loss"] == pytest.approx(nll / sum(len(i.completion_ids) for i in items), abs=2e-5)


def run_best(make_cfg, out, **overrides):
    cfg = make_cfg(eval_fraction=0.15, max_steps=8, save_steps=2, save_total_limit=1,
                   metric_for_best_model="eval_loss",  # the lowest held-out loss: an early step (it overfits)
                   load_best_model_at_end=True, eval_generations=2, max_new_tokens=8, output_dir=str(out),
                   **overrides)
    precompute.run(cfg, progress=False)
    return cfg, train.run(cfg, progress=False)


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s", "eval_runtime")} for r in rows]


def test_best_checkpoint_survives_pruning_loads_at_end_and_resumes(make_cfg, tmp_path, monkeypatch):
    """The best checkpoint by metric_for_best_model is recorded with transformers' keys, kept beside the newest
    one despite save_total_limit=1, becomes the final adapter with load_best_model_at_end; a run interrupted after
    checkpoint-4 (a KeyboardInterrupt at step 6's eval, as Ctrl-C) resumes to the same record, eval lines and
    samples as the uninterrupted run, repeating no eval."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_best(make_cfg, whole)
    evals = eval_lines(whole)
    assert [m["step"] for m in evals] == [2, 4, 6, 8]  # eval_steps null: at every checkpoint
    warned = {m["step"] for m in lines(whole / "metrics.jsonl") if "warnings" in m}  # never the best
    best = min((m for m in evals if m["step"] not in warned), key=lambda m: m["eval_loss"])
    assert best["step"] != 8  # the test needs a best that is not the last step
    state = json.loads((whole / "trainer_state.json").read_text())
    assert state["best_global_step"] == best["step"] and state["best_metric"] == best["eval_loss"]
    folder = whole / "checkpoints" / f"checkpoint-{best['step']}"
    assert state["best_model_checkpoint"] == str(folder) and state["global_step"] == 8
    assert state["log_history"] == lines(whole / "metrics.jsonl")
    assert sorted(s for s, _ in checkpoint.complete(whole)) == [best["step"], 8]
    final, kept = load_file(whole / "adapter_model.safetensors"), load_file(folder / "adapter_model.safetensors")
    last = load_file(whole / "checkpoints" / "checkpoint-8" / "adapter_model.safetensors")
    assert final.keys() == kept.keys() and all(torch.equal(final[k], kept[k]) for k in final)
    assert not all(torch.equal(final[k], last[k]) for k in final)

    real = evaluation.evaluate

    def interrupted(session):
        if session.progress.step == 6:
            raise KeyboardInterrupt  # a Ctrl-C during step 6's eval: checkpoint-4 is the newest
        return real(session)

    monkeypatch.setattr(evaluation, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_best(make_cfg, cut)
    monkeypatch.setattr(evaluation, "evaluate", real)
    assert [s for s, _ in checkpoint.complete(cut)][-1] == 4
    moved = cut.rename(tmp_path / "moved")  # the run folder moves before the rerun: the best is found by its step
    run_best(make_cfg, moved)
    assert without_timing(lines(moved / "metrics.jsonl")) == without_timing(lines(whole / "metrics.jsonl"))
    again = json.loads((moved / "trainer_state.json").read_text())
    assert (again["best_global_step"], again["best_metric"]) == (state["best_global_step"], state["best_metric"])
    assert again["best_model_checkpoint"] == str(moved / "checkpoints" / f"checkpoint-{best['step']}")
    assert sorted(s for s, _ in checkpoint.complete(moved)) == [best["step"], 8]
    assert lines(moved / "samples.jsonl") == lines(whole / "samples.jsonl")
    assert [r["step"] for r in lines(whole / "samples.jsonl")] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]
    final_moved = load_file(moved / "adapter_model.safetensors")
    assert all(torch.equal(final_moved[k], kept[k]) for k in final)


def test_a_start_over_killed_before_its_first_checkpoint_leaves_the_old_run_whole(make_cfg, tmp_path, monkeypatch):
    """resume=never empties samples.jsonl and metrics.jsonl at once, but the old run's checkpoints stay until the
    new run's first one: when it is interrupted before that, resume=auto continues the old run with its own
    samples and metrics (each checkpoint keeps a copy), and the closing metrics are its last training line."""
    out = tmp_path / "run"
    run_best(make_cfg, out)
    want_samples, want_metrics = lines(out / "samples.jsonl"), lines(out / "metrics.jsonl")
    real = evaluation.evaluate

    def interrupted(session):
        raise KeyboardInterrupt  # Ctrl-C at the new run's first eval (step 2), before its first checkpoint

    monkeypatch.setattr(evaluation, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_best(make_cfg, out, resume="never")
    assert [r["step"] for r in lines(out / "samples.jsonl")] == [0, 0]  # the new run's step-0 samples
    monkeypatch.setattr(evaluation, "evaluate", real)
    _, result = run_best(make_cfg, out)  # resume=auto: the old run's checkpoint-8, finished
    assert lines(out / "samples.jsonl") == want_samples and lines(out / "metrics.jsonl") == want_metrics
    assert result.metrics == [m for m in want_metrics if "loss" in m][-1]


def test_out_of_memory_in_the_eval_halves_its_batches(make_cfg, tmp_path, capsys):
    """CUDA out-of-memory cannot happen on this CPU: a forward pre-hook on the backbone raises
    torch.OutOfMemoryError for more than 2 sequences in eval mode (the eval and the samples, not training). The
    eval retries at 2 then 1 pair per forward, the samples 2 prompts at a time, and the numbers are the ones a run
    without the limit gets."""
    plain = make_cfg(eval_fraction=0.15, max_steps=2, save_steps=0, eval_generations=4, max_new_tokens=8,
                     output_dir=str(tmp_path / "plain"), share_prompt="false")  # the limit: 2 sequences per pair
    precompute.run(plain, progress=False)
    train.run(plain, progress=False)
    limited = make_cfg(**{**{k: getattr(plain, k) for k in ("eval_fraction", "max_steps", "save_steps",
                                                            "eval_generations", "max_new_tokens", "share_prompt")},
                          "output_dir": str(tmp_path / "limited")})
    session = train.setup(limited, progress=False)

    def too_big(module, args, kwargs):
        if not module.training and forward_sequences(kwargs) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    session.trainee.model.get_base_model().model.register_forward_pre_hook(too_big, with_kwargs=True)
    loop.run(session, progress=False)
    err = capsys.readouterr().err
    assert "out of memory in the eval at step 2: retrying 2 at a time" in err
    assert "out of memory in the eval at step 2: retrying 1 at a time" in err
    assert "out of memory in the samples at step 0: retrying 2 at a time" in err
    (want,), (got,) = eval_lines(tmp_path / "plain"), eval_lines(tmp_path / "limited")
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_gen/repetition"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    assert lines(tmp_path / "limited" / "samples.jsonl") == lines(tmp_path / "plain" / "samples.jsonl")


def test_resume_names_a_checkpoint_not_the_output_dir(make_cfg, tmp_path, capsys):
    """output_dir has a trainer_state.json too (the run's record): resume=OUTPUT_DIR says to pass a checkpoint."""
    from lowmem_dpo.config.cli import run_cli

    out = tmp_path / "run"
    run_best(make_cfg, out)
    args = [str(TINY_RECIPE), f"dataset={TINY_DATA}", f"output_dir={out}",
            f"ref_cache_dir={tmp_path / 'cache'}", f"resume={out}"]
    assert run_cli(train.main, args, "train", "") == 2
    err = capsys.readouterr().err
    assert "is a run's output_dir, not a checkpoint" in err and "Traceback" not in err


def test_collapse_is_flagged_and_a_healthy_run_is_not(tmp_path, capsys):
    """A tiny model pushed into collapse (learning rate 0.1, constant, 100 steps) writes one word over and over:
    its eval_gen/repetition rises far above step 0's and the warning shows; with early_stop_on_divergence the
    run stops with the sign. The demo recipe (which evaluates on a held-out split) shows no such warning."""
    def cfg_for(name, *overrides):
        return load_config(TINY_RECIPE, [
            f"dataset={TINY_DATA}", f"output_dir={tmp_path / name}", f"ref_cache_dir={tmp_path / 'cache'}",
            "eval_fraction=0.15", *overrides])

    healthy = cfg_for("healthy")
    precompute.run(healthy, progress=False)
    last = train.run(healthy, progress=False).metrics
    log = capsys.readouterr().err
    assert "collapsing" not in log and last["rewards/accuracies"] >= 0.9
    # the resolved choices: one line in the log, their reasons in config.yaml
    (resolved,) = [x for x in log.splitlines() if x.startswith("resolved")]
    reasons = (tmp_path / "healthy" / "config.yaml").read_text().count("\n# resolved ")
    assert re.fullmatch(rf"resolved: cpu in float32, micro-batch \d+, gradient checkpointing (on|off), optimizer "
                        rf"\S+; the {reasons} reasons are in {tmp_path / 'healthy' / 'config.yaml'} \(# resolved\)",
                        resolved) and reasons > 5, resolved
    healthy_evals = eval_lines(tmp_path / "healthy")
    assert healthy_evals[-1]["eval_rewards/accuracies"] >= 0.9

    collapse = ["learning_rate=1e-1", "lr_scheduler_type=constant", "max_steps=100", "eval_steps=50",
                "save_steps=50", "load_best_model_at_end=true"]
    train.run(cfg_for("collapse", *collapse), progress=False)
    log = capsys.readouterr().err
    assert "generations collapsing into repetition" in log
    # a damaged checkpoint is never the best, and the run's last line says it warned, naming the signs
    warned = {m["step"] for m in lines(tmp_path / "collapse" / "metrics.jsonl") if "warnings" in m}
    best = json.loads((tmp_path / "collapse" / "trainer_state.json").read_text())["best_global_step"]
    assert {50, 100} <= warned and best is None, (warned, best)
    assert "load_best_model_at_end: none is kept as the best (no checkpoint without a warning sign" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("warning: this run ended with warning signs") and "collapsing into repetition at step" \
        in last, last
    # each eval says what it cost and which keys set that (eval_generations null: 32 for 100 steps, capped by the
    # distinct held-out prompts)
    assert re.search(r"eval at step 50: .*; \d+\.\d s for \d+ pairs and \d+ answers of up to 64 tokens \(eval_max_pairs, "
                     r"eval_generations, max_new_tokens\)", log)
    # and before step 1, the rate itself: 200 times the top of what LoRA recipes use
    assert "warning: learning_rate=0.1 is far above what LoRA recipes use (5e-5 to 5e-4)" in log
    evals = lines(tmp_path / "collapse" / "metrics.jsonl")
    base = next(m["eval_gen/repetition"] for m in evals if m["step"] == 0)
    final = [m for m in evals if m["step"] == 100 and "eval_gen/repetition" in m][0]["eval_gen/repetition"]
    assert final > base + 0.3 and not math.isnan(final)
    # Evaluated at step 4, the samples show the collapse before the training metrics' signs (first logged at 10):
    # repetition, or the drift from the chosen answers that comes with it (which one first depends on the
    # matmuls' thread count at this learning rate)
    with pytest.raises(UserError, match="stopped at step 4 .*(collapsing into repetition|answers drifting)"):
        train.run(cfg_for("stopped", *collapse[:3], "eval_steps=4", "save_steps=0", "load_best_model_at_end=false",
                          "early_stop_on_divergence=true"), progress=False)


def test_metric_for_best_model_must_be_one_the_stage_logs(make_cfg, split_files, capsys):
    """An SFT run logs no rewards: a DPO metric for the best checkpoint is refused before anything loads (exit 2),
    as is the samples' repetition without samples; never a best that silently never comes."""
    from lowmem_dpo.config.cli import run_cli
    from lowmem_dpo.runtime.errors import ConfigError

    train_file, eval_file = split_files
    args = [f"dataset={train_file}", f"eval_dataset={eval_file}", "metric_for_best_model=rewards/accuracies",
            "device=cpu", "max_steps=2"]
    assert run_cli(sft.main, ["lowmem_dpo:tiny-sft", *args], "sft", "") == 2
    err = capsys.readouterr().err
    assert "metric_for_best_model=rewards/accuracies is a DPO metric" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="eval_generations"):
        make_cfg(eval_fraction=0.1, metric_for_best_model="eval_gen/repetition", eval_generations=0)


def test_report_draws_a_real_run(make_cfg, tmp_path, capsys):
    """The report on a real DPO run with eval: the picture and the best step as trainer_state.json says; with
    report_to=tensorboard the run's eval_loss lines are TensorBoard's eval/loss scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lowmem_dpo import report

    out = tmp_path / "run"
    run_best(make_cfg, out, report_to="tensorboard")
    events = EventAccumulator(str(out / "runs"), size_guidance={"scalars": 0})
    events.Reload()
    got, want = events.Scalars("eval/loss"), eval_lines(out)
    assert [e.step for e in got] == [m["step"] for m in want]
    assert [e.value for e in got] == pytest.approx([m["eval_loss"] for m in want], rel=1e-6)  # stored as float32
    capsys.readouterr()
    assert report.main([str(out)]) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    text = capsys.readouterr().out
    assert f"at step {state['best_global_step']}" in text
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_eval_log_line_shows_the_context_and_the_answers_beside_step_0():
    """KL, margins and accuracy never warn alone: the log's eval line shows them, with the answers' measures beside
    step 0's and the noise of ROUGE-L's change."""
    base = json.dumps({"step": 0, answers.GEN_ROUGE_L: 0.714, answers.GEN_REPETITION: 0.0})
    line = {"step": 80, "eval_loss": 0.1655, "eval_rewards/accuracies": 1.0, "eval_rewards/margins": 2.712,
            answers.GEN_ROUGE_L: 0.657, answers.GEN_ROUGE_L_SE: 0.057, answers.GEN_KL: 0.38, answers.GEN_LENGTH: 7.0,
            answers.GEN_CHOSEN_LENGTH: 7.0, answers.GEN_REPETITION: 0.0}
    assert evaluation.log_line([base], line) == (
        "eval at step 80: loss 0.1655, accuracy 1, margin 2.712; answers: repetition 0, ROUGE-L 0.657 (0.714 at step "
        "0, ±0.057), KL 0.38, length 7")
    assert evaluation.log_line([], {"step": 3, "eval_loss": 1.23}) == "eval at step 3: loss 1.23"  # no samples


def test_the_repeated_warnings_say_which_step_the_adapter_is(tmp_path):
    """chat and export repeat a run's warning signs (provenance.run_warnings); where the final adapter is the best
    checkpoint (load_best_model_at_end), chosen with no sign of damage, they say which step it is."""
    import yaml

    from lowmem_dpo.training import provenance

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (
        {"step": 4, "eval_loss": 0.5}, {"step": 6, "warnings": ["likelihood displacement: chosen log-probs ..."]},
        {"step": 8, "eval_loss": 0.6})))
    (run / "config.yaml").write_text(yaml.safe_dump({"load_best_model_at_end": True}))
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 8, "best_global_step": 4}))
    said = provenance.run_warnings(run, "chat")
    assert said.startswith(f"warning: chat: the run that trained {run} logged warning signs, so the adapter may be "
                           "damaged: likelihood displacement at step 6; the adapter here is step 4's, the best")
    (run / "config.yaml").write_text(yaml.safe_dump({"load_best_model_at_end": False}))
    assert "the adapter here is" not in provenance.run_warnings(run, "chat")  # the last step's: no such note
