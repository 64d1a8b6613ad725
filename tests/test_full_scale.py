"""bench/full_scale.py's pieces on a tiny Mistral: the random-weight builder is deterministic (the same bytes twice;
a truncated model holds the full model's tensors), writes a folder transformers loads with finite log-probs, and
the benchmark's rows fill max_length without being cut."""

from pathlib import Path

import pytest
import torch
from conftest import import_bench


@pytest.fixture(scope="module")
def bench_modules():
    return import_bench("random_weights", "full_scale")


def tiny_config(layers: int):
    from transformers import MistralConfig

    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False,
                         dtype=torch.bfloat16)


def shards(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def test_builder_is_deterministic_and_loads(bench_modules, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    rw, _ = bench_modules
    small = 40_000  # bytes per shard: several shards
    for name, layers in (("a", 2), ("b", 2), ("one", 1)):
        (tmp_path / name).mkdir()
        rw.build(tiny_config(layers), "tiny-mistral", tmp_path / name, log=lambda m: None, shard_bytes=small)
    a, b = tmp_path / "a", tmp_path / "b"
    weights = sorted(p.name for p in a.glob("model-*.safetensors"))
    assert len(weights) > 1
    assert weights == sorted(p.name for p in b.glob("model-*.safetensors"))
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in weights)

    tensors = shards(a)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    one = shards(tmp_path / "one")  # the first layer of a 1-layer build is the 2-layer build's
    assert set(one) < set(tensors) and all(torch.equal(one[k], tensors[k]) for k in one)

    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.bfloat16)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    up = state["model.layers.1.mlp.up_proj.weight"].float()
    assert abs(up.std().item() - rw.INIT_STD) < 0.002 and abs(up.mean().item()) < 0.002
    with torch.no_grad():
        logps = model(torch.randint(0, 1024, (2, 16))).logits.float().log_softmax(-1)
    assert torch.isfinite(logps).all()


def test_rows_fill_max_length_uncut(bench_modules, tiny_path, tokenizer, tmp_path):
    _, fs = bench_modules
    max_length = 128
    data = fs.write_data(tiny_path, max_length, 4, tmp_path / "rows.jsonl")
    shapes = fs.data_shapes(tiny_path, data, max_length)
    assert shapes["truncated_rows"] == 0 and shapes["dropped_rows"] == 0
    for prompt, chosen, rejected in shapes["prompt_chosen_rejected_tokens"]:
        longest = prompt + max(chosen, rejected)
        assert max_length - 16 < longest <= max_length  # within about a sentence of max_length
        assert max_length // 8 <= prompt <= max_length // 4 + 16
    assert data.read_text() == fs.write_data(tiny_path, max_length, 4, tmp_path / "again.jsonl").read_text()


@pytest.mark.parametrize("checkpointing", ["true", "false"])
def test_recomputation_follows_the_checkpointing_train_resolved(bench_modules, tiny_path, checkpointing, tmp_path):
    """The FLOPs a step computes again are the ones of the checkpointing the train stage ran with, read off its
    config.yaml's "# resolved" lines as the package writes them (devices.resolve's reasons): every layer's forward and the
    tiled head's when checkpointed, the head's alone when not."""
    from lowmem_dpo.config.recipe import build_config
    from lowmem_dpo.runtime import devices

    _, fs = bench_modules
    cfg = build_config({"model_name_or_path": str(tiny_path), "dataset": "lowmem_dpo:tiny-prefs", "device": "cpu",
                        "gradient_checkpointing": checkpointing})
    log = tmp_path / "train.log"
    log.write_text("".join(f"# resolved {reason}\n" for reason in devices.resolve(cfg).reasons))  # config.yaml's
    assert fs.resolved_checkpointing(fs.log_lines(log)) is (checkpointing == "true")
    flops = fs.step_flops(tiny_path, [(100, 60), (90, 50)], lora_r=8)
    train = {"step_s": [1.0], "gradient_checkpointing": fs.resolved_checkpointing(fs.log_lines(log))}
    fs.add_flops(train, [flops], [{"peak_flop_per_s": 1e12}])
    fwd = flops["forward"]
    again = sum(fwd.values()) if checkpointing == "true" else fwd["lm_head"]
    assert fwd["lm_head"] > 0 and fwd["linears"] > fwd["lm_head"] / 100
    assert train["flops_with_recompute_per_step"] == [flops["useful_flops"] + again]
    assert train["step_vs_matmul_peak_with_recompute"] == round((flops["useful_flops"] + again) / 1e12, 4)
