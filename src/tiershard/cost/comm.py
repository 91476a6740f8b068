"""Bytes and time of the collectives a plan runs per optimizer step.

The collectives are ``cost.traffic``'s (the schedule the engine's ledger is checked against); this module
only prices them. Bytes per tier use ``comm.volume``'s link model through ``rank_bytes``, summed over one group
and multiplied by the number of congruent groups, so the totals equal ``traffic.total_traffic`` exactly.

[Note: time model] A tier's ``bandwidth`` is per rank. A collective's bytes on a tier are spread evenly over the
ranks' links of that tier (what multi-channel rings do with one NIC per GPU or a node's NICs shared), the
tiers' links run at once, so a collective takes the slowest tier's share:

    time = max over tiers (bytes per rank on the tier / tier bandwidth) + latency
    latency:  steps x (k - 1) x the largest latency of the tiers it crosses
    steps = 2 for all-reduce, else 1; all-to-all: (k - 1) pairwise steps over its tier
    codec:    qwZ/qgZ values quantized and dequantized / that codec's measured rate (``Cluster.codec_rates``),
              else the cluster's one codec rate, else 0 (``Cluster.codec_seconds``)
    every:    a collective that runs once every H steps (the outer sync) counts 1/H of its bytes and time per step

PaRO-CC needs no case of its own: ``traffic`` already splits a plan's multi-tier collectives into one phase per
tier, so each phase pays its own tier's latency and the inter-node phase moves 1/m of the data.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from ..comm.volume import rank_bytes
from ..plan import Placement
from ..runtime.layout import padded_unit_numel, unit_columns
from ..topology import Topology
from .traffic import Collective, FlatGroupShape, group_collectives
from .specs import Cluster, Job, ModelSpec

MICRO_OPS = ("param_gather", "grad_reduce")   # op-name prefixes that run every micro-step; the rest at the boundary


@dataclass(frozen=True)
class Priced:
    """One collective (with its repeat count) and what it costs: bytes per tier over all ranks, seconds."""

    collective: Collective
    tier_bytes: dict[str, int]
    per_rank: dict[str, float]        # mean bytes one rank sends on each tier
    seconds: float

    @property
    def micro(self) -> bool:
        return self.collective.op.startswith(MICRO_OPS)


def unit_shapes(model: ModelSpec, job: Job, chunking: tuple[int, ...],
                frozen_chunking: tuple[int, ...] | None = None) -> list[tuple[FlatGroupShape, int]]:
    """Flat groups of the model and how many units share each shape (``traffic.module_shapes``'s convention).

    A unit's trainable and frozen parameters are separate flat groups, padded per parameter as the engine pads
    them when cut by ``chunking`` (``Topology.chunking(os)``; frozen ones by ``frozen_chunking``,
    ``Topology.chunking(p)``); parameter shapes are exact for a spec made
    ``from_module`` and one flat tensor per group otherwise. A unit other than the root gathers again for
    backward when it has trainable parameters.
    """
    out: list[tuple[FlatGroupShape, int]] = []
    for trainable, frozen, units, root in model.unit_param_shapes():
        for shapes, grad in ((trainable, True), (frozen, False)):
            if shapes:
                backward = bool(trainable) and not root
                cut = chunking if grad or frozen_chunking is None else frozen_chunking
                columns = unit_columns(shapes, cut) if model.param_shapes else ()
                out.append((FlatGroupShape(padded_unit_numel(shapes, cut), grad, backward=backward, columns=columns),
                            units))
    return out


def plan_collectives(pl: Placement, model: ModelSpec, job: Job) -> list[Collective]:
    """Every collective of one optimizer step, as ``traffic.group_collectives`` lists them (with the qwz / qgz
    wire formats: int8 gathers, one all-to-all hop per tier in that tier's codec)."""
    out: list[Collective] = []
    for shape, units in unit_shapes(model, job, pl.topology.chunking(pl.os), pl.topology.chunking(pl.p)):
        for c in group_collectives(pl, shape, job.param_bytes, job.reduce_bytes, job.accum):
            out.append(replace(c, count=c.count * units))
    return out


@lru_cache(maxsize=4096)
def _links(topology: Topology, kind: str, inner: int, outer: int) -> tuple[int, tuple[tuple[str, int], ...], int]:
    """Group size, sending links per tier in one group, and links per sender, from the link model itself."""
    ranks = topology.cross_ranks(0, inner, outer)
    k = len(ranks)
    per_sender = k - 1 if kind == "all_to_all" else 1
    unit = sum(rank_bytes(kind, ranks, k, ranks[0], topology).values()) // per_sender
    counts: dict[str, int] = {}
    for r in ranks:
        for tier, b in rank_bytes(kind, ranks, k, r, topology).items():
            counts[tier] = counts.get(tier, 0) + b // unit
    return k, tuple(counts.items()), per_sender


@lru_cache(maxsize=65536)
def _per_link(topology: Topology, kind: str, inner: int, outer: int, nbytes: int) -> int:
    ranks = topology.cross_ranks(0, inner, outer)
    per_sender = _links(topology, kind, inner, outer)[2]
    return sum(rank_bytes(kind, ranks, nbytes, ranks[0], topology).values()) // per_sender


def price(c: Collective, cluster: Cluster) -> Priced:
    """Bytes on each tier (all ranks, all ``c.count`` repeats) and seconds of ``c`` on ``cluster``."""
    topo = cluster.topology
    k, links, _ = _links(topo, c.kind, c.inner, c.outer)
    if k <= 1 or not links:
        return Priced(c, {}, {}, 0.0)
    per_link = _per_link(topo, c.kind, c.inner, c.outer, c.nbytes)
    groups = topo.world_size // k
    tier_bytes = {t: groups * n * per_link * c.count // c.every for t, n in links}
    per_rank = {t: n * per_link / k for t, n in links}
    tiers = {t.name: t for t in cluster.tiers}
    bw_time = max(b / tiers[t].bandwidth for t, b in per_rank.items())
    steps = 2 if c.kind == "all_reduce" else 1
    latency = steps * (k - 1) * max(tiers[t].latency for t, _ in links)
    codec = cluster.codec_seconds(c.codec, c.codec_bytes)
    return Priced(c, tier_bytes, {t: b * c.count / c.every for t, b in per_rank.items()},
                  c.count * (bw_time + latency + codec) / c.every)


def price_plan(pl: Placement, model: ModelSpec, job: Job, cluster: Cluster) -> list[Priced]:
    return [price(c, cluster) for c in plan_collectives(pl, model, job)]
