"""Closed-form traffic of a plan: the collectives one optimizer step runs, and their bytes on each tier.

This is the schedule the levels imply (DESIGN.md section 1), written once as data, so that the engine's ledger
(``comm_stats``) can be checked against it and the cost model can price it. It does not drive the engine: the
runtime follows the same rules by itself, and the tests compare the two.

Per flat group of ``S`` padded elements (one per unit and per requires_grad), with ``d(L)`` the group size of
level ``L`` and top = world:

    every forward call   p > N: all-gather over level p of S x param bytes
    every backward       p > N: the same again (a unit that runs backward, trainable or not; not the root, which
                         stays gathered from its forward to its backward)
                         with hpz, only the first gather after the weights change uses level p; the rest
                         gather over the finest hpz level
    every micro-step     g > N: reduce-scatter over level g of S x reduce bytes   (trainable groups)
    at the boundary      g < os: reduce-scatter over (g -> os) of S/d(g), then all-reduce over (os -> top)
                         g = os: all-reduce over (g -> top) of S/d(g)
                         g > os: all-reduce over (g -> top) of S/d(g), then all-gather over (os -> g)
    after the step       p < os: all-gather over (p -> os) of S/d(p) x param bytes
    every H steps        outer sync ([Note: outer sync] in plan.py): the levels above are capped at the island
                         (top = the tier below world); then over the islands' cross group (top -> world) an
                         all-reduce of S/d(os) fp32 values, or with a codec an all-gather of each member's encoding
                         of them (``every = H``: bytes per step are the sync's / H; a fragment's share is the same
                         bytes, at another step)

With qwz every parameter gather moves the int8 encodings of the d(p) chunks (payload plus fp32 scales) instead
of param bytes. With qwd (which needs hpz) the gather from level p sends, over the tiers from the outermost hpz
level h to p, each chunk's difference in the qwd codec (``param_diff``), then gathers the whole matrix exactly
over level h; this is the steady state: the first gather after ``ts.shard`` or a write that is not an optimizer
step sends values exactly. With qgz every reduce-scatter from level a to b becomes one all-to-all per tier between them
(see [Note: qgZ hops] in comm/quantized.py), each of the encodings of its input's slots in that tier's own codec
(``Placement.qgz_spec``: one per tier), with blocks cut along the parameters of each row
(``FlatGroupShape.columns``). With cc every other
collective that spans several tiers runs as one phase per tier (comm/hierarchical.py): a reduce-scatter
innermost tier first, an all-gather outermost first, an all-reduce both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, TYPE_CHECKING

from ..comm.quantized import pipeline_chunks
from ..comm.volume import add_into, rank_bytes

if TYPE_CHECKING:
    from ..plan import Placement
    from ..topology import Topology


@dataclass(frozen=True)
class Collective:
    """One collective: ``op`` names its purpose (the ledger's key), ``inner -> outer`` its group."""

    op: str
    kind: str
    inner: int
    outer: int
    nbytes: int
    count: int = 1
    codec_bytes: int = 0    # bytes of values this rank's codec encodes and decodes (qwZ, qgZ); 0 = none
    every: int = 1          # runs once every ``every`` optimizer steps (the outer sync's period)
    codec: str = ""         # the codec's spec (``BlockCodec.spec``) behind ``codec_bytes``; "" = none


@dataclass(frozen=True)
class FlatGroupShape:
    """What the traffic of one flat group depends on."""

    numel: int          # padded
    trainable: bool
    forward_calls: int = 1
    backward: bool = True   # the unit gathers again for backward (not the root, which stays gathered)
    columns: tuple[int, ...] = ()   # the parameters' widths in a row (qgZ's blocks never span two); () = unknown


def group_collectives(pl: "Placement", shape: FlatGroupShape, param_bytes: int, reduce_bytes: int,
                      micro_steps: int = 1) -> list[Collective]:
    """The collectives of one flat group over one optimizer step of ``micro_steps`` micro-steps."""
    top = pl.dp_level
    S, d = shape.numel, pl.size
    out: list[Collective] = []
    qwz, qgz = plan_codecs(pl)
    qgz_feedback = pl.plan.error_feedback

    def reduce_scatter(op: str, inner: int, outer: int, buffer_bytes: int, count: int = 1) -> list[Collective]:
        if qgz is None:
            return [Collective(op, "reduce_scatter", inner, outer, buffer_bytes, count)]
        hops = []
        active = [k for k in range(inner + 1, outer + 1) if d(k) > d(k - 1)]
        runs = pipeline_chunks(shape.columns or None)
        if len(active) < 2 or not shape.columns or qgz_feedback:
            runs = [shape.columns or None]        # one run: no pipeline ([Note: qgZ pipeline])
        width = sum(shape.columns) if shape.columns else S
        for k in range(inner + 1, outer + 1):
            slots, codec = d(k) // d(k - 1), qgz[k - 1]         # each tier's own codec ([Note: qgz specs], plan.py)
            # each run's rows x its columns per member; encode the hop's input, decode and sum what arrives
            for run in runs:
                part = S // d(k) * sum(run) // width if run else S // d(k)
                hops.append(Collective(op, "all_to_all", k - 1, k, slots * codec.wire_bytes(part, run or None), count,
                                       2 * 4 * part * slots, codec=codec.spec))
        return hops

    if pl.p > 0:
        fwd = shape.forward_calls * micro_steps
        bwd = micro_steps if shape.backward else 0
        full = S * param_bytes if qwz is None else d(pl.p) * qwz.wire_bytes(S // d(pl.p))
        codec = 0 if qwz is None else S * param_bytes     # decode the whole unit (its shard's encoding is cached)
        spec = "" if qwz is None else qwz.spec
        if pl.hpz and pl.plan.qwd:
            from ..comm.codecs import codec_from_spec

            h, qwd = max(pl.hpz), codec_from_spec(pl.plan.qwd)
            out.append(Collective("param_diff", "all_gather", h, pl.p, d(pl.p) // d(h) * qwd.wire_bytes(S // d(pl.p)),
                                  1, 4 * (S // d(pl.p) + S // d(h)), codec=qwd.spec))
            out.append(Collective("param_gather", "all_gather", 0, h, full, 1))
            cached = min(pl.hpz)
            out.append(Collective("param_gather", "all_gather", 0, cached, full, fwd - 1, codec, codec=spec))
            out.append(Collective("param_gather_backward", "all_gather", 0, cached, full, bwd, codec, codec=spec))
        elif pl.hpz:
            cached = min(pl.hpz)
            out.append(Collective("param_gather", "all_gather", 0, pl.p, full, 1, codec, codec=spec))
            out.append(Collective("param_gather", "all_gather", 0, cached, full, fwd - 1, codec, codec=spec))
            out.append(Collective("param_gather_backward", "all_gather", 0, cached, full, bwd, codec, codec=spec))
        else:
            out.append(Collective("param_gather", "all_gather", 0, pl.p, full, fwd, codec, codec=spec))
            out.append(Collective("param_gather_backward", "all_gather", 0, pl.p, full, bwd, codec, codec=spec))
    if not shape.trainable:
        return out
    if pl.g > 0:
        out += reduce_scatter("grad_reduce", 0, pl.g, S * reduce_bytes, micro_steps)
    shard_g = S // d(pl.g) * reduce_bytes
    if pl.g < pl.os:
        out += reduce_scatter("grad_sync", pl.g, pl.os, shard_g)
        out.append(Collective("grad_sync", "all_reduce", pl.os, top, S // d(pl.os) * reduce_bytes))
    else:
        out.append(Collective("grad_sync", "all_reduce", pl.g, top, shard_g))
        if pl.g > pl.os:
            out.append(Collective("grad_sync", "all_gather", pl.os, pl.g, S // d(pl.os) * reduce_bytes))
    if pl.p < pl.os:
        out.append(Collective("param_sync", "all_gather", pl.p, pl.os, S // d(pl.p) * param_bytes))
    outer = pl.plan.outer
    if outer is not None:
        n, world = S // d(pl.os), pl.topology.num_levels - 1
        if outer.codec is None:
            out.append(Collective("outer_sync", "all_reduce", top, world, n * 4, every=outer.every))
        else:
            from ..comm.codecs import codec_from_spec

            islands = d(world) // d(top)
            out.append(Collective("outer_sync", "all_gather", top, world,
                                  islands * codec_from_spec(outer.codec).wire_bytes(n), 1, 4 * n * (islands + 1),
                                  every=outer.every, codec=codec_from_spec(outer.codec).spec))
    if pl.plan.cc:
        quantized_gathers = {"param_gather", "param_gather_backward"} if qwz is not None else set()
        out = [hop for c in out for hop in
               ([c] if c.op in quantized_gathers | {"param_diff", "outer_sync"} or c.kind == "all_to_all"
         else _phases(c, d))]
    return [c for c in out if c.count > 0 and pl.size(c.outer) > pl.size(c.inner)]


def _phases(c: Collective, d) -> list[Collective]:
    """One collective per tier between ``c.inner`` and ``c.outer`` (PaRO-CC); bytes at each phase's level."""
    if c.outer - c.inner <= 1 or c.kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        return [c]
    def at(k: int) -> int:
        return c.nbytes * d(c.inner) // d(k)
    kinds = {"all_gather": ["all_gather"], "reduce_scatter": ["reduce_scatter"],
             "all_reduce": ["reduce_scatter", "all_gather"]}[c.kind]
    return [Collective(c.op, kind, k - 1, k, at(k - 1), c.count)
            for kind in kinds for k in range(c.inner + 1, c.outer + 1)]


def plan_codecs(pl: "Placement"):
    """The qwz codec (or None) and the qgz codec of each tier, index k-1 for tier k (or None)."""
    from ..comm.codecs import codec_from_spec, hop_codecs

    qwz = codec_from_spec(pl.plan.qwz) if pl.plan.qwz else None
    qgz = hop_codecs(pl.qgz_spec, len(pl.topology.sizes)) if pl.plan.qgz else None
    return qwz, qgz


def step_collectives(pl: "Placement", shapes: Iterable[FlatGroupShape], param_bytes: int = 4,
                     reduce_bytes: int = 4, micro_steps: int = 1) -> list[Collective]:
    return [c for s in shapes for c in group_collectives(pl, s, param_bytes, reduce_bytes, micro_steps)]


def rank_traffic(collectives: Sequence[Collective], topology: "Topology", rank: int) -> dict:
    """Bytes ``rank`` sends, as ``comm_stats`` reports them: {"tiers": {...}, "ops": {...}} (per step: a
    collective that runs every H steps counts 1/H of its bytes)."""
    tiers: dict[str, int] = {}
    ops: dict[str, int] = {}
    for c in collectives:
        ranks = topology.cross_ranks(rank, c.inner, c.outer)
        part = {t: b * c.count // c.every for t, b in rank_bytes(c.kind, ranks, c.nbytes, rank, topology).items()}
        add_into(tiers, part)
        ops[c.op] = ops.get(c.op, 0) + sum(part.values())
    return {"tiers": tiers, "ops": ops}


def total_traffic(collectives: Sequence[Collective], topology: "Topology") -> dict[str, int]:
    """Bytes on each tier summed over all ranks (divide ``world`` by the node count for ZeRO++'s unit)."""
    total: dict[str, int] = {}
    for rank in range(topology.world_size):
        add_into(total, rank_traffic(collectives, topology, rank)["tiers"])
    return total


def engine_shapes(engine) -> list[FlatGroupShape]:
    """Each flat group of a sharded model's engine (``runtime.engine.Engine``) as the closed form sees it: a unit
    other than the root gathers again for backward when it has trainable parameters."""
    return [FlatGroupShape(group.S, group.trainable, backward=unit is not engine.root and any(
                g.trainable for g in unit.groups), columns=group.cols)
            for unit in engine.units for group in unit.groups]


def module_shapes(model, wrap=None, chunking: Sequence[int] = (1, 1),
                  frozen_chunking: Sequence[int] | None = None) -> list[FlatGroupShape]:
    """The flat groups ``ts.shard(model, ..., wrap=wrap)`` would build, without a process group: trainable
    parameters cut by ``chunking`` (``Topology.chunking(placement.os)``), frozen ones by ``frozen_chunking``
    (``Topology.chunking(placement.p)``; default the same). A unit other than the root is assumed to gather
    again for backward when it has trainable parameters (as ``engine_shapes`` says).
    """
    from ..runtime.layout import padded_unit_numel, unit_columns
    from ..runtime.wrap import find_units

    shapes = []
    for index, unit in enumerate(find_units(model, wrap)):
        groups = {True: [], False: []}
        for param, _, _ in unit.params:
            groups[param.requires_grad].append(tuple(param.shape))
        for trainable in (True, False):
            if groups[trainable]:
                cut = chunking if trainable or frozen_chunking is None else frozen_chunking
                shapes.append(FlatGroupShape(padded_unit_numel(groups[trainable], cut), trainable,
                                             backward=index > 0 and bool(groups[True]),
                                             columns=unit_columns(groups[trainable], cut)))
    return shapes
