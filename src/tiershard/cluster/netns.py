"""Namespaces and links of an emulated cluster: their names, the tc rates, the ip/tc commands that build and cap
them, and running those commands as root.

The layout (``emulated`` describes it whole): one network namespace per node (``ts-<name>-n<i>``, NIC ``eth0`` at
``10.77.0.<i+1>/24``), a switch namespace (``ts-<name>-sw``, bridge ``br0``, one veth port ``p<i>`` per node), a
``tbf`` cap on every node uplink and every switch port; with three tiers each node is a bridge namespace with group
namespaces (``ts-<name>-n<i>g<j>``, port ``q<j>``) behind it. The names, rates and commands are pure functions
(unit-tested without root); ``run_ip``, ``list_namespaces`` and the state files need root and iproute2.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

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


# ---- rates ------------------------------------------------------------------------------------------------
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


# ---- names ------------------------------------------------------------------------------------------------
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


# ---- the commands that build and cap the links --------------------------------------------------------------
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


# ---- running them: root, iproute2, the namespaces present, the state files -----------------------------------
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


def run_ip(cmd: Sequence[str], tools: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    """Run one ip/tc command in its own session, so a Ctrl-C at the terminal reaches only us (and our cleanup)."""
    argv = [tools.get(cmd[0], cmd[0]), *cmd[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, start_new_session=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"`{' '.join(cmd)}` failed: {msg[-1] if msg else f'exit code {proc.returncode}'}")
    return proc


def list_namespaces(tools: dict[str, str] | None = None) -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    tools = tools or require_root_and_tools()
    out = run_ip(["ip", "netns", "list"], tools).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_clusters() -> dict[str, list[str]]:
    """The clusters present on this machine: name -> their ``ts-`` namespaces (node namespaces first)."""
    return cluster_namespaces(list_namespaces())


def state_path(name: str) -> Path:
    """Where ``up`` records cluster ``name``'s shape (``attach`` reads it back)."""
    return STATE_DIR / f"cluster-{check_name(name)}.json"
