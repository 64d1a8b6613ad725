"""Memory planner: shipped architectures, the formulas against measured peaks (tiny-llama and llama-25m, with and
without checkpointing, with and without a 4-bit base), the chunked LM head at 32k and 152k vocabularies, the
knob search, the shipped 12 GB recipes, and the CLI."""

import configparser
import dataclasses
import fnmatch
import json
import sys

import pytest
import torch

from lowmem_dpo.config.recipe import build_config, load_config
from lowmem_dpo.data import Batch
from lowmem_dpo.measure import PeakMeter, at_measured_shapes, measure, measure_slice
from lowmem_dpo.memory.activations import logits_train_bytes
from lowmem_dpo.memory.arch import arch_from_model, load_arch
from lowmem_dpo.memory.arch_source import ARCH_PREFIX, ARCHS_DIR, shipped_archs
from lowmem_dpo.memory.model import pinned_bytes, predict, predict_train
from lowmem_dpo.memory.search import choose
from lowmem_dpo.memory.setup import Setup, setup_from_config
from lowmem_dpo.memory.weights import base_weight_bytes, layer_weight_bytes, linear_weight_bytes
from lowmem_dpo.model.head import head_tile
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.units import GiB, MiB, parse_size

REPO = ARCHS_DIR.parents[2]


# -- architectures -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, params", [
    ("lowmem_dpo:arch/mistral-7b-v0.1", 7.2417e9), ("mistralai/Mistral-7B-v0.1", 7.2417e9),
    ("meta-llama/Llama-3.1-8B", 8.0303e9), ("meta-llama/Llama-3.1-8B-Instruct", 8.0303e9),
    ("Qwen/Qwen2.5-7B", 7.6156e9),
])
def test_shipped_architectures_have_the_published_sizes(spec, params):
    arch = load_arch(spec)
    assert arch.params() == pytest.approx(params, rel=1e-3)


def test_arch_matches_the_model_transformers_builds():
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in shipped_archs():
        config = AutoConfig.from_pretrained(ARCHS_DIR / name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert load_arch(ARCH_PREFIX + name).params() == sum(p.numel() for p in model.parameters()), name


def test_arch_files_are_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    patterns = cfg["options.package_data"]["lowmem_dpo"].split()
    files = [str(p.relative_to(ARCHS_DIR.parents[1])) for p in ARCHS_DIR.glob("*/config.json")]
    assert len(files) == 5 and all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)


def test_unknown_arch_is_a_user_error():
    with pytest.raises(UserError, match="no shipped architecture 'gpt-9'.*lowmem_dpo:arch/mistral-7b-v0.1"):
        load_arch("lowmem_dpo:arch/gpt-9")


def test_builtin_weights_match_the_formula(tiny_path):
    from lowmem_dpo.model.models import load_model

    model = load_model(tiny_path, torch.device("cpu"), torch.float32)
    arch = load_arch("lowmem_dpo:tiny-llama")
    assert sum(base_weight_bytes(arch, "float32", "none").values()) == sum(
        p.numel() * 4 for p in model.parameters())


def test_nf4_bytes_per_param():
    n = 4096 * 14336
    assert linear_weight_bytes(4096, 14336, "4bit", 2) / n == pytest.approx(0.516, abs=0.001)
    assert linear_weight_bytes(4096, 14336, "8bit", 2) / n == pytest.approx(1.0003, abs=0.001)


# -- predicted vs measured (CPU, PeakMeter) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """The step-time benchmark's rows (~250 tokens each): truncated at max_length, so activations dominate."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import make_data
    finally:
        sys.path.remove(str(REPO / "bench"))
    return str(make_data.ensure(tmp_path_factory.mktemp("bench") / "rows.jsonl", 16))


def measured_vs_predicted(cfg, steps=2, layers=None):
    """{stage: (predicted, measured) tensor peak}; `layers`: the model cut to that many decoder layers (random
    weights: plan --measure --slice), measured and predicted so."""
    if layers is not None:
        sliced = measure_slice(cfg, layers, steps)
        pred, measured = sliced["prediction"], sliced["measured"]
    else:
        measured = measure(cfg, steps)
        pred = predict(load_arch(cfg.model_name_or_path), at_measured_shapes(setup_from_config(cfg), measured))
    return {stage: (getattr(pred, stage).tensor_peak_bytes, measured[stage]["measured_peak_bytes"])
            for stage in ("train", "precompute")}


# llama-25m (hidden 512, 8 layers) is measured whole once; its other cases are cut to 2 layers (plan --measure
# --slice: random weights, the same layer and head shapes), a quarter of the work: the layers are the plan's
# multiplier, and each case's question is the layer, its activations and the head. bfloat16 runs once, as the
# 12 GB recipes run (4-bit, checkpointing), at 1 pair per micro-batch: a CPU without native bf16 (AVX2 only)
# multiplies bf16 matrices ~50x slower than float32 (2 against 97 GFLOPS at 512x512x1376), and the whole model's
# case took ~75 s at 1 pair on one worker's thread. The unquantized bf16 base was a case of its own: its 2-byte
# weights are the bytes per parameter that float32's 4 and the quantized cases check, its activations the 4-bit
# case's. Predicted/measured train peaks, here: 1.01 (float32, whole); cut to 2 layers 1.06 (float32 4-bit), 1.08
# (bf16 4-bit), 1.04 (float32 8-bit), 1.10 (float32 8-bit with checkpointing); whole, the float32 4-bit, bf16 4-bit
# and 8-bit-with-checkpointing cases were 1.03, 1.03 and 1.06 (the planner's fixed margins weigh more in 2 layers).
CASES = [  # model, max_length, pairs per micro-batch, dtype, checkpointing, quantization, layers (None: all)
    ("tiny-llama", 64, 8, "float32", "false", "none", None),
    ("tiny-llama", 64, 8, "bfloat16", "true", "4bit", None),
    ("llama-25m", 128, 2, "float32", "false", "none", None),
    ("llama-25m", 128, 2, "float32", "false", "4bit", 2),
    ("llama-25m", 128, 1, "bfloat16", "true", "4bit", 2),
    ("llama-25m", 128, 2, "float32", "false", "8bit", 2),
    ("llama-25m", 128, 2, "float32", "true", "8bit", 2),
]


@pytest.mark.parametrize("model, max_length, batch, dtype, ckpt, quant, layers", CASES,
                         ids=["-".join(map(str, c[:6])) + (f"-{c[6]}layers" if c[6] else "") for c in CASES])
def test_prediction_within_20_percent_of_measured(long_rows, tmp_path, model, max_length, batch, dtype, ckpt, quant,
                                                  layers):
    cfg = build_config(dict(model_name_or_path=f"lowmem_dpo:{model}", dataset=long_rows, device="cpu", dtype=dtype,
                            gradient_checkpointing=ckpt, quantization=quant, max_length=max_length,
                            max_prompt_length=max_length // 2,
                            per_device_train_batch_size=batch, precompute_batch_size=batch,
                            output_dir=str(tmp_path / "out"), ref_cache_dir=str(tmp_path / "cache")))
    # tiny-llama in bf16: the layer's phase counts each adapted Linear's input on its own, +25% at hidden 64 (q/k/v
    # and gate/up share theirs; llama-25m +8%); kept so, conservative: on the card at 32k tokens the plan was only
    # 5% over allocated (bench/README.md)
    over = 0.3 if (model, dtype) == ("tiny-llama", "bfloat16") else 0.2
    for stage, (predicted, measured) in measured_vs_predicted(cfg, layers=layers).items():
        assert measured * 0.8 <= predicted <= measured * (1 + over), (stage, predicted, measured)


@pytest.mark.parametrize("vocab, n_seq, seq_len", [(32000, 6, 1024), (152064, 2, 512)])
def test_chunked_lm_head_is_bounded_at_7b_vocabularies(vocab, n_seq, seq_len):
    """A 2-layer hidden-64 model with a 7B model's vocabulary, LoRA on, forward + backward of completion_logps:
    the measured peak is the planner's (the LM-head term dominates it) and far below the [N, T, V] float32 logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowmem_dpo.model.logps import completion_logps

    prompt = 16
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.requires_grad_(False)
    arch = arch_from_model(model, "test")
    model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    ids = torch.randint(0, vocab, (n_seq, seq_len))
    attention = torch.ones(n_seq, seq_len, dtype=torch.long)
    attention[0, -8:] = 0  # padding: the mask transformers builds, as in real batches
    completion = attention.clone()
    completion[:, :prompt] = 0
    batch = Batch(torch.arange(n_seq), ids, attention, completion, int(attention.sum()))
    with PeakMeter("cpu") as meter:
        completion_logps(model, batch).logps.sum().backward()
    measured = meter.peak_bytes - meter.entry_bytes

    setup = Setup(device="cpu", kind="cpu", dtype="float32", quantization="none", ref_dtype="float32",
                       ref_quantization="none", gradient_checkpointing=False, optimizer="adamw_torch",
                       micro_batch=n_seq // 2, grad_accum=1, precompute_batch=1, max_length=seq_len, lora_r=8,
                       lora_targets="all-linear", completion_tokens=seq_len - prompt)
    pred = predict_train(arch, setup)
    logits = pred.breakdown["peak_phase"]
    m = n_seq * (seq_len - prompt)
    c, v = head_tile(m, vocab)  # (4096, 4096): one float32 tile, a tile's rows' and all rows' hidden gradients
    assert logits == logits_train_bytes(arch, m) == 4 * c * v + c * 64 * 4 + m * 64 * 4
    predicted = pred.breakdown["activations"] + logits + pred.breakdown["lora_grads"]
    assert predicted == pytest.approx(measured, rel=0.2)
    assert measured - pred.breakdown["activations"] == pytest.approx(logits, rel=0.2)
    assert measured < n_seq * seq_len * vocab * 4 / 2  # the whole step, while [N, T, V] float32 logits: 0.6-0.7 GiB


# -- choosing a plan ---------------------------------------------------------------------------------------------
def mistral_setup(**changes):
    cfg = load_config(None, ["model_name_or_path=mistralai/Mistral-7B-v0.1", "device=cuda", "dtype=bfloat16",
                             "max_length=1024", "per_device_train_batch_size=8", "gradient_accumulation_steps=2",
                             "gradient_checkpointing=false", "lora_r=16"])
    return dataclasses.replace(setup_from_config(cfg, 12 * GiB), **changes)


def test_search_order_keeps_the_effective_batch():
    """bf16 Mistral at 2048 tokens does not fit 12 GiB at any micro-batch, with checkpointing or with activation
    offloading: 4-bit with checkpointing does (without offloading: it is not needed there),
    and there the micro-batch is the largest that fits (not the 1 the first knob tried), the pairs per step kept.
    The steps are listed in the knobs' order of cost."""
    arch = load_arch("mistralai/Mistral-7B-v0.1")
    start = mistral_setup(max_length=2048)
    chosen = choose(arch, start, 12 * GiB)
    assert chosen.fits and chosen.offload_bytes == 0
    assert list(chosen.overrides) == ["per_device_train_batch_size", "gradient_accumulation_steps",
                                      "gradient_checkpointing", "quantization"]
    assert chosen.overrides["quantization"] == "4bit" and chosen.setup.ref_quantization == "4bit"
    s = chosen.setup
    assert s.micro_batch * s.grad_accum == 16 and 1 < s.micro_batch < 8
    assert chosen.prediction.train.peak_bytes <= 12 * GiB < predict(arch, start).train.peak_bytes
    # one halving less would not fit: the search stops at the first setup that does
    bigger = dataclasses.replace(s, micro_batch=s.micro_batch * 2, grad_accum=s.grad_accum // 2)
    assert predict(arch, bigger).train.peak_bytes > 12 * GiB
    assert chosen.steps[0].startswith(f"per_device_train_batch_size={s.micro_batch} ")


def test_the_micro_batch_comes_before_streaming():
    """The 12 GB Llama recipe at 3072 tokens and 2 pairs per micro-batch does not fit 11.25 GiB: 1 pair does, with
    nothing streamed (streaming 23 of 32 layers was the answer before the knobs were ordered by cost)."""
    cfg = load_config(REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml", ["max_length=3072"])
    arch = load_arch(cfg.model_name_or_path)
    budget = int(11.25 * GiB)
    setup = setup_from_config(cfg, budget)
    assert setup.micro_batch == 2 and predict(arch, setup).train.peak_bytes > budget
    train = choose(arch, setup, budget, ("micro_batch", "stream"), stages=("train",))
    assert train.fits and train.setup.micro_batch == 1 and train.setup.grad_accum == 16 and not train.streams
    # at 8192 the activations are over: moving them to the host makes it fit, with nothing streamed
    long = choose(arch, setup_from_config(load_config(REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml",
                                                      ["max_length=8192"]), budget), budget, stages=("train",))
    assert long.fits and long.overrides["activation_offloading"] == "true" and not long.streams
    # at 32768 every layer streamed does not make it fit either, and the plan says so
    hopeless = choose(arch, setup_from_config(load_config(REPO / "recipes" / "llama3.1-8b-qlora-12gb.yaml",
                                                          ["max_length=32768"]), budget), budget, stages=("train",))
    assert not hopeless.fits and hopeless.streams["train"].layers == 32
    assert hopeless.streams["train"].device_peak > budget


def test_streaming_when_nothing_else_fits():
    """Last, the trailing layers streamed, each as loaded: 4-bit layers stream 4-bit bytes."""
    arch = load_arch("mistralai/Mistral-7B-v0.1")
    chosen = choose(arch, mistral_setup(), 4 * GiB)
    streamed = layer_weight_bytes(arch, "bfloat16", "4bit")
    assert chosen.setup.micro_batch == 1 and chosen.setup.quantization == "4bit" and chosen.offload_layers > 0
    # pinned: each layer's host buffer rounded up to a power of two by torch's caching host allocator
    assert streamed == 112_537_052 and pinned_bytes(streamed) == 128 * MiB
    assert chosen.offload_bytes == chosen.streams["train"].layers * 128 * MiB
    assert chosen.streams["train"].bytes_per_step == chosen.streams["train"].layers * streamed * 32
    assert chosen.fits
    hopeless = choose(arch, mistral_setup(), 1 * GiB)
    assert not hopeless.fits


def test_offloaded_activations_pin_what_the_host_allocator_rounds_to():
    """Mistral's 12 GB recipe at 9,984 tokens: each layer input (its tokens x 4,096 x 2 bytes) is 164 MB, pinned as
    256 MiB; the issue's 5.18 GiB of tensors pin ~8.1 GiB (the final norm's float32 input: 327 MB -> 512 MiB)."""
    cfg = load_config(REPO / "recipes" / "mistral-7b-qlora-12gb.yaml", ["max_length=9984", "max_prompt_length=null"])
    arch = load_arch(cfg.model_name_or_path)
    setup = dataclasses.replace(setup_from_config(cfg, int(11.25 * GiB)), activation_offloading=True, micro_batch=1)
    details = predict(arch, setup).train.details
    per_layer = details["kept.layer_inputs"] // arch.layers
    assert per_layer == setup.sequences("train") * setup.shapes("train")[0] * 4096 * 2 > 160e6 and pinned_bytes(per_layer) == 256 * MiB
    assert details["offload.host_bytes"] == 32 * 256 * MiB + pinned_bytes(details["kept.final_norm"])
    assert pinned_bytes(details["kept.final_norm"]) == 512 * MiB
    assert [pinned_bytes(n) for n in (0, 1, 4096, 4097)] == [0, 1, 4096, 8192]


def test_fitting_recipe_is_left_alone():
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    setup = mistral_setup(quantization="4bit", ref_quantization="4bit", gradient_checkpointing=True, micro_batch=1)
    chosen = choose(arch, setup, 12 * GiB)
    # nothing turned; the MLP runs whole: its tiles would save memory the run does not need
    assert chosen.fits and chosen.overrides == {} and chosen.setup == dataclasses.replace(setup, mlp_tiles=False)


def test_the_mlp_runs_in_the_largest_tiles_that_fit():
    """Where the MLP cannot run whole, its tiles are as large as the budget allows (each tile dequantizes the 4-bit
    weights again): a budget that holds 8192-token tiles but neither 16,384-token ones nor the whole MLP gets 8192."""
    arch = load_arch("lowmem_dpo:arch/mistral-7b-v0.1")
    setup = mistral_setup(quantization="4bit", ref_quantization="4bit", gradient_checkpointing=True, micro_batch=1,
                          max_length=16384)
    peak = {n: predict(arch, dataclasses.replace(setup, mlp_tile_tokens=n)).train.peak_bytes
            for n in (4096, 8192, 16384)}
    whole = predict(arch, dataclasses.replace(setup, mlp_tiles=False)).train.peak_bytes
    assert peak[4096] < peak[8192] < peak[16384] < whole
    chosen = choose(arch, setup, peak[8192], stages=("train",))
    assert chosen.fits and chosen.setup.mlp_tiles and chosen.setup.mlp_tile_tokens == 8192
    assert choose(arch, setup, whole, stages=("train",)).setup.mlp_tiles is False


@pytest.mark.parametrize("recipe", ["mistral-7b-qlora-12gb.yaml", "llama3.1-8b-qlora-12gb.yaml"])
def test_12gb_recipes_plan_at_most_10_gib(recipe):
    """What torch gets of a 12 GB card (11.25 GiB): the 12 GB rule, and room to spare at the recipe's length."""
    cfg = load_config(REPO / "recipes" / recipe)
    pred = predict(load_arch(cfg.model_name_or_path), cfg, budget=int(11.25 * GiB))
    assert pred.setup.kind == "cuda-12gb-bf16" and pred.setup.quantization == "4bit"
    assert pred.setup.dtype == "bfloat16"  # dtype: auto on a bf16 card
    assert pred.train.peak_bytes <= 10 * GiB and pred.precompute.peak_bytes <= 10 * GiB
    # the LM head term is a tile (TRL's fused kernel's bf16 4096 x 32768 on CUDA), not batch * seq * vocab * 4
    assert pred.train.phases["logits"] <= 384 * MiB


def test_parse_size():
    assert parse_size("12GiB") == 12 * GiB
    assert parse_size("11.5GB") == 11_500_000_000
    assert parse_size("512 MiB") == 512 * MiB
    with pytest.raises(UserError, match="--budget 'lots'"):
        parse_size("lots")


# -- CLI -------------------------------------------------------------------------------------------------------
def _run(capsys, *args):
    """python -m lowmem_dpo.plan ARGS, in this process (its entry point, run_cli): exit code and output."""
    from types import SimpleNamespace

    from lowmem_dpo import plan
    from lowmem_dpo.config.cli import run_cli

    capsys.readouterr()
    code = run_cli(plan.main, [str(REPO / args[0]) if args and args[0].endswith(".yaml") else args[0], *args[1:]],
                   "plan", plan.__doc__)
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    p = _run(capsys, "recipes/mistral-7b-qlora-12gb.yaml", "per_device_train_batch_size=16", "--budget", "12GiB",
             "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "peak" in p.stdout and "overrides: " in p.stdout
    report = json.loads(out.read_text())
    assert report["budget_bytes"] == 12 * GiB
    assert set(report["train"]) >= {"peak_bytes", "fits", "offload_bytes", "breakdown"}
    assert report["train"]["fits"] is False and report["plan"]["fits"] is True
    assert sum(report["train"]["breakdown"].values()) == report["train"]["peak_bytes"]
    assert report["plan"]["overrides"]["gradient_accumulation_steps"] == str(
        16 * 8 // int(report["plan"]["overrides"]["per_device_train_batch_size"]))


def test_cli_exits_1_when_nothing_fits(tmp_path, capsys):
    out = tmp_path / "plan.json"
    p = _run(capsys, "recipes/mistral-7b-qlora-12gb.yaml", "--budget", "1GiB", "--json", str(out))
    assert p.returncode == 1, p.stderr
    assert "DOES NOT FIT 1.00 GiB even with every knob" in p.stdout
    assert json.loads(out.read_text())["plan"]["fits"] is False


@pytest.mark.parametrize("args, fragment", [
    (["--budget", "twelve"], "--budget 'twelve'"),
    (["model_name_or_path=lowmem_dpo:arch/nope", "--budget", "12GiB"], "no shipped architecture"),
    (["--slice", "2"], "--slice N needs N >= 1 and --measure"),
    (["--measure", "model_name_or_path=lowmem_dpo:arch/mistral-7b-v0.1", "--budget", "12GiB"],
     "--measure needs weights"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    ([], "device=cuda but no GPU here to read its memory from: pass --budget"),
])
def test_cli_errors_exit_2_in_one_line(args, fragment, capsys):
    p = _run(capsys, "recipes/mistral-7b-qlora-12gb.yaml", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert fragment in p.stderr and len(p.stderr.strip().splitlines()) == 1
