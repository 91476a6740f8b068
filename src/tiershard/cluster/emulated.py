"""An emulated multi-node cluster on one Linux machine: network namespaces as nodes, a bridge as the switch.

Tier-aware sharding only pays off when the links between nodes are slower than the links inside a node. On one
machine every rank talks over loopback, so this module builds the slow tier out of kernel parts:

- one network namespace per node (``ts-<name>-n<i>``), each with one NIC ``eth0`` at ``10.77.0.<i+1>/24``;
- a switch namespace (``ts-<name>-sw``) holding a bridge ``br0`` and one veth port ``p<i>`` per node;
- a ``tbf`` cap on every node uplink (node -> switch) AND every switch port (switch -> node), so each NIC is
  capped in both directions at once, like a full-duplex link, and incast from several nodes queues at the port.

Ranks of one node bind to the node's address; the kernel routes traffic between them over that namespace's
loopback, so intra-node traffic never touches the capped NIC, and the NIC byte counters count only the inter-node
tier.

With ``groups_per_node`` > 1 the cluster has three tiers (e.g. GCD pairs, nodes, world): each node is a bridge
namespace (``ts-<name>-n<i>``, bridge ``br0``, uplink ``eth0`` to the switch) and its ranks run in
``groups_per_node`` group namespaces (``ts-<name>-n<i>g<j>``, NIC ``eth0`` at ``10.77.0.<k+1>`` for the k-th group
of the world) attached to the node bridge through port ``q<j>``. Ranks of one group talk over loopback (uncapped,
uncounted), groups of one node over their capped group links (``node_bw``), nodes over the capped node uplinks
(``inter_bw``). Everything made here carries the ``ts-`` prefix, and ``down`` removes exactly the namespaces of one
cluster (deleting a namespace deletes its veth ends and the bridge). It needs root and iproute2 (``ip``, ``tc``).

``python -m tiershard.cluster allreduce ...`` is the small gloo job that ``tiershard cluster check`` and the
tests launch on every rank.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

PREFIX = "ts-"
DEFAULT_NAME = "main"
IFNAME = "eth0"                 # every node's NIC has the same name, so one GLOO_SOCKET_IFNAME fits all ranks
BRIDGE = "br0"
SUBNET = "10.77.0"              # node i is SUBNET.(i + 1)/24; namespaces are separate, so clusters may share it
MAX_NODES = 250
STATE_DIR = Path("/run/tiershard")
TBF_LATENCY = "2ms"             # the tbf queue bound (not an added delay): small queues keep RTTs near idle ones
MIN_BURST = 256 * 1024          # bytes; also >= 10 ms of the rate, so the bucket never starves at high rates
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,15}$")
NAMESPACE_RE = re.compile(r"^ts-([a-z0-9][a-z0-9_]{0,15})-(sw|n(\d+)(?:g(\d+))?)$")
TIER_NAMES = {2: ("node", "world"), 3: ("pair", "node", "world")}    # Topology's default names for these tiers
NODE_NETNS_ENV = "TIERSHARD_NODE_NETNS"     # three tiers: the namespace holding a rank's node uplink (for counters)

_BITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
         "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40}
_UNLIMITED = {"none", "unlimited", "off", "inf", "0"}
_RATE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([a-z/]*)$")


class ClusterError(Exception):
    """A user or environment error (not root, no iproute2, a cluster already up, a bad rate): says the fix."""


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


# ---------------------------------------------------------------------------------------------------------------
# Pure parts: rates, names, commands (unit-tested without root)


def parse_rate(rate: str | int | float | None) -> int | None:
    """A tc rate as bits/s, or None for no cap: ``250mbit``, ``1gbit``, ``1.5gbit``, ``500kibit``, a bare number of
    bits/s, or ``none``/``unlimited``.

    Byte units (``mbps``, ``MB/s``) are refused: tc reads ``mbps`` as megabytes/s but ``tiershard plan`` reads
    ``Gbps`` as gigabits/s, and an 8x misreading is worse than an error.
    """
    if rate is None:
        return None
    if isinstance(rate, bool):
        raise ClusterError(f"bandwidth {rate!r} is not a rate: give e.g. 250mbit, 1gbit or none")
    if isinstance(rate, (int, float)):
        if rate == 0:
            return None
        if rate < 0 or rate != rate:
            raise ClusterError(f"bandwidth {rate!r} must be positive bits/s (or none for no cap)")
        bits = int(round(rate))
        if bits < 8:
            raise ClusterError(f"bandwidth {rate!r} bits/s is below 8bit: give e.g. 250mbit or 1gbit")
        return bits
    text = str(rate).strip().lower()
    if text in _UNLIMITED:
        return None
    match = _RATE_RE.match(text)
    if match is None or match.group(2) not in _BITS:
        unit = match.group(2) if match else ""
        if unit.endswith("bps") or unit.endswith("b/s"):
            raise ClusterError(f"bandwidth {rate!r} is ambiguous (tc reads mbps as megabytes/s, tiershard plan reads "
                               f"Gbps as gigabits/s): give bits the tc way, e.g. 250mbit or 1gbit")
        raise ClusterError(f"bandwidth {rate!r} is not a tc rate: give e.g. 250mbit, 1gbit, 500kbit or none "
                           f"(units: {', '.join(u for u in _BITS if u)})")
    bits = int(round(float(match.group(1)) * _BITS[match.group(2)]))
    if bits == 0:
        raise ClusterError(f"bandwidth {rate!r} is zero: give a positive rate, or none for no cap")
    if bits < 8:
        raise ClusterError(f"bandwidth {rate!r} is below 8bit: give e.g. 250mbit or 1gbit")
    return bits


def format_rate(bits: int | None) -> str:
    """The shortest exact tc spelling of a rate (``250mbit``), or ``none``; tc reads it back unchanged."""
    if bits is None:
        return "none"
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits % _BITS[unit] == 0:
            return f"{bits // _BITS[unit]}{unit}"
    return f"{bits}bit"


def tbf_burst(bits: int) -> int:
    """Bytes of burst for a tbf at ``bits``/s: at least 256 KiB and 10 ms of the rate (tc needs rate/HZ or more)."""
    return max(MIN_BURST, bits // 8 // 100)


def tbf_args(bits: int) -> list[str]:
    """The qdisc half of a tc command capping a device at ``bits``/s."""
    return ["tbf", "rate", f"{bits}bit", "burst", str(tbf_burst(bits)), "latency", TBF_LATENCY]


def check_name(name: str) -> str:
    """Cluster names become part of namespace names (``ts-<name>-n0``), so they are short and plain."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ClusterError(f"cluster name {name!r} must be 1-16 characters of a-z, 0-9 and _ (starting with a "
                           "letter or digit), e.g. main")
    return name


def switch_namespace(name: str) -> str:
    return f"{PREFIX}{check_name(name)}-sw"


def node_namespace(name: str, node: int) -> str:
    return f"{PREFIX}{check_name(name)}-n{node}"


def node_address(node: int) -> str:
    """Node ``node``'s NIC address (the same in every cluster: each lives in its own namespaces). With three tiers
    the same formula numbers the groups: the k-th group of the world is at ``node_address(k)``."""
    return f"{SUBNET}.{node + 1}"


def port_name(node: int) -> str:
    return f"p{node}"


def group_namespace(name: str, node: int, group: int) -> str:
    """Three tiers: the namespace of group ``group`` of node ``node`` (its ranks run there)."""
    return f"{PREFIX}{check_name(name)}-n{node}g{group}"


def group_port_name(group: int) -> str:
    """Three tiers: the node bridge's port towards group ``group``."""
    return f"q{group}"


def cluster_namespaces(names: Sequence[str]) -> dict[str, list[str]]:
    """Group namespace names by the cluster they belong to; names without the ``ts-<name>-`` form are ignored."""
    clusters: dict[str, list[str]] = {}
    for ns in names:
        match = NAMESPACE_RE.match(ns)
        if match:
            clusters.setdefault(match.group(1), []).append(ns)
    return {k: sorted(v, key=_ns_order) for k, v in sorted(clusters.items())}


def _ns_order(ns: str) -> tuple[int, int, int]:
    match = NAMESPACE_RE.match(ns)
    if match and match.group(3) is not None:
        return (0, int(match.group(3)), -1 if match.group(4) is None else int(match.group(4)))
    return (1, 0, 0)


def shape_commands(name: str, nodes: int, bits: int | None) -> list[list[str]]:
    """tc commands that put every node's uplink and switch port at ``bits``/s (replace), or remove the cap."""
    sw = switch_namespace(name)
    cmds = []
    for i in range(nodes):
        for ns, dev in ((node_namespace(name, i), IFNAME), (sw, port_name(i))):
            if bits is None:
                cmds.append(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
            else:
                cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bits)])
    return cmds


def group_shape_commands(name: str, nodes: int, groups_per_node: int, bits: int | None) -> list[list[str]]:
    """Three tiers: tc commands that put every group link (group -> node bridge and back) at ``bits``/s, or remove
    the cap."""
    cmds = []
    for i in range(nodes):
        for j in range(groups_per_node):
            for ns, dev in ((group_namespace(name, i, j), IFNAME), (node_namespace(name, i), group_port_name(j))):
                if bits is None:
                    cmds.append(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
                else:
                    cmds.append(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(bits)])
    return cmds


def up_commands(name: str, nodes: int, bits: int | None, groups_per_node: int = 1,
                node_bits: int | None = None) -> list[list[str]]:
    """Every ip/tc command that builds a cluster, in order. Links get no IPv6 address (``addrgenmode none``) so
    no neighbour discovery chatter lands on the NIC counters. ``groups_per_node`` > 1 builds three tiers: node
    bridges with group namespaces behind them, group links capped at ``node_bits``."""
    if groups_per_node > 1:
        return _three_tier_up_commands(name, nodes, bits, groups_per_node, node_bits)
    sw = switch_namespace(name)
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "addrgenmode", "none"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]
    for i in range(nodes):
        ns, port = node_namespace(name, i), port_name(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw],
            ["ip", "-n", ns, "link", "set", IFNAME, "addrgenmode", "none"],
            ["ip", "-n", sw, "link", "set", port, "addrgenmode", "none"],
            ["ip", "-n", ns, "addr", "add", f"{node_address(i)}/24", "dev", IFNAME],
            ["ip", "-n", ns, "link", "set", IFNAME, "up"],
            ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", sw, "link", "set", port, "up"],
        ]
    if bits is not None:
        cmds += shape_commands(name, nodes, bits)
    return cmds


def _bridge_commands(ns: str) -> list[list[str]]:
    return [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"],
            ["ip", "-n", ns, "link", "set", BRIDGE, "addrgenmode", "none"],
            ["ip", "-n", ns, "link", "set", BRIDGE, "up"]]


def _veth_commands(inner_ns: str, inner_dev: str, outer_ns: str, port: str, address: str | None) -> list[list[str]]:
    """A veth from ``inner_ns`` (device ``inner_dev``, optionally addressed) to a port of ``outer_ns``'s bridge."""
    cmds = [["ip", "link", "add", inner_dev, "netns", inner_ns, "type", "veth", "peer", "name", port, "netns",
             outer_ns],
            ["ip", "-n", inner_ns, "link", "set", inner_dev, "addrgenmode", "none"],
            ["ip", "-n", outer_ns, "link", "set", port, "addrgenmode", "none"]]
    if address is not None:
        cmds.append(["ip", "-n", inner_ns, "addr", "add", f"{address}/24", "dev", inner_dev])
    return cmds + [["ip", "-n", inner_ns, "link", "set", inner_dev, "up"],
                   ["ip", "-n", outer_ns, "link", "set", port, "master", BRIDGE],
                   ["ip", "-n", outer_ns, "link", "set", port, "up"]]


def _three_tier_up_commands(name: str, nodes: int, bits: int | None, groups_per_node: int,
                            node_bits: int | None) -> list[list[str]]:
    """Switch, then per node a bridge namespace uplinked to the switch and its group namespaces behind it."""
    sw = switch_namespace(name)
    cmds = _bridge_commands(sw)
    for i in range(nodes):
        node_ns = node_namespace(name, i)
        cmds += _bridge_commands(node_ns)
        cmds += _veth_commands(node_ns, IFNAME, sw, port_name(i), None)
        cmds.append(["ip", "-n", node_ns, "link", "set", IFNAME, "master", BRIDGE])     # the uplink is a port too
        for j in range(groups_per_node):
            gns = group_namespace(name, i, j)
            cmds += [["ip", "netns", "add", gns], ["ip", "-n", gns, "link", "set", "lo", "up"]]
            cmds += _veth_commands(gns, IFNAME, node_ns, group_port_name(j), node_address(i * groups_per_node + j))
    if bits is not None:
        cmds += shape_commands(name, nodes, bits)
    if node_bits is not None:
        cmds += group_shape_commands(name, nodes, groups_per_node, node_bits)
    return cmds


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


def check_tiers(tiers: Sequence[int], rates: Sequence[str | int | None]) -> tuple[int, int, int, int | None,
                                                                                   int | None]:
    """Tier sizes and per-tier rates, innermost first, as (nodes, ranks_per_node, groups_per_node, node_bits,
    inter_bits): ``(2, 4)`` with ``("none", "250mbit")`` is 2 nodes of 2 ranks; ``(2, 4, 8)`` with
    ``("none", "2gbit", "250mbit")`` is 2 nodes of 2 groups of 2 ranks. The innermost tier is loopback, so its
    rate must be none."""
    sizes = tuple(tiers)
    if len(sizes) not in (2, 3) or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
        raise ClusterError(f"tiers {tuple(tiers)!r} must be 2 or 3 positive sizes, innermost first, e.g. 2,4 (2 "
                           "nodes of 2 ranks) or 2,4,8 (2 nodes of 2 groups of 2 ranks)")
    for inner, outer in zip(sizes, sizes[1:]):
        if outer % inner or outer == inner:
            raise ClusterError(f"tiers {sizes}: each tier must hold 2 or more of the tier inside it ({outer} is not "
                               f"a multiple of {inner} above it), e.g. 2,4,8")
    if len(rates) != len(sizes):
        raise ClusterError(f"{len(rates)} rates for {len(sizes)} tiers {sizes}: give one per tier, innermost first, "
                           "e.g. none,2gbit,250mbit (the innermost is loopback: none)")
    bits = [parse_rate(r) for r in rates]
    if bits[0] is not None:
        raise ClusterError(f"the innermost tier's rate is {rates[0]!r}: its ranks share a namespace and talk over "
                           "loopback, which is not capped; give none")
    if len(sizes) == 2:
        return sizes[1] // sizes[0], sizes[0], 1, None, bits[1]
    return sizes[2] // sizes[1], sizes[1], sizes[1] // sizes[0], bits[1], bits[2]


def ring_allreduce_tier_bytes(nbytes: int, tiers: Sequence[int]) -> dict[str, int]:
    """Bytes per node and tier link for one world ring all_reduce of ``nbytes`` over contiguous ranks: ``world``
    is what each node uplink sends; with three tiers ``node`` is what the node's group links send on top of that
    (each group sends one ring edge's 2(n-1)/n of the buffer; one of them per node leaves the node)."""
    sizes = tuple(tiers)
    n = sizes[-1]
    edge = int(round(2 * (n - 1) / n * nbytes)) if n > 1 else 0
    out = {"world": edge if sizes[-2] < n else 0}
    if len(sizes) == 3:
        out["node"] = sizes[1] // sizes[0] * edge - out["world"]
    return out


def ring_allreduce_nic_bytes(nbytes: int, nodes: int, ranks_per_node: int) -> int:
    """Bytes each node's NIC sends (and receives) for one world ring all_reduce of ``nbytes`` over contiguous ranks.

    Each rank sends 2(n-1)/n of the buffer to its ring successor; with ranks numbered node by node exactly one ring
    edge leaves each node, so that is also what each NIC carries. One node: nothing crosses.
    """
    n = nodes * ranks_per_node
    if nodes < 2 or n < 2:
        return 0
    return int(round(2 * (n - 1) / n * nbytes))


# ---------------------------------------------------------------------------------------------------------------
# Privileges, tools, processes


def require_root_and_tools() -> dict[str, str]:
    """Absolute paths of ``ip`` and ``tc``; raises ClusterError if not root or iproute2 is missing."""
    if os.geteuid() != 0:
        raise ClusterError("an emulated cluster needs root to create network namespaces: run it as root "
                           "(e.g. sudo .venv/bin/tiershard cluster ...)")
    search = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    tools = {tool: shutil.which(tool, path=search) for tool in ("ip", "tc")}
    missing = [tool for tool, path in tools.items() if path is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2 (e.g. apt-get install iproute2)")
    return tools  # type: ignore[return-value]


def namespaces_unavailable(tag: str = "probe") -> str | None:
    """None if this process can create network namespaces (root, iproute2, a kernel that allows it), else why
    not: one throwaway namespace is made and removed."""
    try:
        tools = require_root_and_tools()
    except ClusterError as err:
        return str(err)
    probe = f"{PREFIX}{tag}{os.getpid()}-sw"
    made = subprocess.run([tools["ip"], "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    subprocess.run([tools["ip"], "netns", "del", probe], capture_output=True)
    return None


def _run(cmd: Sequence[str], tools: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command in its own session, so a Ctrl-C at the terminal reaches only us (and our cleanup)."""
    argv = [tools.get(cmd[0], cmd[0]), *cmd[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, start_new_session=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit code {proc.returncode}'}")
    return proc


@contextmanager
def _deferred_signals() -> Iterator[None]:
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
def _terminate_as_interrupt() -> Iterator[None]:
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


def list_namespaces(tools: dict[str, str] | None = None) -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    tools = tools or require_root_and_tools()
    out = _run(["ip", "netns", "list"], tools).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_clusters() -> dict[str, list[str]]:
    """The clusters present on this machine: name -> their ``ts-`` namespaces (node namespaces first)."""
    return cluster_namespaces(list_namespaces())


def _state_path(name: str) -> Path:
    return STATE_DIR / f"cluster-{check_name(name)}.json"


def _kill_pids(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


# ---------------------------------------------------------------------------------------------------------------
# The cluster


class EmulatedCluster:
    """``nodes`` emulated nodes of ``ranks_per_node`` ranks each, linked at ``inter_bw`` (a tc rate, or None).

    ``groups_per_node`` > 1 makes three tiers: each node's ranks run in that many group namespaces, linked to
    the node's bridge at ``node_bw`` (a tc rate, or None); ``EmulatedCluster.from_tiers((2, 4, 8), ("none",
    "2gbit", "250mbit"))`` says the same by tier.

    Use as a context manager: the cluster comes up on enter and is torn down on exit, also after an exception,
    Ctrl-C or SIGTERM. ``up`` refuses to build over an existing cluster of the same name unless ``replace=True``,
    which tears the old one down first.
    """

    def __init__(self, nodes: int = 2, ranks_per_node: int = 1, inter_bw: str | int | None = None, *,
                 name: str = DEFAULT_NAME, replace: bool = False, groups_per_node: int = 1,
                 node_bw: str | int | None = None):
        if not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ClusterError(f"nodes must be an integer from 1 to {MAX_NODES}, got {nodes!r}")
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ClusterError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not isinstance(groups_per_node, int) or groups_per_node < 1 or ranks_per_node % groups_per_node:
            raise ClusterError(f"groups_per_node={groups_per_node!r} must be a positive integer dividing "
                               f"ranks_per_node={ranks_per_node}, e.g. 2 for GCD pairs on nodes of 4 ranks")
        if nodes * groups_per_node > MAX_NODES:
            raise ClusterError(f"{nodes} nodes x {groups_per_node} groups is more than the {MAX_NODES} addresses "
                               "of the cluster's subnet: use fewer nodes or groups")
        if groups_per_node == 1 and parse_rate(node_bw) is not None:
            raise ClusterError(f"node_bw={node_bw!r} caps the links between the groups of a node, but this cluster "
                               "has one group per node: give groups_per_node=2 or more, or node_bw=None")
        self.name = check_name(name)
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.groups_per_node = groups_per_node
        self.inter_bw = parse_rate(inter_bw)
        self.node_bw = parse_rate(node_bw)
        self.replace = replace
        self._tools: dict[str, str] | None = None
        self._owned = False
        self._signals = None

    @classmethod
    def from_tiers(cls, tiers: Sequence[int], rates: Sequence[str | int | None], *, name: str = DEFAULT_NAME,
                   replace: bool = False) -> EmulatedCluster:
        """The cluster of tier sizes ``tiers`` (innermost first: ``(2, 4)`` or ``(2, 4, 8)``) with one tc rate per
        tier (the innermost, loopback, must be none): ``from_tiers((2, 4, 8), ("none", "2gbit", "250mbit"))``."""
        nodes, per_node, groups, node_bits, inter_bits = check_tiers(tiers, rates)
        return cls(nodes, per_node, inter_bits, name=name, replace=replace, groups_per_node=groups,
                   node_bw=node_bits)

    def __repr__(self) -> str:
        groups = "" if self.groups_per_node == 1 else \
            f", groups_per_node={self.groups_per_node}, node_bw={format_rate(self.node_bw)!r}"
        return (f"EmulatedCluster(nodes={self.nodes}, ranks_per_node={self.ranks_per_node}, "
                f"inter_bw={format_rate(self.inter_bw)!r}, name={self.name!r}{groups})")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def ranks_per_group(self) -> int:
        """Ranks that share one namespace (and loopback): a node's ranks, or with three tiers a group's."""
        return self.ranks_per_node // self.groups_per_node

    @property
    def tiers(self) -> tuple[int, ...]:
        """Tier sizes innermost first, as ``Topology`` takes them: (ranks_per_node, world) or (group, node, world)."""
        inner = (self.ranks_per_group,) if self.groups_per_node > 1 else ()
        return (*inner, self.ranks_per_node, self.world_size)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return TIER_NAMES[len(self.tiers)]

    @property
    def tier_rates(self) -> tuple[int | None, ...]:
        """The configured cap of each tier's links (bits/s or None), innermost (loopback, None) first."""
        return (None, self.node_bw, self.inter_bw) if self.groups_per_node > 1 else (None, self.inter_bw)

    @property
    def tools(self) -> dict[str, str]:
        if self._tools is None:
            self._tools = require_root_and_tools()
        return self._tools

    # -- life cycle ---------------------------------------------------------------------------------------------

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME) -> EmulatedCluster:
        """The cluster ``name`` that is already up (e.g. from ``tiershard cluster up``); leaving a ``with`` block on
        it does not tear it down."""
        tools = require_root_and_tools()
        present = cluster_namespaces(list_namespaces(tools)).get(check_name(name))
        if not present:
            raise ClusterError(f"no cluster {name!r} is up: start one with `tiershard cluster up`")
        try:
            state = json.loads(_state_path(name).read_text())
        except (OSError, ValueError):
            raise ClusterError(f"cluster {name!r} has namespaces but no state file {_state_path(name)} (an "
                               "interrupted up?): run `tiershard cluster down` and up again") from None
        cluster = cls(state["nodes"], state["ranks_per_node"], None, name=name,
                      groups_per_node=state.get("groups_per_node", 1))
        cluster._tools = tools
        cluster.inter_bw = cluster.bandwidth()
        if cluster.groups_per_node > 1:
            cluster.node_bw = cluster.link_caps()[0]["groups"][0]["uplink"]
        return cluster

    def exists(self) -> bool:
        """Whether any namespace (or the state file) of this cluster's name is present."""
        return bool(cluster_namespaces(list_namespaces(self.tools)).get(self.name)) or _state_path(self.name).exists()

    def up(self) -> EmulatedCluster:
        """Build the namespaces, links and caps; on any error or interrupt half-way, remove what was made."""
        tools = self.tools
        if self.exists():
            if not self.replace:
                raise ClusterError(f"cluster {self.name!r} is already up: run `tiershard cluster down` first, or "
                                   "use --replace (replace=True) to re-create it")
            self.down()
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"name": self.name, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                 "inter_bw": format_rate(self.inter_bw), "ifname": IFNAME,
                 "addresses": [node_address(i) for i in range(self.nodes * self.groups_per_node)]}
        if self.groups_per_node > 1:
            state.update(groups_per_node=self.groups_per_node, node_bw=format_rate(self.node_bw))
        try:
            # O_EXCL: two concurrent ups of one name cannot both pass this point.
            fd = os.open(_state_path(self.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ClusterError(f"cluster {self.name!r} is being created by another process: wait, or run "
                               "`tiershard cluster down`") from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1)
            for cmd in up_commands(self.name, self.nodes, self.inter_bw, self.groups_per_node, self.node_bw):
                proc = _run(cmd, tools, check=False)
                if proc.returncode != 0:
                    raise ClusterError(self._explain(cmd, proc))
        except BaseException:
            self.down()
            raise
        self._owned = True
        return self

    def _explain(self, cmd: Sequence[str], proc: subprocess.CompletedProcess) -> str:
        err = (proc.stderr or proc.stdout).strip().splitlines()
        last = err[-1] if err else f"exit code {proc.returncode}"
        hint = ""
        if cmd[:3] == ["ip", "netns", "add"]:
            hint = " (network namespaces need CAP_SYS_ADMIN: a container may need --privileged)"
        elif cmd[0] == "tc" and "unknown" in last.lower():
            hint = " (this kernel lacks the tbf qdisc: use --inter-bw none)"
        return f"`{' '.join(cmd)}` failed: {last}{hint}; nothing of cluster {self.name!r} was left behind"

    def down(self) -> None:
        """Kill what runs inside this cluster's namespaces and delete them (their veths and bridge go with them)."""
        tools = self.tools
        with _deferred_signals():
            errors = []
            for ns in cluster_namespaces(list_namespaces(tools)).get(self.name, []):
                pids = _run(["ip", "netns", "pids", ns], tools, check=False).stdout.split()
                _kill_pids([int(p) for p in pids if p.isdigit()])
                proc = _run(["ip", "netns", "del", ns], tools, check=False)
                if proc.returncode != 0:
                    errors.append(f"{ns}: {proc.stderr.strip()}")
            try:
                _state_path(self.name).unlink()
            except FileNotFoundError:
                pass
            try:
                STATE_DIR.rmdir()
            except OSError:
                pass
            self._owned = False
        if errors:
            raise ClusterError(f"could not delete {'; '.join(errors)}: retry `tiershard cluster down`")

    def __enter__(self) -> EmulatedCluster:
        self._signals = _terminate_as_interrupt()
        self._signals.__enter__()
        try:
            return self.up()
        except BaseException:
            self._signals.__exit__(None, None, None)
            self._signals = None
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._owned:
                self.down()
        finally:
            if self._signals is not None:
                self._signals.__exit__(None, None, None)
                self._signals = None

    # -- links --------------------------------------------------------------------------------------------------

    def set_bandwidth(self, rate: str | int | None) -> None:
        """Cap every node link at ``rate`` in both directions (tc rate, or None/'none' to remove the cap)."""
        bits = parse_rate(rate)
        for cmd in shape_commands(self.name, self.nodes, bits):
            proc = _run(cmd, self.tools, check=False)
            if proc.returncode != 0 and not (bits is None and ("No such file" in proc.stderr
                                                               or "Cannot find" in proc.stderr
                                                               or "handle of zero" in proc.stderr)):
                raise ClusterError(self._explain(cmd, proc).replace("; nothing of", "; cap unchanged on"))
        self.inter_bw = bits

    def set_node_bandwidth(self, rate: str | int | None) -> None:
        """Three tiers: cap every group link (group <-> node bridge) at ``rate`` in both directions, or uncap it."""
        if self.groups_per_node == 1:
            raise ClusterError(f"cluster {self.name!r} has one group per node, so no links between groups to cap: "
                               "up one with groups_per_node=2 or more (--tiers 2,4,8)")
        bits = parse_rate(rate)
        for cmd in group_shape_commands(self.name, self.nodes, self.groups_per_node, bits):
            proc = _run(cmd, self.tools, check=False)
            if proc.returncode != 0 and not (bits is None and ("No such file" in proc.stderr
                                                               or "Cannot find" in proc.stderr
                                                               or "handle of zero" in proc.stderr)):
                raise ClusterError(self._explain(cmd, proc).replace("; nothing of", "; cap unchanged on"))
        self.node_bw = bits

    def set_tier_rates(self, rates: Sequence[str | int | None]) -> None:
        """One tc rate per tier, innermost first, as ``from_tiers`` takes them: ``("none", "2gbit", "250mbit")``."""
        _, _, _, node_bits, inter_bits = check_tiers(self.tiers, rates)
        if self.groups_per_node > 1:
            self.set_node_bandwidth(node_bits)
        self.set_bandwidth(inter_bits)

    def bandwidth(self) -> int | None:
        """The cap in force (bits/s, read from tc on node 0's uplink), or None if uncapped."""
        return self.link_caps()[0]["uplink"]

    def link_caps(self) -> list[dict]:
        """Per node, the tbf rate (bits/s, or None) on its uplink and on its switch port, as tc reports them; with
        three tiers also ``groups``: per group, the rate on its link to the node bridge and on the bridge's port."""
        caps = []
        for i in range(self.nodes):
            cap: dict = {"uplink": self._tbf_rate(node_namespace(self.name, i), IFNAME),
                         "port": self._tbf_rate(switch_namespace(self.name), port_name(i))}
            if self.groups_per_node > 1:
                cap["groups"] = [{"uplink": self._tbf_rate(group_namespace(self.name, i, j), IFNAME),
                                  "port": self._tbf_rate(node_namespace(self.name, i), group_port_name(j))}
                                 for j in range(self.groups_per_node)]
            caps.append(cap)
        return caps

    def _tbf_rate(self, ns: str, dev: str) -> int | None:
        out = _run(["tc", "-j", "-n", ns, "qdisc", "show", "dev", dev], self.tools).stdout
        for qdisc in json.loads(out or "[]"):
            if qdisc.get("kind") == "tbf" and qdisc.get("root"):
                return int(qdisc["options"]["rate"]) * 8       # tc -j reports bytes/s
        return None

    # -- nodes --------------------------------------------------------------------------------------------------

    def _check_node(self, node: int) -> int:
        if not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ClusterError(f"node {node!r} is not in this cluster of {self.nodes} nodes (0-{self.nodes - 1})")
        return node

    def node_address(self, node: int) -> str:
        """The IPv4 address of node ``node``'s NIC (ranks of that node bind to it); with three tiers, of its first
        group's NIC (the node's bridge has no address)."""
        return node_address(self._check_node(node) * self.groups_per_node)

    def node_namespace(self, node: int) -> str:
        """Node ``node``'s namespace: where its ranks run, or with three tiers its bridge and uplink."""
        return node_namespace(self.name, self._check_node(node))

    def group_namespace(self, node: int, group: int) -> str:
        """Three tiers: the namespace of group ``group`` of node ``node``."""
        if not isinstance(group, int) or not 0 <= group < self.groups_per_node or self.groups_per_node == 1:
            raise ClusterError(f"group {group!r} is not in this cluster's {self.groups_per_node} group(s) per node "
                               "(groups exist with three tiers)")
        return group_namespace(self.name, self._check_node(node), group)

    def rank_namespace(self, rank: int) -> str:
        """Where rank ``rank`` runs: its node's namespace, or with three tiers its group's."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ClusterError(f"rank {rank!r} is not in this cluster of {self.world_size} ranks")
        node, local = divmod(rank, self.ranks_per_node)
        if self.groups_per_node == 1:
            return node_namespace(self.name, node)
        return group_namespace(self.name, node, local // self.ranks_per_group)

    def rank_address(self, rank: int) -> str:
        """The address rank ``rank`` binds to (its node's, or with three tiers its group's, NIC)."""
        self.rank_namespace(rank)
        return node_address(rank // self.ranks_per_group if self.groups_per_node > 1 else rank // self.ranks_per_node)

    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside node ``node`` (``ip netns exec``, which also shows that node's /sys)."""
        return [self.tools["ip"], "netns", "exec", self.node_namespace(node), *argv]

    def run_in_node(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside node ``node``."""
        return subprocess.run(self.node_command(node, argv), **kwargs)

    def nic_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each node's NIC (its uplink to the switch) has sent and received so far:
        ``{node: {"tx": ..., "rx": ...}}``."""
        return {i: self._read_counters(node_namespace(self.name, i), f"node {i}") for i in range(self.nodes)}

    def group_nic_bytes(self) -> dict[int, list[dict[str, int]]]:
        """Three tiers: per node, the bytes each group's NIC (its link to the node bridge) has sent and received."""
        return {i: [self._read_counters(group_namespace(self.name, i, j), f"group {j} of node {i}")
                    for j in range(self.groups_per_node)] for i in range(self.nodes)} \
            if self.groups_per_node > 1 else {}

    def tier_nic_bytes(self) -> dict[str, dict[int, dict[str, int]]]:
        """Bytes sent and received so far on each capped tier's links, per node: ``{"world": {node: {"tx", "rx"}}}``
        from the node uplinks, and with three tiers ``"node"``: the node's group links minus what went on through
        its uplink (the traffic between the node's groups). Counters are cumulative: take differences."""
        world = self.nic_bytes()
        tiers = {"world": world}
        if self.groups_per_node > 1:
            groups = self.group_nic_bytes()
            tiers["node"] = {i: {d: sum(g[d] for g in groups[i]) - world[i][d] for d in ("tx", "rx")}
                             for i in range(self.nodes)}
        return tiers

    def _read_counters(self, ns: str, what: str) -> dict[str, int]:
        stats = f"/sys/class/net/{IFNAME}/statistics"
        proc = subprocess.run([self.tools["ip"], "netns", "exec", ns, "cat", f"{stats}/tx_bytes",
                               f"{stats}/rx_bytes"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"cannot read {what}'s NIC counters: {proc.stderr.strip()} (is cluster "
                               f"{self.name!r} up?)")
        tx, rx = (int(v) for v in proc.stdout.split())
        return {"tx": tx, "rx": rx}

    # -- jobs ---------------------------------------------------------------------------------------------------

    def launch(self, argv: Sequence[str], env: dict[str, str] | None = None, *, timeout: float | None = 600.0,
               echo: bool = False, port: int | None = None, cwd: str | os.PathLike | None = None
               ) -> list[RankResult]:
        """Run ``argv`` once per rank like torchrun would, rank r inside node r // ranks_per_node (with three
        tiers inside its group's namespace, ``rank_namespace``); wait for all.

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
            for rank in range(self.world_size):
                argv_in_ns = [self.tools["ip"], "netns", "exec", self.rank_namespace(rank), *argv]
                proc = subprocess.Popen(argv_in_ns, cwd=cwd, text=True, errors="replace",
                                        env={**base, **rank_env(rank, self.nodes, self.ranks_per_node, port,
                                                                self.groups_per_node, self.name)},
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
        results = [RankResult(rank, rank // self.ranks_per_node, proc.returncode, "".join(outputs[rank][0]),
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


def down_all() -> list[str]:
    """Tear down every ``ts-`` cluster on this machine; returns their names."""
    names = list(list_clusters())
    for state in STATE_DIR.glob("cluster-*.json") if STATE_DIR.exists() else []:
        name = state.stem.removeprefix("cluster-")
        if NAME_RE.match(name) and name not in names:
            names.append(name)
    for name in names:
        EmulatedCluster(1, 1, None, name=name).down()
    return names


# ---------------------------------------------------------------------------------------------------------------
# The check job: runs on every rank (``python -m tiershard.cluster allreduce``)


def read_node_uplink() -> dict[str, int]:
    """Inside a rank of a three-tier cluster: bytes its node's uplink has sent and received so far, read in the
    node's namespace (``TIERSHARD_NODE_NETNS``; the rank's own namespace shows only its group's NIC)."""
    ns = os.environ.get(NODE_NETNS_ENV, "")
    if not NAMESPACE_RE.match(ns):
        raise ClusterError(f"{NODE_NETNS_ENV}={ns!r} does not name a cluster node's namespace: this reads a node's "
                           "uplink from a rank launched on a three-tier EmulatedCluster, which sets it")
    ip = shutil.which("ip", path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN])) or "ip"
    stats = f"/sys/class/net/{IFNAME}/statistics"
    proc = subprocess.run([ip, "netns", "exec", ns, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"cannot read {ns}'s uplink counters: {proc.stderr.strip()}")
    tx, rx = (int(v) for v in proc.stdout.split())
    return {"tx": tx, "rx": rx}


def _read_nic() -> tuple[int, int]:
    stats = Path(f"/sys/class/net/{IFNAME}/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def allreduce_job(nbytes: int, iters: int, warmup: int = 1, phases: Sequence[str] = ("world", "node")) -> list[dict]:
    """Time gloo all_reduces of ``nbytes`` over the world and over each node's ranks, and read this node's NIC
    counters around each op (between barriers, so only that op's bytes are counted). Returns one record per phase.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node_groups = [dist.new_group(list(range(s, s + per_node))) for s in range(0, world, per_node)]
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        records = []
        for phase in phases:
            group = None if phase == "world" else node_groups[rank // per_node]
            seconds, tx, rx = [], [], []
            for i in range(warmup + iters):
                dist.barrier()
                t0, (tx0, rx0) = time.perf_counter(), _read_nic()
                dist.all_reduce(buf, group=group)
                elapsed = time.perf_counter() - t0
                dist.barrier()
                tx1, rx1 = _read_nic()
                if i >= warmup:
                    seconds.append(elapsed)
                    tx.append(tx1 - tx0)
                    rx.append(rx1 - rx0)
            records.append({"rank": rank, "node": rank // per_node, "phase": phase, "bytes": buf.numel() * 4,
                            "seconds": seconds, "nic_tx": tx, "nic_rx": rx})
        return records
    finally:
        dist.destroy_process_group()


def summarize_allreduce(results: Sequence[RankResult], nodes: int, ranks_per_node: int) -> list[dict]:
    """Per phase: the slowest rank's median op time and each node's median NIC bytes per op, with the formula."""
    records = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    summary = []
    for phase in dict.fromkeys(rec["phase"] for rec in records):
        recs = [rec for rec in records if rec["phase"] == phase]
        nbytes = recs[0]["bytes"]
        per_node = {}
        for rec in recs:
            per_node.setdefault(rec["node"], {"tx": _median(rec["nic_tx"]), "rx": _median(rec["nic_rx"])})
        summary.append({
            "phase": phase, "bytes": nbytes, "seconds": max(_median(rec["seconds"]) for rec in recs),
            "nic": per_node,
            "expected_nic_bytes": ring_allreduce_nic_bytes(nbytes, nodes, ranks_per_node) if phase == "world" else 0,
        })
    return summary


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tiershard.cluster",
                                description="Jobs that run on each rank of an emulated cluster.")
    sub = p.add_subparsers(dest="job", required=True)
    a = sub.add_parser("allreduce", help="time world and intra-node all_reduces; print one JSON line per phase")
    a.add_argument("--bytes", type=int, default=16 * 2**20)
    a.add_argument("--iters", type=int, default=3)
    a.add_argument("--warmup", type=int, default=1)
    a.add_argument("--phases", default="world,node", help="comma list of world, node")
    args = p.parse_args(argv)
    for record in allreduce_job(args.bytes, args.iters, args.warmup, args.phases.split(",")):
        print(json.dumps(record), flush=True)
    return 0

