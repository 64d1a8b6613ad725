"""A model folder's safetensors weights, read and written one tensor at a time (export.py's merge streams them).

Reading goes a block of rows at a time, opening the shard (safetensors' safe_open) for each block and closing it
after: safe_open memory-maps the whole file, and every page of it that was read stays in the process's resident
memory until the map closes, so one open map read through would hold a whole shard. Writing needs no shard in
memory either: a safetensors file is an 8-byte header length, a JSON header of each tensor's dtype, shape and
byte range, then the bytes in that order, and the header is known before any tensor is computed (from the base's
shapes), so each block is written as it is made. The folder layout is transformers': one model.safetensors, or
model-0000K-of-0000N.safetensors and model.safetensors.index.json (its total_size and weight_map).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from lowmem_dpo.runtime.errors import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a saved model, known from its shard's header (no data read)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        return nbytes(dtype or self.dtype, self.shape)


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, in its index's order (or the single model.safetensors)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: unreadable ({type(e).__name__}); re-download the model") from None
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise UserError(f"{index} names {len(missing)} shards that are not in the folder (first: {missing[0]}); "
                            "the download is incomplete: fetch the missing files")
        return [folder / n for n in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if found:
        raise UserError(f"model folder {str(folder)!r} has {', '.join(found)} but neither {SINGLE} nor {INDEX}: "
                        "not a transformers model folder")
    if any(folder.glob("*.bin")):
        raise UserError(f"model folder {str(folder)!r} holds only PyTorch .bin weights; the streaming export reads "
                        "safetensors: convert the base once (load it with transformers and save_pretrained it, "
                        "which writes safetensors) and point the adapter at the converted folder")
    raise UserError(f"model folder {str(folder)!r} has no safetensors weights")


def tensors(folder: Path) -> list[TensorInfo]:
    """Every tensor of a model folder, shard by shard, each shard's in file order (for sequential reads)."""
    from safetensors import safe_open

    out = []
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                names = {name: f.get_slice(name) for name in f.keys()}
                found = [(name, tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
                         for name, tensor_slice in names.items()]
        except Exception as e:  # safetensors' own error types for a cut or corrupt header
            raise UserError(f"{path}: not a readable safetensors file ({type(e).__name__}: {str(e)[:120]}); "
                            "restore the base's weights") from None
        for name, code, shape in found:
            if code not in DTYPES:
                raise UserError(f"{path}: tensor {name} has dtype {code}, which lowmem_dpo.export does not write")
            out.append(TensorInfo(name, path, DTYPES[code], shape))
    return out


def read_rows(info: TensorInfo, elements: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """A tensor in blocks of whole rows (first dimension) of about `elements` elements each: (rows, block). The
    shard is opened for each block and closed after: the memory map that safe_open reads through then lets go of
    its pages (see the module docstring), so memory holds one block, never the tensor or the shard."""
    from safetensors import safe_open

    if not info.shape or info.shape[0] == 0:
        with safe_open(str(info.file), framework="pt") as f:
            yield slice(None), f.get_tensor(info.name)
        return
    step = max(1, elements // max(1, math.prod(info.shape[1:])))
    for start in range(0, info.shape[0], step):
        with safe_open(str(info.file), framework="pt") as f:
            block = f.get_slice(info.name)[start:start + step]  # a copy of those rows
        yield slice(start, start + step), block


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """transformers' split: the indices of `sizes` in order, a new shard when the next tensor would take the current
    one over max_bytes (a tensor larger than max_bytes gets a shard of its own)."""
    shards: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if shards[-1] and total + size > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += size
    return shards if shards[0] else []


def shard_names(count: int) -> list[str]:
    """transformers' file names for `count` shards."""
    if count == 1:
        return [SINGLE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `entries` (name, dtype, shape) back to back
    in that order, padded with spaces to a multiple of 8 bytes as safetensors writes it."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = nbytes(dtype, shape)
        meta[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                made: Iterable[Iterable[torch.Tensor]], on_bytes=None) -> None:
    """Write a safetensors file whose tensors are produced while it is written: `made` gives, for each of `entries`
    in order, its blocks of rows in order (each block the entry's dtype); `on_bytes(n)` after each block."""
    with open(path, "wb") as f:
        f.write(header(entries))
        for (name, dtype, shape), blocks in zip(entries, made, strict=True):
            written = 0
            for block in blocks:
                if block.dtype != dtype:
                    raise AssertionError(f"{name}: made {block.dtype}, the header says {dtype}")
                data = block.contiguous().reshape(-1).view(torch.uint8).numpy()  # the raw bytes, no copy
                f.write(memoryview(data))
                written += data.nbytes
                if on_bytes is not None:
                    on_bytes(data.nbytes)
            if written != nbytes(dtype, shape):
                raise AssertionError(f"{name}: made {written} bytes, the header says {nbytes(dtype, shape)}")


def write_index(folder: Path, names: list[str], shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]]) -> None:
    """model.safetensors.index.json for several shards (transformers' form)."""
    total = sum(nbytes(dtype, shape) for shard in shards for _, dtype, shape in shard)
    weight_map = {name: file for file, shard in zip(names, shards) for name, _, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
