"""Who is alive and what it is doing: a heartbeat beside the collectives, and the watch that tells slow from dead.

[Note: slow is not dead] A rank that is alive but busy outside the engine's collectives (rank-0 evaluation, a slow
disk, a first ``torch.compile``) must be waited for; a rank that died or whose interpreter stopped must be named
soon. A collective cannot tell the two apart, and on gloo a collective waited on with a timeout closes its
connections, so the engine's process groups carry the process group's own timeout (``init_process_group(timeout=)``,
30 minutes by default) and the decision is made here, beside them:

- every rank's heartbeat thread writes, once per beat, under ``tiershard/alive/RANK`` in the default c10d store
  (the one torchrun already runs): a counter, its host and pid, the collectives it waits in, how many it has issued
  per group, and, when it waits in none, how long it has been in user code and on which line;
- a rank that has waited in a collective for more than a second reads its peers' beats. A peer that has issued the
  collective already is fine. A peer behind it whose counter moves is busy: the lowest waiting member prints
  "waiting for rank R (busy in user code for N s, at FILE:LINE)" every ``notice_every(timeout)`` seconds. A peer
  whose counter has not moved for ``silent_after`` (the topology's ``timeout`` less two report windows, so that
  the report exchange that follows still ends inside the bound) is dead or hung (SIGSTOP, a C call holding the
  interpreter), one whose process exited is gone, and two ranks that each wait, for longer than ``timeout``, in a
  collective the other has not reached run different collectives (``if rank == 0: ts.save``). A peer that is
  itself ending (its beat carries its verdict) ends this rank too, so that a rank waiting on a rank waiting on the
  dead one is not left until a connection closes. A Python thread beats, so a main thread looping in Python counts
  as busy, with its line shown. When the store itself stops answering (its host, rank 0's, died) for
  ``silent_after``, a waiting rank ends as well: nothing can tell it any more whether its peers are alive.

Those verdicts end the rank: the watch writes the failure report as a failed collective would (comm/failure.py),
prints the same ``CollectiveError`` message and ends the process with ``EXIT_CODE``, because nothing wakes a
thread blocked in a gloo collective (NCCL's watchdog ends the process the same way). Ending loses nothing: a
checkpoint commits atomically, so the previous one stands. Staleness is judged by the counter on this rank's own
clock, so the hosts' clocks need not agree.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from ..topology import process_group_timeout

if TYPE_CHECKING:
    from ..topology import Topology

EXIT_CODE = 1
_KEY = "tiershard/alive/{}"
_OWN_CODE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.path.dirname(os.path.abspath(dist.__file__)).rsplit(os.sep, 1)[0], os.path.dirname(threading.__file__))


def notice_every(timeout: float) -> float:
    """Seconds between "waiting for rank R" lines (and before the first)."""
    return min(30.0, timeout)


def beat_period(timeout: float) -> float:
    return min(1.0, timeout / 8)


def silent_after(topology: "Topology") -> float:
    """Seconds without a heartbeat before a rank is taken for dead: the bound less two report windows, one for
    the report exchange that follows, so that the survivors name it within the bound."""
    return topology.timeout - 2 * topology.report_window


@dataclass
class Wait:
    """One collective this rank waits in (between a guard's enter and exit)."""
    group: str
    ranks: tuple[int, ...]
    seq: int
    op: str
    unit: str
    started: float                      # monotonic
    topology: "Topology"
    guard: Any                          # the failure.guard it waits in
    noticed: float = 0.0                # monotonic time of the last notice


_ACTIVE: dict[int, Wait] = {}           # id(guard) -> its wait
_ISSUED: dict[str, int] = {}            # group name -> engine collectives this rank issued on it
_NAMES: dict[int, str] = {}             # id(process group) -> its name
_STATE = {"idle_since": time.monotonic(), "last": None, "ending": False}
_LOCK = threading.Lock()


def group_name(pg) -> str:
    key = id(pg)
    name = _NAMES.get(key)
    if name is None:
        try:
            name = str(dist.distributed_c10d._get_process_group_name(pg))
        except Exception:     # an older torch: the ranks, the same on every member
            name = ",".join(map(str, dist.get_process_group_ranks(pg)))
        _NAMES[key] = name
    return name


def enter(g: Any, first: bool, unit: str) -> None:
    """``g`` begins waiting in ``unit`` (``first``: it is a new collective, so count it as issued)."""
    name = group_name(g.group.pg)
    if first:
        _ISSUED[name] = g.seq
        if not HEART.running or g.topology.timeout < HEART.shortest:
            HEART.start(g.topology)
    with _LOCK:
        _ACTIVE[id(g)] = Wait(name, tuple(g.group.ranks), g.seq, g.op, unit, time.monotonic(), g.topology, g)


def leave(g: Any) -> None:
    with _LOCK:
        wait = _ACTIVE.pop(id(g), None)
        if wait is not None:
            _STATE["last"] = f"{wait.op!r} of unit {wait.unit!r}"
        if not _ACTIVE:
            _STATE["idle_since"] = time.monotonic()


# ---- the heartbeat -----------------------------------------------------------------------------------------------

class _Heart:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.period = 1.0
        self.count = 0
        self.linger = 1.0
        self.running = False
        self.shortest = float("inf")            # the shortest bound of the topologies it serves
        self.rank = 0
        self.host = socket.gethostname()
        self.main = threading.main_thread().ident
        # rank -> (its counter, monotonic time it was last seen to move, monotonic time it was last read)
        self.seen: dict[int, tuple[int, float, float]] = {}
        self.verdict: str | None = None         # why this rank ends, once it does (its beats carry it)
        self.store_failing: float | None = None         # monotonic time the store began to fail, while it does
        self.worker: threading.Thread | None = None     # the thread of the store calls of a beat and a watch
        self.worker_began = 0.0                         # monotonic time it began
        self.worker_error: BaseException | None = None  # what its store calls raised
        self.end: Callable[[str], None] = end_process
        # comm/failure.py sets these (it imports this module, not the other way round): the CollectiveError of a
        # verdict, and its stay at exit while the other ranks read the reports
        self.describe: Callable[..., BaseException] | None = None
        self.linger_reports: Callable[[], None] = lambda: None

    def start(self, topology: "Topology") -> None:
        """Begin beating (once per process, from the first collective; a shorter ``timeout`` beats faster)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        self.shortest = min(self.shortest, topology.timeout)
        self.period = min(self.period, beat_period(topology.timeout))
        self.linger = topology.report_window + 2 * self.period
        self.rank = dist.get_rank()
        if self.thread is None or not self.thread.is_alive():
            _STATE["idle_since"] = time.monotonic()      # not the import's time (forked ranks import early)
            self.thread = threading.Thread(target=self.run, name="tiershard-heartbeat", daemon=True)
            self.running = True
            self.thread.start()
            atexit.register(self.exited)

    def beat(self, store, **extra) -> None:
        with _LOCK:
            waits = [[w.group, w.seq, w.op, w.unit, round(time.monotonic() - w.started, 1)]
                     for w in _ACTIVE.values()]
            idle = time.monotonic() - _STATE["idle_since"]
        self.count += 1
        payload = {"n": self.count, "host": self.host, "pid": os.getpid(), "waits": waits, "issued": dict(_ISSUED),
                   "last": _STATE["last"], **extra}
        if self.verdict:
            payload["ending"] = self.verdict
        if not waits:
            payload["idle"] = round(idle, 1)
            payload["at"] = self.where()
        store.set(_KEY.format(self.rank), json.dumps(payload))

    def where(self) -> str | None:
        """The innermost line of the main thread outside tiershard, torch and the standard library."""
        frame = sys._current_frames().get(self.main)
        while frame is not None:
            path = frame.f_code.co_filename
            if not path.startswith(_OWN_CODE + ("<frozen",)):
                return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def run(self) -> None:
        try:
            self.beat_until_destroyed()
        finally:
            self.running = False

    def beat_until_destroyed(self) -> None:
        failing = None                # monotonic time the store began to fail
        while dist.is_initialized():
            try:
                self.tick()
                failing = self.store_failing = None
            except Exception as err:  # the store's host went away or stopped, or the group was destroyed
                if not dist.is_initialized() or _STATE["ending"]:
                    return            # (c10d logs every failed store call with its stack: no more of those)
                blocked = self.worker is not None and self.worker.is_alive()
                failing = self.store_failing = failing or (self.worker_began if blocked else time.monotonic())
                self.store_gone(failing, err)
            # after a failure, try again less often: each failed call is a logged stack trace
            time.sleep(self.period if failing is None else min(8.0, max(self.period, time.monotonic() - failing)))

    def tick(self) -> None:
        """One beat and one watch, on a thread of their own: a store call to a stopped store host blocks with no
        timeout (TCPStore's reads have none), and the heartbeat must still judge that. Raises what the store
        raised, or that it has not answered for a few beats."""
        if self.worker is None or not self.worker.is_alive():
            self.worker_error, self.worker_began = None, time.monotonic()
            self.worker = threading.Thread(target=self.work, name="tiershard-heartbeat-store", daemon=True)
            self.worker.start()
        self.worker.join(max(2.0, 4 * self.period))
        if self.worker.is_alive():
            raise RuntimeError(f"a store call has not returned for {time.monotonic() - self.worker_began:.0f} s")
        if self.worker_error is not None:
            raise self.worker_error

    def work(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            self.beat(store)          # also while ending: the peers must not take a lingering rank for dead
            if not _STATE["ending"]:
                self.watch(store)
        except Exception as err:
            self.worker_error = err

    def store_gone(self, failing: float, err: BaseException) -> None:
        """End a rank that waits in a collective while the store has failed for ``silent_after``: nothing can tell
        it whether its peers are alive (the store lives on the master, rank 0's host)."""
        with _LOCK:
            waits = list(_ACTIVE.values())
        quiet = time.monotonic() - failing
        for wait in waits:
            if not _STATE["ending"] and quiet > silent_after(wait.topology):
                self.finish(wait, f"the rendezvous store (on the master, rank 0's host) has not answered for "
                                  f"{quiet:.0f} s ({first_line(err)[:200]}): that host may have died")
                return

    def exited(self) -> None:
        try:
            if dist.is_initialized() and not _STATE["ending"]:
                self.beat(dist.distributed_c10d._get_default_store(), exited=True)
        except Exception:
            pass

    # ---- the watch ----------------------------------------------------------------------------------------------
    def read(self, store, ranks: list[int], looking: bool = True) -> dict[int, dict]:
        """The peers' last beats; ``looking``: this is the watch, so note when each counter was seen to move (a
        report's read, after a pause in the watch, must not take a silent rank's old counter for a new one)."""
        keys = {r: _KEY.format(r) for r in ranks}
        there = [r for r in ranks if store.check([keys[r]])]
        values = store.multi_get([keys[r] for r in there]) if there else []
        beats = {r: json.loads(bytes(v)) for r, v in zip(there, values)}
        now = time.monotonic()
        for r, b in beats.items() if looking else ():
            n, moved, looked = self.seen.get(r, (None, now, now))
            # unobserved for a while: when it last moved is unknown, so count from now
            if n != b["n"] or now - looked > 3 * self.period + 1:
                moved = now
            self.seen[r] = (b["n"], moved, now)
        return beats

    def watch(self, store) -> None:
        now = time.monotonic()
        with _LOCK:
            waits = [w for w in _ACTIVE.values() if now - w.started > 2 * self.period]
        for wait in waits:
            peers = [r for r in wait.ranks if r != self.rank]
            beats = self.read(store, peers)
            verdict, behind = self.judge(wait, peers, beats, time.monotonic())
            if verdict:
                self.finish(wait, verdict)
                return
            if behind:
                self.notice(wait, peers, beats, behind)

    def judge(self, wait: Wait, peers: list[int], beats: dict[int, dict],
              now: float) -> tuple[str | None, dict[int, str]]:
        """(why this rank must end, or None; what each peer it waits for is doing)."""
        silent = silent_after(wait.topology)
        waited = now - wait.started
        behind: dict[int, str] = {}
        for r in peers:
            b = beats.get(r)
            since = self.seen[r][1] if r in self.seen else wait.started
            if b is None:
                if now - since > silent:
                    return f"rank {r} never sent a heartbeat in {now - since:.0f} s: it did not start, or died", {}
                continue
            if b.get("exited"):
                return (f"rank {r} ({_whose(b)}) has exited while this rank waits for it; its last collective was "
                        f"{b.get('last') or 'none'}"), {}
            if b.get("ending"):
                return f"rank {r} ({_whose(b)}), which this rank waits for, has ended: {b['ending']}", {}
            if now - since > silent:
                return (f"rank {r} ({_whose(b)}) sent no heartbeat for {now - since:.0f} s: dead, or its interpreter "
                        f"stopped (SIGSTOP, a call holding the GIL); last seen {_doing(b)}"), {}
            if b.get("issued", {}).get(wait.group, 0) >= wait.seq:
                continue                                           # it is in this collective, or past it
            stuck = [w for w in b.get("waits", ()) if w[0] != wait.group and w[0] in _member_groups()
                     and _ISSUED.get(w[0], 0) < w[1] and w[4] > wait.topology.report_window]
            if stuck and waited > wait.topology.timeout:
                g, seq, op, unit, secs = stuck[0]
                return (f"rank {r} ({_whose(b)}) waits in {op!r} of unit {unit!r} (collective #{seq} of its group) "
                        f"for {secs:.0f} s, which this rank has not reached, while this rank waits in this one, which "
                        f"rank {r} has not reached: the ranks run different collectives"), {}
            if now - since > 3 * self.period + 1:
                behind[r] = f"no heartbeat for {now - since:.0f} s"
            elif not b.get("waits"):                         # one waiting elsewhere is waited for by its own
                behind[r] = _doing(b)
        return None, behind

    def notice(self, wait: Wait, peers: list[int], beats: dict[int, dict], behind: dict[int, str]) -> None:
        now = time.monotonic()
        every = notice_every(wait.topology.timeout)
        if now - wait.started < every or now - wait.noticed < every:
            return
        waiting_lower = [r for r in peers if r < self.rank and r in beats and
                         any(w[0] == wait.group and w[1] == wait.seq for w in beats[r].get("waits", ()))]
        wait.noticed = now
        if waiting_lower:               # the lowest waiting member speaks for the group
            return
        pg = process_group_timeout()
        whom = "; ".join(f"rank {r} ({what})" for r, what in sorted(behind.items()))
        alive = all(not what.startswith("no heartbeat") for what in behind.values())
        then = (f"alive, so waited for up to the process group's timeout ({pg:.0f} s)" if alive else
                f"taken for dead after {silent_after(wait.topology):g} s without one")
        print(f"tiershard: rank {self.rank} has waited {now - wait.started:.0f} s in {wait.op!r} of unit "
              f"{wait.unit!r} (group ranks {list(wait.ranks)}) for {whom}; {then}", file=sys.stderr, flush=True)

    def finish(self, wait: Wait, verdict: str) -> None:
        """End this rank on a thread of its own, so that the heartbeat goes on while the reports are exchanged
        and the rank lingers (its peers must not take it for dead meanwhile)."""
        _STATE["ending"] = True
        self.verdict = verdict[:500]
        since = time.time() - (time.monotonic() - wait.started)

        def end() -> None:
            error = self.describe(RuntimeError(f"tiershard watchdog: {verdict}"), wait.op, wait.unit,
                                  wait.guard.group, wait.topology, wait.seq, since)
            self.end(f"{error}\n  This rank ends here: nothing wakes a thread blocked in the collective "
                     f"(exit code {EXIT_CODE}).")
        threading.Thread(target=end, name="tiershard-watchdog-end", daemon=True).start()


def _member_groups() -> set[str]:
    """Names of the groups this rank belongs to (torch registers a group only on its members)."""
    return set(dist.distributed_c10d._world.pg_names.values())


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type where it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _whose(beat: dict) -> str:
    return f"host {beat.get('host')}, pid {beat.get('pid')}"


def _doing(beat: dict) -> str:
    waits = beat.get("waits") or []
    if waits:
        g, seq, op, unit, secs = waits[0]
        return f"in {op!r} of unit {unit!r} for {secs:.0f} s"
    at = f", at {beat['at']}" if beat.get("at") else ""
    last = f"; its last collective {beat['last']}" if beat.get("last") else ""
    return f"busy in user code for {beat.get('idle', 0):.0f} s{at}{last}"


def end_process(message: str) -> None:
    """Print the verdict and end the process (the main thread may be blocked in gloo, which nothing wakes)."""
    print(message, file=sys.stderr, flush=True)
    HEART.linger_reports()                # rank 0 usually hosts the store: until the others have read the reports
    # and every rank a little longer with its connections open, so that peers one beat behind reach their own
    # verdict rather than a closed connection
    time.sleep(HEART.linger)
    os._exit(EXIT_CODE)


HEART = _Heart()


def describe_ranks(store, ranks: list[int]) -> list[str]:
    """One line per rank from its last heartbeat: who it is and what it was doing."""
    lines = []
    beats = HEART.read(store, ranks, looking=False)
    now = time.monotonic()
    for r in ranks:
        b = beats.get(r)
        if b is None:
            lines.append(f"rank {r}: no heartbeat ever")
            continue
        n, moved, _ = HEART.seen.get(r, (b["n"], now, now))
        quiet = now - moved if n == b["n"] else 0.0
        state = "exited" if b.get("exited") else "ending" if b.get("ending") else (f"no heartbeat for {quiet:.0f} s" if quiet > 2 * HEART.period
                                                  else "alive")
        lines.append(f"rank {r} ({_whose(b)}): {state}, last seen {_doing(b)}")
    return lines
