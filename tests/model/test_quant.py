"""A quantized base through bitsandbytes (4bit: NF4 + double quantization, 8bit: LLM.int8), on the CPU: every
LoRA weight gets a gradient with and without checkpointing, a quantized reference and policy start at ln 2, the
cache is keyed by the reference's settings; and the device rules behind the optimizer choice."""

import math
import sys
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import TINY_DATA, stored_sides, write_jsonl

from lowmem_dpo import data, precompute, train
from lowmem_dpo.config.cli import run_cli
from lowmem_dpo.config.recipe import load_config
from lowmem_dpo.model import models
from lowmem_dpo.runtime import devices, rules
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.training import policy
from lowmem_dpo.training.step import accumulate, next_items, optimizer_step

LN2 = math.log(2)


@pytest.fixture
def small(make_cfg, tmp_path):
    """make_cfg on the first 32 rows of the shipped data: a quantized precompute + step in a few seconds."""
    path = write_jsonl(tmp_path / "small.jsonl", data.load_rows(str(TINY_DATA)).select(range(32)).to_list())

    def make(**overrides):
        return make_cfg(**{"dataset": str(path), **overrides})

    return make


def quantized_layer_type(quantization: str):
    import bitsandbytes as bnb

    return {"4bit": bnb.nn.Linear4bit, "8bit": bnb.nn.Linear8bitLt}[quantization]


def metrics(cfg) -> list[dict]:
    import json

    with open(f"{cfg.output_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# -- gradient flow ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", ["true", "false"], ids=["ckpt", "no-ckpt"])
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_every_lora_parameter_gets_a_gradient(small, quantization, checkpointing):
    """The reported failure (8-bit + LoRA + checkpointing: "element 0 of tensors does not require grad") or a
    LoRA weight left without a gradient would show here. Step 1 moves every LoRA B off its zero init, so the
    second backward gives A a nonzero gradient too."""
    cfg = small(quantization=quantization, gradient_checkpointing=checkpointing, ref_source="live", max_steps=2,
                per_device_train_batch_size=2)
    session = train.setup(cfg, progress=False)
    kind = quantized_layer_type(quantization)
    adapted = [m for m in session.trainee.model.modules() if isinstance(m, kind)]
    assert len(adapted) == 14  # 2 layers x (q, k, v, o, gate, up, down): the base is quantized
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in session.trainee.model.modules())
    assert checkpointed == (checkpointing == "true")

    optimizer_step(session)
    items = next_items(session.progress.stream, session.progress.micro_batch)
    accumulate(session, items, len(items))
    lora = {n: p for n, p in session.trainee.model.named_parameters() if p.requires_grad}
    assert len(lora) == 2 * len(adapted) and all("lora_A" in n or "lora_B" in n for n in lora)
    assert [n for n, p in lora.items() if p.grad is None] == []
    assert [n for n, p in lora.items() if not p.grad.abs().sum() > 0] == []


def test_quantized_base_casts_nothing_to_float32(small, tiny_path):
    """Embeddings, norms and LM head stay in the run's dtype (no prepare_model_for_kbit_training upcast); only
    the LoRA weights are float32."""
    cfg = small(quantization="4bit", dtype="bfloat16")
    resolved = devices.resolve(cfg)
    model = policy.setup_model(cfg, resolved, tiny_path)
    kind = quantized_layer_type("4bit")
    quantized = {id(m.weight) for m in model.modules() if isinstance(m, kind)}
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.dtype == torch.float32, name
        elif id(p) not in quantized:
            assert p.dtype == torch.bfloat16, name
    assert model.get_base_model().lm_head.weight.dtype == torch.bfloat16


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantized_load_keeps_no_weight_file_mapped(tiny_path, quantization):
    """After a quantized load on the CPU nothing points into the memory-mapped safetensors file (the unquantized
    weights are copied, so the whole file's pages leave the process), and the model computes the same log-probs
    with the mapping gone. Before, the embeddings kept the file mapped."""
    import gc

    def mapped() -> bool:
        gc.collect()
        return any(str(tiny_path / "model.safetensors") in line for line in open("/proc/self/maps"))

    model = models.load_model(tiny_path, torch.device("cpu"), torch.float32, quantization=quantization)
    assert not mapped()
    ids = torch.tensor([[1, 5, 9, 14, 7, 3]])
    assert torch.isfinite(model(input_ids=ids).logits).all()
    plain = models.load_model(tiny_path, torch.device("cpu"), torch.float32)  # unquantized: mapped, as intended
    assert mapped()
    assert torch.equal(model.get_input_embeddings().weight, plain.get_input_embeddings().weight)


# -- end to end: precompute with a quantized reference, train a quantized policy ----------------------------------
@pytest.mark.parametrize("quantization, dtype", [("4bit", "float32"), ("8bit", "float32"), ("4bit", "bfloat16")])
def test_quantized_reference_and_policy_start_at_ln2(small, quantization, dtype):
    cfg = small(quantization=quantization, dtype=dtype, max_steps=1)
    precompute.run(cfg, progress=False)
    (components,) = stored_sides(cfg.ref_cache_dir)
    assert components["quantization"] == quantization and components["dtype"] == dtype
    train.run(cfg, progress=False)
    (m,) = metrics(cfg)
    assert m["loss"] == pytest.approx(LN2, abs=2e-3)
    assert abs(m["rewards/margins"]) < 1e-2


def test_cache_is_keyed_by_the_reference_settings(small, monkeypatch):
    """One recipe, a 4-bit policy and a full-precision reference: precompute runs unquantized, train runs 4-bit
    against that cache. The cache is refused, before any model loads, when the reference settings train would
    use differ from the cache's."""
    pinned = small(quantization="4bit", ref_quantization="none", max_steps=1)
    precompute.run(pinned, progress=False)
    assert [c["quantization"] for c in stored_sides(pinned.ref_cache_dir)] == ["none"]

    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model for a stale cache"))
    with pytest.raises(UserError) as e:  # ref_quantization null: the reference would be 4-bit too
        train.run(small(quantization="4bit", max_steps=1), progress=False)
    msg = str(e.value)
    assert "quantization none -> 4bit" in msg and "lowmem-dpo precompute" in msg
    assert "ref_quantization=none ref_dtype=float32" in msg  # how to use the cache as built
    with pytest.raises(UserError, match=r"dtype float32 -> bfloat16 changed"):
        train.run(small(quantization="4bit", ref_quantization="none", ref_dtype="bfloat16"), progress=False)
    monkeypatch.setattr(models, "load_model", real_load)

    m = train.run(pinned, progress=False).metrics
    # The 4-bit policy differs from the full-precision reference by its quantization error: near ln 2, not at it.
    assert abs(m["loss"] - LN2) < 0.05
    assert abs(m["loss"] - LN2) > 1e-5 and abs(m["rewards/margins"]) > 1e-5


def test_missing_bitsandbytes_is_a_user_error(small, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    with pytest.raises(UserError, match=r"quantization=4bit needs bitsandbytes.*pip install"):
        precompute.run(small(quantization="4bit"), progress=False)
    with pytest.raises(UserError, match="pip install"):
        train.setup(small(quantization="8bit", ref_source="live"), progress=False)
    with pytest.raises(UserError, match="paged_adamw_8bit.*pip install"):
        devices.make_optimizer(rules.PAGED_ADAMW_8BIT, [torch.nn.Parameter(torch.zeros(2))], 1e-3, 0.0)

    cfg = small()
    capsys.readouterr()  # what came before (a first use in this worker builds the tiny model, with its bar)
    code = run_cli(precompute.main, ["lowmem_dpo:tiny-cpu", f"dataset={cfg.dataset[0].path}", "quantization=4bit",
                                     f"ref_cache_dir={tmp_path / 'c'}"], "precompute", precompute.__doc__)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "pip install" in err
    assert len(err.strip().splitlines()) == 1


def test_live_reference_must_use_the_policy_settings():
    from lowmem_dpo.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="ref_quantization=none: ref_source=live"):
        load_config(None, ["ref_source=live", "quantization=4bit", "ref_quantization=none"])
    load_config(None, ["ref_source=live", "quantization=4bit", "ref_quantization=4bit"])


def test_none_is_a_choice_of_ref_quantization_not_null(tmp_path):
    cfg = load_config(None, ["ref_quantization=none", "ref_dtype=null", "quantization=4bit"])
    assert cfg.ref_quantization == "none" and cfg.ref_dtype is None
    assert (cfg.reference_quantization, cfg.reference_dtype) == ("none", "auto")
    assert load_config(None, ["ref_quantization=null", "quantization=8bit"]).reference_quantization == "8bit"
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


# -- device rules and the optimizer (the CUDA decisions: test_rules.py) ------------------------------------------
def test_auto_picks_mps_when_present(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("auto picks CUDA first")
    with pytest.raises(UserError, match="device=mps but"):
        devices.resolve(load_config(None, ["device=mps"]))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    r = devices.resolve(load_config(None, ["device=auto"]))
    assert (r.device.type, r.kind, r.optimizer, r.dtype) == ("mps", "mps", rules.ADAMW_TORCH, torch.float32)


def test_optimizer_follows_the_device_rule():
    cfg = load_config(None, ["device=cpu", "learning_rate=1e-2"])
    resolved = devices.resolve(cfg)
    model = torch.nn.Linear(128, 64)  # 8192 weights: above bitsandbytes' 4096-element minimum for 8-bit state
    opt, _, _ = policy.setup_optimizer(cfg, model, 10, resolved)
    assert type(opt) is torch.optim.AdamW  # CPU: torch AdamW

    import bitsandbytes as bnb

    opt, sched, params = policy.setup_optimizer(cfg, model, 10, replace(resolved, optimizer=rules.PAGED_ADAMW_8BIT))
    assert isinstance(opt, bnb.optim.PagedAdamW8bit)
    before = model.weight.detach().clone()
    model(torch.randn(4, 128)).square().sum().backward()
    with warnings.catch_warnings():  # on a CPU bitsandbytes says it falls back to unpaged memory
        warnings.simplefilter("ignore", UserWarning)
        opt.step()
    sched.step()
    assert opt.state[model.weight]["state1"].dtype == torch.uint8  # 8-bit optimizer state
    assert not torch.equal(model.weight, before)
