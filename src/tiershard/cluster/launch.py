"""Launching a job on an emulated cluster: one process per rank inside its namespace, the torchrun-style
environment each rank gets, the signals that must not stop a teardown half-way, and the ranks' results.

``EmulatedCluster.launch`` is ``launch_ranks`` on the cluster's shape; the namespaces come from ``netns``.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from .netns import DEFAULT_NAME, IFNAME, NODE_NETNS_ENV, ClusterError, node_address, node_namespace

class LaunchError(RuntimeError):
    """A rank of a launched job failed or timed out; carries that rank's exit code and the tail of its stderr."""

    def __init__(self, message: str, rank: int | None = None, returncode: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.rank, self.returncode, self.stderr = rank, returncode, stderr


@dataclass
class RankResult:
    """What one rank of ``EmulatedCluster.launch`` left behind."""

    rank: int
    node: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def rank_env(rank: int, nodes: int, ranks_per_node: int, port: int, groups_per_node: int = 1,
             cluster: str = DEFAULT_NAME) -> dict[str, str]:
    """The torchrun-style environment of one rank: rank r runs on node r // ranks_per_node.

    With three tiers (``groups_per_node`` > 1) rank r runs in group (r % ranks_per_node) // ranks_per_group of its
    node, MASTER_ADDR is the first group's address, and the rank also gets ``TIERSHARD_TOPOLOGY`` (group, node,
    world sizes: ``Topology.from_env()`` names them pair, node, world), ``TIERSHARD_HOST_ID`` (one per node, so
    the groups of a node count as one host at ``ts.shard``) and ``TIERSHARD_NODE_NETNS`` (the node's namespace,
    where the node uplink's counters are).
    """
    world = nodes * ranks_per_node
    node, local = divmod(rank, ranks_per_node)
    extra = {}
    if groups_per_node > 1:
        extra = {"TIERSHARD_TOPOLOGY": f"{ranks_per_node // groups_per_node},{ranks_per_node},{world}",
                 "TIERSHARD_HOST_ID": f"{socket.gethostname()}/{node_namespace(cluster, node)}",
                 NODE_NETNS_ENV: node_namespace(cluster, node)}
    return {**extra,
        "MASTER_ADDR": node_address(0), "MASTER_PORT": str(port),
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes), "NODE_RANK": str(node),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
        "GLOO_SOCKET_IFNAME": IFNAME,
    }


def launch_ranks(argv: Sequence[str], *, ip: str, namespaces: Sequence[str], ranks_per_node: int,
                 groups_per_node: int = 1, cluster: str = DEFAULT_NAME, env: dict[str, str] | None = None,
                 timeout: float | None = 600.0, echo: bool = False, port: int | None = None,
                 cwd: str | os.PathLike | None = None) -> list[RankResult]:
    """Run ``argv`` once per rank like torchrun would, rank r inside ``namespaces[r]`` (node r // ranks_per_node's,
    with three tiers its group's) through ``ip netns exec`` (``ip``: the tool's path); wait for all.

    Each rank gets MASTER_ADDR (node 0), MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK/NODE_RANK and GLOO_SOCKET_IFNAME on top of os.environ and ``env`` (OMP_NUM_THREADS is 1 unless
    set there, as under torchrun). With ``echo`` the ranks' output lines are also printed, prefixed by the
    rank. If a rank fails, the others are stopped and LaunchError carries the failing rank's stderr tail; a
    timeout stops them all.
    """
    if not argv:
        raise ClusterError("launch needs a command, e.g. [sys.executable, 'train.py']")
    port = port or random.randrange(20000, 30000)   # each node namespace has its own, otherwise unused, ports
    base = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    procs: list[subprocess.Popen] = []
    outputs: list[tuple[list[str], list[str]]] = []
    readers: list[threading.Thread] = []
    started = time.monotonic()
    ended: dict[int, float] = {}
    try:
        nodes = len(namespaces) // ranks_per_node
        for rank, ns in enumerate(namespaces):
            proc = subprocess.Popen([ip, "netns", "exec", ns, *argv], cwd=cwd, text=True, errors="replace",
                                    env={**base, **rank_env(rank, nodes, ranks_per_node, port, groups_per_node,
                                                            cluster)},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            procs.append(proc)
            out: tuple[list[str], list[str]] = ([], [])
            outputs.append(out)
            for stream, lines, sink in ((proc.stdout, out[0], sys.stdout), (proc.stderr, out[1], sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, lines, sink if echo else None, rank), daemon=True)
                t.start()
                readers.append(t)
        failed: int | None = None
        failed_at = 0.0
        while len(ended) < len(procs):
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank not in ended and proc.poll() is not None:
                    ended[rank] = now - started
                    if proc.returncode != 0 and failed is None:
                        failed, failed_at = rank, now
            if failed is not None and now - failed_at > 3.0:
                break                                   # the others had time to fail or finish; stop them
            if timeout is not None and now - started > timeout:
                break
            time.sleep(0.05)
    except BaseException:
        for proc in procs:
            _kill_group(proc)
        raise
    finally:
        for proc in procs:
            _kill_group(proc)
        for t in readers:
            t.join(timeout=5)
    results = [RankResult(rank, rank // ranks_per_node, proc.returncode, "".join(outputs[rank][0]),
                          "".join(outputs[rank][1]), ended.get(rank, time.monotonic() - started))
               for rank, proc in enumerate(procs)]
    if failed is not None:
        r = results[failed]
        tail = _tail(r.stderr) or _tail(r.stdout) or "(no output)"
        raise LaunchError(f"rank {failed} (node {r.node}) exited with code {r.returncode}; the end of its "
                          f"stderr:\n{tail}", failed, r.returncode, r.stderr)
    if len(ended) < len(procs):
        stuck = [r for r in range(len(procs)) if r not in ended]
        raise LaunchError(f"ranks {stuck} did not finish within {timeout:.0f} s and were stopped; the end of "
                          f"rank {stuck[0]}'s stderr:\n{_tail(results[stuck[0]].stderr) or '(no output)'}",
                          stuck[0], None, results[stuck[0]].stderr)
    return results


def _pump(stream, lines: list[str], sink, rank: int) -> None:
    for line in stream:
        lines.append(line)
        if sink is not None:
            sink.write(f"[rank {rank}] {line}")
            sink.flush()
    stream.close()


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def _kill_group(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """Stop a rank and anything it started (each rank leads its own process group)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL each of ``pids`` that still runs (what ``down`` finds inside a namespace)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends (then raise KeyboardInterrupt): teardown must not stop half-way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            raise KeyboardInterrupt


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt for the block (where their handlers are the default), so a killed
    job still runs its teardown."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_DFL:
            previous[s] = signal.signal(s, interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
