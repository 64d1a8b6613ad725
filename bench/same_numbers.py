"""Same numbers before and after a refactor: the metrics and adapter tensors of the demo, [sigmoid, sft], SFT then
DPO, KTO and tiny-simpo runs on the tiny model, and a resume from another tree's stored checkpoint, written as one
JSON of fingerprints (every metric but the timings, every sample's text, each adapter tensor's sha256).

    python bench/same_numbers.py OUT_DIR                          # ~3 min on 2 CPU cores; writes OUT_DIR/numbers.json
    python bench/same_numbers.py OUT_DIR --checkpoint-from OLD    # resume OLD/demo's step-40 checkpoint (an older tree's)
    python bench/same_numbers.py --compare OLD/numbers.json NEW/numbers.json   # exit 1 and the differences if any

Run it with one tree's package first on the path (PYTHONPATH=TREE), once per tree; the runs go in subprocesses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = ("seconds", "per_s", "runtime", "_s", "elapsed", "time")  # keys that differ run to run by the clock
TINY = "lowmem_dpo:tiny-cpu"


def runs(work: Path) -> dict[str, list[list[str]]]:
    """name -> the lowmem-dpo commands (stage, recipe, overrides) that make its output folder work/name."""
    def out(name: str) -> list[str]:
        return [f"output_dir={work / name}", f"ref_cache_dir={work / (name + '-cache')}"]
    short = ["max_steps=40", "save_steps=20", "eval_steps=20"]
    return {
        "demo": [["precompute", TINY, *out("demo")], ["train", TINY, *out("demo")]],
        "sigmoid_sft": [["precompute", TINY, *out("sigmoid_sft"), "loss_type=[sigmoid, sft]"],
                        ["train", TINY, *out("sigmoid_sft"), "loss_type=[sigmoid, sft]", *short]],
        "sft_dpo": [["sft", "lowmem_dpo:tiny-sft", f"output_dir={work / 'sft'}", "max_steps=30"],
                    ["precompute", "lowmem_dpo:tiny-dpo-after-sft", f"model_name_or_path={work / 'sft'}",
                     *out("sft_dpo")],
                    ["train", "lowmem_dpo:tiny-dpo-after-sft", f"model_name_or_path={work / 'sft'}", *out("sft_dpo"),
                     "max_steps=30"]],
        "kto": [["precompute", TINY, *out("kto"), "loss_type=[kto]"],
                ["train", TINY, *out("kto"), "loss_type=[kto]", *short]],
        "simpo": [["train", "recipes/tiny-simpo.yaml", f"output_dir={work / 'simpo'}", *short]],
    }


def lowmem(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "lowmem_dpo", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"lowmem-dpo {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def tensors(path: Path) -> dict[str, str]:
    return {name: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in sorted(load_file(str(path)).items())}


def fingerprint(folder: Path) -> dict:
    """Every metric line but its timings, every sample's text, and each adapter's tensors' sha256 (the final one and
    each checkpoint's)."""
    lines = []
    for line in open(folder / "metrics.jsonl"):
        row = json.loads(line)
        lines.append({k: v for k, v in row.items() if not any(t in k for t in TIMING)})
    samples = folder / "samples.jsonl"
    texts = [json.loads(x).get("answers", json.loads(x)) for x in open(samples)] if samples.exists() else []
    adapters = {str(p.parent.relative_to(folder)): tensors(p) for p in sorted(folder.rglob("adapter_model.safetensors"))}
    return {"metrics": lines, "samples": texts, "adapters": adapters}


def resumed(work: Path, source: Path) -> dict:
    """A copy of source/demo cut back to its step-40 checkpoint, resumed to the end by this tree."""
    folder = work / "resume"
    shutil.copytree(source / "demo", folder)
    for checkpoint in (folder / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[-1]) > 40:
            shutil.rmtree(checkpoint)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (folder / name).unlink(missing_ok=True)
    with open(folder / "metrics.jsonl") as f:
        kept = [x for x in f if json.loads(x).get("step", 0) <= 40]
    (folder / "metrics.jsonl").write_text("".join(kept))
    lowmem(["train", TINY, f"output_dir={folder}", f"ref_cache_dir={work / 'demo-cache'}"])
    return fingerprint(folder)


def compare(old: dict, new: dict, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) for d in compare(old.get(k), new.get(k), f"{path}/{k}")]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in compare(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {str(old)[:120]} -> {str(new)[:120]}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--checkpoint-from", type=Path, help="a folder this script wrote with another tree")
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        diffs = compare(*(json.loads(p.read_text()) for p in args.compare))
        print("\n".join(diffs[:40]) or "identical", f"({len(diffs)} differences)" if diffs else "")
        sys.exit(1 if diffs else 0)
    work = Path(args.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(Path(__file__).resolve().parents[1])  # recipes/ paths
    numbers = {}
    for name, commands in runs(work).items():
        for command in commands:
            lowmem(command)
        numbers[name] = fingerprint(work / name)
        print(name, "done", flush=True)
    numbers["resume"] = resumed(work, (args.checkpoint_from or work).resolve())
    (work / "numbers.json").write_text(json.dumps(numbers, indent=1))
    print(f"wrote {work / 'numbers.json'}")


if __name__ == "__main__":
    main()
