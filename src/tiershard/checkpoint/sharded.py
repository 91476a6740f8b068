"""Checkpoints that outlive the topology: ``torch.distributed.checkpoint`` under names users know, made atomic.

A checkpoint is a folder of DCP files (every rank writes its own shards, in parallel) holding
``{"model": model state dict, "optim": optimizer state dict}`` under the module's original names (torch's
``get_state_dict``), plus:

    tiershard.json      the manifest: every file's size and CRC-32, the world, topology and plan that wrote it
    extra/rank<R>.pt    what the trainer passed as ``extra`` on rank R (step, data position, RNG states): plain data

Because masters are DTensors, DCP reshards on load: a checkpoint loads under any world size, topology and plan.

[Note: atomic save] Ranks write into a hidden temporary folder beside the target; each rank checksums and
fsyncs the files it is assigned; rank 0 writes the manifest, fsyncs it, renames the folder into place, fsyncs
the parent, and only then points ``latest`` at it (written to a temporary file and renamed). A save killed at
any point leaves the previous checkpoint and ``latest`` as they were; leftovers of a killed save are removed
by the next one. Replacing a checkpoint of the same name takes two renames (the old folder aside to
``.NAME.old-TOKEN``, the new one into place); a kill between them leaves ``latest`` naming a folder that is not
there, so ``latest()`` then names the set-aside previous checkpoint, and the next save renames it back before it
writes.

[Note: refused loads change nothing] Before reading a byte into the model, every rank checks the manifest
(each file's presence and size, and the CRC-32 of a share of the files), and all ranks agree; DCP then checks
that every tensor the model needs is in the checkpoint before it reads any. A truncated, corrupt or
incomplete checkpoint raises ``CheckpointError`` naming the file, and the model and optimizer are untouched.
So does a checkpoint of another model (missing or unexpected keys) unless ``strict=False``.

[Note: nothing runs from a file] A checkpoint may come from elsewhere, and unpickling runs whatever the pickle
names. So every pickle in it is read admitting plain data only: the extras and DCP's non-tensor entries (optimizer
hyperparameters) through torch's weights-only loader (tensors, numbers, strings, lists, tuples, dicts) plus NumPy
arrays (NumPy's RNG state), and DCP's ``.metadata`` through an unpickler that admits only the classes DCP's
metadata is made of (``SafeReader``, which ``tiershard convert`` uses too). ``ts.save`` reads each extra back the
same way before the checkpoint is renamed into place, so what it writes, ``ts.load`` can read.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import io
import json
import os
import pickle
import re
import secrets
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from ..comm.failure import CollectiveError, guard
from ..topology import TierGroup
from ..runtime.flat import copy_in_background
from .staging import ShardStager, _local

__all__ = ["CheckpointError", "LoadResult", "SaveFuture", "save", "load", "latest", "resolve", "verify"]

MANIFEST = "tiershard.json"
LATEST = "latest"
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and what is wrong."""


class LoadResult(dict):
    """What ``ts.load`` returns: the saved ``extra`` (its items when it is a dict, so ``result["step"]`` reads as
    before; ``.extra`` is the extra itself, whatever it is), and the DCP keys it did not load, as
    ``nn.Module.load_state_dict`` reports them: ``missing_keys`` (in the model or optimizer, not in the
    checkpoint: kept as they were) and ``unexpected_keys`` (in the checkpoint, not in them: not read)."""

    def __init__(self, extra: Any = None, missing_keys: list[str] | None = None,
                 unexpected_keys: list[str] | None = None):
        super().__init__(extra if isinstance(extra, dict) else {})
        self.extra = extra
        self.missing_keys = list(missing_keys or [])
        self.unexpected_keys = list(unexpected_keys or [])

    def __reduce__(self):
        return (LoadResult, (self.extra, self.missing_keys, self.unexpected_keys))


def _engine(model: torch.nn.Module):
    from ..runtime.api import _engine as engine_of

    return engine_of(model)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _bounded(op: str):
    """Run ``save``/``load`` as one collective of the topology's ``control_group``: bounded by its timeout, and
    a rank that does not take part is named in the ``CollectiveError`` ([Note: bounded collectives])."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(path, model, *args, **kwargs):
            topology = _engine(model).topology
            with guard(op, topology.control_group, topology, unit=f"checkpoint {Path(path).absolute()}"):
                return fn(path, model, *args, **kwargs)
        return run
    return wrap


def _broadcast(value: Any, group=None) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _agree(error: str | None, group=None) -> None:
    """Every rank raises the first rank's error, or none does: a refusal must not leave ranks split."""
    if dist.is_initialized():
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=group)
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


# ---- reading pickles as data, never code ([Note: nothing runs from a file]) ----------------------------------
PLAIN = "tensors, NumPy arrays, numbers, strings, None, and lists, tuples and dicts of them"


class _NotPlain(Exception):
    """A pickle that names something other than plain data; the message says what."""


def _numpy_globals() -> list:
    """What NumPy arrays and scalars unpickle through (NumPy's RNG state is an array): only array builders."""
    try:
        import numpy as np
    except ImportError:
        return []
    dtypes = {type(np.dtype(code)) for code in np.typecodes["All"]}
    return [np.ndarray, np.dtype, *dtypes, np.zeros(1).__reduce__()[0], np.float64(0).__reduce__()[0]]


def _plain(source: Any) -> Any:
    """Unpickle a ``torch.save`` file or buffer admitting plain data only (torch's weights-only loader)."""
    allow = getattr(torch.serialization, "safe_globals", None)     # torch >= 2.5; before, allow them for good
    if allow is None:
        torch.serialization.add_safe_globals(_numpy_globals())
    try:
        with allow(_numpy_globals()) if allow is not None else contextlib.nullcontext():
            return torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+) was not an allowed global", str(err))
        if found:
            raise _NotPlain(f"a reference to {found.group(1)}") from None
        why = [line.strip() for line in str(err).partition("WeightsUnpickler error:")[2].splitlines() if line.strip()]
        raise _NotPlain(f"an object torch's weights-only reader refuses ({why[0] if why else err})") from None


def _write_extra(extra: Any, file: Path, rank: int) -> str | None:
    """Pickle this rank's ``extra`` into ``file``; why ``ts.load`` could not read it back, or None."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    file.write_bytes(buffer.getvalue())
    buffer.seek(0)
    try:
        _plain(buffer)
    except _NotPlain as err:
        return (f"ts.save: the extra of rank {rank} holds {err}, which is not plain data: ts.load reads back only "
                f"{PLAIN} (it never runs code from a checkpoint); pass plain data, e.g. an object's state_dict()")
    return None


def _read_extra(path: Path, rank: int, world: int, manifest: dict) -> Any:
    """This rank's extra (rank 0's when another world size wrote the checkpoint), read as plain data."""
    extra = path / "extra" / f"rank{rank}.pt"
    if not extra.is_file() or manifest.get("world_size") != world:
        extra = path / "extra" / "rank0.pt"
    if not extra.is_file():
        return None
    try:
        return _plain(extra)
    except _NotPlain as err:
        raise CheckpointError(f"checkpoint {path}: {extra} holds {err}, which is not plain data; ts.load reads only "
                              f"{PLAIN}, and never runs code from a file (a checkpoint from elsewhere, or one saved "
                              "with objects in its extra: load it where it was written and save plain data)") from None
    except Exception as err:  # noqa: BLE001 - a file torch.load cannot parse at all
        raise CheckpointError(f"checkpoint {path} is corrupt: {extra} cannot be read ({err})") from None


# What DCP's .metadata is made of (torch 2.x); a reference to anything else is refused, never called.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what ``_METADATA_GLOBALS`` (and torch's dtypes) names; anything else is refused unbuilt."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _NotPlain(f"{module}.{name}")


def read_metadata(path: Path) -> Metadata:
    """DCP's index of the checkpoint folder ``path``, unpickled admitting only the classes DCP's metadata is made
    of ([Note: nothing runs from a file]); raises ``CheckpointError`` naming the file otherwise."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _NotPlain as err:
        raise CheckpointError(f"checkpoint {path}: {file} holds an object that is not checkpoint metadata (a "
                              f"reference to {err}); it is refused rather than run: the file was not written by "
                              "torch.distributed.checkpoint, or was altered") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: its metadata file {file} is missing") from None
    except Exception as err:  # noqa: BLE001 - truncated or not a pickle at all
        raise CheckpointError(f"checkpoint {path} is corrupt: {file} cannot be read ({err!r})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: {file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` once through ``read_metadata`` and the non-tensor entries before
    any tensor (a refused one stops the load before the state is written), each as plain data (``SafePlanner``)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(str(path))
        self.folder = Path(path)
        self.metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self.metadata = read_metadata(self.folder)
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan, planner):
        data = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if data and len(data) < len(plan.items):
            super().read_data(dataclasses.replace(plan, items=data), planner).wait()
            plan = dataclasses.replace(plan, items=[item for item in plan.items if item.type != LoadItemType.BYTE_IO])
        return super().read_data(plan, planner)


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, unpickling non-tensor entries (optimizer hyperparameters) as plain data only."""

    def __init__(self, reader: SafeReader, allow_partial_load: bool = False):
        super().__init__(allow_partial_load=allow_partial_load)
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = _plain(value)
        except _NotPlain as err:
            where = self.reader.folder / self.reader.storage_data[read_item.storage_index].relative_path
            raise CheckpointError(f"checkpoint {self.reader.folder}: its entry {fqn} in {where} holds {err}, which "
                                  f"is not plain data; ts.load reads only {PLAIN}, and never runs code from a file "
                                  "(the checkpoint was not written by ts.save or torch's state dicts, or was "
                                  "altered)") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


@_bounded("save")
def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, *, async_save: bool = False) -> Path | SaveFuture:
    """Save ``model`` (and ``optimizer``) to the folder ``path`` on every rank, atomically ([Note: atomic save]).

    ``extra`` (plain data: tensors, NumPy arrays, numbers, strings, None, and lists, tuples and dicts of them; may
    differ per rank) is kept per rank and returned by ``load``; anything else raises ``CheckpointError`` on every
    rank and nothing is renamed into place. The parent folder's ``latest`` then names this checkpoint. Returns the
    checkpoint folder.

    ``async_save=True`` returns at once and copies this rank's state aside in the background; the optimizer's next
    step (and any load) waits for the copy, and an in-place write made while it is taken fails the save
    ([Note: asynchronous save]). It returns a ``SaveFuture`` whose ``result()`` waits until the checkpoint is in
    place and ``latest`` names it, and returns its folder (or raises ``CheckpointError``; the previous checkpoint
    and ``latest`` are then unchanged). A later ``save`` or ``load`` of the model waits for it first.
    """
    engine = _engine(model)
    from ..runtime.api import _check_loaded

    _check_loaded(model, "ts.save")               # a meta-built model still waiting for its weights has none to save
    _wait_for_save(engine, "ts.save")             # one save at a time: the earlier one completes first
    group = engine.topology.control_group.pg      # bounded by the topology's timeout, not the default group's
    rank, world = _rank_world()
    path = Path(path).absolute()
    token = _broadcast(secrets.token_hex(4) if rank == 0 else None, group)
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _recover_replaced(path.parent)
        for stale in path.parent.glob(".*.tmp-*"):     # left by saves that were killed (one job per folder)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier(group=group)
    state = _state(model, optimizer)
    _restart_differences(engine)
    _write_reducers(engine, tmp, rank)
    if async_save:                                # the extra as it is now, before training goes on
        _save_extra(extra, tmp, rank, group)
        return _save_async(state, tmp, path, token, engine)
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)
    _save_extra(extra, tmp, rank, group)
    return _commit(tmp, path, token, engine, group)


def _restart_differences(engine) -> None:
    """[Note: a save restarts qWD] qWD sends each gather as a difference against a reference band that a
    checkpoint does not hold (a load starts from an exact gather), so every save drops the reference too: the
    gathers after it are exact on the saving run as on a run resumed from it, and a resume repeats the run bit for
    bit. One exact gather per save."""
    for group in engine.groups():
        if group.qwd is not None:
            group.sync_params()


def _save_extra(extra: Any, tmp: Path, rank: int, group) -> None:
    """Write this rank's extra into ``tmp``; one that ``load`` could not read is refused on every rank and the
    save ends there, nothing renamed."""
    (tmp / "extra").mkdir(exist_ok=True)
    error = _write_extra(extra, tmp / "extra" / f"rank{rank}.pt", rank)
    try:
        _agree(error, group)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: Path, path: Path, token: str, engine, group) -> Path:
    """Every rank's shards are in ``tmp``: checksum them, write the manifest, rename ``tmp`` to ``path`` and point
    ``latest`` at it ([Note: atomic save]); collectives on ``group``."""
    rank, world = _rank_world()
    if dist.is_initialized():
        dist.barrier(group=group)
    files = _files(tmp)
    mine = {str(f.relative_to(tmp)): {"size": f.stat().st_size, "crc32": _crc(f, sync=True)}
            for i, f in enumerate(files) if i % world == rank}
    everyone: list = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine, group=group)
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
        dist.barrier(group=group)
    return path


class SaveFuture(Future):
    """What ``ts.save(..., async_save=True)`` returns: ``result(timeout=None)`` waits until the checkpoint is in
    place and ``latest`` names it and returns its folder, or raises ``CheckpointError``; ``done()`` asks."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.observed = False           # result() or exception() was asked: its failure has been seen

    def result(self, timeout: float | None = None) -> Path:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        return super().exception(timeout)


def _wait_for_save(engine, what: str) -> None:
    """Wait for the model's asynchronous save in flight, if any; a failure nobody has looked at is raised here,
    before anything of ``what`` happens."""
    pending: SaveFuture | None = getattr(engine, "_tiershard_saving", None)
    if pending is None:
        return
    engine._tiershard_saving = None
    seen = pending.observed
    error = pending.exception()
    if error is not None and not seen:
        raise CheckpointError(f"{what}: the asynchronous save before it failed and nothing waited for its "
                              f"handle: {error} Nothing of this {what} was done; wait on the handle (its "
                              "result()) to see such a failure where it happens") from None


def _async_group(topology):
    """A gloo group of every rank for the background saves (DCP's async save needs a CPU backend; the main
    thread's collectives stay on ``control_group``), made once per topology by the first asynchronous save."""
    group = getattr(topology, "_tiershard_async_save_group", None)
    if group is None:
        world = dist.get_world_size()
        # bounded as the control group is ([Note: slow is not dead])
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=topology.group_timeout),
                               backend="gloo")
        topology._tiershard_async_save_group = group
    return group


def _save_async(state: dict, tmp: Path, path: Path, token: str, engine) -> SaveFuture:
    """[Note: asynchronous save] DCP's ``async_save``, given tiershard's stager (``staging.ShardStager``), copies this
    rank's state aside (a CPU copy; on a GPU into pinned memory) in a background thread, and a second thread writes
    the copy, then commits as ``save`` does ([Note: atomic save]) on a gloo group of its own: ``latest`` moves only
    after every rank's files are written and checksummed. A failed or killed write leaves the hidden folder, which
    the next save removes, and nothing else. The call returns at once; until the copy is taken, every write the
    engine sees coming waits for it ([Note: background copies]: the optimizer's step, loads). A write it cannot see
    coming (an in-place write to a parameter or an optimizer state) is caught by the tensors' version counters, read
    before the copy starts and the moment it ends: the save then fails on every rank, naming the tensor, instead of
    writing a torn checkpoint. The copy's buffers are made by the first asynchronous save and kept with the model
    for the next ones (a second save waits for the first, so one copy is enough: memory of this rank's shards, held
    from then on)."""
    rank, _ = _rank_world()
    group = _async_group(engine.topology)
    stager = getattr(engine, "_tiershard_stager", None)
    if stager is None:              # kept with the model: its buffers (pinned: slow to make) serve later saves
        stager = engine._tiershard_stager = ShardStager(engine.device)
    before = _versions(state)
    response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, async_stager=stager)
    copied: Future = Future()      # set only once the versions are read: no waiting writer runs before
    written: list[str] = []

    def staged(_) -> None:
        try:
            written.extend(name for name, mark in _versions(state).items() if mark != before.get(name))
        finally:
            copied.set_result(None)

    copy_in_background(copied)
    response.staging_completion.add_done_callback(staged)
    handle = SaveFuture(path)
    handle.set_running_or_notify_cancel()

    everyone = tuple(range(dist.get_world_size()))
    collective = TierGroup(everyone, everyone, group)      # a rank lost meanwhile is named ([Note: bounded ...])

    def finish() -> None:
        try:
            with guard("save", collective, engine.topology, unit=f"checkpoint {path}"):
                response.upload_completion.result()
                copied.result()
                _agree(f"rank {rank}'s {written[0]} was written while the save copied it ({len(written)} tensors "
                       "in all), so the copy may mix old and new values. Write parameters and optimizer states "
                       "after the optimizer's next step (which waits for the copy), or after the save (its "
                       "handle's result())" if written else None, group)
                handle.set_result(_commit(tmp, path, token, engine, group))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the handle
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            cause = err if isinstance(err, (CheckpointError, CollectiveError)) else _first_failure(err)
            failure = CheckpointError(f"ts.save to {path} failed in the background ({cause}): nothing was renamed "
                                      f"into place, the previous checkpoint and {LATEST} are unchanged")
            failure.__cause__ = _first_exception(err)     # its traceback, for whoever prints the handle's error
            handle.set_exception(failure)

    engine._tiershard_saving = handle
    threading.Thread(target=finish, name=f"tiershard-save-{path.name}").start()
    return handle


def _versions(state: dict) -> dict[str, tuple[int, int]]:
    """Each tensor of ``state`` by its key path: its version counters (a DTensor's and its shard's), which every
    in-place write advances."""
    from torch.utils._pytree import tree_flatten_with_path

    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in key):
            (value._version, _local(value)._version)
            for key, value in tree_flatten_with_path(state)[0] if isinstance(value, torch.Tensor)}


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when there is none yet. ``latest`` holds one folder name
    inside ``root``; anything else (a path, ``..``) is refused, so a load never reads outside ``root``."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name:
        return None
    if name in (".", "..") or any(c in name for c in "/\\\0"):
        raise CheckpointError(f"{pointer} names {name!r}, which is not a folder name inside {root}: `latest` holds "
                              "the name of one checkpoint beside it (ts.save writes it); write that name into it, "
                              "or load the checkpoint folder itself")
    target = Path(root) / name
    if not target.exists():
        aside = _set_aside(target)
        if aside is not None:              # a replacing save was killed between its renames ([Note: atomic save])
            return aside
    return target


def _set_aside(path: Path) -> Path | None:
    """The complete previous checkpoint a replacing save renamed aside, if one is there."""
    for old in sorted(path.parent.glob(f".{glob.escape(path.name)}.old-*")):
        if (old / MANIFEST).is_file():
            return old
    return None


def _recover_replaced(parent: Path) -> None:
    """(Rank 0, before a save writes.) Put back a checkpoint that a killed replacing save left aside, and remove
    the set-aside copies of replacements that completed."""
    for old in parent.glob(".*.old-*"):
        name = old.name[1:old.name.rindex(".old-")]
        if not old.is_dir() or not name:
            continue
        if not (parent / name).exists() and (old / MANIFEST).is_file():
            old.rename(parent / name)
        else:
            shutil.rmtree(old, ignore_errors=True)
    _fsync(parent)


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


@_bounded("load")
def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True) -> LoadResult:
    """Load a checkpoint into ``model`` (and ``optimizer``) under any world size, topology and plan.

    ``path`` is a checkpoint folder, a folder whose ``latest`` names one, or a plain DCP folder of torch's state
    dicts (``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict``, e.g. written by FSDP2: no manifest,
    so nothing to check its files against). Returns a ``LoadResult``: the ``extra`` this rank saved (rank 0's
    when the checkpoint was written by fewer ranks) and the missing and unexpected keys. Raises
    ``CheckpointError``, changing nothing, when the checkpoint is missing, incomplete or corrupt ([Note: refused
    loads change nothing]), or holds anything but data ([Note: nothing runs from a file]). ``strict`` (as in
    ``nn.Module.load_state_dict``): the checkpoint's keys must be exactly the model's (and the optimizer's);
    ``strict=False`` loads the keys that match and keeps the others as they are.
    """
    engine = _engine(model)
    _wait_for_save(engine, "ts.load")             # an asynchronous save in flight completes first
    group = engine.topology.control_group.pg      # bounded by the topology's timeout, not the default group's
    rank, world = _rank_world()
    error = reader = extra = None
    try:
        path = resolve(path)
        manifest = {} if is_plain_dcp(path) else verify(path, rank, world)
        reader = SafeReader(path)
        reader.read_metadata()
        extra = _read_extra(path, rank, world, manifest)
        reducers = _read_reducers(path, rank, world, manifest, engine)
        _check_islands(path, manifest, engine)
    except CheckpointError as err:
        error = str(err)
    state = _state(model, optimizer, None if reader is None or reader.metadata is None else
                   reader.metadata.state_dict_metadata)
    missing, unexpected = ([], []) if error is not None else _key_diff(reader.metadata, state)
    if error is None and strict:
        error = _mismatch(path, reader.metadata, state, missing, unexpected)
    _agree(error, group)
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(reader, allow_partial_load=not strict),
                 process_group=group)
    except (Exception, CheckpointException) as err:   # a tensor the model needs has another shape
        inner = _first_exception(err)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from None
        raise CheckpointError(f"checkpoint {path} does not fit this model: {_first_failure(err)}") from None
    prefix, own = _own(state, engine)
    model_state, options = own["model"], None
    if not strict:    # what the checkpoint lacks is not loaded: it keeps its value, and a parameter of a meta-built
        saved = reader.metadata.state_dict_metadata      # model that waits for a load goes on waiting
        model_state = {k: v for k, v in model_state.items() if f"{prefix}model.{k}" in saved}
        options = StateDictOptions(strict=False)
    if optimizer is None:
        set_model_state_dict(model, model_state, options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=own["optim"],
                       options=options)
    if engine.outer is not None:
        engine.outer.loaded(state["outer"])
    for group, reducer in zip(engine.groups(), reducers):
        if group.qgz is not None:
            group.qgz.load_state_dict(reducer)
    for group in engine.groups():
        group.sync_params()
    return LoadResult(extra, missing, unexpected)


def is_plain_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder ``dcp.save`` wrote by itself (``.metadata``, no tiershard manifest, none of
    the files ``ts.save`` writes beside DCP's), as opposed to a ``ts.save`` checkpoint that lost its manifest."""
    path = Path(path)
    return ((path / ".metadata").is_file() and not (path / MANIFEST).exists()
            and not (path / "extra").exists() and not (path / "qgz").exists())


# [Note: qgz state in checkpoints] qgz's reducers hold per-rank state that shapes the next reductions: the
# error-feedback residuals and the call counters that key stochastic rounding. ``ts.save`` writes them per rank
# (qgz/rank<R>.pt, one entry per flat group) and ``ts.load`` restores them when the same world, topology and plan
# wrote the checkpoint, so a resumed run continues bitwise as an uninterrupted one. Elsewhere they have no meaning
# (they follow this rank's layout) and the reducers start afresh, as at ts.shard.
def _write_reducers(engine, folder: Path, rank: int) -> None:
    states = [g.qgz.state_dict() if g.qgz is not None else None for g in engine.groups()]
    if any(state is not None for state in states):
        (folder / "qgz").mkdir(exist_ok=True)
        torch.save(states, folder / "qgz" / f"rank{rank}.pt")


def _read_reducers(path: Path, rank: int, world: int, manifest: dict, engine) -> list[dict]:
    """Each flat group's reducer state to load ([Note: qgz state in checkpoints]); fresh state where none fits."""
    groups, file = list(engine.groups()), path / "qgz" / f"rank{rank}.pt"
    fresh = [{"counters": {}, "residuals": {}}] * len(groups)
    if (manifest.get("world_size"), manifest.get("topology"), manifest.get("plan")) != \
            (world, list(engine.topology.sizes), str(engine.placement.plan)) or not file.is_file():
        return fresh
    try:
        states = _plain(file)
    except Exception as err:  # noqa: BLE001 - not plain data, or not a torch file at all
        raise CheckpointError(f"checkpoint {path} is corrupt: {file} cannot be read as plain data ({err})") from None
    if not isinstance(states, list) or len(states) != len(groups):
        return fresh
    return [fresh[0] if s is None else {"counters": s["counters"],
                                        "residuals": {k: v.to(g.device) for k, v in s["residuals"].items()}}
            for g, s in zip(groups, states)]


def _key_diff(metadata: Metadata, state: dict) -> tuple[list[str], list[str]]:
    """(keys of ``state`` the checkpoint lacks, the checkpoint's keys ``state`` lacks), of the parts ``state``
    holds: the model, and the optimizer if given."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    where = metadata.planner_data or {}
    saved = [k for k in metadata.state_dict_metadata if (where[k][0] if k in where else k.split(".")[0]) in state]
    return [k for k in flat if k not in metadata.state_dict_metadata], [k for k in saved if k not in flat]


_RECIPE = ("read it with torch's own route: model_sd, optim_sd = get_state_dict(model, opt); "
           "state = {\"model\": model_sd, \"optim\": optim_sd}; dcp.load(state, checkpoint_id=path); "
           "set_state_dict(model, opt, model_state_dict=state[\"model\"], optim_state_dict=state[\"optim\"]) "
           "(torch.distributed.checkpoint.state_dict)")


def _mismatch(path: Path, metadata: Metadata, state: dict, missing: list[str], unexpected: list[str]) -> str | None:
    """The missing and unexpected keys as one message naming the fix; None when there are none."""
    if not missing and not unexpected:
        return None
    keys = metadata.state_dict_metadata
    if "optim" in state and any(re.match(r"optim\.state\.\d+\.", k) for k in keys):
        return (f"checkpoint {path} holds the optimizer's own state_dict() (its states keyed by parameter "
                "position, e.g. optim.state.0.exp_avg), not torch's get_state_dict (keyed by name): loading that "
                "into a fresh optimizer restarts it (Adam's moments and step lost); save with ts.save or "
                "get_state_dict(model, opt), or load the model only, ts.load(path, model), and start the "
                "optimizer afresh knowingly")
    if "optim" in state and not any(k.startswith("optim.") for k in keys):
        return (f"checkpoint {path} holds no optimizer state (it was saved without an optimizer): load the model "
                "only, ts.load(path, model), or pass strict=False to keep the optimizer as it is")
    if "optim" in state and not any(k.startswith("optim.state.") for k in keys):
        return (f"checkpoint {path} holds an optimizer without per-parameter state (no optim.state.* keys: saved "
                "from an optimizer's state_dict() before its first step, or of a fresh one): load the model only, "
                "ts.load(path, model), or pass strict=False to keep the optimizer as it is")

    def few(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f", ... ({len(keys) - 5} more)" if len(keys) > 5 else "")

    parts = [f"{len(keys)} {what} keys ({where}): {few(keys)}" for keys, what, where in (
        (missing, "missing", "in this model, not in the checkpoint"),
        (unexpected, "unexpected", "in the checkpoint, not in this model")) if keys]
    if is_plain_dcp(path) and not any(k.startswith("model.") for k in keys):
        where = metadata.planner_data or {}
        tops = sorted({str(where[k][0]) if k in where else k.split(".")[0] for k in keys})
        return (f"checkpoint {path} is a plain DCP folder (.metadata, no {MANIFEST}) whose keys are under "
                f"{', '.join(repr(t) for t in tops[:5])}, not 'model': ts.load reads {{\"model\": model_sd, "
                f"\"optim\": optim_sd}} as torch's get_state_dict gives them; {_RECIPE}, under the keys it was "
                "saved with")
    return (f"checkpoint {path} does not fit this model: {'; '.join(parts)}. Load a checkpoint of this model, or "
            "pass strict=False to load the keys that match and keep the others as they are")


def _first_exception(err: BaseException) -> BaseException:
    """The first rank's exception inside a DCP failure, which carries every rank's."""
    failures = getattr(err, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
        if isinstance(exc, BaseException):
            return exc
    return err


def _first_failure(err: BaseException) -> str:
    """One line for a DCP failure, which carries every rank's traceback: the exception's type and last line."""
    err = _first_exception(err)
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[-1]}" if text else type(err).__name__


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, saved=None) -> dict:
    """What DCP saves and loads: torch's own state dicts, keyed by the module's parameter names; with outer sync
    ([Note: islands in checkpoints]) under the island's key, beside the outer state. ``saved``: the checkpoint's
    keys, when loading (which corrections of a streamed sync it holds)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        _init_optimizer_state(optimizer)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    outer = _engine(model).outer
    if outer is None:
        return state
    mine = f"island{outer.island}"
    corrections = None if saved is None else \
        [k.removeprefix(f"{mine}.outer.correction.") for k in saved if k.startswith(f"{mine}.outer.correction.")]
    shared, island = outer.state_dict(corrections)
    return {"outer": shared, mine: {**state, "outer": island}}


# [Note: islands in checkpoints] Between two outer syncs the islands hold different masters and inner optimizer
# states, which DCP would deduplicate as replicas of one DTensor (keeping one island's). So with outer sync each
# island's model and optimizer state sit under ``island<I>.`` (DCP reshards them inside the island, under any
# inner topology and plan), and the outer state every island shares under ``outer.`` ([Note: outer state in
# checkpoints], runtime/outer.py). Such a checkpoint loads only with the same number of islands.
def _own(state: dict, engine) -> tuple[str, dict]:
    """(key prefix, the dict holding "model" and "optim") of this rank's part of ``_state``."""
    if engine.outer is None:
        return "", state
    mine = f"island{engine.outer.island}"
    return f"{mine}.", state[mine]


def _check_islands(path: Path, manifest: dict, engine) -> None:
    """Raise unless the checkpoint and the model agree on outer sync and on the number of islands."""
    sizes = manifest.get("topology") or [1]
    saved = "outer=" in str(manifest.get("plan", ""))
    theirs = sizes[-1] // sizes[-2] if len(sizes) > 1 else 1
    if engine.outer is None and saved:
        raise CheckpointError(f"checkpoint {path} was saved with outer sync ({manifest.get('plan')}): its islands "
                              "hold their own states; load it into a plan with +outer over the same "
                              f"{theirs} islands")
    if engine.outer is not None and not saved:
        raise CheckpointError(f"checkpoint {path} was saved without outer sync ({manifest.get('plan')}): load it "
                              "into that plan, then copy its weights over (ts.full_state_dict / "
                              "ts.load_full_state_dict) to start outer sync from them")
    if engine.outer is not None and theirs != engine.outer.islands:
        raise CheckpointError(f"checkpoint {path} holds {theirs} islands but this topology has "
                              f"{engine.outer.islands}: load it with {theirs} islands (the inner tiers may differ)")


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's states (what a load fills) one parameter at a time: torch's state-dict helpers
    take one step at learning rate zero with every gradient set to zeros at once, a temporary the size of all
    the masters; here each parameter in turn gets a zero gradient (a view of one zero buffer of the largest
    shard, so no freed gradient leaves a hole between the states), its step, and loses the gradient."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return                                     # as torch: states exist, or a step is under way
    trained = [p for p in params if p.requires_grad]
    if not trained:
        return
    local = [_local(p) for p in trained]
    largest: dict[tuple, int] = {}
    for t in local:
        largest[(t.dtype, t.device)] = max(largest.get((t.dtype, t.device), 0), t.numel())
    zeros = {kind: torch.zeros(n, dtype=kind[0], device=kind[1]) for kind, n in largest.items()}
    rates = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        for param, mine in zip(trained, local):
            grad = zeros[(mine.dtype, mine.device)][:mine.numel()].view(mine.shape)
            if isinstance(param, DTensor):
                grad = DTensor(grad, param._spec, requires_grad=False)
            param.grad = grad
            optimizer.step()
            param.grad = None
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            if rate is not None:
                group["lr"] = rate


def verify(path: str | os.PathLike, rank: int = 0, world: int = 1) -> dict:
    """Check the manifest against the files: presence and size of all, CRC-32 of this rank's share (all of them
    by default, in one process). Returns the manifest; raises ``CheckpointError`` naming the first bad file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if is_plain_dcp(path):
        raise CheckpointError(f"checkpoint {path} is a plain DCP folder (.metadata, no {MANIFEST}): it has no "
                              "manifest to verify its files against; ts.load and tiershard convert read it as it "
                              "is, and DCP checks every tensor's shape as it loads")
    if not manifest_path.is_file() and (path / "extra").exists():
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_path} is missing, though ts.save's "
                              "extra/ is there (a copy that lost it, or a folder altered after the save; ts.save "
                              "renames a folder into place only with its manifest): copy the checkpoint again")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {manifest_path} is missing (not a tiershard "
                              "checkpoint, nor a folder dcp.save completed: it writes .metadata last)")
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
