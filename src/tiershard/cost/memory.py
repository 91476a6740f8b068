"""Memory per device of a plan: model states at their levels, cached copies, transient buffers, activations.

Model states in mixed precision (reference/papers.md section 1)::

    params  param_bytes     x Ψ  / d_p        working-precision weights at rest; a trainable one only where p
                                              is replicated or finer than os (at p = os each gather casts the
                                              masters' band, as the engine does: docs/engine.md), frozen ones always
    grads   grad_bytes      x Ψ' / d_g        accumulated gradients
    optim   optimizer_bytes x Ψ' / d_os       fp32 master + Adam m, v (12 bytes)
    hpz     param_bytes     x Ψ  / d_h        one cached weight shard per hpz level h (ZeRO++ section 2.6)
    outer   4 x (1 + [mu > 0]) x Ψ' / d_os    outer sync: the anchor and the outer momentum, fp32 beside the
                                              masters; streamed, two more fp32 copies of the largest fragment
                                              (the masters at the issue, then the corrections)

with d the group size of the level (1 = replicated). Transient buffers: a sharded p gathers one unit at a
time and prefetches the next (2 full units in working precision, plus an int8 receive buffer with qwz); a
sharded g holds one unit's full gradient before reducing it (plus, with qgz, the send and receive wire buffers of
its first hop in that tier's codec, and with ``+ef`` the decoded sent values and the new residual; the rotation
works block by block inside the kernels and needs no copy). Error feedback (``+ef``) keeps, for every trainable
parameter and every quantized hop, the fp32 residual of that hop's input (``feedback_bytes``;
``QuantizedReduceScatter.residual_bytes()`` counts the same on a running engine).
Activations, per micro-step, assume flash attention (no s^2 term) and half-precision activations, after
Korthikanti et al.: 34·s·b·h bytes per layer; with recompute only each layer's input (2·s·b·h) is kept. Either
way one layer's working set (34·s·b·h) comes on top: the recomputed activations, or, without recompute, the
gradients of the activations of the layer whose backward runs (the step's peak is in the first layers of
backward, where every saved activation is still alive). The logits and their gradient add 8·s·b·V (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

from ..comm.codecs import codec_from_spec
from ..plan import Placement
from ..runtime.layout import ParamLayout
from .specs import Job, ModelSpec
from .traffic import plan_codecs

ACT_BYTES_PER_LAYER = 34   # per token per hidden unit, no recompute (half precision, flash attention)


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by what they hold."""

    params: float
    grads: float
    optimizer: float
    hpz: float
    buffers: float
    activations: float
    feedback: float = 0.0    # qgz error-feedback residuals (fp32, one per quantized hop's input)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["total"] = self.total
        return out


def outer_bytes(pl: Placement, trainable: float) -> float:
    """Bytes per device of the outer sync's state ([Note: outer step] in runtime/outer.py), counted with the
    optimizer's: the anchor and momentum in fp32 at the masters' level, and a streamed fragment's two copies."""
    spec = pl.plan.outer
    if spec is None:
        return 0.0
    per_copy = 4 * trainable / pl.size(pl.os)
    return per_copy * (1 + (spec.momentum > 0) + (2 / spec.fragments if spec.fragments > 1 else 0))


def memory(pl: Placement, model: ModelSpec, job: Job) -> Memory:
    """Peak bytes per device of ``pl`` for ``model`` trained as ``job``."""
    d = pl.size
    plan = pl.plan
    psi, psi_t = model.params, model.trainable
    unit = max(t + f for t, f, _ in model.unit_sizes())
    unit_t = max(t for t, _, _ in model.unit_sizes())
    buffers = 0.0
    if pl.p > 0:
        buffers += 2 * unit * job.param_bytes + (unit if plan.qwz else 0)
    if pl.g > 0:
        buffers += unit_t * job.reduce_bytes + (qgz_scratch(pl, unit_t) if plan.qgz else 0)
    return Memory(
        params=job.param_bytes * (psi - psi_t + (0 if pl.p == pl.os and pl.p > 0 else psi_t)) / d(pl.p),
        grads=job.grad_bytes * psi_t / d(pl.g),
        optimizer=job.optimizer_bytes * psi_t / d(pl.os) + outer_bytes(pl, psi_t),
        hpz=sum(job.param_bytes * psi / d(h) for h in pl.hpz),
        buffers=buffers,
        activations=activations(model, job),
        feedback=feedback_bytes(pl, psi_t),
    )


def _hops(pl: Placement) -> list[int]:
    """The tiers the quantized gradient reductions cross (0 -> g, then g -> os), innermost first."""
    d = pl.size
    return [k for k in range(1, max(pl.g, pl.os) + 1) if d(k) > d(k - 1)] if pl.plan.qgz else []


def feedback_bytes(pl: Placement, numel: float) -> float:
    """Bytes of qgz's error-feedback residuals for ``numel`` gradient values on one device: an fp32 copy of each
    hop's input, the rank's level-(k-1) chunk for the hop over tier k (0 without ``+ef``)."""
    return sum(4 * numel / pl.size(k - 1) for k in _hops(pl)) if pl.plan.error_feedback else 0.0


def qgz_scratch(pl: Placement, numel: float) -> float:
    """Transient bytes of one reduction of ``numel`` values with qgz: its first (largest) hop's send and receive
    wire buffers in that hop's codec, and with ``+ef`` the decoded sent values and the new residual (fp32)."""
    hops = _hops(pl)
    if not hops:
        return 0.0
    codec = plan_codecs(pl)[1][hops[0] - 1]
    wire = numel * codec.bits / 8 + 4 * numel / codec.block
    return 2 * wire + (8 * numel if pl.plan.error_feedback else 0)


def activations(model: ModelSpec, job: Job) -> float:
    """Activation bytes of one micro-step on one device at their peak, early in backward: the saved activations
    (every layer's, or with recompute every layer's input) and one layer's working set."""
    sbh = job.tokens * model.hidden
    saved = model.layers * (job.param_bytes if job.recompute else ACT_BYTES_PER_LAYER) * sbh
    return saved + ACT_BYTES_PER_LAYER * sbh + 8 * job.tokens * model.vocab


# ---- one sharded model, exactly: the breakdown ts.memory_stats measures ([Note: memory breakdown], engine.py) ----

@dataclass(frozen=True)
class GroupLayout:
    """One flat group as the engine lays it out: all that its bytes depend on."""

    unit: int                          # its unit's place in registration order (0: the root)
    trainable: bool
    numel: int                         # S: the padded (slots x U) matrix
    params: tuple[ParamLayout, ...]


def engine_layouts(engine) -> list[GroupLayout]:
    """The flat groups of a sharded model's engine (``runtime.engine.Engine``), read from their layouts only."""
    return [GroupLayout(index, group.trainable, group.S, tuple(group.layouts))
            for index, unit in enumerate(engine.units) for group in unit.groups]


def breakdown(pl: Placement, groups: Sequence[GroupLayout], rank: int, param_bytes: int, optimizer_states: int,
              prefetch: int = 1, micro_steps: int = 1) -> dict[str, int]:
    """Bytes rank ``rank`` holds by what they hold, as ``ts.memory_stats`` names them, at the end of a step's last
    backward (before ``optimizer.step``, after at least one step: the optimizer states exist), and the peaks of
    gathered weights over a training step. ``optimizer_states``: fp32 tensors per master (AdamW 2, SGD with
    momentum 1); ``micro_steps``: of that step (the bytes do not depend on it: the placeholders between
    micro-steps hold no memory unless written)."""
    topo, d = pl.topology, pl.size
    world, plan = topo.world_size, pl.plan
    qwz = codec_from_spec(plan.qwz) if plan.qwz else None
    out = dict.fromkeys(("master_weights", "optimizer_states", "gradients", "frozen_weights", "working_weights",
                         "hpz_bands", "gathered", "comm_buffers", "codec_scratch", "ef_residuals"), 0)
    working: dict[int, int] = {}       # unit -> bytes of its gathered working tensors
    matrices: dict[int, int] = {}      # unit -> bytes of its gathered (slots x U) matrices
    for g in groups:
        S = g.numel
        level = pl.os if g.trainable else pl.p

        def bands(lvl: int):
            slots = world // d(lvl)
            return [layout.band(topo.chunk_index(rank, lvl) * slots, slots) for layout in g.params]

        shards = [b.length * layout.row for b, layout in zip(bands(level), g.params)]
        if not g.trainable:
            out["frozen_weights"] += sum(shards) * param_bytes
        else:
            out["master_weights"] += 4 * sum(shards)
            out["optimizer_states"] += 4 * optimizer_states * sum(shards)
            out["gradients"] += 4 * _grad_elements(bands(pl.os), g.params, world // d(pl.os), shards)
            if pl.p == 0:
                out["working_weights"] += param_bytes * sum(layout.numel for layout in g.params)
            elif pl.p != pl.os:
                out["working_weights"] += param_bytes * S // d(pl.p)
            out["ef_residuals"] += round(feedback_bytes(pl, S))
        if pl.p > 0:
            for h in pl.hpz:
                out["hpz_bands"] += param_bytes * S // d(h) if qwz is None else \
                    d(pl.p) // d(h) * qwz.wire_bytes(S // d(pl.p))
            if qwz is not None:
                out["codec_scratch"] += qwz.wire_bytes(S // d(pl.p))
            working[g.unit] = working.get(g.unit, 0) + param_bytes * sum(layout.numel for layout in g.params)
            matrices[g.unit] = matrices.get(g.unit, 0) + param_bytes * S
    # the root stays gathered; every other unit is released before the next is copied out
    others = [working[u] for u in working if u != 0]
    out["peak_gathered"] = working.get(0, 0) + max(others, default=0)
    # in flight: a unit's own matrix, or the next max(prefetch, 1) units' (registration order, root aside)
    units = sorted(u for u in matrices if u != 0)
    depth = max(prefetch, 1)
    windows = [sum(matrices[u] for u in units[i:i + depth]) for i in range(len(units))]
    out["peak_gather_buffers"] = max([matrices.get(0, 0), *windows])
    return out


def unit_gradients(pl: Placement, groups: Sequence[GroupLayout], rank: int, micro_steps: int, param_bytes: int,
                   reduce_bytes: int) -> list[tuple[int, int, int]]:
    """For each unit, in registration order (the root first): the masters' gradient bytes its last backward of a
    step makes, the fp32 accumulator bytes between micro-steps it turns into them (0 with one micro-step), and the
    transient bytes of its reduction: the working gradients and the (slots x U) matrix cut from them, or, on the
    stream, the matrix and its fp32 sum (a whole one when g is replicated, a level-g chunk otherwise)."""
    units = sorted({g.unit for g in groups})
    out = []
    for u in units:
        mine = [g for g in groups if g.unit == u]
        grads = breakdown(pl, mine, rank, 2, 0)["gradients"]
        transient = 0
        for g in mine:
            if g.trainable:
                making = (param_bytes + reduce_bytes) * g.numel
                summing = reduce_bytes * g.numel + 4 * g.numel // pl.size(pl.g)
                transient += max(making, summing)
        out.append((grads, accumulator_bytes(pl, mine) if micro_steps > 1 else 0, transient))
    return out


def backward_peak(steady: float, units: Sequence[tuple[int, int, int]], model: ModelSpec, job: Job) -> float:
    """Model states + activations at their peak over a step's (last) backward: it starts with every saved
    activation alive and the accumulators of the micro-steps before; each block's backward then frees its saved
    activations (one layer's each, the blocks sharing the model's layers), makes its gradients from its
    accumulators and reduces them (its reduction's transient bytes in place of the backward's working set, one
    reduction at a time: [Note: one reduction in flight]); the root's come last. ``steady``: the states without
    gradients or accumulators (masters, optimizer states, frozen and working weights, hpz bands, residuals);
    ``units``: ``unit_gradients``."""
    acts = activations(model, job)
    working = ACT_BYTES_PER_LAYER * job.tokens * model.hidden
    root, blocks = units[0], units[1:]
    saved = acts - working - 8 * job.tokens * model.vocab
    alive = steady + sum(unit[1] for unit in units) + acts
    peak = alive
    for grads, acc, transient in reversed(blocks):
        alive += grads - acc - saved / len(blocks)
        peak = max(peak, alive - working + transient)    # the block's backward is done: its reduction instead
    alive += root[0] - root[1]
    return max(peak, alive - working + root[2])


def accumulator_bytes(pl: Placement, groups: Sequence[GroupLayout]) -> int:
    """Bytes of the fp32 gradient accumulators at level g that every trainable group holds between micro-steps
    (``FlatGroup.grad_acc``: the rank's level-g chunk of the (slots x U) matrix); with one micro-step they live
    only while a unit's reduction runs."""
    return sum(4 * (g.numel // pl.size(pl.g)) for g in groups if g.trainable)


def _grad_elements(bands, params, slots: int, shards: list[int]) -> int:
    """Elements of the masters' gradient storage after the boundary: the level-os band (views of it, one slot)
    or one block per parameter, with a copy for a shard whose real rows are picked by index. Accumulating
    micro-steps changes nothing: the ``PendingGrad`` placeholders between them hold no memory unless written."""
    views = [b.index is None for b in bands]
    copies = sum(n for n, view in zip(shards, views) if not view)
    if slots == 1:
        return (sum(layout.cols for layout in params) if any(views) else 0) + copies
    return sum(slots * layout.cols for layout, view in zip(params, views) if view) + copies
