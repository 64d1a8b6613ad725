"""Merge a trained LoRA adapter into its base and write a standard transformers model folder, tensor by tensor.

    lowmem-dpo export ADAPTER_DIR MERGED_DIR [--dtype auto|bfloat16|float16|float32]
                                [--max-shard-size 2GB] [--overwrite] [--gguf f16|bf16|q8_0]

ADAPTER_DIR is a PEFT LoRA adapter folder: a run's output_dir (the final adapter), one of its
checkpoints/checkpoint-STEP folders, or any PEFT adapter. The base is the one the run trained on (the run's
config.yaml beside a final adapter, the config in a checkpoint's trainer_state.json), else the one
adapter_config.json names. An adapter trained with adapter_mode=new_on_merged sat on base + the SFT adapter merged:
that SFT adapter is merged first, then this one.

MERGED_DIR gets safetensors weights (one model.safetensors, or shards of at most --max-shard-size with
model.safetensors.index.json), config.json (dtype set to the written one), generation_config.json when the base
has one, the tokenizer files (ADAPTER_DIR's when it holds a tokenizer, else the base's) and a model card naming
the base. --dtype auto keeps the base's dtype. The folder is written beside MERGED_DIR under a hidden name and
renamed when complete: a crash or a full disk leaves no half folder. --gguf also writes model-TYPE.gguf by
llama.cpp's own converter and an Ollama Modelfile beside it (model/gguf.py; pip install 'lowmem_dpo[gguf]').

Memory: the base is read, merged in float32 (W + scale * B @ A per adapter) and written a block of rows at a time,
so the peak is the adapters plus a few 16 MiB blocks, never the whole model nor a shard (bench/README.md).
Refused (exit 2): a pre-quantized base (merge into the unquantized one), .bin-only bases, adapters that are not
plain LoRA (DoRA, modules_to_save, LoRA biases, ...), adapter keys that match no base tensor, LoRA on embeddings
tied to the output head, and a MERGED_DIR that holds files other than an earlier export (which --overwrite replaces).
"""

# A stage on the top floor: it reads an adapter and a base and imports no other stage.

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from lowmem_dpo.config.cli import StageParser, run_cli
from lowmem_dpo.model import gguf, lora_merge, models, weights
from lowmem_dpo.model.lora_merge import CONV1D, EMBEDDING, LINEAR, LoraPair
from lowmem_dpo.runtime import files, folders
from lowmem_dpo.runtime.errors import UserError, log
from lowmem_dpo.runtime.units import fmt, parse_size
from lowmem_dpo.training import provenance
from lowmem_dpo.training.provenance import Chain, merge_chain

USAGE = ("ADAPTER_DIR MERGED_DIR [--dtype auto|bfloat16|float16|float32] [--max-shard-size 2GB] [--overwrite] "
         "[--no-progress] [--gguf f16|bf16|q8_0]")
DTYPES = ("auto", "bfloat16", "float16", "float32")
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # cast to --dtype; other tensors kept
# Saves memory: a tensor is read, merged and written in blocks of rows of about this many elements (16 MiB in
# float32), so the peak holds a few blocks, not the largest tensor (an embedding: 0.5 GiB in float32 at 7B). On the
# 7B-width slice of bench/export_memory.py, 4x larger blocks add 0.26 GB to the peak, 4x smaller ones take 1.8x the time.
BLOCK_ELEMENTS = 1 << 22


# -- what the base is, and where each LoRA pair goes -------------------------------------------------------------
def base_config(base: Path) -> dict:
    """The base's config.json; a pre-quantized base is refused (its weights are not the ones the adapter adds to)."""
    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"base {base}: cannot read its config.json ({type(e).__name__})") from None
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "quantized") if isinstance(quant, dict) else "quantized"
        raise UserError(f"base {base} is a pre-quantized checkpoint ({method}): merging into quantized weights "
                        "would round the adapter away or write a model no loader reads back. Merge into the "
                        "unquantized base instead: point the adapter's base (or the run's model_name_or_path) at "
                        "the 16-bit model it was quantized from")
    return config


def tied_modules(model) -> set[str]:
    """The names of the input embedding and output head when they share one weight (tie_word_embeddings)."""
    inputs, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or inputs.weight is not head.weight:
        return set()
    return {name for name, module in model.named_modules() if module is inputs or module is head}


def layout(module, pair: LoraPair, where: str) -> str:
    """How the LoRA delta lies in `module`'s weight, from the module's type, as peft decides it."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Embedding) and pair.embedding:
        return EMBEDDING
    if isinstance(module, torch.nn.Linear) and not pair.embedding:
        return LINEAR
    if isinstance(module, Conv1D) and not pair.embedding:
        return CONV1D  # GPT-2's Conv1D stores (in, out): peft's fan_in_fan_out
    raise UserError(f"{where}: LoRA on {pair.module}, a {type(module).__name__} layer: lowmem_dpo.export merges LoRA "
                    "on Linear, Conv1D and Embedding layers only")


def expected_shape(pair: LoraPair, how: str) -> tuple[int, int]:
    """The shape of the weight a pair's delta is added to (lora_merge.delta's)."""
    out, fan_in = pair.B.shape[0], pair.A.shape[1]  # B: (out, r); A: (r, in)
    return (out, fan_in) if how == LINEAR else (fan_in, out)


def plan_targets(model, chain_pairs: list[tuple[str, list[LoraPair]]],
                 infos: dict[str, weights.TensorInfo]) -> dict[str, list[tuple[LoraPair, str]]]:
    """The base tensor each LoRA pair is added to, with its layout, in merge order; a pair that fits no base tensor
    exactly is a UserError."""
    modules, tied = dict(model.named_modules()), tied_modules(model)
    prefix = f"{model.base_model_prefix}."
    targets: dict[str, list[tuple[LoraPair, str]]] = {}
    for where, pairs in chain_pairs:
        for pair in pairs:
            if pair.module not in modules:
                raise UserError(f"{where}: the adapter has LoRA weights for {pair.module}, which the base model "
                                "does not have: it was trained on another architecture; merge it into its own base")
            if pair.module in tied:
                raise UserError(f"{where}: the adapter has LoRA on {pair.module}, which this base ties to "
                                f"{' and '.join(sorted(tied - {pair.module}))} (tie_word_embeddings): one weight "
                                "serves both, and merged it would change both where the adapter changed one. "
                                "lowmem_dpo.export refuses it; use the adapter unmerged with peft")
            how = layout(modules[pair.module], pair, where)
            weight = f"{pair.module}.weight"
            if weight not in infos and weight.startswith(prefix):
                weight = weight[len(prefix):]  # checkpoints saved without the prefix (e.g. GPT-2's own)
            if weight not in infos:
                raise UserError(f"{where}: no base tensor {pair.module}.weight for the adapter's LoRA on "
                                f"{pair.module}; the base's weights do not match its architecture")
            if tuple(infos[weight].shape) != expected_shape(pair, how):
                raise UserError(f"{where}: the LoRA weights of {pair.module} make a {expected_shape(pair, how)} "
                                f"update, but the base's {weight} is {tuple(infos[weight].shape)}: the adapter was "
                                "trained on another model")
            if pair.base_weight is not None and pair.base_weight.shape != infos[weight].shape:
                raise UserError(f"{where}: the adapter saved its own {pair.module} weight of shape "
                                f"{tuple(pair.base_weight.shape)}, the base's is {tuple(infos[weight].shape)} (a "
                                "resized vocabulary): lowmem_dpo.export merges into the base's own shapes only")
            targets.setdefault(weight, []).append((pair, how))
    return targets


def adapter_pairs(adapter: Path) -> tuple[str, list[LoraPair]]:
    """An adapter folder's LoRA pairs, and how messages name it."""
    where = f"adapter {adapter}"
    weights_file = models.adapter_files(adapter)[1]
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            state = load_file(str(weights_file))
        except Exception as e:  # safetensors' own error types for a cut or corrupt file
            raise UserError(f"{weights_file}: not a readable safetensors file ({type(e).__name__}: "
                            f"{str(e)[:120]}); re-save the adapter, or point ADAPTER_DIR at an intact checkpoint"
                            ) from None
    else:
        state = torch.load(weights_file, map_location="cpu", weights_only=True)
    return where, lora_merge.lora_pairs(state, models.read_adapter_config(adapter, "ADAPTER_DIR"), where)


def output_dtype(choice: str, config: dict, infos: list[weights.TensorInfo]) -> torch.dtype:
    """--dtype, or with auto the base's: its config's dtype, else its first floating tensor's."""
    if choice != "auto":
        return getattr(torch, choice)
    named = config.get("dtype") or config.get("torch_dtype")
    if named in DTYPES[1:]:
        return getattr(torch, named)
    return next((i.dtype for i in infos if i.dtype in FLOATS), torch.float32)


# -- writing -----------------------------------------------------------------------------------------------------
def check_destination(merged_dir: Path, overwrite: bool, inputs: list[Path]) -> None:
    """MERGED_DIR must be new or empty, or an earlier export holding nothing else (replaced with --overwrite only),
    and never one of the inputs or a folder holding them. Anything else is refused, --overwrite or not: the whole
    folder is replaced, so hidden files (a .git) count too."""
    target = merged_dir.resolve()
    for p in inputs:
        if p.resolve() == target or target in p.resolve().parents:
            raise UserError(f"MERGED_DIR={str(merged_dir)!r} holds the input {p}: writing there would replace it; "
                            "choose another folder")
    folders.check(merged_dir, "merged model", "MERGED_DIR", earlier_export, hidden=True)
    held = folders.visible(merged_dir, hidden=True) if merged_dir.is_dir() else []
    if not held:
        return
    fresh = f"{folders.free_name(merged_dir)} is free"
    if not overwrite:
        raise UserError(f"MERGED_DIR={str(merged_dir)!r} holds an earlier export: pass --overwrite to replace it, "
                        f"or choose a new folder ({fresh})")
    recorded = set((folders.read_marker(merged_dir) or {}).get("files", []))
    others = [n for n in held if n != folders.MARKER and n not in recorded and not exported(n)]
    if others:
        raise UserError(f"MERGED_DIR={str(merged_dir)!r} holds an earlier export and files it did not write "
                        f"({folders.listed(others)}): --overwrite replaces the whole folder, so move them away first, "
                        f"or choose a new folder ({fresh})")


def exported(name: str) -> bool:
    """Whether a file name is one an export writes (for a folder exported before the marker recorded its files)."""
    return (name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))
            or name in ("config.json", "generation_config.json", "README.md", *models.TOKENIZER_FILES))


def earlier_export(folder: Path) -> bool:
    """A merged model this tool wrote before it marked its folders: its model card says so, and it holds nothing
    an export does not write."""
    try:
        card = (folder / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return "by lowmem_dpo.export." in card and all(exported(n) for n in folders.visible(folder, hidden=True))


def merged_blocks(info: weights.TensorInfo, targets: dict, dtype: torch.dtype):
    """A base tensor as MERGED_DIR stores it, block by block of rows: merged with its LoRA deltas in float32, cast to
    `dtype` (floating tensors only)."""
    out = dtype if info.dtype in FLOATS else info.dtype
    pairs = targets.get(info.name)
    for rows, block in weights.read_rows(info, BLOCK_ELEMENTS):
        yield lora_merge.merge(block, pairs, out, rows) if pairs else block.to(out)


def write_weights(folder: Path, infos: list[weights.TensorInfo], targets: dict, dtype: torch.dtype,
                  max_bytes: int, progress: bool) -> int:
    """The merged weights into `folder` as transformers shards them; returns the number of shards."""
    from tqdm.auto import tqdm

    entries = [(i.name, dtype if i.dtype in FLOATS else i.dtype, i.shape) for i in infos]
    sizes = [weights.nbytes(d, shape) for _, d, shape in entries]
    plan = weights.plan_shards(sizes, max_bytes)
    names = weights.shard_names(len(plan))
    with tqdm(total=sum(sizes), desc="export", unit="B", unit_scale=True, disable=not progress,
              dynamic_ncols=True) as bar:
        for name, shard in zip(names, plan):
            weights.write_shard(folder / name, [entries[i] for i in shard],
                                (merged_blocks(infos[i], targets, dtype) for i in shard), bar.update)
    if len(plan) > 1:
        weights.write_index(folder, names, [[entries[i] for i in shard] for shard in plan])
    return len(plan)


def write_metadata(folder: Path, chain: Chain, config: dict, dtype: torch.dtype) -> None:
    """config.json with the written dtype, generation_config.json, the tokenizer files and a model card."""
    config = dict(config)
    name = str(dtype).removeprefix("torch.")
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = name
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if (chain.base / "generation_config.json").is_file():
        shutil.copyfile(chain.base / "generation_config.json", folder / "generation_config.json")
    if chain.chat_template is not None:  # the run's template, which the tokenizer folder does not carry
        models.load_tokenizer(chain.tokenizer, chain.chat_template).save_pretrained(folder)
    else:
        for f in models.tokenizer_files(chain.tokenizer):
            shutil.copyfile(f, folder / f.name)
    merged = " then ".join(str(a) for a in chain.adapters)
    (folder / "README.md").write_text(f"---\nbase_model: {chain.base_name}\nlibrary_name: transformers\ntags:\n"
                                      f"- lowmem_dpo\n- merged-lora\n---\n\n{chain.base_name} with the LoRA "
                                      f"adapter {merged} merged in ({name}), by lowmem_dpo.export.\n",
                                      encoding="utf-8")


def place(tmp: Path, merged_dir: Path) -> None:
    """Move the finished folder to MERGED_DIR; old contents (--overwrite) are removed only once it is there."""
    old = None
    if merged_dir.is_dir() and any(merged_dir.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{merged_dir.name}.old-", dir=merged_dir.parent))
        os.replace(merged_dir, old / "replaced")
    os.replace(tmp, merged_dir)  # onto a missing or empty folder
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(adapter_dir: Path, merged_dir: Path, dtype: str = "auto", max_shard_size: str = "2GB",
           overwrite: bool = False, progress: bool = True, gguf_type: str | None = None) -> Path:
    """Merge ADAPTER_DIR (and the SFT adapter under it, for new_on_merged) into its base; write MERGED_DIR (and,
    gguf_type, its GGUF and Modelfile)."""
    if gguf_type is not None:
        gguf.check_available()  # before anything is read or written
    if not (adapter_dir / models.ADAPTER_CONFIG).is_file():
        raise UserError(f"ADAPTER_DIR={str(adapter_dir)!r} is not a PEFT adapter folder (no "
                        f"{models.ADAPTER_CONFIG}); pass a run's output_dir or one of its checkpoint folders")
    merged_dir = merged_dir.resolve()  # "." has no name to build the hidden sibling folder from
    max_bytes = parse_size(max_shard_size, "--max-shard-size")
    chain = merge_chain(adapter_dir)
    config = base_config(chain.base)
    infos = weights.tensors(chain.base)
    targets = plan_targets(models.meta_model(chain.base), [adapter_pairs(a) for a in chain.adapters],
                           {i.name: i for i in infos})
    out_dtype = output_dtype(dtype, config, infos)
    check_destination(merged_dir, overwrite, [chain.base, *chain.adapters])
    merged_dir.parent.mkdir(parents=True, exist_ok=True)
    need = sum(i.nbytes(out_dtype if i.dtype in FLOATS else None) for i in infos) + (1 << 20)
    if gguf_type is not None:  # its GGUF beside it: 2 bytes a weight in 16 bits, 34 per 32 in q8_0
        need += sum(i.nbytes(torch.float16) for i in infos) * (17 if gguf_type == "q8_0" else 32) // 32
    then = f"Nothing was written to {merged_dir}."
    files.ensure_free_space(merged_dir.parent, need, "the merged model", then)
    for stale in merged_dir.parent.glob(f".{merged_dir.name}.partial-*"):  # a killed export's: never a model
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{merged_dir.name}.partial-", dir=merged_dir.parent))
    try:
        shards = write_weights(tmp, infos, targets, out_dtype, max_bytes, progress)
        write_metadata(tmp, chain, config, out_dtype)
        if gguf_type is not None:  # the finished folder, converted before it is placed: all or nothing
            gguf.convert(tmp, gguf_type, merged_dir.name)  # named as MERGED_DIR, not the partial folder
            tokenizer = models.load_tokenizer(tmp)
            (tmp / "Modelfile").write_text(gguf.modelfile(gguf.file_name(gguf_type), tokenizer), encoding="utf-8")
        folders.mark(tmp, "merged model", [p.name for p in tmp.iterdir()])
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        os.chmod(tmp, 0o755)
        files.fsync_tree(tmp)
        place(tmp, merged_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if files.is_disk_full(e):
            raise files.disk_full_error(merged_dir.parent, "the merged model", need, then) from None
        raise
    log(f"export: {merged_dir}: {len(targets)} weights merged from {len(chain.adapters)} adapter(s) into "
        f"{chain.base}, {fmt(need - (1 << 20))} of {str(out_dtype).removeprefix('torch.')} in {shards} shard(s)")
    warned = provenance.run_warnings(adapter_dir, "export")
    if warned:
        log(warned)
    return merged_dir


def main(argv: list[str]) -> int:
    parser = StageParser("lowmem-dpo export", USAGE)
    parser.add_argument("adapter_dir", type=Path)
    parser.add_argument("merged_dir", type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--gguf", choices=gguf.TYPES, default=None)
    a = parser.parse_args(argv)
    export(a.adapter_dir, a.merged_dir, a.dtype, a.max_shard_size, a.overwrite, not a.no_progress, a.gguf)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main, None, "export", __doc__, usage=USAGE))
