"""Shared fixtures: a private LOWMEM_DPO_HOME with the built-in tiny model built once per session, and configs
that write into a test's tmp_path. Everything is real: transformers, tokenizers, peft, safetensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The tests use no hub. Offline, a name that could be a hub id is answered at once, not after the network's
# timeouts on a machine without one (27 s for one test of model paths); the stages' processes inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (make test: a worker per core), each worker's torch takes its share of the cores, set before
# anything imports torch (torch's default is a thread per core in every process: 2 workers would run 4 on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

REPO = Path(__file__).resolve().parents[1]
TINY_DATA = REPO / "lowmem_dpo" / "demo" / "tiny-prefs.jsonl"  # lowmem_dpo:tiny-prefs, the demo's rows
TINY_RECIPE = "lowmem_dpo:tiny-cpu"  # the demo's recipe (lowmem_dpo/demo/tiny-cpu.yaml)


@pytest.fixture(scope="session", autouse=True)
def lowmem_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("lowmem_home")
    old = os.environ.get("LOWMEM_DPO_HOME")
    os.environ["LOWMEM_DPO_HOME"] = str(home)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield home
    if old is None:
        os.environ.pop("LOWMEM_DPO_HOME", None)
    else:
        os.environ["LOWMEM_DPO_HOME"] = old


@pytest.fixture(scope="session")
def tiny_path(lowmem_home) -> Path:
    from lowmem_dpo.model.tiny import ensure_builtin

    return ensure_builtin("lowmem_dpo:tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from lowmem_dpo.model.models import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="module")
def pairs(tokenizer):
    """Six pairs of the demo's rows made unequal in length: a prompt cut to 2 tokens, a one-token chosen, a long
    rejected (the layouts' tests: test_share_prompt, test_packing)."""
    from lowmem_dpo import data

    got = data.tokenize_rows(data.load_rows(str(TINY_DATA)).select(range(6)), tokenizer, 64, None,
                             progress=False).pairs
    got[1].prompt_ids = got[1].prompt_ids[:2]
    got[2].chosen_ids = got[2].chosen_ids[:1]
    got[3].rejected_ids = got[3].rejected_ids + got[0].chosen_ids
    return got


@pytest.fixture
def make_cfg(tmp_path):
    """Config for the tiny model and shipped data, writing under tmp_path; keyword args override."""
    from lowmem_dpo.config.recipe import build_config

    def make(**overrides):
        values = dict(model_name_or_path="lowmem_dpo:tiny-llama", dataset=str(TINY_DATA),
                      output_dir=str(tmp_path / "out"), ref_cache_dir=str(tmp_path / "cache"), device="cpu",
                      dtype="float32",  # exact comparisons; auto may pick bfloat16 on a CPU with native bf16
                      max_length=64, per_device_train_batch_size=4, precompute_batch_size=16, max_steps=3,
                      logging_steps=1, learning_rate=1e-2, seed=0,
                      # tests skip and cut rows on purpose; test_third_hour checks the limits at their defaults
                      max_skipped_share=1, max_truncated_share=1)
        values.update(overrides)
        return build_config(values)

    return make


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def build_tiny_model(config_class: str, kwargs: dict, out: Path, tokenizer) -> Path:
    """A seeded tiny model of a transformers config class (e.g. "GPT2Config") with the tiny tokenizer's vocabulary
    and special tokens, saved with its tokenizer as a local model folder."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                 eos_token_id=tokenizer.eos_token_id,
                                                 pad_token_id=tokenizer.pad_token_id, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def llama2_tokenizer(folder):
    """A byte-fallback BPE tokenizer in Llama 2's form (metaspace normalizer, no pre-tokenizer), trained on the
    demo's text; ChatML turns."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowmem_dpo.model.tiny import preference_rows

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    text = [r[k] for r in preference_rows(200) for k in ("prompt", "chosen", "rejected")]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS + [f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def build_llama2_style(root: Path) -> Path:
    """root/base: a tiny Llama (random weights, seed 0) with llama2_tokenizer; root/adapter: a LoRA adapter on it
    with non-zero weights (seed 1). Returns root. A tokenizer llama.cpp knows (the built-in tiny model's it does
    not): test_gguf.py, bench/gguf_runtime.py --tiny, and the docs' my-model (test_doc_blocks.py)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    build_tiny_model("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         tie_word_embeddings=False), root / "base", llama2_tokenizer(root / "base"))
    torch.manual_seed(1)
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"], init_lora_weights=False))
    peft.save_pretrained(root / "adapter")
    return root


def import_bench(*names: str) -> tuple:
    """The bench/ scripts `names` as modules (bench/ is not a package: its folder on sys.path while importing)."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(REPO / "bench"))


def forward_sequences(kwargs: dict) -> int:
    """The sequences a backbone forward runs (its keyword arguments, as a forward pre-hook with_kwargs sees them):
    a packed row's (padding_free: its bounds), else the padded batch's rows. The simulated out-of-memory errors
    (CUDA's, which cannot happen on this CPU) count these."""
    bounds = kwargs.get("sequence_bounds")
    return len(bounds) - 1 if bounds is not None else kwargs["input_ids"].shape[0]


def cached(cfg):
    """(the dataset rows' reference values, eval_dataset's or None) as train would serve them from cfg's cache:
    inputs.reference_of, no model loaded."""
    from lowmem_dpo.training import inputs

    return inputs.reference_of(cfg)


def stored_sequences(cache_dir) -> int:
    """Sequences the cache folder's store holds (every model side); 0 without a store."""
    from lowmem_dpo.data import cache

    store = cache.open_store(Path(cache_dir))
    if store is None:
        return 0
    with store:
        return store.count()


def sequences_of(cfg) -> set:
    """The distinct (prompt, completion) token ids cfg's rows read (the dataset's and eval_dataset's), tokenized
    as train tokenizes them: what a full build computes."""
    from lowmem_dpo.runtime import devices
    from lowmem_dpo.training import inputs

    prepared = inputs.prepare(cfg, devices.resolve(cfg))
    dataset = inputs.load_data(cfg, prepared.tokenizer, progress=False)
    return {(tuple(seq.prompt_ids), tuple(seq.completion_ids)) for seq in dataset.sequences().values()}


def stored_sides(cache_dir) -> list[dict]:
    """The components of every model side the cache folder's store holds rows of, most rows first."""
    from lowmem_dpo.data import cache

    with cache.open_store(Path(cache_dir)) as store:
        return [u.components for u in store.usage() if u.sequences]


def pytest_collection_finish(session):
    """Once the tests are imported (in each xdist worker too): import the libraries the stages import lazily, then
    gc.freeze() every object alive. A full garbage collection walks every tracked object: after torch,
    transformers, peft and bitsandbytes that is ~500k objects and 0.5 s a pass here, and the stages collect on
    purpose (precompute frees its model before train loads one) besides Python's own passes. Frozen objects are
    never collected again; those are the modules' own. This took 20% off test_cache, test_train and test_eval
    in one process (151 s -> 121 s)."""
    import gc

    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch's optimizers import it at their first construction)
    import transformers.models.llama.modeling_llama  # noqa: F401

    gc.freeze()


def backward_pairs(trainee, cfg, pairs: list, pad_id: int, resolved):
    """One micro-batch of pairs through the run's objective (objective.Pairs: live reference when no cache), its
    loss backward'ed into the trainee's gradients; returns its sums (step.Sums)."""
    from lowmem_dpo.training.objective import Batching, Pairs
    from lowmem_dpo.training.step import Pass

    objective = Pairs.of(cfg, Batching(resolved, pad_id))
    within = Pass(None, objective.size(pairs, False), len(pairs))
    out = objective.loss(objective.forward(trainee.lm, pairs, within), within.size)
    trainee.backward(out.value)
    return out.sums
