"""The link model behind ``comm_stats`` and the cost model: which bytes a collective puts on which tier.

[Note: link model] All-gather, reduce-scatter and all-reduce run as a ring over the group's ranks in rank
order (tier-contiguous, so a ring crosses each tier boundary as few times as possible); all-to-all sends each
member its slice directly. A link's bytes are counted by the sender, on the smallest tier holding both ends.
With ``k`` members and a buffer of ``S`` bytes (the gathered output, the reduce-scatter input, the all-reduce
buffer, the all-to-all input):

    all_gather, reduce_scatter: each rank sends (k-1)/k * S to its ring successor
    all_reduce:                 each rank sends 2 (k-1)/k * S to its ring successor
    all_to_all:                 each rank sends S/k to every other member
    gather:                     each rank but the first sends S/k to the first (state dicts for one rank)

The engine records every collective through ``rank_bytes``; the cost model sums the same function over ranks,
so a prediction and a measurement can only differ if the schedule differs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..topology import Topology

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "gather")


def rank_bytes(kind: str, ranks: Sequence[int], nbytes: int, rank: int, topology: "Topology") -> dict[str, int]:
    """Bytes that ``rank`` sends on each tier for one collective of ``kind`` over ``ranks``."""
    k = len(ranks)
    if k <= 1 or nbytes == 0:
        return {}
    i = ranks.index(rank)
    if kind in ("all_gather", "reduce_scatter", "all_reduce"):
        sent = (k - 1) * nbytes // k * (2 if kind == "all_reduce" else 1)
        return {topology.tier_of_link(rank, ranks[(i + 1) % k]): sent}
    if kind == "all_to_all":
        out: dict[str, int] = {}
        for peer in ranks:
            if peer != rank:
                tier = topology.tier_of_link(rank, peer)
                out[tier] = out.get(tier, 0) + nbytes // k
        return out
    if kind == "gather":
        return {} if rank == ranks[0] else {topology.tier_of_link(rank, ranks[0]): nbytes // k}
    raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")


def add_into(total: dict[str, int], part: dict[str, int], times: int = 1) -> dict[str, int]:
    for tier, b in part.items():
        total[tier] = total.get(tier, 0) + b * times
    return total
