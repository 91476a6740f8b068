"""PaRO-CC: a collective that spans several tiers, run as one phase per tier on the cross groups.

With the ownership map of topology.py a level-``a`` chunk is the concatenation, in slot order, of the level-``b``
chunks of its cross group, so a reduce-scatter from ``a`` to ``b`` is one reduce-scatter per tier, innermost
first (intra-node, then inter-node with 1/m of the data), and an all-gather is the same phases in reverse
(inter-node first on the small chunks, then intra-node). An all-reduce is the reduce-scatter phases followed by
the all-gather phases. ``groups(k)`` is the cross group from level ``k - 1`` to ``k``.
"""
from __future__ import annotations

from typing import Callable, TYPE_CHECKING

import torch

from . import collectives as C

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology

Groups = Callable[[int], "TierGroup"]


def all_gather(out: torch.Tensor, shard: torch.Tensor, inner: int, outer: int, groups: Groups,
               topology: "Topology", op: str) -> None:
    """``out`` (the level-``inner`` chunk) from every level-``outer`` shard, outermost tier first."""
    buf = shard
    for k in range(outer, inner, -1):
        group = groups(k)
        target = out if k == inner + 1 else torch.empty(buf.numel() * group.size, dtype=buf.dtype, device=buf.device)
        C.all_gather(target, buf, group, topology, op)
        buf = target


def reduce_scatter(buf: torch.Tensor, inner: int, outer: int, groups: Groups, topology: "Topology",
                   op: str) -> torch.Tensor:
    """This rank's level-``outer`` chunk of the sum of ``buf`` (a level-``inner`` chunk), innermost tier first."""
    for k in range(inner + 1, outer + 1):
        group = groups(k)
        out = torch.empty(buf.numel() // group.size, dtype=buf.dtype, device=buf.device)
        C.reduce_scatter(out, buf, group, topology, op)
        buf = out
    return buf


def all_reduce(buf: torch.Tensor, inner: int, outer: int, groups: Groups, topology: "Topology", op: str) -> None:
    """Sum ``buf`` in place over the (inner -> outer) group: reduce-scatter phases, then all-gather phases."""
    if outer == inner:
        return
    if outer - inner == 1:
        C.all_reduce(buf, groups(outer), topology, op)
        return
    shard = reduce_scatter(buf, inner, outer, groups, topology, op)
    all_gather(buf, shard, inner, outer, groups, topology, op)
