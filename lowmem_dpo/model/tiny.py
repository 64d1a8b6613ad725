"""Built-in tiny models and the synthetic preference data: no download, deterministic.

    python -m lowmem_dpo.model.tiny            # build both built-in models now (otherwise built on first use)
    python -m lowmem_dpo.model.tiny --data lowmem_dpo/demo/tiny-prefs.jsonl   # regenerate the shipped dataset

`lowmem_dpo:tiny-llama` is a 2-layer Llama (hidden 64) for tests and the demo, pretrained for a few seconds at build
so that it writes sentences; `lowmem_dpo:llama-25m` is the same architecture at hidden 512 and 8 layers (~25M
parameters, random weights) for benchmarks. Both share one byte-level BPE
tokenizer trained on text from the same generator as the data, with a Llama-style BOS and a chat template.
Models live under $LOWMEM_DPO_HOME (default ~/.cache/lowmem_dpo)/models/NAME-vVERSION.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from lowmem_dpo.runtime.builtins import PREFIX as BUILTIN_PREFIX
from lowmem_dpo.runtime.errors import UserError
from lowmem_dpo.runtime.files import home

VERSION = 2  # 2: tiny-llama is pretrained (pretrain)
# name -> Llama sizes. llama-25m: 8 x (4*512^2 attn + 3*512*1376 mlp) + 2*1024*512 embeddings = 25.3M params.
BUILTINS = {
    "tiny-llama": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
    "llama-25m": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8),
}
# Built-ins given a short language-model pretraining at build (optimizer steps); the others keep random weights.
PRETRAIN_STEPS = {"tiny-llama": 300}
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

NOUNS = ["lamp", "chair", "phone", "garden", "bread", "movie", "river", "hotel", "guitar", "jacket", "coffee",
         "train", "laptop", "bridge", "soup", "novel", "camera", "pillow", "bicycle", "museum", "tea", "kitchen",
         "window", "market"]
GOOD = ["great", "lovely", "bright", "warm", "clean", "friendly", "useful", "calm", "solid", "sweet"]
BAD = ["awful", "broken", "dull", "cold", "dirty", "rude", "useless", "noisy", "weak", "sour"]


def preference_rows(n: int = 384, seed: int = 0) -> list[dict]:
    """Rows where chosen follows the instruction's polarity and rejected the opposite one.

    Learnable: the policy must read "positive"/"negative" in the prompt and prefer matching adjectives.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        noun = rng.choice(NOUNS)
        kind = "positive" if i % 2 == 0 else "negative"
        right, wrong = (GOOD, BAD) if kind == "positive" else (BAD, GOOD)
        a, b = rng.sample(right, 2)
        c, d = rng.sample(wrong, 2)
        rows.append({
            "prompt": f"Write a {kind} review of the {noun}.\n",
            "chosen": f"The {noun} is {a} and {b}.",
            "rejected": f"The {noun} is {c} and {d}.",
        })
    return rows


def _corpus() -> list[str]:
    texts = []
    for row in preference_rows(2000, seed=1):
        texts += [row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]]
    texts += ["<|user|>\n", "<|assistant|>\n", "<|system|>\n"] * 50
    return texts


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Llama convention: the tokenizer's default special tokens are a BOS in front.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(name: str, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(out_dir)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         **BUILTINS[name])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if name in PRETRAIN_STEPS:
        pretrain(model, tok, PRETRAIN_STEPS[name])
    model.save_pretrained(out_dir, safe_serialization=True)


def pretrain(model, tok, steps: int) -> None:
    """A few seconds of language modelling on review text from the data's generator (both polarities alike, so
    following the prompt's polarity is left for DPO to learn): the model then writes "The lamp is lovely and
    clean." where a random one writes byte soup, so its samples and their collapse mean something. Seeded: the
    same steps on the same batches every build."""
    import torch

    texts = [row["prompt"] + c for row in preference_rows(2000, seed=2) for c in (row["chosen"], row["rejected"])]
    seqs = [tok(t).input_ids + [tok.eos_token_id] for t in texts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)  # (N, T), right-padded
    mask = torch.zeros_like(ids)  # (N, T)
    for i, seq in enumerate(seqs):
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(seqs), (64,), generator=g)  # (64,)
        labels = ids[pick].masked_fill(mask[pick] == 0, -100)  # (64, T): no loss on padding
        model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def ensure_builtin(spec: str) -> Path:
    """Path of a built-in model folder, built atomically on first use."""
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise UserError(f"model_name_or_path={spec!r}: unknown built-in model; built-ins are "
                        + ", ".join(BUILTIN_PREFIX + n for n in BUILTINS))
    target = home() / "models" / f"{name}-v{VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build_model(name, tmp)
        try:
            os.rename(tmp, target)  # atomic: a folder is complete or absent
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another builder: theirs is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"built {spec} at {target}", file=sys.stderr)
    return target


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--data":
        write_jsonl(preference_rows(), Path(sys.argv[2]))
    else:
        for n in BUILTINS:
            print(ensure_builtin(BUILTIN_PREFIX + n))
