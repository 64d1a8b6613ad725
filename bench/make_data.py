"""Deterministic long preference rows for the step-time benchmark.

    python bench/make_data.py [OUT.jsonl] [--rows N]     # default bench/out/data/bench-prefs.jsonl, 96 rows

Each row concatenates short reviews from `lowmem_dpo.tiny.preference_rows`, so every word is in the built-in
tokenizer's vocabulary: a prompt of 6-8 earlier reviews plus one "Write a positive/negative review" instruction,
and a chosen / rejected completion of 19-21 sentences of the matching / opposite polarity. With the built-in
tokenizer, prompt + completion is about 215-255 tokens (under max_length 256, so nothing is truncated).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lowmem_dpo.tiny import preference_rows, write_jsonl  # noqa: E402

DEFAULT_PATH = Path("bench/out/data/bench-prefs.jsonl")
DEFAULT_ROWS = 96


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


def ensure(path: str | Path, n: int = DEFAULT_ROWS) -> Path:
    """Write the rows to `path` unless it already holds exactly them."""
    path = Path(path)
    rows = bench_rows(n)
    if path.is_file():
        import json

        with open(path, encoding="utf-8") as f:
            if [json.loads(line) for line in f if line.strip()] == rows:
                return path
    write_jsonl(rows, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=str(DEFAULT_PATH))
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    args = ap.parse_args(argv)
    path = ensure(args.out, args.rows)
    print(f"wrote {args.rows} rows to {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
