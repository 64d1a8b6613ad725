"""Stacked SFT -> DPO: the SFT stage, adapter detection, the SFT model as the reference, one adapter throughout."""

import json
import math
import shutil

import pytest
import torch
from conftest import TINY_DATA, cached, forward_sequences, stored_sides, write_jsonl
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from lowmem_dpo import data, precompute, sft, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import build_config
from lowmem_dpo.model import adapters
from lowmem_dpo.model.models import load_model, model_source
from lowmem_dpo.objectives.metrics import LOSS
from lowmem_dpo.runtime import devices
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import inputs, policy
from lowmem_dpo.training.checkpoint import read_state
from lowmem_dpo.training.step import accumulate, backward_with_backoff, next_items, pair_stream


@pytest.fixture(scope="module")
def rows64(tmp_path_factory):
    """The first 64 shipped preference rows: every stage in a few seconds."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "rows64.jsonl",
                       data.load_rows(str(TINY_DATA)).select(range(64)).to_list())


def tiny_cfg(tmp, **overrides):
    values = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA), output_dir=str(tmp / "out"),
                  ref_cache_dir=str(tmp / "cache"), device="cpu", dtype="float32", max_length=64,
                  per_device_train_batch_size=8, precompute_batch_size=32, max_steps=2, logging_steps=1,
                  learning_rate=1e-2, seed=0)
    values.update(overrides)
    return build_config(values)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, lowmem_home, rows64):
    """Stage A: a LoRA adapter fine-tuned for a few steps on prompt/chosen of preference rows."""
    out = tmp_path_factory.mktemp("sft") / "adapter"
    sft.run(tiny_cfg(out.parent, dataset=str(rows64), output_dir=str(out), max_steps=6, lora_r=4, lora_alpha=8),
            progress=False)
    return out


def lines(path):
    return [json.loads(line) for line in open(path)]


def logps_by_hand(model, pairs):
    """(chosen, rejected) completion log-prob sums from a plain forward per sequence (no padding, no batching, no
    lowmem_dpo.model.logps): log_softmax of the logits at the positions before each completion token."""
    out = []
    for p in pairs:
        sums = []
        for completion in (p.chosen_ids, p.rejected_ids):
            ids = torch.tensor([p.prompt_ids + completion])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, V)
            n = len(completion)
            sums.append(logp[-n:].gather(-1, ids[0, -n:, None]).sum().item())
        out.append(sums)
    return torch.tensor(out)  # (rows, 2)


def test_sft_writes_a_peft_adapter_and_its_loss_is_completion_only(sft_dir, tiny_path, tokenizer, rows64):
    config = json.loads((sft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert config["base_model_name_or_path"] == "lowmem_dpo:tiny-llama"
    assert {"config.yaml", "metrics.jsonl", "adapter_model.safetensors"} <= {p.name for p in sft_dir.iterdir()}
    m = lines(sft_dir / "metrics.jsonl")
    assert [x["step"] for x in m] == list(range(1, 7))
    assert m[-1]["loss"] < m[0]["loss"]
    # Step 1's loss is the base model's mean -log p over the completion tokens of the first micro-batch.
    cfg = tiny_cfg(sft_dir.parent)
    items = data.tokenize_completions(data.load_rows(str(rows64)), tokenizer, 64, None, progress=False).pairs
    first = next_items(pair_stream(items, cfg.seed), cfg.per_device_train_batch_size)
    base = load_model(tiny_path, torch.device("cpu"), torch.float32)
    pairs = [data.TokenizedPair(c.row, c.prompt_ids, c.completion_ids, c.completion_ids) for c in first]
    nll = -logps_by_hand(base, pairs)[:, 0].sum().item() / sum(len(c.completion_ids) for c in first)
    assert m[0]["loss"] == pytest.approx(nll, abs=1e-4)


def test_prompt_completion_rows_tokenize_as_the_chosen_of_preference_rows(tmp_path, tokenizer):
    rows = [{"prompt": "Write a positive review of the tea.\n", "chosen": "The tea is warm.", "rejected": "No."},
            {"prompt": "Write a negative review of the soup.\n", "chosen": "The soup is cold.</s>", "rejected": "x"}]
    prefs = write_jsonl(tmp_path / "prefs.jsonl", rows)
    sft_rows = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
    a, b = (data.tokenize_completions(data.load_rows(str(p), required=("prompt",)), tokenizer, 64, None,
                                      progress=False).pairs for p in (prefs, sft_rows))
    assert a == b
    assert tokenizer.decode(a[0].completion_ids) == "The tea is warm.</s>"  # EOS appended once, as TRL
    assert tokenizer.decode(a[1].completion_ids) == "The soup is cold.</s>"
    assert a[0].prompt_ids[0] == tokenizer.bos_token_id
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}],
                                                   "completion": [{"role": "assistant", "content": "hello"}]}])
    (c,) = data.tokenize_completions(data.load_rows(str(chat), required=("prompt",)), tokenizer, 64, None,
                                     progress=False).pairs
    assert tokenizer.decode(c.prompt_ids).endswith("<|assistant|>\n")
    assert tokenizer.decode(c.completion_ids) == "hello</s>\n"
    gap = write_jsonl(tmp_path / "gap.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
    tok = data.tokenize_completions(data.load_rows(str(gap), required=("prompt",)), tokenizer, 64, None,
                                    progress=False)
    assert [c.row for c in tok.pairs] == [0] and tok.skipped == {"empty_completion": [1]}
    with pytest.raises(UserError, match="row 1 at line 2: the prompt or the completion is empty.*strict=true"):
        data.tokenize_completions(data.load_rows(str(gap), required=("prompt",)), tokenizer, 64, None, spec=str(gap),
                                  progress=False, strict=True)
    with pytest.raises(UserError, match="no completion or chosen column"):
        data.tokenize_completions(data.load_rows(str(write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "y": "b"}])),
                                                 required=("prompt",)), tokenizer, 64, None, progress=False)


def test_stacked_dpo_reference_is_base_plus_sft_adapter_and_continues_it(sft_dir, tiny_path, tokenizer, tmp_path,
                                                                          capfd, rows64):
    from peft import PeftModel

    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), dataset=str(rows64), lora_r=16)  # lora_r conflicts: named, ignored
    precompute.run(cfg, progress=False)
    (side,) = stored_sides(tmp_path / "cache")
    assert side["adapter"] is not None
    ref = cached(cfg)[0]
    chosen, rejected = ref.chosen, ref.rejected

    # The cache equals base + SFT adapter loaded independently with peft, and not the base alone.
    sft_model = PeftModel.from_pretrained(load_model(tiny_path, torch.device("cpu"), torch.float32), str(sft_dir))
    pairs = data.tokenize_rows(data.load_rows(str(rows64)), tokenizer, 64, None, progress=False).pairs[:6]
    rows = [p.row for p in pairs]
    want = logps_by_hand(sft_model, pairs)
    assert torch.allclose(torch.stack([chosen[rows], rejected[rows]], 1), want.double(), atol=1e-4)
    with sft_model.disable_adapter():
        base_only = logps_by_hand(sft_model, pairs)
    assert (want - base_only).abs().max() > 0.05

    result = train.run(cfg, progress=False)
    err = capfd.readouterr().err
    assert "is a LoRA adapter" in err and "continuing" in err
    assert "lora_r=16 (adapter: 4)" in err
    m = lines(tmp_path / "out" / "metrics.jsonl")
    assert m[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert m[1]["loss"] != pytest.approx(math.log(2), abs=1e-4)
    before, after = load_file(sft_dir / "adapter_model.safetensors"), load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert all(before[k].shape == after[k].shape for k in before)
    assert any(not torch.allclose(before[k], after[k]) for k in before)
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["base_model_name_or_path"] == "lowmem_dpo:tiny-llama"
    assert list(result.model.peft_config) == ["default"]  # one adapter, never two


def test_continue_on_a_quantized_base_with_checkpointing(sft_dir, tmp_path, rows64):
    """QLoRA stage B: the SFT adapter continued on a 4-bit base with gradient checkpointing starts at ln 2 and
    every one of its weights gets a gradient (its B is not zero, so A's gradient is not zero either)."""
    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), dataset=str(rows64), quantization="4bit",
                   gradient_checkpointing="true", max_steps=1)
    precompute.run(cfg, progress=False)
    session = train.setup(cfg, progress=False)
    first = next_items(session.progress.stream, session.progress.micro_batch)
    stats = accumulate(session, first, len(first))
    assert stats.means()[LOSS.name] == pytest.approx(math.log(2), abs=2e-3)
    lora = {n: p for n, p in session.trainee.model.named_parameters() if p.requires_grad}
    assert len(lora) == 28 and all("lora_" in n for n in lora)  # 14 adapted layers x (A, B)
    assert [n for n, p in lora.items() if p.grad is None or not p.grad.abs().sum() > 0] == []


def test_adapter_content_is_in_the_fingerprint(sft_dir, tmp_path):
    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir))
    resolved = devices.resolve(cfg)
    fp = inputs.prepare(cfg, resolved).fingerprint
    same = inputs.prepare(tiny_cfg(tmp_path, model_name_or_path="lowmem_dpo:tiny-llama", sft_adapter=str(sft_dir),
                                   adapter_mode="new_on_merged"), resolved).fingerprint
    assert same == fp  # the same reference, however the adapter is named, in either adapter_mode
    other = tmp_path / "other"
    shutil.copytree(sft_dir, other)
    weights = load_file(other / "adapter_model.safetensors")
    weights = {k: v + 1e-3 for k, v in weights.items()}
    save_file(weights, other / "adapter_model.safetensors")
    changed = inputs.prepare(tiny_cfg(tmp_path, model_name_or_path=str(other)), resolved).fingerprint
    assert {k for k in fp if fp[k] != changed[k]} == {"adapter"}
    plain = inputs.prepare(tiny_cfg(tmp_path), resolved).fingerprint
    assert plain["adapter"] is None and plain["model"] == fp["model"]


def test_new_on_merged_trains_a_fresh_adapter_from_ln2_and_refuses_a_quantized_base(sft_dir, tmp_path, rows64):
    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), dataset=str(rows64), adapter_mode="new_on_merged",
                   lora_r=2, max_steps=1)
    precompute.run(cfg, progress=False)
    result = train.run(cfg, progress=False)
    assert result.metrics["loss"] == pytest.approx(math.log(2), abs=1e-4)
    weights = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert {v.shape[0] for k, v in weights.items() if "lora_A" in k} == {2}  # the recipe's lora_r, not the SFT's 4
    assert list(result.model.peft_config) == ["default"]
    quantized = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), adapter_mode="new_on_merged",
                         quantization="4bit")
    with pytest.raises(UserError, match="adapter_mode=continue.*or quantization=none"):
        train.setup(quantized, progress=False)


def test_an_adapter_on_a_model_that_carries_one_is_refused(sft_dir, tiny_path, tmp_path, capsys):
    # The recipe names two adapters: exit code 2, one line, before anything loads.
    code = run_cli(train.main, ["lowmem_dpo:tiny-cpu", f"model_name_or_path={sft_dir}", f"sft_adapter={sft_dir}",
                                f"dataset={TINY_DATA}"], "train", "")
    err = capsys.readouterr().err
    assert code == 2 and "keeps one adapter" in err and len(err.strip().splitlines()) == 1
    # A folder with full weights and an adapter_config.json (transformers would attach the adapter on load).
    both = tmp_path / "both"
    shutil.copytree(tiny_path, both)
    shutil.copy(sft_dir / "adapter_config.json", both)
    with pytest.raises(UserError, match="full model weights and an adapter_config.json"):
        model_source(str(both))
    # A loaded model that already carries an active adapter, and a request for a new or the SFT one.
    carrying = load_model(tiny_path, torch.device("cpu"), torch.float32)
    carrying.load_adapter(str(sft_dir))
    lora_layers = sum("lora_A" in n for n, _ in carrying.named_modules())
    cfg = tiny_cfg(tmp_path)
    with pytest.raises(UserError, match="already carries a LoRA adapter"):
        policy.new_adapter(cfg, carrying)
    with pytest.raises(UserError, match="already carries a LoRA adapter"):
        adapters.continue_adapter(carrying, cfg, model_source(str(sft_dir)))
    assert sum("lora_A" in n for n, _ in carrying.named_modules()) == lora_layers  # nothing stacked


def test_model_source_kinds(sft_dir, tiny_path, tmp_path):
    assert model_source("lowmem_dpo:tiny-llama").kind == "base"
    source = model_source(str(sft_dir))
    assert (source.kind, source.base_path, source.adapter_path) == ("adapter", tiny_path, sft_dir)
    source = model_source("lowmem_dpo:tiny-llama", str(sft_dir))
    assert (source.kind, source.adapter_path) == ("sft_adapter", sft_dir)
    merged = tmp_path / "merged"
    shutil.copytree(tiny_path, merged)
    (merged / "README.md").write_text("---\nbase_model: lowmem_dpo:tiny-llama\n---\n# merged\n")
    source = model_source(str(merged))
    assert (source.kind, source.adapter_path) == ("merged", None)
    assert "base_model lowmem_dpo:tiny-llama" in source.description
    with pytest.raises(UserError, match="not a PEFT adapter folder"):
        model_source("lowmem_dpo:tiny-llama", str(tmp_path))


def test_the_adapter_folder_supplies_planning_and_its_saved_tokenizer(sft_dir, tiny_path, tokenizer, tmp_path):
    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir))
    planned = adapters.planned_lora(cfg, model_source(str(sft_dir)))
    assert (planned.lora_r, planned.lora_target_modules) == (
        4, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    merged_mode = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), adapter_mode="new_on_merged")
    assert adapters.planned_lora(merged_mode, model_source(str(sft_dir))) is merged_mode  # a fresh adapter
    assert model_source(str(sft_dir)).tokenizer_path == sft_dir  # sft saves the tokenizer beside the adapter
    bare = tmp_path / "bare"  # an adapter folder without one (another trainer's): the base's
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(sft_dir / name, bare / name)
    assert model_source(str(bare)).tokenizer_path == tiny_path
    assert AutoTokenizer.from_pretrained(sft_dir)("a b").input_ids == tokenizer("a b").input_ids


def test_lora_conflicts_name_only_keys_the_user_set():
    adapter = {"r": 8, "lora_alpha": 16, "target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"]}
    linear = {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert adapters.lora_conflicts(build_config({"lora_r": 4}), adapter, linear) == {"lora_r": (4, 8)}
    assert adapters.lora_conflicts(build_config({}), adapter, linear) == {}  # defaults (lora_r 8) are not named
    assert adapters.lora_conflicts(build_config({"lora_target_modules": "v_proj,q_proj", "lora_alpha": 16}),
                                   adapter, linear) == {}
    got = adapters.lora_conflicts(build_config({"lora_target_modules": "all-linear"}), adapter, linear)
    assert got == {"lora_target_modules": ("all-linear", "q_proj,v_proj")}


def test_sft_resumes_from_its_checkpoint_to_the_same_adapter(tmp_path, rows64, capsys):
    """A crash between two checkpoints (its aftermath made by hand: the later checkpoint and the final adapter
    removed, the crashed run's extra metrics lines left): rerunning resumes from checkpoint-4 and ends with an
    uninterrupted run's adapter, bit for bit, and its metrics lines."""
    kw = dict(dataset=str(rows64), max_steps=8, save_steps=4, save_total_limit=0, lora_dropout=0.1)
    whole = tiny_cfg(tmp_path / "whole", **kw)
    sft.run(whole, progress=False)
    crashed = tiny_cfg(tmp_path / "crashed", **kw)
    sft.run(crashed, progress=False)
    out = tmp_path / "crashed" / "out"
    shutil.rmtree(out / "checkpoints" / "checkpoint-8")
    (out / "adapter_model.safetensors").unlink()
    capsys.readouterr()
    result = sft.run(crashed, progress=False)
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-4'} (step 4 of 8)" in capsys.readouterr().err
    assert result.metrics["step"] == 8
    want, got = load_file(str(tmp_path / "whole" / "out" / "adapter_model.safetensors")), load_file(
        str(out / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    timing = ("step_time_s", "tokens_per_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert [r["step"] for r in lines(out / "metrics.jsonl")] == list(range(1, 9))
    assert strip(lines(out / "metrics.jsonl")) == strip(lines(tmp_path / "whole" / "out" / "metrics.jsonl"))


def test_sft_out_of_memory_halves_the_micro_batch(tmp_path, rows64, capsys):
    """CUDA out-of-memory cannot happen on this CPU: a forward pre-hook on the backbone raises
    torch.OutOfMemoryError for batches above 4 rows. The step is retried as 2 x 4 with the gradient 1 x 8 gives."""
    cfg = tiny_cfg(tmp_path, dataset=str(rows64))
    grads = []
    for limit in (None, 4):
        session = sft.setup(cfg, progress=False)
        if limit is not None:
            def too_big(module, args, kwargs):
                if forward_sequences(kwargs) > limit:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            session.trainee.model.get_base_model().model.register_forward_pre_hook(too_big, with_kwargs=True)
        items = next_items(session.progress.stream, session.run.items_per_step)
        stats, micro_batch, grad_accum = backward_with_backoff(session, items)
        grads.append((micro_batch, grad_accum, stats.counts[LOSS.name], [p.grad.clone() for p in session.trainee.params]))
    (b1, a1, t1, g1), (b2, a2, t2, g2) = grads
    assert (b1, a1, b2, a2) == (8, 1, 4, 2) and t1 == t2 > 0
    assert "retrying with per_device_train_batch_size=4 gradient_accumulation_steps=2" in capsys.readouterr().err
    assert any(g.abs().sum() > 0 for g in g1)
    assert all(torch.allclose(x, y, atol=1e-7, rtol=1e-4) for x, y in zip(g1, g2))


def test_plan_cli_plans_with_the_continued_adapters_rank(tmp_path, sft_dir):
    """python -m lowmem_dpo.plan on a recipe naming an SFT adapter: the LoRA terms are the adapter's (r=4), not
    the recipe's lora_r, as train uses them."""
    from lowmem_dpo import plan

    out = tmp_path / "plan.json"
    args = ["lowmem_dpo:tiny-dpo-after-sft", f"model_name_or_path={sft_dir}", "lora_r=32",
            "--budget", "1GiB", "--json", str(out)]
    assert run_cli(plan.main, args, "plan", "") == 0
    assert json.loads(out.read_text())["setup"]["lora_r"] == 4
    args[2] = "adapter_mode=new_on_merged"  # a fresh adapter: the recipe's rank
    assert run_cli(plan.main, args + ["lora_r=32"], "plan", "") == 0
    assert json.loads(out.read_text())["setup"]["lora_r"] == 32


def test_sft_checkpoints_record_its_inputs_and_resume_checks_them(tmp_path, rows64, capsys):
    """SFT's checkpoints record what it trains on (no reference cache: SFT has none): raising max_steps continues
    the run, and a changed completion in the data is refused on resume, naming the data and its tokenization."""
    rows = data.load_rows(str(rows64)).to_list()
    prefs = write_jsonl(tmp_path / "prefs.jsonl", rows)
    cfg = tiny_cfg(tmp_path, dataset=str(prefs), max_steps=2, save_steps=2)
    sft.run(cfg, progress=False)
    state = read_state(tmp_path / "out" / "checkpoints" / "checkpoint-2")
    assert list(state.inputs) == ["data", "model weights", "adapter weights", "tokenizer", "tokenization"]
    capsys.readouterr()
    assert sft.run(tiny_cfg(tmp_path, dataset=str(prefs), max_steps=4, save_steps=2), progress=False).metrics[
        "step"] == 4
    assert "max_steps 2 -> 4: continuing from step 2 of 4" in capsys.readouterr().err
    write_jsonl(prefs, [{**rows[0], "chosen": rows[0]["chosen"] + " Indeed."}, *rows[1:]])
    with pytest.raises(UserError, match="checkpoint-4 was trained on other inputs: data, tokenization changed since"):
        sft.setup(tiny_cfg(tmp_path, dataset=str(prefs), max_steps=4, save_steps=2), progress=False)


def test_sft_samples_are_scored_against_their_completions_but_not_as_drift_from_the_base(tmp_path, rows64):
    """SFT means to move away from its base: its evals log ROUGE-L against the completions, and no KL (the DPO
    sign's measure), so the drift-from-the-reference sign never judges an SFT run."""
    cfg = tiny_cfg(tmp_path, dataset=str(rows64), eval_fraction=0.2, eval_steps=1, eval_generations=2,
                   max_new_tokens=8)
    sft.run(cfg, progress=False)
    evals = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if "eval_gen" in x]
    assert evals and all("eval_gen/rouge_l" in e and "eval_gen/kl" not in e for e in evals)


def test_kto_after_sft_starts_at_its_reference_on_a_mixture(sft_dir, tmp_path, rows64):
    """SFT -> KTO: the SFT adapter is the reference (step 1's loss is 0.5: every log-ratio 0, z0 0) and is what
    train continues; the data a mixture of pairs (unpaired) and unpaired rows."""
    unpaired_rows = [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
                     for i, r in enumerate(lines(TINY_DATA)[100:140])]
    mixture = [{"path": str(rows64), "fraction": 0.5}, str(write_jsonl(tmp_path / "unpaired.jsonl", unpaired_rows))]
    cfg = tiny_cfg(tmp_path, model_name_or_path=str(sft_dir), dataset=mixture, loss_type=["kto"],
                   per_device_train_batch_size=4, eval_fraction=0.0)
    precompute.run(cfg, progress=False)
    (side,) = stored_sides(tmp_path / "cache")
    assert side["adapter"] is not None
    train.run(cfg, progress=False)
    m = lines(tmp_path / "out" / "metrics.jsonl")
    assert m[0]["loss"] == pytest.approx(0.5, abs=1e-6) and m[0]["kl"] == 0.0
    assert m[1]["loss"] != pytest.approx(0.5, abs=1e-5)
