"""Checkpoints that outlive the topology: ``torch.distributed.checkpoint`` under names users know, made atomic.

A checkpoint is a folder of DCP files (every rank writes its own shards, in parallel) holding
``{"model": model state dict, "optim": optimizer state dict}`` under the module's original names (torch's
``get_state_dict``), plus:

    tiershard.json      the manifest: every file's size and CRC-32, the world, topology and plan that wrote it
    extra/rank<R>.pt    what the trainer passed as ``extra`` on rank R (step, data position, RNG states)

Because masters are DTensors, DCP reshards on load: a checkpoint loads under any world size, topology and plan.

[Note: atomic save] Ranks write into a hidden temporary folder beside the target; each rank checksums and
fsyncs the files it is assigned; rank 0 writes the manifest, fsyncs it, renames the folder into place, fsyncs
the parent, and only then points ``latest`` at it (written to a temporary file and renamed). A save killed at
any point leaves the previous checkpoint and ``latest`` as they were; leftovers of a killed save are removed
by the next one.

[Note: refused loads change nothing] Before reading a byte into the model, every rank checks the manifest
(each file's presence and size, and the CRC-32 of a share of the files), and all ranks agree; DCP then checks
that every tensor the model needs is in the checkpoint before it reads any. A truncated, corrupt or
incomplete checkpoint raises ``CheckpointError`` naming the file, and the model and optimizer are untouched.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

__all__ = ["CheckpointError", "save", "load", "latest", "resolve", "verify"]

MANIFEST = "tiershard.json"
LATEST = "latest"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and what is wrong."""


def _engine(model: torch.nn.Module):
    from ..runtime.api import _engine as engine_of

    return engine_of(model)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(error: str | None) -> None:
    """Every rank raises the first rank's error, or none does: a refusal must not leave ranks split."""
    if dist.is_initialized():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc(path: Path, sync: bool = False) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
        if sync:
            os.fsync(f.fileno())
    return crc


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None) -> Path:
    """Save ``model`` (and ``optimizer``) to the folder ``path`` on every rank, atomically ([Note: atomic save]).

    ``extra`` (any picklable value, may differ per rank) is kept per rank and returned by ``load``. The parent
    folder's ``latest`` then names this checkpoint. Returns the checkpoint folder.
    """
    engine = _engine(model)
    rank, world = _rank_world()
    path = Path(path).absolute()
    token = _broadcast(secrets.token_hex(4) if rank == 0 else None)
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(".*.tmp-*"):     # left by saves that were killed (one job per folder)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier()
    state = _state(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp))
    (tmp / "extra").mkdir(exist_ok=True)
    torch.save(extra, tmp / "extra" / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    files = _files(tmp)
    mine = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "crc32": _crc(f, sync=True)}
            for i, f in enumerate(files) if i % world == rank}
    everyone: list = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if rank == 0:
        manifest = {"format": FORMAT, "files": {k: v for part in everyone for k, v in sorted(part.items())},
                    "world_size": world, "topology": list(engine.topology.sizes),
                    "plan": str(engine.placement.plan), "time": time.time()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if path.exists():                  # replacing a checkpoint: the old one is removed only after the swap
            old = path.parent / f".{path.name}.old-{token}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
        _fsync(path.parent)
        pointer = path.parent / f".{LATEST}.tmp-{token}"
        pointer.write_text(path.name + "\n")
        _fsync(pointer)
        pointer.rename(path.parent / LATEST)
        _fsync(path.parent)
    if dist.is_initialized():
        dist.barrier()
    return path


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    return Path(root) / name if name else None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder, or a folder of checkpoints whose ``latest`` names one."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        return path
    target = latest(path)
    if target is not None:
        return target
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
    raise CheckpointError(f"no checkpoint at {path}: it has neither {MANIFEST} (a checkpoint) nor {LATEST} "
                          "(a folder of checkpoints)")


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint into ``model`` (and ``optimizer``) under any world size, topology and plan.

    ``path`` is a checkpoint folder or a folder whose ``latest`` names one. Returns the ``extra`` this rank
    saved (rank 0's when the checkpoint was written by fewer ranks). Raises ``CheckpointError``, changing
    nothing, when the checkpoint is missing, incomplete or corrupt ([Note: refused loads change nothing]).
    """
    engine = _engine(model)
    rank, world = _rank_world()
    error = None
    try:
        path = resolve(path)
        manifest = verify(path, rank, world)
    except CheckpointError as err:
        error, manifest = str(err), None
    _agree(error)
    state = _state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:   # a tensor the model needs is missing or has another shape
        raise CheckpointError(f"checkpoint {path} does not fit this model: {_first_failure(err)}") from None
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for group in engine.groups():
        group.sync_params()
    extra = path / "extra" / f"rank{rank}.pt"
    if not extra.is_file() or manifest.get("world_size") != world:
        extra = path / "extra" / "rank0.pt"
    return torch.load(extra, weights_only=False) if extra.is_file() else None


def _first_failure(err: BaseException) -> str:
    """One line for a DCP failure, which carries every rank's traceback."""
    failures = getattr(err, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        err = exc[0] if isinstance(exc, tuple) else exc
    return str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """What DCP saves and loads: torch's own state dicts, keyed by the module's parameter names."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def verify(path: Path, rank: int = 0, world: int = 1) -> dict:
    """Check the manifest against the files: presence and size of all, CRC-32 of this rank's share (all of them
    by default, in one process). Returns the manifest; raises ``CheckpointError`` naming the first bad file."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_path} is missing (a save that did not "
                              "finish, or not a tiershard checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {manifest_path} cannot be read ({err})") from None
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: its metadata file {path / '.metadata'} is missing")
    for index, (name, entry) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {f} is missing")
        size = f.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {f} has {size} bytes, the manifest says "
                                  f"{entry['size']} (truncated or overwritten)")
        if index % world == rank and _crc(f) != entry["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {f} does not match its CRC-32 in the manifest")
    return manifest
