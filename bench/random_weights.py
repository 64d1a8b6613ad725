"""A deterministic random-weight model of a shipped architecture, for bench/full_scale.py.

    python bench/random_weights.py mistral-7b-v0.1 [--layers N]    # build once (or print the existing folder)

The folder is $LOWMEM_DPO_HOME/full_scale/NAME-vVERSION (NAME-Nlayers-vVERSION with --layers): config.json and
generation_config.json from lowmem_dpo/memory/archs/NAME/config.json, bfloat16 safetensors shards of at most
SHARD_BYTES with model.safetensors.index.json, and the built-in byte-level BPE tokenizer (lowmem_dpo.model.tiny: 1024
ids, valid in any vocabulary of >= 1024; its BOS/EOS ids 1/2 are Mistral's). No download.

Never the whole model in memory: the model is instantiated on the meta device for its tensor names and shapes,
then each tensor is drawn on its own (a torch.Generator seeded from SEED and the tensor's name: the same name
gets the same values in a truncated and in the full model) and written shard by shard. Matrices and embeddings
~ N(0, 0.02) (transformers' initializer_range), 1-D weights (the RMSNorms) 1, biases 0.

The build goes into a temporary folder that is renamed into place when complete (build.json written last before
the rename): a folder with build.json is complete; a killed build leaves only a temporary folder, removed by the
next build.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lowmem_dpo.memory.arch_source import ARCHS_DIR, shipped_archs  # noqa: E402
from lowmem_dpo.runtime import files  # noqa: E402
from lowmem_dpo.runtime.errors import UserError  # noqa: E402

VERSION = 1  # bump when the values drawn change: a new folder is built
SEED = 0
INIT_STD = 0.02
SHARD_BYTES = 2 * 10**9
DTYPE = torch.bfloat16
MARKER = "build.json"


def folder_name(arch: str, layers: int | None) -> str:
    return f"{arch}-{layers}layers-v{VERSION}" if layers else f"{arch}-v{VERSION}"


def model_folder(arch: str, layers: int | None) -> Path:
    return files.home() / "full_scale" / folder_name(arch, layers)


def model_config(arch: str, layers: int | None):
    """The transformers config of a shipped architecture, cut to `layers` decoder layers when given."""
    from transformers import AutoConfig

    if arch not in shipped_archs():
        raise UserError(f"--arch {arch!r}: not a shipped architecture; shipped: {', '.join(shipped_archs())}")
    config = AutoConfig.from_pretrained(ARCHS_DIR / arch)
    if layers:
        if not 1 <= layers <= config.num_hidden_layers:
            raise UserError(f"--layers {layers}: {arch} has {config.num_hidden_layers} decoder layers")
        config.num_hidden_layers = layers
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = layers
    config.dtype = DTYPE
    return config


def tensor_specs(config) -> dict[str, torch.Size]:
    """name -> shape of every tensor the model saves, in state_dict order, from the model on the meta device
    (no memory); a tied LM head is left out, as save_pretrained leaves it out."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    specs = {name: t.shape for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        specs.pop("lm_head.weight", None)
    return specs


def draw(name: str, shape: torch.Size, seed: int = SEED) -> torch.Tensor:
    """One tensor's values: 1-D weights (norms) 1, biases 0, the rest ~ N(0, INIT_STD) from a generator seeded by
    (seed, name)."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=DTYPE)
    if len(shape) == 1:
        return torch.ones(shape, dtype=DTYPE)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(key)
    return torch.empty(shape, dtype=DTYPE).normal_(0.0, INIT_STD, generator=g)


def shard_plan(specs: dict[str, torch.Size], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Names per shard, in order, each shard at most shard_bytes (a bigger tensor gets a shard of its own)."""
    shards, size = [[]], 0
    for name, shape in specs.items():
        n = shape.numel() * DTYPE.itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_shard(specs: dict[str, torch.Size], out: Path, fname: str) -> tuple[int, float]:
    """One shard's tensors drawn and written (a worker process's job); its bytes and seconds."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    tensors = {name: draw(name, shape) for name, shape in specs.items()}
    save_file(tensors, out / fname, metadata={"format": "pt"})
    os.chmod(out / fname, 0o644)  # safetensors creates it 0600
    return sum(t.numel() * t.element_size() for t in tensors.values()), time.perf_counter() - t0


def write_weights(specs: dict[str, torch.Size], out: Path, log=print, shard_bytes: int = SHARD_BYTES) -> None:
    """The shards and model.safetensors.index.json, a shard per worker process at a time (one core draws ~70 MB/s:
    a 7B took 4 minutes in one process on a GPU machine's 16 cores); each tensor's values depend on its name alone,
    so the files are the same bytes whatever the workers."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    plan = shard_plan(specs, shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    workers = max(1, min(len(plan), os.cpu_count() or 1, 8))  # 8 x a 2 GB shard in RAM at most
    # fork: the workers need no import of this file (a test loads it by path); the parent has run no parallel
    # region by then (the specs come from the meta device)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        jobs = [pool.submit(_write_shard, {n: specs[n] for n in shard}, out, fname) for shard, fname in zip(plan, names)]
        for shard, fname, job in zip(plan, names, jobs):
            size, secs = job.result()
            log(f"  {fname}: {len(shard)} tensors, {size / 1e9:.2f} GB in {secs:.0f} s")
    weight_map = {name: fname for shard, fname in zip(plan, names) for name in shard}
    total = sum(s.numel() for s in specs.values()) * DTYPE.itemsize
    files.atomic_write_json(out / "model.safetensors.index.json",
                            {"metadata": {"total_size": total}, "weight_map": weight_map})


def build(config, name: str, out: Path, log=print, shard_bytes: int = SHARD_BYTES) -> None:
    """Write the whole model folder of transformers `config` (architecture `name`) into `out`, an empty folder."""
    from transformers import GenerationConfig

    from lowmem_dpo.model.tiny import build_tokenizer

    tok = build_tokenizer(out)
    if len(tok) > config.vocab_size:
        raise UserError(f"the built-in tokenizer has {len(tok)} ids, more than {name}'s vocabulary {config.vocab_size}")
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    specs = tensor_specs(config)
    n = sum(s.numel() for s in specs.values())
    log(f"building {name} with {config.num_hidden_layers} layers: {len(specs)} tensors, {n / 1e9:.2f}B params, "
        f"{n * DTYPE.itemsize / 1e9:.1f} GB")
    write_weights(specs, out, log, shard_bytes)
    files.atomic_write_json(out / MARKER, {"arch": name, "layers": config.num_hidden_layers, "params": n,
                                           "dtype": "bfloat16", "seed": SEED, "init_std": INIT_STD,
                                           "version": VERSION})
    files.fsync_tree(out)


def _remove_dead_builds(parent: Path, name: str) -> None:
    """Temporary folders of killed builds (their process is gone): they can hold gigabytes."""
    for tmp in parent.glob(f".{name}.building-*"):
        m = re.search(r"building-(\d+)$", tmp.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_model(arch: str, layers: int | None = None, log=print) -> Path:
    """The model folder, built on first use (atomically: complete or absent)."""
    target = model_folder(arch, layers)
    name, parent = target.name, target.parent
    if (target / MARKER).is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(parent, name)
    if target.exists():  # no marker: not ours to trust (a folder from elsewhere); rebuild
        shutil.rmtree(target)
    config = model_config(arch, layers)
    need = sum(s.numel() for s in tensor_specs(config).values()) * DTYPE.itemsize
    files.ensure_free_space(parent, need + (1 << 30), f"the random-weight model {name}", "Nothing was written.")
    tmp = parent / f".{name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(config, arch, tmp, log)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", help=f"a shipped architecture: {', '.join(shipped_archs())}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    args = ap.parse_args(argv)
    try:
        print(ensure_model(args.arch, args.layers, log=lambda m: print(m, file=sys.stderr, flush=True)))
    except UserError as e:
        print(f"random_weights: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
