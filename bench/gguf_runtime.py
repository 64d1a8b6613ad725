"""Does the GGUF answer as the trained model does? export --gguf, then llama.cpp (llama-cpp-python, built from
source) against transformers on the merged model, greedy, on the same prompt tokens.

    pip install --no-deps --target /work/llamacpp llama-cpp-python      # once: a source build, ~10-20 min on 2 cores
    PYTHONPATH=/work/llamacpp python bench/gguf_runtime.py --adapter bench/out/signs/style-healthy/out
    PYTHONPATH=/work/llamacpp python bench/gguf_runtime.py --tiny       # a tiny Llama built here (its tokenizer
                                                                        # one llama.cpp reads), seconds

For each --types entry the adapter's merged model is converted by export's own path (model/gguf.py) and loaded
in llama.cpp (CPU, 2 threads). Each prompt is rendered with the model's chat template and tokenized by
transformers; llama.cpp's own tokenization of the same text is compared with it, then both runtimes continue the
same prompt ids greedily for --tokens tokens (transformers in float32 on the merged folder; llama.cpp top_k=1, no
repetition penalty), stopping at the end of turn. Reported per type: prompts tokenized alike, continuations equal
token for token, and the mean length of the common prefix as a share of transformers' continuation.

Writes the JSON (--json) and prints a Markdown table; bench/README.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = ["Write a short review of a camera you liked.", "What is the capital of France?",
           "Give me three tips for sleeping better.", "Explain what a neural network is in two sentences.",
           "Write a haiku about the sea.", "How do I boil an egg?", "Summarize the plot of Romeo and Juliet.",
           "What is 17 times 23?"]


def tiny_adapter(root: Path) -> Path:
    """A tiny Llama with a Llama-2-style tokenizer and a LoRA adapter on it (tests/conftest.py's
    build_llama2_style, which tests/model/test_gguf.py exports too)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_llama2_style

    return build_llama2_style(root) / "adapter"


def transformers_greedy(merged: Path, prompt_ids: list[list[int]], tokens: int, eos: set[int]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=list(eos),
                                 pad_token_id=next(iter(eos)))[0, len(ids):].tolist()
        out.append(cut(got, eos))
    return out


def llama_greedy(gguf: Path, prompt_ids: list[list[int]], texts: list[str], tokens: int, eos: set[int]):
    """(llama.cpp's continuations of the prompt ids, its own tokenization of each prompt text)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=2, verbose=False)
    outs, tokenized = [], []
    for ids, text in zip(prompt_ids, texts):
        tokenized.append(llm.tokenize(text.encode(), add_bos=False, special=True))
        llm.reset()
        got = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            got.append(t)
            if t in eos or len(got) == tokens:
                break
        outs.append(cut(got, eos))
    return outs, tokenized


def cut(ids: list[int], eos: set[int]) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(adapter: Path, types: list[str], tokens: int, work: Path) -> dict:
    from transformers import AutoTokenizer

    from lowmem_dpo import export
    from lowmem_dpo.model import gguf

    merged = export.export(adapter, work / "merged", dtype="float32", progress=False)
    tok = AutoTokenizer.from_pretrained(merged)
    eos = {tok.eos_token_id, *tok.convert_tokens_to_ids(gguf.stop_tokens(tok))}
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    ids = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    want = transformers_greedy(merged, ids, tokens, eos)
    out = {"adapter": str(adapter), "tokens": tokens, "prompts": len(PROMPTS), "types": {}}
    for t in types:
        path = gguf.convert(merged, t)
        got, tokenized = llama_greedy(path, ids, texts, tokens, eos)
        shares = [common(g, w) / max(1, len(w)) for g, w in zip(got, want)]
        out["types"][t] = {"tokenized_alike": sum(a == b for a, b in zip(tokenized, ids)),
                           "equal_continuations": sum(g == w for g, w in zip(got, want)),
                           "mean_common_prefix": round(sum(shares) / len(shares), 4),
                           "examples": [{"transformers": tok.decode(w), "llama.cpp": tok.decode(g)}
                                        for g, w in list(zip(got, want))[:2]]}
        print(f"{t}: tokenized alike {out['types'][t]['tokenized_alike']}/{len(PROMPTS)}, equal continuations "
              f"{out['types'][t]['equal_continuations']}/{len(PROMPTS)}, mean common prefix "
              f"{out['types'][t]['mean_common_prefix']:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", type=Path)
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama of tests/conftest.py's build_llama2_style")
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gguf-runtime-") as tmp:
        adapter = tiny_adapter(Path(tmp) / "tiny") if args.tiny else args.adapter
        result = run(adapter, args.types.split(","), args.tokens, Path(tmp))
    from machine import machine_info

    result["machine"] = machine_info()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
