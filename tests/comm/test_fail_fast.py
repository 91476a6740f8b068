"""Slow is waited for, dead is named, different collectives end every rank with one error naming both sides; and
no failed job of the stream is ever dropped ([Note: slow is not dead], [Note: bounded collectives]).

Two launches of 4 gloo ranks (2 nodes of 2) with a 3 s liveness bound and a 6 s process-group timeout:
1. rank 0 works alone in user code for 4 s (beyond the bound) before the forward: the others wait for it, the
   lowest of them says so once the bound has passed, and the step completes; then rank 0 skips a backward the
   others run and sleeps: their reductions wait for it up to the process group's timeout and fail there, naming
   it as busy; then rank 0 alone calls ts.save while the others call the model: both sides wait in a collective
   the other has not reached, and the watchdog ends every rank within the bound, each naming the other side.
2. rank 3 stops (SIGSTOP) before the forward: the survivors name it, its host and pid, within the bound.
Killed ranks are in tests/cluster/test_fail_fast_cluster.py and tests/cluster/test_fault_matrix.py.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

from _dist import run_ranks
from _models import Block, TinyGPT

BOUND = 3.0
PG_TIMEOUT = 6.0
BUSY = 4.0


def _outcome(call) -> dict:
    import tiershard as ts

    start = time.monotonic()
    try:
        call()
        out = {"error": None}
    except ts.CollectiveError as err:
        out = {"error": "CollectiveError", "op": err.op, "unit": err.unit, "tier": err.tier, "ranks": err.ranks,
               "missing": err.missing, "message": str(err)}
    except Exception as err:          # anything else is a failure of the test, reported with its type
        out = {"error": type(err).__name__, "message": str(err)[:2000]}
    out["seconds"] = time.monotonic() - start
    return out


class _Tee(io.StringIO):
    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text):
        self.stream.write(text)
        return super().write(text)


def _ended_into(path: str):
    """Make the watchdog's end write its message to ``path`` (then end the process as it would)."""
    from tiershard.comm import liveness

    def end(message: str) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"message": message, "time": time.time()}))
        liveness.end_process(message)
    liveness.HEART.end = end


def _slow_and_skipped(rank, world, folder):
    import tiershard as ts

    sys.stderr = _Tee(sys.stderr)
    torch.manual_seed(0)
    tokens = torch.randint(0, 37, (2, 8))
    out = {"bound": ts.Topology((2, 4)).timeout}
    # 1. rank 0 is busy in user code past the bound: waited for, with a notice
    model = ts.shard(TinyGPT(), "IIG", ts.Topology((2, 4)), wrap={Block})
    if rank == 0:
        time.sleep(BUSY)
    out["busy"] = _outcome(lambda: model(tokens).float().sum().backward())
    out["busy_notices"] = [line for line in sys.stderr.getvalue().splitlines() if "has waited" in line]
    # 2. rank 0 skips backward: the others' first reduction waits for it up to the process group's timeout
    # ([Note: one reduction in flight]), and the error names it as busy
    model = ts.shard(TinyGPT(), "NGG", ts.Topology((2, 4)), wrap={Block})
    loss = model(tokens).float().sum()
    if rank != 0:
        out["backward"] = _outcome(loss.backward)
    else:
        time.sleep(PG_TIMEOUT + 1)
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    # 3. `if rank == 0: ts.save(...)` while the others go on to the model: the watchdog ends every rank
    _ended_into(f"{folder}/ended{rank}.json")
    model = ts.shard(TinyGPT(), "GGG", ts.Topology((2, 4)), wrap={Block})
    started = time.time()
    with open(f"{folder}/started{rank}", "w") as f:
        f.write(str(started))
    _raised_into(f"{folder}/raised{rank}.json", lambda: ts.save(f"{folder}/ckpt", model) if rank == 0
                 else model(tokens))
    return "not ended by the watchdog"


def _stopped(rank, world, folder, victim=3):
    import tiershard as ts

    model = ts.shard(TinyGPT(), "IIG", ts.Topology((2, 4)), wrap={Block})
    _ended_into(f"{folder}/ended{rank}.json")
    with open(f"{folder}/started{rank}", "w") as f:
        f.write(str(time.time()))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    _raised_into(f"{folder}/raised{rank}.json", lambda: model(torch.randint(0, 37, (2, 8))))
    return "not ended by the watchdog"


def _raised_into(path: str, call) -> None:
    """Run ``call``; a CollectiveError it raises (a peer ended by the watchdog closed the connections) is written to
    ``path`` as the watchdog's end would write it."""
    out = _outcome(call)
    if out["error"] == "CollectiveError":
        with open(path, "w") as f:
            f.write(json.dumps({"message": out["message"], "time": time.time()}))


def _ended(folder, rank) -> tuple[str, float]:
    """How rank ``rank`` ended (the watchdog's message, or the CollectiveError it raised), and how long after it
    entered the case."""
    path = f"{folder}/ended{rank}.json"
    if not os.path.exists(path):
        path = f"{folder}/raised{rank}.json"
    with open(path) as f:
        ended = json.load(f)
    with open(f"{folder}/started{rank}") as f:
        return ended["message"], ended["time"] - float(f.read())


def test_slow_is_waited_for_and_different_collectives_end_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSHARD_COLLECTIVE_TIMEOUT", str(BOUND))
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_slow_and_skipped, 4, str(tmp_path), timeout=300, pg_timeout=PG_TIMEOUT)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["bound"] for r in results] == [BOUND] * 4
    # 1. waited for, past the bound; a notice from the lowest rank waiting for rank 0 in each group, with its line
    for rank in range(4):
        assert results[rank]["busy"]["error"] is None, results[rank]["busy"]
    assert results[1]["busy"]["seconds"] > BOUND
    notices = results[1]["busy_notices"]
    assert notices and "rank 0 (busy in user code for" in notices[0] and "test_fail_fast.py" in notices[0], notices
    # rank 3 waits for rank 2, which waits itself (and says so): nothing to say
    assert not results[3]["busy_notices"], results[3]["busy_notices"]
    # 2. up to the process group's timeout, then named as busy
    for rank in (1, 2, 3):
        waited = results[rank]["backward"]
        assert waited["error"] == "CollectiveError", (rank, waited)
        assert (waited["op"], waited["tier"], waited["missing"]) == ("grad_reduce", "world", [0]), (rank, waited)
        assert "rank 0 (host" in waited["message"] and "alive, last seen busy in user code" in waited["message"]
        assert waited["seconds"] > BOUND
    # 3. every rank ended by the watchdog within the bound (and its report window), naming the other side
    ended = sorted(r for r in range(4) if (tmp_path / f"ended{r}.json").exists())
    assert ended, "no rank was ended by the watchdog"
    message, seconds = _ended(tmp_path, 0)
    assert "collective 'save'" in message and "ranks [1, 2, 3] did not arrive" in message, message
    assert "'param_gather'" in message and "ts.save" in message, message
    assert seconds < 4 * BOUND, seconds
    for rank in (1, 2, 3):
        message, seconds = _ended(tmp_path, rank)
        assert "collective 'param_gather' of unit '<root>'" in message and "0" in message.split("did not arrive")[0]
        assert "'save'" in message, message
        assert seconds < 4 * BOUND, seconds
    first = min(ended, key=lambda r: _ended(tmp_path, r)[1])
    message, seconds = _ended(tmp_path, first)
    assert "different collectives" in message and seconds > BOUND, message


def test_a_stopped_rank_is_named_with_its_host_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERSHARD_COLLECTIVE_TIMEOUT", str(BOUND))
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_stopped, 4, str(tmp_path), timeout=120)
    ended = [r for r in range(3) if (tmp_path / f"ended{r}.json").exists()]
    assert ended, "no rank was ended by the watchdog"
    for rank in (0, 1, 2):
        message, seconds = _ended(tmp_path, rank)
        # the watchdog's verdict, or (raised when a peer it ended closed the connections) where it began
        assert ("rank 3 (host " in message and "no heartbeat for" in message) or \
            "where it began: rank 3" in message, message
        assert seconds < 3 * BOUND, seconds
    message, _ = _ended(tmp_path, ended[0])
    assert "its interpreter stopped" in message and "last seen busy in user code" in message, message
    assert not (tmp_path / "ended3.json").exists()


def test_a_stopped_store_host_ends_every_waiting_rank_within_the_bound(tmp_path, monkeypatch):
    """Rank 0 hosts the store here: stopped, it answers no store call (TCPStore's reads have no timeout), and the
    heartbeat must judge that too, not block with it until the process group's timeout."""
    monkeypatch.setenv("TIERSHARD_COLLECTIVE_TIMEOUT", str(BOUND))
    with pytest.raises(AssertionError, match="exited without a result"):
        run_ranks(_stopped, 4, str(tmp_path), 0, timeout=120, pg_timeout=60)
    for rank in (1, 2, 3):
        message, seconds = _ended(tmp_path, rank)
        assert "the rendezvous store (on the master, rank 0's host) has not answered" in message, message
        assert seconds < 3 * BOUND, seconds


# ---- the stream drops no failure ([Note: no failure is dropped]) --------------------------------------------------

def _lost():
    raise RuntimeError("the reduction was lost")


def _finished(future) -> None:
    while not future.done():
        time.sleep(0.01)


def test_a_failure_that_finished_before_the_next_submit_is_not_dropped():
    from tiershard.comm.stream import CommStream

    stream = CommStream(torch.device("cpu"))
    _finished(stream.submit(_lost))
    raised = []
    # submit used to prune finished (failed) jobs from the pending list, so the drain saw nothing
    for step in (lambda: stream.submit(lambda: None), stream.drain, stream.drain):
        try:
            step()
        except RuntimeError as err:
            raised.append(str(err))
    assert raised == ["the reduction was lost"]          # at the next submit, and once
    assert stream.run(lambda: 7) == 7                    # not a collective: the stream goes on


def test_a_failure_a_caller_has_seen_is_not_raised_again():
    from tiershard.comm.stream import CommStream

    stream = CommStream(torch.device("cpu"))
    seen = stream.submit(_lost)
    with pytest.raises(RuntimeError):
        seen.result()                    # the caller saw it: drain does not raise it again
    stream.drain()


def test_after_a_failed_collective_the_stream_runs_nothing():
    from tiershard.comm.failure import CollectiveError
    from tiershard.comm.stream import CommStream

    def failed():
        raise CollectiveError("lost", "grad_reduce", "blocks.0", "world", (0, 1), (1,), 0)

    ran, gate = [], threading.Event()
    stream = CommStream(torch.device("cpu"))
    first = stream.submit(lambda: gate.wait() and failed())
    later = stream.submit(ran.append, 1)
    gate.set()
    with pytest.raises(CollectiveError):
        first.result()
    with pytest.raises(CollectiveError):
        later.result()
    assert ran == []


def test_the_bound_is_a_documented_setting(monkeypatch):
    import tiershard as ts

    monkeypatch.delenv("TIERSHARD_COLLECTIVE_TIMEOUT", raising=False)
    assert ts.Topology((2, 4)).timeout == 60.0
    monkeypatch.setenv("TIERSHARD_COLLECTIVE_TIMEOUT", "20")
    assert ts.Topology((2, 4)).timeout == 20.0 and ts.Topology((2, 4), timeout=5).timeout == 5.0
    assert ts.Topology((2, 4)).report_window == 5.0 and ts.Topology((2, 4), timeout=2).report_window == 0.5
    for bad in (0, -1, float("inf"), "60", True):
        with pytest.raises(ts.TopologyError, match="positive number of seconds"):
            ts.Topology((2, 4), timeout=bad)
    monkeypatch.setenv("TIERSHARD_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ts.TopologyError, match="TIERSHARD_COLLECTIVE_TIMEOUT='soon' is not a number"):
        ts.Topology((2, 4))


def test_a_report_stands_until_its_rank_gets_over_it(monkeypatch):
    """A peer that failed before this rank entered its collective, and still fails, is read (so that the dead rank
    behind it is named); a failure it caught and went on from, or one of an earlier run, is not."""
    from tiershard.comm import failure

    entered = failure._BORN + 10                 # this rank entered its collective then
    assert failure._stands({"time": entered + 1}, entered)                   # written after this rank entered
    assert failure._stands({"time": entered - 1}, entered)                   # earlier, and still failing
    assert not failure._stands({"time": entered - 1, "over": entered - 0.5}, entered)
    assert failure._stands({"time": entered + 1, "over": entered + 2}, entered)   # over only after it was read
    assert not failure._stands({"time": failure._BORN - 5}, entered)        # a previous run's rank
    published = []
    monkeypatch.setattr(failure, "_publish", lambda rank, mine: published.append((rank, mine)))
    monkeypatch.setattr(failure, "_REPORTED", [(2, {"op": "param_gather", "time": entered - 1})])
    failure._mark_over()                     # its next collective: the report is marked over, once
    failure._mark_over()
    assert len(published) == 1 and published[0][0] == 2 and published[0][1]["over"] >= entered
    assert not failure._stands(published[0][1], entered + 1)
