"""Memory per device of a plan: model states at their levels, cached copies, transient buffers, activations.

Model states in mixed precision (reference/papers.md section 1)::

    params  param_bytes     x Ψ  / d_p        working-precision weights at rest
    grads   grad_bytes      x Ψ' / d_g        accumulated gradients
    optim   optimizer_bytes x Ψ' / d_os       fp32 master + Adam m, v (12 bytes)
    hpz     param_bytes     x Ψ  / d_h        one cached weight shard per hpz level h (ZeRO++ section 2.6)

with d the group size of the level (1 = replicated). Transient buffers: a sharded p gathers one unit at a
time and prefetches the next (2 full units in working precision, plus an int8 receive buffer with qwz); a
sharded g holds one unit's full gradient before reducing it (plus the int4 send/receive buffers with qgz).
Activations, per micro-step, assume flash attention (no s^2 term) and half-precision activations, after
Korthikanti et al.: 34·s·b·h bytes per layer; with recompute only each layer's input (2·s·b·h) is kept,
plus one layer's working set. The logits and their gradient add 8·s·b·V (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..plan import Placement
from .specs import Job, ModelSpec

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
        buffers += unit_t * job.reduce_bytes + (unit_t if plan.qgz else 0)
    return Memory(
        params=job.param_bytes * psi / d(pl.p),
        grads=job.grad_bytes * psi_t / d(pl.g),
        optimizer=job.optimizer_bytes * psi_t / d(pl.os),
        hpz=sum(job.param_bytes * psi / d(h) for h in pl.hpz),
        buffers=buffers,
        activations=activations(model, job),
    )


def activations(model: ModelSpec, job: Job) -> float:
    """Activation bytes of one micro-step on one device."""
    sbh = job.tokens * model.hidden
    if job.recompute:
        layers = model.layers * job.param_bytes * sbh + ACT_BYTES_PER_LAYER * sbh
    else:
        layers = model.layers * ACT_BYTES_PER_LAYER * sbh
    return layers + 8 * job.tokens * model.vocab
