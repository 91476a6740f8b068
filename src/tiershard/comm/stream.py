"""A communication stream: the engine's collectives, run in issue order (on CPUs, on one background thread).

[Note: one ordered stream] Every rank must issue the collectives of a process group in the same order. The
engine submits all of its collectives to one FIFO, run by one thread per topology, so their order is the order
the main thread submitted them in, which follows the model's control flow and is the same on every rank. The
main thread goes on computing meanwhile (torch and gloo release the GIL), and waits on a future only when it
needs the result: a prefetched unit's weights, or every reduction at the end of backward. Anything the engine
runs on the main thread drains the stream first. The engine's process groups are its own (``Topology``), so
the user's collectives never interleave with them.

[Note: one issuing thread on CUDA] NCCL forbids issuing operations on one device from two host threads at once,
and the main thread issues the user's own collectives (a loss all-reduce, SyncBatchNorm, tensor-parallel layers).
So on CUDA no thread of ours issues anything: each job runs on the submitting thread at submission, on a CUDA
stream of its own that first waits for everything queued on the submitting stream. The device runs the
collectives behind compute, the host never waits, and the main stream waits for a job's work (an event recorded
after it) only when it takes the job's result or drains, as FSDP2 does with its all-gather and reduce-scatter
streams. On CPUs a gloo collective blocks the thread that calls it, so there the jobs run on one background
thread (torch and gloo release the GIL). A buffer a job allocates and the main stream goes on using (a gathered
unit, the gradients it writes) is marked with ``hand_over``, so the caching allocator does not give its memory
back to the communication stream while the main stream's kernels may still read it.
``inline=True`` runs everything on the caller's thread at submission: the synchronous schedule, the reference
the overlapped one must match bit for bit.

[Note: one reduction in flight] Each gradient reduction holds its unit's full gradient matrix until it has run.
Backward makes them faster than a slow link sends them, so unbounded they pile up: every unit's matrix alive at
once at the end of backward, a peak that depends on the link's speed. ``submit(..., bound=key)`` first waits for
the previous job submitted under the same key, so at most one reduction runs while backward builds the next
unit's matrix, as FSDP2 waits for its previous reduce-scatter before the next. The link is busy either way;
compute waits only when the link is the bottleneck, and then the step's length is the link's.

[Note: a finished job holds nothing] A waiter wakes as soon as a job's result is set, and the main thread then
allocates the next buffers (the next unit's gradient matrix after ``wait_previous``, the optimizer's after
``drain``). The thread that ran the job must not still hold its inputs then: the executor's work item and the job's
frame keep the function and its arguments until the thread gets back to its queue. So a job's function and
arguments are handed over in a list the job empties first, and dropped before the result is set.

[Note: no failure is dropped] A job's failure reaches the main thread exactly once: at the first ``result()`` of
its future, or else at the next ``drain`` or ``submit``, even when the job finished long before (a reduction that
failed must stop the step before the optimizer uses the gradients it did not deliver). After a collective failed
(``CollectiveError``) the stream runs no further job: each later one fails with that error, since a collective
issued after a failed one on the same groups would hang or pair with the wrong peer.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable

import torch

from .failure import CollectiveError, unit_scope
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import Topology

_STREAMS: dict[int, "CommStream"] = {}   # id(topology) -> its stream, dropped when the topology is collected


def stream_for(topology: "Topology") -> "CommStream":
    """The FIFO every collective of ``topology``'s groups runs through ([Note: one ordered stream]): one per
    Topology object (equal topologies still own separate process groups), made on first use on the device of its
    mesh."""
    key = id(topology)
    stream = _STREAMS.get(key)
    if stream is None:
        device_type = topology.mesh.device_type
        device = (torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda"
                  else torch.device("cpu"))
        stream = _STREAMS[key] = CommStream(device)
        weakref.finalize(topology, _STREAMS.pop, key, None)
    return stream


def drain_all() -> None:
    """Wait for every topology's stream: what a master's ``.grad`` does first ([Note: draining before .grad],
    runtime/flat.py)."""
    for stream in list(_STREAMS.values()):
        stream.drain()


class _Job(Future):
    """A job's future that remembers whether its failure has reached a caller ([Note: no failure is dropped])."""

    seen = False
    done_event = None     # CUDA: recorded on the communication stream after the job's work
    inputs = None         # CUDA, bounded jobs: kept until the main stream waits for done_event

    def result(self, timeout: float | None = None) -> Any:
        start = time.perf_counter()
        try:
            value = super().result(timeout)
        except BaseException:
            if self.done():
                self.seen = True
            raise
        finally:
            LEDGER.add_seconds("waited", time.perf_counter() - start)    # [Note: where the time goes]
        if self.done_event is not None:     # the caller's stream waits for the job's work on the device
            torch.cuda.current_stream().wait_event(self.done_event)
        return value

    def take(self) -> Any:
        """``result()``, after which the job no longer holds the value: a buffer it returned is freed as soon as
        the taker drops it, not when the stream next forgets finished jobs."""
        value = self.result()
        self._result = None
        return value


class CommStream:
    """A FIFO of collectives for one topology (see [Note: one ordered stream])."""

    def __init__(self, device: torch.device, inline: bool = False):
        self.device, self.inline = device, inline
        self._cuda = torch.cuda.Stream(device) if device.type == "cuda" and not inline else None
        # [Note: one issuing thread on CUDA]: a thread of ours only where collectives block the host
        self._pool = (None if inline or self._cuda is not None
                      else ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiershard-comm"))
        self._consumer = torch.cuda.current_stream(device) if self._cuda is not None else None
        self._pending: list[_Job] = []
        self._bounded: dict[str, _Job] = {}    # the last job per bound key ([Note: one reduction in flight])
        self._queued = False          # CUDA: work queued on the communication stream since the last drain
        self._broken: CollectiveError | None = None    # the first collective that failed: nothing runs after it

    def submit(self, fn: Callable[..., Any], *args: Any, unit: str | None = None, bound: str | None = None) -> Future:
        """Run ``fn(*args)`` after everything submitted before; returns its future. ``unit`` is named in the
        error of a collective that fails in it. ``bound``: first wait for the previous job submitted with this
        key ([Note: one reduction in flight]). Raises first a failure of an earlier job nobody has seen."""
        if bound is not None:
            self.wait_previous(bound)
        self._raise_unseen()
        job = _Job()
        if bound is not None:
            self._bounded[bound] = job
            if self._cuda is not None:      # the device still reads them after the host is done with the job
                job.inputs = args
        work = [fn, args]         # [Note: a finished job holds nothing]
        if self._pool is None:
            self._execute(job, work, unit)      # a failure surfaces at result(), as on the thread
        else:
            self._pool.submit(self._execute, job, work, unit)
        self._pending.append(job)
        return job

    def wait_previous(self, bound: str) -> None:
        """Wait for the last job submitted under ``bound`` to finish ([Note: one reduction in flight]); call it
        before allocating the next job's buffers, so the previous job's are freed first."""
        previous = self._bounded.pop(bound, None)
        if previous is None:
            return
        start = time.perf_counter()
        wait([previous])
        LEDGER.add_seconds("waited", time.perf_counter() - start)
        if previous.done_event is not None:     # CUDA: its inputs may be reused once the device is past it
            torch.cuda.current_stream(self.device).wait_event(previous.done_event)
        previous.inputs = None

    def _raise_unseen(self) -> None:
        """Forget finished jobs; raise the first failure that has not reached a caller yet."""
        failed = next((f for f in self._pending if f.done() and not f.seen and f.exception() is not None), None)
        self._pending = [f for f in self._pending if not f.done()]
        if failed is not None:
            failed.result()

    def _execute(self, job: _Job, work: list, unit: str | None) -> None:
        if self._broken is not None:
            work.clear()
            job.set_exception(self._broken)
            return
        fn, args = work
        work.clear()
        start = time.perf_counter()
        try:
            with unit_scope(unit):
                result = self._run(job, fn, args)
            del fn, args          # before the result wakes a waiter, not when this thread returns
        except BaseException as err:
            if isinstance(err, CollectiveError) and self._broken is None:
                self._broken = err
            LEDGER.add_seconds("stream", time.perf_counter() - start)
            job.set_exception(err)
        else:
            LEDGER.add_seconds("stream", time.perf_counter() - start)
            job.set_result(result)

    def _run(self, job: _Job, fn: Callable[..., Any], args: tuple) -> Any:
        with torch.no_grad():
            if self._cuda is None:
                return fn(*args)
            self._cuda.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._cuda):
                result = fn(*args)
            job.done_event = self._cuda.record_event()
            self._queued = True
            return result

    def hand_over(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark a buffer made on the stream for use on the main (default) stream; a no-op off CUDA."""
        if self._consumer is not None and tensor.is_cuda:
            tensor.record_stream(self._consumer)
        return tensor

    def held_results(self) -> list[Any]:
        """The results its unfinished or not yet forgotten jobs still hold (what a memory breakdown counts)."""
        return [job._result for job in self._pending if job.done() and job._result is not None]

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in stream order, waited for."""
        return self.submit(fn, *args).result()

    def drain(self) -> None:
        """Wait for everything submitted; raise the first failure no caller has seen yet."""
        pending, self._pending = self._pending, []
        start = time.perf_counter()
        wait(pending)
        LEDGER.add_seconds("waited", time.perf_counter() - start)
        if self._queued:                 # the caller's stream waits for everything queued on the device
            torch.cuda.current_stream(self.device).wait_stream(self._cuda)
            self._queued = False
        for job in self._bounded.values():
            job.inputs = None
        self._bounded.clear()
        for job in pending:
            if not job.seen and job.exception() is not None:
                job.result()
