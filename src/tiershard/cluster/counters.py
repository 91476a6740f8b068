"""NIC byte counters of an emulated cluster: read from outside (``EmulatedCluster.nic_bytes`` and friends, through
``ip netns exec``) or from inside a rank (``read_node_uplink``), and what a ring all-reduce should put on them.

Each namespace's ``eth0`` counts only what crosses its link: ranks of one namespace talk over loopback, so a node's
uplink counts the inter-node tier and, with three tiers, a group's link counts what leaves the group.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from .netns import IFNAME, NAMESPACE_RE, NODE_NETNS_ENV, SBIN, ClusterError

def read_counters(ip: str, ns: str, what: str, cluster: str) -> dict[str, int]:
    """Bytes ``ns``'s NIC has sent and received so far, ``{"tx": ..., "rx": ...}`` (``what`` names it in errors)."""
    stats = f"/sys/class/net/{IFNAME}/statistics"
    proc = subprocess.run([ip, "netns", "exec", ns, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"cannot read {what}'s NIC counters: {proc.stderr.strip()} (is cluster {cluster!r} up?)")
    tx, rx = (int(v) for v in proc.stdout.split())
    return {"tx": tx, "rx": rx}


def tier_bytes(world: dict[int, dict[str, int]], groups: dict[int, list[dict[str, int]]]
               ) -> dict[str, dict[int, dict[str, int]]]:
    """Per capped tier and node, from the node uplinks' counters (``world``) and, with three tiers, the group
    links' (``groups``): ``"node"`` is the node's group links less what went on through its uplink."""
    tiers = {"world": world}
    if groups:
        tiers["node"] = {i: {d: sum(g[d] for g in groups[i]) - world[i][d] for d in ("tx", "rx")} for i in world}
    return tiers


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


def read_nic() -> tuple[int, int]:
    """Inside a rank: bytes its own namespace's NIC has sent and received so far."""
    stats = Path(f"/sys/class/net/{IFNAME}/statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


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
