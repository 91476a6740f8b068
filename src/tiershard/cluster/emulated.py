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

This module holds the cluster itself (``EmulatedCluster``: its life cycle, caps, addresses and jobs); the rest is
split by concern, and every name that used to live here still imports from here:

- ``netns``: the namespaces and links (names, tc rates, the ip/tc commands, root and iproute2, the state files);
- ``launch``: launching a job (one process per rank in its namespace, its environment, signals, results);
- ``counters``: the NIC byte counters and what a ring all-reduce puts on them;
- ``check``: the small gloo job that ``tiershard cluster check`` and the tests launch on every rank
  (``python -m tiershard.cluster allreduce ...``).
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import Sequence

from . import netns
from .check import allreduce_job, summarize_allreduce
from .check import main as _main
from .counters import (read_counters, read_nic, read_node_uplink, ring_allreduce_nic_bytes,
                       ring_allreduce_tier_bytes, tier_bytes)
from .launch import (LaunchError, RankResult, deferred_signals, kill_pids, launch_ranks, rank_env,
                     terminate_as_interrupt)
from .netns import (BRIDGE, DEFAULT_NAME, IFNAME, MAX_NODES, MIN_BURST, NAME_RE, NAMESPACE_RE, NODE_NETNS_ENV,
                    PREFIX, SBIN, STATE_DIR, SUBNET, TBF_LATENCY, TIER_NAMES, ClusterError, check_name, check_tiers,
                    cluster_namespaces, format_rate, group_namespace, group_port_name, group_shape_commands,
                    list_clusters, list_namespaces, namespaces_unavailable, node_address, node_namespace, parse_rate,
                    port_name, require_root_and_tools, shape_commands, switch_namespace, tbf_args, tbf_burst,
                    up_commands)

# Host calls go through the module (netns.run_ip, netns.STATE_DIR), so one patch there reaches every caller.

__all__ = [
    "BRIDGE", "DEFAULT_NAME", "IFNAME", "MAX_NODES", "MIN_BURST", "NAME_RE", "NAMESPACE_RE", "NODE_NETNS_ENV", "PREFIX",
    "SBIN", "STATE_DIR", "SUBNET", "TBF_LATENCY", "TIER_NAMES", "ClusterError", "EmulatedCluster", "LaunchError",
    "RankResult", "allreduce_job", "check_name", "check_tiers", "cluster_namespaces", "down_all", "format_rate",
    "group_namespace", "group_port_name", "group_shape_commands", "kill_pids", "launch_ranks", "list_clusters",
    "list_namespaces", "namespaces_unavailable", "node_address", "node_namespace", "parse_rate", "port_name",
    "rank_env", "read_counters", "read_nic", "read_node_uplink", "require_root_and_tools", "ring_allreduce_nic_bytes",
    "ring_allreduce_tier_bytes", "shape_commands", "summarize_allreduce", "switch_namespace", "tbf_args", "tbf_burst",
    "tier_bytes", "up_commands",
]


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
        present = cluster_namespaces(netns.list_namespaces(tools)).get(check_name(name))
        if not present:
            raise ClusterError(f"no cluster {name!r} is up: start one with `tiershard cluster up`")
        try:
            state = json.loads(netns.state_path(name).read_text())
        except (OSError, ValueError):
            raise ClusterError(f"cluster {name!r} has namespaces but no state file {netns.state_path(name)} (an "
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
        present = cluster_namespaces(netns.list_namespaces(self.tools)).get(self.name)
        return bool(present) or netns.state_path(self.name).exists()

    def up(self) -> EmulatedCluster:
        """Build the namespaces, links and caps; on any error or interrupt half-way, remove what was made."""
        tools = self.tools
        if self.exists():
            if not self.replace:
                raise ClusterError(f"cluster {self.name!r} is already up: run `tiershard cluster down` first, or "
                                   "use --replace (replace=True) to re-create it")
            self.down()
        netns.STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"name": self.name, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                 "inter_bw": format_rate(self.inter_bw), "ifname": IFNAME,
                 "addresses": [node_address(i) for i in range(self.nodes * self.groups_per_node)]}
        if self.groups_per_node > 1:
            state.update(groups_per_node=self.groups_per_node, node_bw=format_rate(self.node_bw))
        try:
            # O_EXCL: two concurrent ups of one name cannot both pass this point.
            fd = os.open(netns.state_path(self.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise ClusterError(f"cluster {self.name!r} is being created by another process: wait, or run "
                               "`tiershard cluster down`") from None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1)
            for cmd in up_commands(self.name, self.nodes, self.inter_bw, self.groups_per_node, self.node_bw):
                proc = netns.run_ip(cmd, tools, check=False)
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
        with deferred_signals():
            errors = []
            for ns in cluster_namespaces(netns.list_namespaces(tools)).get(self.name, []):
                pids = netns.run_ip(["ip", "netns", "pids", ns], tools, check=False).stdout.split()
                kill_pids([int(p) for p in pids if p.isdigit()])
                proc = netns.run_ip(["ip", "netns", "del", ns], tools, check=False)
                if proc.returncode != 0:
                    errors.append(f"{ns}: {proc.stderr.strip()}")
            try:
                netns.state_path(self.name).unlink()
            except FileNotFoundError:
                pass
            try:
                netns.STATE_DIR.rmdir()
            except OSError:
                pass
            self._owned = False
        if errors:
            raise ClusterError(f"could not delete {'; '.join(errors)}: retry `tiershard cluster down`")

    def __enter__(self) -> EmulatedCluster:
        self._signals = terminate_as_interrupt()
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
            proc = netns.run_ip(cmd, self.tools, check=False)
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
            proc = netns.run_ip(cmd, self.tools, check=False)
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
        out = netns.run_ip(["tc", "-j", "-n", ns, "qdisc", "show", "dev", dev], self.tools).stdout
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
        return {i: read_counters(self.tools["ip"], node_namespace(self.name, i), f"node {i}", self.name)
                for i in range(self.nodes)}

    def group_nic_bytes(self) -> dict[int, list[dict[str, int]]]:
        """Three tiers: per node, the bytes each group's NIC (its link to the node bridge) has sent and received."""
        return {i: [read_counters(self.tools["ip"], group_namespace(self.name, i, j), f"group {j} of node {i}",
                                  self.name) for j in range(self.groups_per_node)] for i in range(self.nodes)} \
            if self.groups_per_node > 1 else {}

    def tier_nic_bytes(self) -> dict[str, dict[int, dict[str, int]]]:
        """Bytes sent and received so far on each capped tier's links, per node: ``{"world": {node: {"tx", "rx"}}}``
        from the node uplinks, and with three tiers ``"node"``: the node's group links minus what went on through
        its uplink (the traffic between the node's groups). Counters are cumulative: take differences."""
        return tier_bytes(self.nic_bytes(), self.group_nic_bytes())

    # -- jobs ---------------------------------------------------------------------------------------------------

    def launch(self, argv: Sequence[str], env: dict[str, str] | None = None, *, timeout: float | None = 600.0,
               echo: bool = False, port: int | None = None, cwd: str | os.PathLike | None = None
               ) -> list[RankResult]:
        """Run ``argv`` once per rank like torchrun would, rank r inside node r // ranks_per_node (with three
        tiers inside its group's namespace, ``rank_namespace``); wait for all: ``launch.launch_ranks``, which says
        what each rank gets. If a rank fails, the others are stopped and LaunchError carries the failing rank's
        stderr tail; a timeout stops them all."""
        namespaces = [self.rank_namespace(rank) for rank in range(self.world_size)]
        return launch_ranks(argv, ip=self.tools["ip"], namespaces=namespaces, ranks_per_node=self.ranks_per_node,
                            groups_per_node=self.groups_per_node, cluster=self.name, env=env, timeout=timeout,
                            echo=echo, port=port, cwd=cwd)


def down_all() -> list[str]:
    """Tear down every ``ts-`` cluster on this machine; returns their names."""
    names = list(list_clusters())
    for state in netns.STATE_DIR.glob("cluster-*.json") if netns.STATE_DIR.exists() else []:
        name = state.stem.removeprefix("cluster-")
        if NAME_RE.match(name) and name not in names:
            names.append(name)
    for name in names:
        EmulatedCluster(1, 1, None, name=name).down()
    return names
