"""Consolidate a ``ts.save`` checkpoint (or a plain DCP folder of ``{"model": get_model_state_dict(model)}``, as
FSDP2 users write it) into one model file set (safetensors or ``torch.save``), in one process.

A checkpoint holds the model as DCP shards written by every rank. Converting needs no process group and no
GPU: the reader asks DCP for one tensor at a time (``dcp.load(..., no_dist=True)`` into a state dict holding
only that key), so the whole model is never in memory at once on the safetensors path.

[Note: streaming safetensors] A safetensors file is an 8-byte header length, a JSON header giving every
tensor's dtype, shape and byte range, then the raw little-endian bytes. Every shape and dtype is in the DCP
metadata, so each shard's header is written first and its tensors are then read, cast and written one after
another into one reused buffer: peak memory is the largest tensor (twice when ``dtype`` casts it) plus DCP's
read of one saved chunk, whatever the shard size.
Shards follow transformers' convention: ``model.safetensors`` when there is one, else
``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json`` mapping each name to its file.

Names are the module's own (the checkpoint's ``model`` entries without the ``model.`` prefix), exactly the keys
of ``ts.full_state_dict``: a tied weight is written under each of its names (the checkpoint stores both, and
does not record that they were one tensor). transformers' ``from_pretrained`` accepts the tied copy and ties
the two again, so a GPT-2 written this way loads with no missing or unexpected keys.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["ConvertError", "Entry", "model_entries", "read_model_tensors", "to_safetensors", "to_torch",
           "parse_size", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD = 5 * 10**9          # transformers' default: "5GB", decimal

# safetensors dtype codes (https://github.com/huggingface/safetensors, format.md)
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class ConvertError(ValueError):
    """A conversion that cannot be done as asked (existing output, unknown format, a non-tensor entry)."""


@dataclass(frozen=True)
class Entry:
    """One model tensor of a checkpoint: its name in the module, its DCP key, global shape and saved dtype."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * _itemsize(dtype or self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` (bytes) -> bytes; GB is 10**9 and GiB 2**30, as in
    transformers' ``max_shard_size``."""
    if isinstance(text, int):
        size = text
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        s = text.strip().upper()
        digits = s.rstrip("KMGTIB")
        unit = s[len(digits):]
        try:
            number = float(digits)
        except ValueError:
            number = None
        if number is None or unit not in units:
            raise ConvertError(f"size {text!r} is not a size: write a number with an optional unit, such as "
                               "5GB, 500MB, 2GiB or 1000 (bytes)")
        size = int(number * units[unit])
    if size < 1:
        raise ConvertError(f"size {text!r} must be at least one byte")
    return size


class _Reader:
    """One checkpoint's model entries, read one tensor at a time with no process group."""

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from . import sharded as checkpoint

        self.path = checkpoint.resolve(path)
        if verify and not checkpoint.is_plain_dcp(self.path):   # a plain DCP folder has no manifest to check
            checkpoint.verify(self.path)       # every file's presence, size and CRC-32 against the manifest

        # DCP's reader, reading .metadata once (every load asks) and as data only: a checkpoint from elsewhere
        # cannot run code here ([Note: nothing runs from a file] in sharded.py)
        self.reader = checkpoint.SafeReader(self.path)
        metadata = self.reader.read_metadata()
        paths = getattr(metadata, "planner_data", None) or {}
        self.entries: list[Entry] = []
        for key, meta in metadata.state_dict_metadata.items():
            where = paths.get(key)
            if where is not None:
                if where[0] != "model":
                    continue
                name = ".".join(str(p) for p in where[1:])
            elif key.startswith("model."):
                name = key[len("model."):]
            else:
                continue
            if not isinstance(meta, TensorStorageMetadata):
                raise ConvertError(f"model entry {name!r} of {self.path} is not a tensor (a module's extra "
                                   "state): convert writes tensors only")
            self.entries.append(Entry(name, key, tuple(meta.size), meta.properties.dtype))
        if not self.entries:
            raise ConvertError(f"{self.path} holds no model tensors (no 'model' entries): convert reads ts.save "
                               "checkpoints and DCP folders saved as dcp.save({\"model\": get_model_state_dict("
                               "model)}) (or with get_state_dict's optimizer beside it); save the model under "
                               "\"model\"")

    def read(self, entry: Entry, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The full tensor of ``entry``; read into the front of ``scratch`` (bytes) when given, so a stream of
        tensors reuses one buffer instead of allocating and freeing one per tensor."""
        import torch.distributed.checkpoint as dcp

        from .sharded import SafePlanner

        if scratch is None:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
        else:
            tensor = scratch[:entry.nbytes()].view(entry.dtype).view(entry.shape)
        box = {entry.key: tensor}
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(box, storage_reader=self.reader, planner=SafePlanner(self.reader), no_dist=True)
        return box[entry.key]


def model_entries(checkpoint: str | os.PathLike) -> list[Entry]:
    """The model tensors of a checkpoint (a checkpoint folder or a folder whose ``latest`` names one), in the
    module's order, without reading them; verifies the checkpoint against its manifest first."""
    return _Reader(checkpoint).entries


def read_model_tensors(checkpoint: str | os.PathLike, dtype: torch.dtype | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for each model tensor, one at a time; floating tensors cast to ``dtype`` if given.

    Holds one tensor at a time (the caller decides what to keep), so a model of any size can be streamed."""
    reader = _Reader(checkpoint)
    for entry in reader.entries:
        yield entry.name, _cast(reader.read(entry), dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def _out_dtype(entry: Entry, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype


def _plan_shards(entries: list[Entry], dtype: torch.dtype | None, max_shard: int) -> list[list[Entry]]:
    """Greedy in module order, as transformers does: a tensor larger than the limit gets a shard of its own."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = entry.nbytes(_out_dtype(entry, dtype))
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def _write_safetensors(path: Path, reader: _Reader, entries: list[Entry], dtype: torch.dtype | None) -> int:
    """One safetensors file, header first, then each tensor's bytes straight from its memory
    ([Note: streaming safetensors]). Returns the bytes of tensor data written."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        out = _out_dtype(entry, dtype)
        if out not in _ST_DTYPES:
            raise ConvertError(f"{entry.name} has dtype {out}, which safetensors cannot store: use --to torch")
        n = entry.nbytes(out)
        header[entry.name] = {"dtype": _ST_DTYPES[out], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                   # the data starts 8-byte aligned, as safetensors writes it
    # one buffer for the tensors as saved and one for their casts, each of the largest: peak memory stays put
    scratch = torch.empty(max(entry.nbytes() for entry in entries), dtype=torch.uint8)
    cast = torch.empty(max((entry.nbytes(_out_dtype(entry, dtype)) for entry in entries
                            if _out_dtype(entry, dtype) != entry.dtype), default=0), dtype=torch.uint8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for entry in entries:
            tensor = reader.read(entry, scratch)
            out = _out_dtype(entry, dtype)
            if out != entry.dtype:
                tensor = cast[:entry.nbytes(out)].view(out).view(entry.shape).copy_(tensor)
            if tensor.numel():
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
        f.flush()
        os.fsync(f.fileno())
    return offset


def _prepare_folder(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out} exists and is a file: --to safetensors writes a folder; give a folder path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConvertError(f"{out} already exists and is not empty: choose another folder or pass --force to "
                           "replace the model files in it")


def _hf_config(config: str | os.PathLike, dtype: torch.dtype | None) -> dict:
    """A transformers config.json (the file, or a folder holding one), with ``dtype`` set to what is written."""
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConvertError(f"config {config} does not exist: give a transformers config.json or a folder "
                           "holding one")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConvertError(f"config {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConvertError(f"config {path} is not a transformers config (no \"model_type\" key)")
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        data["dtype"] = name
        if "torch_dtype" in data:
            data["torch_dtype"] = name
    return data


def to_safetensors(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
                   max_shard_size: int | str = DEFAULT_MAX_SHARD, config: str | os.PathLike | None = None,
                   force: bool = False) -> list[Path]:
    """Write the checkpoint's model to the folder ``out`` as safetensors shards of at most ``max_shard_size``
    bytes each (a larger tensor gets a shard of its own); floating tensors cast to ``dtype`` if given.

    ``config``: a transformers config (``config.json`` or its folder) copied beside the weights, so that
    ``from_pretrained(out)`` works. An existing non-empty ``out`` is refused unless ``force``, which replaces
    the model files in it (and config.json when ``config`` is given) and leaves other files alone. The files
    appear only once all are written. Returns the files written.
    """
    out = Path(out)
    max_shard = parse_size(max_shard_size)
    _prepare_folder(out, force)
    config_data = _hf_config(config, dtype) if config is not None else None
    if sys.byteorder != "little":
        raise ConvertError("safetensors is little-endian and this machine is not: convert on another machine")
    reader = _Reader(checkpoint)
    shards = _plan_shards(reader.entries, dtype, max_shard)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.convert-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        total = 0
        for name, shard in zip(names, shards):
            total += _write_safetensors(staging / name, reader, shard, dtype)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if config_data is not None:
            (staging / "config.json").write_text(json.dumps(config_data, indent=2, sort_keys=True) + "\n")
        written = sorted(p.name for p in staging.iterdir())
        if not out.exists():
            staging.rename(out)
        else:
            out.mkdir(exist_ok=True)
            for old in out.iterdir():                 # shards of an earlier conversion that the new one lacks
                if old.name in _WEIGHT_FILES or (old.name.startswith("model-") and old.name.endswith(".safetensors")):
                    old.unlink()
            for name in written:
                (staging / name).replace(out / name)
            staging.rmdir()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in written]


def to_torch(checkpoint: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | None = None,
             force: bool = False) -> Path:
    """Write the checkpoint's model as one ``torch.save`` file of ``{name: tensor}``.

    ``torch.save`` takes the whole dict, so the model is in memory once (read one tensor at a time, never
    twice). An existing ``out`` is refused unless ``force``; the file appears only once it is complete."""
    out = Path(out)
    if out.is_dir():
        raise ConvertError(f"{out} is a folder: --to torch writes one file; give a file path such as {out}/model.pt")
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists: choose another path or pass --force to replace it")
    reader = _Reader(checkpoint)
    state = {entry.name: _cast(reader.read(entry), dtype) for entry in reader.entries}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.convert-{secrets.token_hex(4)}"
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
