"""Peak memory of `python -m lowmem_dpo.export` on a 7B-width slice and on llama-25m, against peft's merge.

    python bench/export_memory.py                # ~3 minutes on 2 cores; ~4.5 GB of disk at the peak, freed after

The 7B-width slice is Mistral-7B-v0.1's widths (hidden 4096, MLP 14336, 32 heads, vocabulary 32000) with
--layers decoder layers (default 2: 1.44 GB in bfloat16), built by bench/random_weights.py's writer (seeded:
the same values every run) as 500 MB safetensors shards, in a temporary folder under --work that is deleted at
the end. llama-25m is the built-in `lowmem_dpo:llama-25m` (float32). Each gets a rank-16 LoRA adapter on every
linear layer (q, k, v, o, gate, up, down) with seeded random A and B, saved as peft saves one.

How it is measured: each command runs in a python process of its own, started by this script; as it finishes,
the process reads its peak resident set, VmHWM in /proc/self/status, and prints it. VmHWM counts anonymous memory
and the file pages the process has mapped (safetensors' memory maps of the shards it reads), so nothing the
command touches escapes it. "import" is a process that only imports torch, transformers, peft and lowmem_dpo:
the floor under every row. The export runs exactly `python -m lowmem_dpo.export` (runpy, the same argv); the
peft row loads the base with transformers in bfloat16 (float32 for llama-25m), loads the adapter with peft,
merge_and_unload()s it and save_pretrained()s the result with the same shard size, the usual way to merge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ARCH = "mistral-7b-v0.1"
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_SHARD = 5 * 10**8  # the slice's own shards


def write_adapter(base: Path, out: Path, seed: int = 0) -> int:
    """A rank-RANK LoRA adapter on every TARGETS layer of `base`, random A and B, in peft's saved form (keys,
    adapter_config.json); returns its bytes."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            key = f"base_model.model.{name}"
            state[f"{key}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=g) / module.in_features**0.5
            state[f"{key}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=g) * 0.01
    out.mkdir(parents=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS), task_type="CAUSAL_LM",
               base_model_name_or_path=str(base)).save_pretrained(out)
    return sum(t.numel() * t.element_size() for t in state.values())


def folder_bytes(folder: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(suffix))


# -- the measured processes ----------------------------------------------------------------------------------------
def child(kind: str, args: list[str]) -> None:
    """Run one measured command in this process, then print its peak RSS as JSON."""
    import runpy

    import peft  # noqa: F401  (every row pays the same imports: the floor is the import row)
    import transformers  # noqa: F401

    import lowmem_dpo.export  # noqa: F401

    if kind == "export":
        sys.argv = ["lowmem_dpo.export", *args, "--no-progress"]
        try:
            runpy.run_module("lowmem_dpo.export", run_name="__main__")
        except SystemExit as e:
            if e.code:
                raise
    elif kind == "peft":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        adapter, out, dtype, shard = args
        model = AutoModelForCausalLM.from_pretrained(Path(adapter).parent / "base", dtype=getattr(torch, dtype))
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        model.save_pretrained(out, max_shard_size=shard)
    status = Path("/proc/self/status").read_text()
    hwm = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))
    print(json.dumps({"hwm": hwm}))


def measure(kind: str, *args) -> tuple[int, float]:
    """(peak RSS bytes, wall seconds) of `kind` run in a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--child", kind, *map(str, args)], capture_output=True, text=True,
                       cwd=REPO, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if p.returncode != 0:
        raise SystemExit(f"{kind} {args} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["hwm"], time.perf_counter() - t0


# -- the runs ------------------------------------------------------------------------------------------------------
def build_slice(work: Path, layers: int) -> Path:
    sys.path.insert(0, str(REPO / "bench"))
    import random_weights

    base = work / "slice" / "base"
    base.mkdir(parents=True)
    random_weights.build(random_weights.model_config(ARCH, layers), ARCH, base, log=lambda m: print(m, flush=True),
                         shard_bytes=BASE_SHARD)
    return base


def llama25m(work: Path) -> Path:
    from lowmem_dpo.model.tiny import ensure_builtin

    base = work / "25m" / "base"
    shutil.copytree(ensure_builtin("lowmem_dpo:llama-25m"), base)  # beside its adapter: the peft row finds it
    return base


def rows_for(name: str, base: Path, shards: list[str], dtype: str) -> list[dict]:
    adapter = base.parent / "adapter"
    adapter_bytes = write_adapter(base, adapter)
    model_bytes = folder_bytes(base)
    rows = []
    for tool, shard in [("export", s) for s in shards] + [("peft", shards[-1])]:
        out = base.parent / f"merged-{tool}-{shard}"
        if tool == "export":
            peak, wall = measure("export", adapter, out, "--dtype", dtype, "--max-shard-size", shard)
        else:
            peak, wall = measure("peft", adapter, out, dtype, shard)
        n_shards = len([p for p in out.iterdir() if p.suffix == ".safetensors"])
        rows.append(dict(model=name, model_bytes=model_bytes, adapter_bytes=adapter_bytes, tool=tool, shard=shard,
                         shards=n_shards, written=folder_bytes(out), peak=peak, wall=wall))
        shutil.rmtree(out)
    return rows


def table(rows: list[dict], floor: int) -> str:
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    lines = ["| model (weights, adapter) | merge | --max-shard-size (shards) | peak RSS | above the import floor "
             "| wall |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({gb(r['model_bytes'])}, {r['adapter_bytes'] / 1e6:.1f} MB) | {r['tool']} | "
                     f"{r['shard']} ({r['shards']}) | {gb(r['peak'])} | {gb(r['peak'] - floor)} | "
                     f"{r['wall']:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the 7B-width slice")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()), help="where the models go (deleted)")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1:])
        return 0
    work = Path(tempfile.mkdtemp(prefix="export-memory-", dir=args.work))
    try:
        floor, _ = measure("import")
        rows = rows_for("llama-25m", llama25m(work), ["20MB", "2GB"], "float32")
        rows += rows_for(f"{ARCH} widths, {args.layers} layers", build_slice(work, args.layers), ["500MB", "2GB"],
                         "bfloat16")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"import floor (torch, transformers, peft, lowmem_dpo): {floor / 1e9:.2f} GB")
    print(table(rows, floor))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
