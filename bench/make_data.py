"""Deterministic long preference rows for the step-time benchmark.

    python bench/make_data.py [OUT.jsonl] [--rows N]     # default bench/out/data/bench-prefs.jsonl, 96 rows
    python bench/make_data.py --long-prompts [OUT.jsonl] [--rows N]   # bench/out/data/bench-long-prompts.jsonl
    python bench/make_data.py --long-prompts --lengths   # the token lengths, with the built-in tokenizer

Each row concatenates short reviews from `lowmem_dpo.model.tiny.preference_rows`, so every word is in the built-in
tokenizer's vocabulary.
- reviews (default): a prompt of 6-8 earlier reviews plus one "Write a positive/negative review" instruction,
  and a chosen / rejected completion of 19-21 sentences of the matching / opposite polarity. With the built-in
  tokenizer, prompt + completion is about 215-255 tokens (under max_length 256, so nothing is truncated).
- long-prompts (prompt-heavy, for max_length 512): a "document" of earlier reviews (both polarities, many nouns)
  plus the instruction, about 400 tokens, and completions of 30-120 tokens (a length drawn per row), chosen of
  the asked polarity and rejected the same sentences with the opposite one. Sentences are added while the built-in
  tokenizer's counts stay under the drawn lengths, so prompt + completion + EOS fits max_length: nothing is cut.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lowmem_dpo.model.tiny import preference_rows, write_jsonl  # noqa: E402

DEFAULT_PATH = Path("bench/out/data/bench-prefs.jsonl")
DEFAULT_ROWS = 96
KINDS = ("reviews", "long-prompts")
DEFAULT_PATHS = {"reviews": DEFAULT_PATH, "long-prompts": Path("bench/out/data/bench-long-prompts.jsonl")}
# long-prompts: the tokenizer the lengths are counted with (the bench recipe's model), and the length goals
LONG_MODEL = "lowmem_dpo:llama-25m"
LONG_MAX_LENGTH = 512
PROMPT_TOKENS = (385, 415)  # drawn per row, capped so that prompt + the longer completion + EOS fits max_length
COMPLETION_TOKENS = (30, 119)  # drawn per row; sentences are added while under it (each is 8 tokens with this
# tokenizer): 31-119 tokens, 32-120 with EOS


def bench_rows(n: int = DEFAULT_ROWS, seed: int = 0) -> list[dict]:
    """n rows {prompt, chosen, rejected}; the same n and seed give the same rows."""
    rng = random.Random(seed)
    pool = preference_rows(n * 64, seed=seed)  # alternating polarity: even rows positive, odd negative
    by_kind = [pool[0::2], pool[1::2]]
    cursor = [0, 0]

    def take(kind: int, k: int) -> list[dict]:
        start = cursor[kind]
        cursor[kind] += k
        return by_kind[kind][start:start + k]

    rows = []
    for i in range(n):
        kind = i % 2
        context = [r["chosen"] for r in take(1 - kind, rng.randint(3, 4)) + take(kind, 3)]
        rng.shuffle(context)
        group = take(kind, rng.randint(19, 21))
        rows.append({
            "prompt": "Earlier reviews: " + " ".join(context) + "\n" + group[0]["prompt"],
            "chosen": " ".join(r["chosen"] for r in group),
            "rejected": " ".join(r["rejected"] for r in group),
        })
    return rows


class _Pool:
    """Review sentences of one polarity and their nouns, handed out in order (each used once)."""

    def __init__(self, rows: list[dict]):
        self.rows, self.next = rows, 0

    def take(self) -> dict:
        self.next += 1
        return self.rows[self.next - 1]


def _fill(tokens, head: str, pools: list[_Pool], pick, goal: int, tail: str = "") -> tuple[str, list[dict]]:
    """head + sentences (from pools[pick()]) + tail, adding sentences while the text is under `goal` tokens."""
    used: list[dict] = []
    text = head + tail
    while tokens(text) < goal:
        used.append(pools[pick()].take())
        text = head + " ".join(r["chosen"] for r in used) + tail
    return text, used


def long_prompt_rows(n: int = DEFAULT_ROWS, seed: int = 0, tokenizer=None,
                     max_length: int = LONG_MAX_LENGTH) -> list[dict]:
    """n prompt-heavy rows {prompt, chosen, rejected} (module doc); the same n, seed and tokenizer give the same
    rows. `tokenizer` defaults to LONG_MODEL's (built on first use)."""
    if tokenizer is None:
        from lowmem_dpo.model import models

        tokenizer = models.load_tokenizer(models.resolve_model_path(LONG_MODEL))

    def tokens(text: str) -> int:  # as the trainers count a prompt (BOS first) or a completion (no BOS)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    pool = preference_rows(n * 128, seed=seed)  # alternating polarity: even rows positive, odd negative
    pools = [_Pool(pool[0::2]), _Pool(pool[1::2])]
    rows = []
    for i in range(n):
        kind = i % 2
        _, group = _fill(tokens, "", pools, lambda: kind, rng.randint(*COMPLETION_TOKENS))
        chosen = " ".join(r["chosen"] for r in group)
        rejected = " ".join(r["rejected"] for r in group)
        longest = max(tokens(chosen), tokens(rejected)) + 1  # + EOS
        # BOS + prompt + completion + EOS <= max_length; the last sentence may overshoot the goal by one sentence
        goal = min(rng.randint(*PROMPT_TOKENS), max_length - longest - 1 - 12)
        prompt, _ = _fill(tokens, "Earlier reviews: ", pools, lambda: rng.randint(0, 1), goal,
                          "\n" + group[0]["prompt"])
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def make_rows(kind: str, n: int = DEFAULT_ROWS) -> list[dict]:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return bench_rows(n) if kind == "reviews" else long_prompt_rows(n)


def length_stats(path: str | Path, model: str = LONG_MODEL, max_length: int = LONG_MAX_LENGTH) -> dict:
    """Token lengths of a preference file as lowmem_dpo tokenizes it for training (TRL 1.16's conventions: prompt
    with BOS, completion with EOS): min / median / mean / max per part, and the rows cut or skipped."""
    import statistics

    from lowmem_dpo.data.encode import tokenize_rows
    from lowmem_dpo.data.rows import load_rows
    from lowmem_dpo.model import models

    tok = models.load_tokenizer(models.resolve_model_path(model))
    data = tokenize_rows(load_rows(str(path)), tok, max_length, None, str(path), progress=False)
    parts = {"prompt": [len(p.prompt_ids) for p in data.pairs],
             "chosen": [len(p.chosen_ids) for p in data.pairs],
             "rejected": [len(p.rejected_ids) for p in data.pairs],
             "prompt+longer completion": [len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))
                                          for p in data.pairs]}
    out = {k: {"min": min(v), "median": statistics.median(v), "mean": round(statistics.fmean(v), 1), "max": max(v)}
           for k, v in parts.items()}
    out["rows"], out["dropped"] = data.num_rows, len(data.dropped)
    out["truncated"] = {part: len(rows) for part, rows in data.truncated.items()}
    out["prompt_share_of_tokens"] = round(sum(2 * x for x in parts["prompt"]) / sum(
        2 * p + c + r for p, c, r in zip(parts["prompt"], parts["chosen"], parts["rejected"])), 3)
    return out


def ensure(path: str | Path, n: int = DEFAULT_ROWS, kind: str = "reviews") -> Path:
    """Write the rows of `kind` to `path` unless it already holds exactly them."""
    path = Path(path)
    rows = make_rows(kind, n)
    if path.is_file():
        import json

        with open(path, encoding="utf-8") as f:
            if [json.loads(line) for line in f if line.strip()] == rows:
                return path
    write_jsonl(rows, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="default: bench/out/data/bench-prefs.jsonl, with --long-prompts "
                    "bench/out/data/bench-long-prompts.jsonl")
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    ap.add_argument("--long-prompts", action="store_true", help="the prompt-heavy rows (max_length 512)")
    ap.add_argument("--lengths", action="store_true", help="then print the token lengths (built-in tokenizer)")
    args = ap.parse_args(argv)
    kind = "long-prompts" if args.long_prompts else "reviews"
    path = ensure(args.out or DEFAULT_PATHS[kind], args.rows, kind)
    print(f"wrote {args.rows} rows to {path} ({path.stat().st_size / 1024:.0f} KiB)")
    if args.lengths:
        import json

        max_length = LONG_MAX_LENGTH if args.long_prompts else 256
        print(f"token lengths at max_length {max_length}:", json.dumps(length_stats(path, max_length=max_length),
                                                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
