"""The staging copy of an asynchronous save: this rank's state copied into CPU buffers kept for the next saves.

DCP's ``async_save`` takes any object with ``stage``, ``should_synchronize_after_execute``, ``synchronize_staging``
and ``close`` (its ``AsyncStager`` protocol). tiershard gives it ``ShardStager`` rather than DCP's
``DefaultStager`` for two measured reasons (docs/benchmarks.md, "On a GPU"):

- Pinning is what a first save on a GPU spends: ``cudaHostRegister`` of fresh pages faults them in from one
  thread (0.36 s per GiB on an H200 host), while faulting them in from several threads first and registering
  them after takes 0.08 + 0.07 s. DCP's stager registers each buffer as it makes it.
- The buffers must outlive the save. torch 2.11 empties a ``DefaultStager``'s copy rules when the save it was
  given completes, so every save made its pinned buffers again. Here the buffers belong to the stager, which
  ``close()`` does not free: they live as long as the storages they copy (a weak map), i.e. with the model.

A buffer is one per source storage (a flat group's storage holds many parameters' shards), copied whole, and a
staged tensor is a view of it at the source's offset, size and stride, so tensors that share a storage still
share it in the copy. Non-tensor entries (hyperparameters) are deep-copied.
"""
from __future__ import annotations

import copy
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

#: Pages are faulted in by threads taking at least this many bytes each.
FAULT_CHUNK_BYTES = 32 << 20
#: Smaller buffers (step counters, norms' shards) are not page-locked: locking costs more than it saves.
PIN_MIN_BYTES = 64 << 10


class ShardStager:
    """Copies a state dict's tensors (DTensors as their local shards) into CPU buffers made by the first save
    and reused by the later ones, in a background thread; pinned (page-locked) when ``device`` is a GPU, so the
    copy from the device runs at full speed. One copy at a time: a save waits for the one before."""

    should_synchronize_after_execute = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        if self.pinned and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()   # source storage -> CPU uint8 buffer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiershard-stage")
        self._stream = torch.cuda.Stream(self.device) if self.pinned else None   # made here, off the main stream
        self._future: Future | None = None
        #: The last copy's seconds and bytes: ``fault`` and ``pin`` (new buffers only), ``copy``, ``made`` (bytes
        #: of new buffers) and ``staged`` (bytes copied); what ``benchmarks/gpu_checkpoint.py`` reports.
        self.timings: dict[str, float] = {}

    def stage(self, state_dict: Any) -> Future:
        """Start copying ``state_dict``; the future gives the CPU copy. On a GPU the copy starts after the work
        queued so far on the current stream (the step that wrote the values)."""
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._future = self._executor.submit(self._stage, state_dict, ready)
        return self._future

    def synchronize_staging(self) -> None:
        if self._future is not None:
            self._future.result()

    def close(self) -> None:
        """Nothing to release: DCP calls this after each save on some torch versions, and the buffers are kept
        for the next save (they go with the storages they copy)."""

    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers held now (one per source storage)."""
        return list(self._buffers.values())

    @torch.no_grad()
    def _stage(self, state_dict: Any, ready) -> Any:
        if self.pinned:
            # This thread's CUDA calls (registering buffers, the copy's stream) go to this rank's device; a new
            # thread starts on device 0, where they would make a context on another rank's GPU.
            torch.cuda.set_device(self.device)
        storages: dict[int, torch.UntypedStorage] = {}
        _collect(state_dict, storages)
        self.timings = {"fault": 0.0, "pin": 0.0, "made": 0, "staged": sum(s.nbytes() for s in storages.values())}
        self._make_buffers([s for s in storages.values()      # new, or resized since (resize_ keeps the object)
                            if s not in self._buffers or self._buffers[s].numel() != s.nbytes()])
        copies = {key: self._buffers[s] for key, s in storages.items()}
        start = time.perf_counter()
        if self._stream is None:
            for key, source in storages.items():
                copies[key].untyped_storage().copy_(source)
        else:
            self._stream.wait_event(ready)
            with torch.cuda.stream(self._stream):
                for key, source in storages.items():
                    copies[key].untyped_storage().copy_(source, non_blocking=True)
            self._stream.synchronize()
        self.timings["copy"] = time.perf_counter() - start
        return _rebuild(state_dict, {key: buf.untyped_storage() for key, buf in copies.items()})

    def _make_buffers(self, sources: list[torch.UntypedStorage]) -> None:
        """One CPU buffer per new source storage, its pages faulted in by several threads and only then
        registered with CUDA (the registration is cheap once the pages exist)."""
        if not sources:
            return
        start = time.perf_counter()
        fresh = [torch.empty(s.nbytes(), dtype=torch.uint8) for s in sources]
        _fault_in(fresh)
        faulted = time.perf_counter()
        for source, buf in zip(sources, fresh):
            if self.pinned and source.device.type == "cuda" and buf.numel() >= PIN_MIN_BYTES:
                _pin(buf)
            self._buffers[source] = buf
        self.timings.update(fault=faulted - start, pin=time.perf_counter() - faulted,
                            made=sum(b.numel() for b in fresh))


def _collect(obj: Any, storages: dict[int, torch.UntypedStorage]) -> None:
    """Every tensor storage under ``obj`` (DTensors by their local shard), keyed by identity."""
    for leaf in tree_leaves(obj):
        tensor = _local(leaf)
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages.setdefault(id(storage), storage)


def _rebuild(obj: Any, copies: dict[int, torch.UntypedStorage]) -> Any:
    """``obj`` with every tensor replaced by the same view of its storage's copy, the other leaves deep-copied."""
    from torch.distributed.tensor import DTensor

    def staged(leaf: Any) -> Any:
        tensor = _local(leaf)
        if tensor is None:
            return copy.deepcopy(leaf)
        view = torch.empty(0, dtype=tensor.dtype).set_(copies[id(tensor.untyped_storage())],
                                                        tensor.storage_offset(), tensor.size(), tensor.stride())
        return DTensor(view, leaf._spec, requires_grad=False) if isinstance(leaf, DTensor) else view

    return tree_map(staged, obj)


def _local(obj: Any) -> torch.Tensor | None:
    """A tensor's values on this rank (a DTensor's local shard), or None for anything else."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj._local_tensor
    return obj if isinstance(obj, torch.Tensor) else None


def _fault_in(buffers: list[torch.Tensor]) -> None:
    """Write every page of ``buffers``, split across threads (page faults are the cost of new memory)."""
    chunks = [buf[i:i + FAULT_CHUNK_BYTES] for buf in buffers for i in range(0, buf.numel(), FAULT_CHUNK_BYTES)]
    threads = min(len(chunks), _fault_threads())
    if threads <= 1:
        for chunk in chunks:
            chunk.zero_()
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tiershard-fault") as pool:
        list(pool.map(torch.Tensor.zero_, chunks))


def _fault_threads() -> int:
    """The cores this process may use: the machine's shared among the node's ranks, at most 16."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(16, (os.cpu_count() or 1) // max(local, 1)))


#: cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the registering thread's (as
#: torch registers the buffers it pins).
_REGISTER_PORTABLE = 1


def _pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf`` for CUDA; unlocked when ``buf`` is dropped (never at exit, after CUDA is gone). Staged
    views that outlive ``buf`` keep its memory, merely no longer locked."""
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), _REGISTER_PORTABLE))
    if error:
        raise RuntimeError(f"cudaHostRegister of a {buf.numel()}-byte staging buffer failed (cudaError {error})")
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.data_ptr()).atexit = False
