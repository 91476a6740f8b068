"""When a collective cannot complete: one error that names the operation, the unit, the tier and the missing ranks.

[Note: bounded collectives] Every process group the engine uses (``Topology.init_process_groups``, and its
``control_group`` for checkpoints) carries the topology's ``timeout`` minus a short report window; gloo and NCCL
apply it to each operation. A collective that one rank skipped (``if rank == 0: ts.save(...)``) therefore times
out, and one whose peer died fails at once ("Connection closed by peer"), instead of waiting for the default
group's 30 minutes.

Every engine collective runs inside ``guard``, whose only cost in the normal path is one counter per process group
(the collective's sequence number in that group, equal on every member since all run the same collectives in the
same order) and one clock read. When the collective raises a communication error, the guard turns it into
``CollectiveError``: this rank writes what it was in (group, sequence number, operation, unit, time) under its own
key in the default c10d store, waits up to the report window for the other members' keys, and names as missing
every member that reported a different collective (it skipped this one) or nothing (it died, or waits outside
tiershard). A report counts when it was written after this rank entered its collective, or, written earlier by
this run's processes (torchrun's restarts keep the store's keys), it is not over: its rank has not gone on to
another collective since (having caught the error). So a member that failed before this rank arrived, and still
fails, is read too, while an older failure that its rank got over is not. A rank that waited only for
members that failed themselves (a rank two hops from a dead one) then reads the world's reports of the same
failure and names where it began: a rank the others name as missing that wrote no report. The store lives on
the master (rank 0's host); when it does not answer, the error says the missing ranks could not be determined.
The error is raised where the collective ran: on the stream's thread it reaches the main thread through the job's
future (``CommStream`` raises it at the next wait, drain or submit).
"""
from __future__ import annotations

import atexit
import json
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..topology import process_group_timeout
from . import liveness
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology

_BORN = time.time()                         # reports older than this process are an earlier run's
_REPORTED: list[tuple[int, dict]] = []       # this rank's last report, until its next collective marks it over
_LINGER: list[tuple] = []                    # rank 0 at exit: (until, ranks not reported, since) (see describe)
_SEQ: dict[int, int] = {}                    # id(process group) -> engine collectives issued on it so far
_LOCAL = threading.local()                   # .unit: the unit whose job this thread runs
STORE_SLACK = 10.0                           # seconds past the window before a silent store counts as gone
CLOCK_SLACK = 0.1                            # seconds the hosts' clocks may disagree when reports are compared
_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection", "peer", "broken pipe", "socket", "watchdog")
HINT = ("Every rank must run the same collectives in the same order: call the model, ts.save, ts.load and "
        "ts.full_state_dict on every rank, never under `if rank == 0:`. If a rank died, its own log says why.")


class CollectiveError(RuntimeError):
    """A collective of the engine (or of ts.save/ts.load) could not complete on this rank.

    ``op`` (e.g. "param_gather", "grad_reduce", "save"), ``unit`` (the module path, or the checkpoint), ``tier``
    (the tier the group spans), ``ranks`` (the group), ``missing`` (members that did not arrive; None when they
    could not be determined) and ``rank`` (this one)."""

    def __init__(self, message: str, op: str, unit: str, tier: str, ranks: tuple[int, ...],
                 missing: tuple[int, ...] | None, rank: int):
        super().__init__(message)
        self.op, self.unit, self.tier, self.ranks, self.missing, self.rank = op, unit, tier, ranks, missing, rank


class unit_scope:
    """Name ``unit`` in the errors of the collectives this thread runs inside the block."""

    __slots__ = ("unit", "outer")

    def __init__(self, unit: str | None):
        self.unit = unit

    def __enter__(self) -> None:
        self.outer = getattr(_LOCAL, "unit", None)
        _LOCAL.unit = self.unit

    def __exit__(self, *exc) -> None:
        _LOCAL.unit = self.outer


def comm_failure(err: BaseException) -> BaseException | None:
    """The process-group error (timeout, lost peer) behind ``err``, if any, as opposed to a bug in the local
    computation around a collective. Looks through what ``err`` wraps (DCP's per-rank failures, a CheckpointError
    raised in place of one); None for a CollectiveError, which is already named."""
    todo, seen = [err], set()
    while todo:
        err = todo.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, CollectiveError):
            return None
        if isinstance(err, getattr(dist, "DistError", ())) or (
                type(err) is RuntimeError and any(marker in str(err).lower() for marker in _MARKERS)):
            return err
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict):        # DCP's CheckpointException: rank -> exception or (exception, trace)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [err.__cause__, err.__context__]
    return None


class guard:
    """Around one collective on ``group``: counts it, and turns its communication failure into CollectiveError."""

    __slots__ = ("op", "group", "topology", "unit", "seq", "entered", "opened", "counted")

    def __init__(self, op: str, group: "TierGroup", topology: "Topology", unit: str | None = None):
        self.op, self.group, self.topology, self.unit, self.seq = op, group, topology, unit, 0

    def __enter__(self) -> "guard":
        first = not self.seq          # else entered again (to wait for what it issued): the same collective
        if first:
            key = id(self.group.pg)
            self.seq = _SEQ[key] = _SEQ.get(key, 0) + 1
            self.entered, self.counted = time.monotonic(), 0.0
            if _REPORTED:
                _mark_over()
        self.opened = time.monotonic()
        liveness.enter(self, first, self.unit_name())
        return self

    def _clock(self) -> None:
        """The ledger's seconds ([Note: where the time goes]): issue to completion on the group's tier; on the main
        thread, the time inside the guard is time the caller waited (entries do not overlap on one thread)."""
        now = time.monotonic()
        in_flight, self.counted = now - self.entered - self.counted, now - self.entered
        LEDGER.add_tier_seconds(_tier(self.group, self.topology), in_flight)
        if threading.current_thread() is threading.main_thread():
            LEDGER.add_seconds("waited", now - self.opened)

    def unit_name(self) -> str:
        return self.unit or getattr(_LOCAL, "unit", None) or "(no unit)"

    def __exit__(self, kind, err, tb) -> bool:
        liveness.leave(self)
        self._clock()
        cause = comm_failure(err) if isinstance(err, Exception) else None
        if cause is None:
            return False
        unit = self.unit_name()
        since = time.time() - (time.monotonic() - self.entered)
        raise describe(cause, self.op, unit, self.group, self.topology, self.seq, since) from err


def _mark_over() -> None:
    """This rank got over its last failure (it entered another collective): its report no longer stands."""
    try:
        rank, mine = _REPORTED.pop()
    except IndexError:                # the other thread marked it
        return
    _publish(rank, {**mine, "over": time.time()})


def _stands(report: dict, since: float) -> bool:
    """Whether ``report`` is of the failure a rank that entered its collective at wall time ``since`` is in
    ([Note: bounded collectives])."""
    written = report.get("time", 0)
    return written >= since or (written >= _BORN - CLOCK_SLACK and "over" not in report)


def _linger() -> None:
    try:
        store = dist.distributed_c10d._get_default_store()
        for until, silent, since in _LINGER:
            while silent and time.monotonic() < until:
                silent = [r for r in silent if not (store.check([f"tiershard/failed/{r}"]) and
                                                   _stands(json.loads(store.get(f"tiershard/failed/{r}")), since))]
                time.sleep(0.05)
            if not silent:
                time.sleep(0.5)           # the last to report reads the others' reports
    except Exception:
        pass


def _tier(group: "TierGroup", topology: "Topology") -> str:
    return topology.tier_of_link(group.ranks[0], group.ranks[-1])


def _group_name(group: "TierGroup") -> str:
    return liveness.group_name(group.pg)


def _exchange(rank: int, mine: dict, others: list[int], window: float,
              since: float) -> tuple[dict[int, dict], str | None]:
    """Write this rank's report, read the others' that stand for a rank that entered at wall time ``since``, for up
    to ``window`` s;
    (reports by rank, why not if the store failed).

    Runs on a daemon thread so that a store that stopped answering cannot hold the error back."""
    reports: dict[int, dict] = {}
    problem: list[str] = []
    late: list[str] = []
    beats: list[str] = []

    def work() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"tiershard/failed/{rank}", json.dumps(mine))
        except Exception as err:          # the store's host died, or no default store
            problem.append(liveness.first_line(err))
            return
        try:
            waiting = {r: f"tiershard/failed/{r}" for r in others}
            deadline = time.monotonic() + window
            while waiting:
                for r, key in list(waiting.items()):
                    if store.check([key]):
                        report = json.loads(store.get(key))
                        if _stands(report, since):     # else an older failure of that rank
                            reports[r] = report
                            del waiting[r]
                if not waiting or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception as err:          # the store's host went away meanwhile: what was read stands
            late.append(liveness.first_line(err))
            return
        try:
            silent = [r for r in others if r not in reports]
            if silent:
                beats.extend(liveness.describe_ranks(store, silent))
        except Exception:
            pass

    if liveness.HEART.store_failing is not None:       # the heartbeat already found it silent: no exchange
        return {}, f"it has not answered for {time.monotonic() - liveness.HEART.store_failing:.0f} s"
    thread = threading.Thread(target=work, name="tiershard-failure-report", daemon=True)
    thread.start()
    thread.join(window + STORE_SLACK)
    if thread.is_alive():
        return {}, "the rendezvous store did not answer"
    if late:
        mine["late"] = late[0]
    if beats:
        mine["beats"] = beats
    return dict(reports), (problem[0] if problem else None)


def _publish(rank: int, mine: dict) -> None:
    """Rewrite this rank's report (now with the ranks it found missing); at most a second, on a daemon thread."""
    def work() -> None:
        try:
            dist.distributed_c10d._get_default_store().set(f"tiershard/failed/{rank}", json.dumps(mine))
        except Exception:
            pass
    thread = threading.Thread(target=work, name="tiershard-failure-report", daemon=True)
    thread.start()
    thread.join(1.0)


def _first_cause(rank: int, missing: tuple[int, ...], reports: dict[int, dict], topology: "Topology",
                 since: float) -> str | None:
    """Where the failure began, when the members this rank waited for failed themselves: a rank that the other
    ranks' reports (of this failure, anywhere in the world) name as missing and that wrote none of its own, so a
    survivor far from a dead rank names it too. Best effort: reads only what is already in the store."""
    if all(r not in reports for r in missing):        # this rank waited for the silent ones itself
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        fresh: dict[int, dict] = dict(reports)
        for r in range(world):
            key = f"tiershard/failed/{r}"
            if r != rank and r not in fresh and store.check([key]):
                report = json.loads(store.get(key))
                if _stands(report, since):
                    fresh[r] = report
        named: dict[int, list[int]] = {}
        for r, report in fresh.items():
            for m in report.get("missing") or ():
                if m != rank and m not in fresh:
                    named.setdefault(m, []).append(r)
    except Exception:                                   # the store's host went away: the rest stands
        return None
    if not named:
        return None
    culprits = ", ".join(f"rank {m} (named by ranks {sorted(by)})" for m, by in sorted(named.items()))
    return (f"where it began: {culprits} sent no report of its own: dead, or blocked outside tiershard; the "
            f"ranks this one waited for failed waiting for {'it' if len(named) == 1 else 'them'}")


def describe(err: BaseException, op: str, unit: str, group: "TierGroup", topology: "Topology", seq: int,
             since: float) -> CollectiveError:
    """The CollectiveError for ``err``, raised by collective number ``seq`` of ``group``, entered at wall time
    ``since`` ([Note: bounded collectives])."""
    rank, tier, ranks = topology.rank, _tier(group, topology), tuple(group.ranks)
    name = _group_name(group)
    mine = {"group": name, "seq": seq, "op": op, "unit": unit, "tier": tier, "ranks": list(ranks),
            "time": time.time()}
    window = topology.report_window
    others = [r for r in ranks if r != rank]
    reports, problem = _exchange(rank, mine, others, window, since - CLOCK_SLACK)
    _REPORTED[:] = [(rank, mine)]
    if rank == 0 and problem is None:     # rank 0 usually hosts the store: at exit, stay up (at most a window)
        if not _LINGER:                   # until the members that have not reported yet could read every report
            atexit.register(_linger)
        _LINGER.append((time.monotonic() + window, [r for r in others if r not in reports], since - CLOCK_SLACK))
    cause = liveness.first_line(err)
    timed_out = "timed out" in cause.lower() or "timeout" in cause.lower()
    head = (f"tiershard: collective {op!r} of unit {unit!r} on the {tier} tier (group ranks {list(ranks)}, "
            f"collective #{seq} of that group) failed on rank {rank}")
    lines = []
    if problem is not None:
        missing = None
        lines.append(f"the ranks that did not arrive could not be determined: the rendezvous store (on the master, "
                     f"rank 0's host) does not answer ({problem}); that host may have died")
    else:
        silent = [r for r in others if r not in reports]
        elsewhere = [r for r in others if r in reports and
                     (reports[r].get("group"), reports[r].get("seq"), reports[r].get("op")) != (name, seq, op)]
        missing = tuple(sorted(silent + elsewhere))
        for r in elsewhere:
            o = reports[r]
            lines.append(f"rank {r} was in {o.get('op')!r} of unit {o.get('unit')!r} on the {o.get('tier')} tier "
                         f"(group ranks {o.get('ranks')}, collective #{o.get('seq')}) and failed there")
        if silent:
            why = ("dead, or never in this collective" if timed_out else
                   "dead, or still waiting in this collective (its own error follows)")
            if "late" in mine:
                why += f"; the rendezvous store stopped answering meanwhile ({mine['late']})"
            lines.append(f"ranks {silent} sent no report within {window:g} s: {why}")
            lines += mine.pop("beats", [])
    if missing:
        head += f": ranks {list(missing)} did not arrive"
        mine["missing"] = list(missing)
        _publish(rank, mine)                  # so that ranks failing later can follow it to where it began
        first = _first_cause(rank, missing, reports, topology, since - CLOCK_SLACK)
        if first:
            lines.insert(0, first)
    elif missing is not None:
        head += ": every member arrived, but the connection between them failed"
    lines.append(f"cause: {cause}")
    lines.append(HINT)
    lines.append(f"A rank whose heartbeat stops for {liveness.silent_after(topology):g} s (the bound, "
                 f"{topology.timeout:g} s, less two report windows) is taken for dead (ts.Topology(..., "
                 f"timeout=...) or TIERSHARD_COLLECTIVE_TIMEOUT); a live rank is waited for up to the process "
                 f"group's timeout ({process_group_timeout():g} s, init_process_group(timeout=...)).")
    return CollectiveError(head + ".\n  " + "\n  ".join(lines), op, unit, tier, ranks, missing, rank)


liveness.HEART.describe = describe
liveness.HEART.linger_reports = _linger
