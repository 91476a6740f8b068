"""[Note: one issuing thread on CUDA]: on CUDA the stream queues each collective from the submitting thread, on a
side stream that waits for the submitting stream's work, and the caller's stream waits for a job's event only when
it takes the result or drains; on CPUs the jobs run on one background thread.

No GPU is needed: torch.cuda's streams and events are replaced by recorders, so the test sees which host thread
ran each job and which waits were queued. (Before, CUDA jobs ran on the background thread as on CPUs, so a
collective of ours could be issued while the main thread issued the user's own: NCCL forbids that.)
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from tiershard.comm.stream import CommStream


class _Recorder:
    """A CUDA stream or event that logs what is asked of it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.name))

    def record_event(self, event=None):
        self.log.append(("record_event", self.name))
        return _Recorder(f"event after {self.name}", self.log)

    def record(self, stream=None):
        self.log.append(("record", self.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


def test_cuda_jobs_are_issued_from_the_submitting_thread(monkeypatch):
    log: list = []
    main = _Recorder("main", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Recorder("comm", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Recorder("event", log))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    stream = CommStream(torch.device("cuda", 0))
    caller = threading.get_ident()

    def collective(tag):
        log.append(("issue", tag, threading.get_ident() == caller))
        return tag

    first = stream.submit(collective, "all_gather")
    assert first.result() == "all_gather"
    stream.submit(collective, "reduce_scatter")
    stream.drain()
    stream.drain()                      # nothing queued since: no second wait
    assert log == [
        ("wait_stream", "comm", "main"), ("issue", "all_gather", True), ("record_event", "comm"),
        ("wait_event", "main", "event after comm"),
        ("wait_stream", "comm", "main"), ("issue", "reduce_scatter", True), ("record_event", "comm"),
        ("wait_stream", "main", "comm"),
    ]


def test_cpu_jobs_run_in_order_on_one_background_thread():
    stream = CommStream(torch.device("cpu"))
    caller, seen = threading.get_ident(), []
    for i in range(5):
        stream.submit(lambda i=i: seen.append((i, threading.get_ident())))
    stream.drain()
    assert [i for i, _ in seen] == list(range(5))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != caller


def test_a_finished_job_no_longer_holds_its_inputs():
    """[Note: a finished job holds nothing]: when a job's result wakes a waiter, the thread that ran it has dropped
    the job's function and arguments, so a buffer only the job referenced is already freed (the next unit's
    gradient matrix is allocated right after such a wake-up)."""
    stream = CommStream(torch.device("cpu"))
    gate = threading.Event()
    stream.submit(gate.wait)                  # holds the thread until the second job is queued and let go of here
    x = torch.ones(1000)
    ref = weakref.ref(x)
    job = stream.submit(lambda t: float(t.sum()), x)
    del x
    held_at_wake = []
    job.add_done_callback(lambda _: held_at_wake.append(ref() is not None))   # runs on the thread, at set_result
    gate.set()
    assert job.result() == 1000.0
    stream.drain()
    assert held_at_wake == [False]


def test_the_ledger_clocks_the_stream_the_waits_and_the_codecs():
    """[Note: where the time goes]: a job's run counts as the stream's busy time, the caller's block on it as
    waited, and the codecs' calls as codec time; a reset clears them."""
    import time

    import tiershard as ts
    from tiershard.comm.codecs import INT8

    ts.reset_comm_stats()
    stream = CommStream(torch.device("cpu"))
    stream.submit(time.sleep, 0.05).result()
    stream.submit(time.sleep, 0.03)
    stream.drain()
    INT8.decode_wire(INT8.encode_wire(torch.randn(4096), 1), 1, 4096)
    seconds = ts.comm_stats()["seconds"]
    assert seconds["stream"] >= 0.08 and seconds["waited"] >= 0.07 and seconds["codec"] > 0, seconds
    ts.reset_comm_stats()
    assert ts.comm_stats()["seconds"] == {"waited": 0.0, "stream": 0.0, "codec": 0.0, "tiers": {}}
