"""Estimates per plan, the ranking, and the auto-planner (policy on top of the memory and comm mechanisms).

[Note: overlap model] Per optimizer step of A micro-steps::

    compute  = A x tokens x (2Ψ forward [+ 2Ψ recompute] + 2Ψ input grads + 2Ψ' weight grads) / (peak x efficiency)
    hidden   = min(parameter sync, overlap x forward of one micro-step)
    exposed  = max(0, micro-step comm + hidden - overlap x compute) + boundary comm - hidden
    step     = compute + exposed

Micro-step comm (parameter gathers, per-micro-step gradient reduction) runs beside compute and hides behind
up to ``overlap`` of it (the cluster's measured value, ``tiershard probe``, else ``Job.overlap``). Boundary
comm waits for the last backward: the gradient sync is fully exposed. The outer sync ([Note: outer sync]) is its
own term: with one fragment it blocks the step it runs in (its time / H per step, all exposed); streamed in F
fragments, each fragment's mean (1/F of the bytes) runs behind one inner step, so per step
``F / H x max(0, fragment time - inner step)`` is exposed. The parameter sync after the optimizer
step runs in the next forward, each unit's inside its gather ([Note: deferred rebuild], runtime/flat.py), so
it hides behind at most the first micro-step's forward, out of the same overlap budget. The optimizer step's
own time is left out (it is the same order for every plan that shards os alike).

[Note: quality rule] Quantized plans (qwz, qgz) change the training numerics, which step time cannot price, so the
planner never trades quality for speed unasked: by default it generates exact plans only and its pick is the
fastest exact plan; ``allow_lossy=True`` (``--allow-lossy``) adds the qwz / qgz plans, with bare ``qgz`` (int8
inside, int4 on the outermost tier, rotated) as their gradient codec. Outer-sync plans (``+outer``) cost more
quality than the codecs and by how much depends on H (docs/outer-sync.md), so ``--allow-lossy`` alone never picks
them: ``outer=True`` (``--allow-outer``, with ``--allow-lossy``) adds every island-capped placement with each of
``OUTER_CANDIDATES``. Plans named in ``candidates`` are all
ranked as given: naming a lossy plan allows it. Every estimate carries its ``quality`` and the best one's
``reason`` names the choice ('fastest exact plan', 'lossy plan allowed: ...').
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from ..plan import QGZ_DEFAULT, Plan, PlanError, use_planner
from ..topology import Topology
from .comm import Priced, price_plan
from .memory import Memory, memory
from .specs import Cluster, Job, ModelSpec
from .tensor_parallel import tp_cluster, tp_collectives, tp_degrees, tp_model


class NoPlanFits(ValueError):
    """No candidate plan fits the model in device memory."""


@dataclass(frozen=True)
class Estimate:
    """What one plan costs on one cluster for one job (bytes per optimizer step, seconds per optimizer step)."""

    plan: Plan
    memory: Memory
    capacity: float
    tier_bytes: dict[str, int]        # summed over all ranks
    tier_seconds: dict[str, float]    # per rank: that tier's bytes / its bandwidth
    compute: float
    comm_micro: float
    comm_boundary: float
    step_time: float
    world: int
    group_sizes: dict[str, int] = field(repr=False)   # tier -> ranks per group of the tier inside it
    model_flops: float = field(repr=False, default=0.0)
    overlap: float = field(repr=False, default=1.0)
    reason: str = ""
    quality: str = "exact"            # Plan.quality on the cluster: 'exact' or 'lossy: ...' with the bits per tier
    tp: int = 1                       # tensor-parallel degree inside the node ([Note: TP in the cost model])
    comm_tp: float = 0.0              # seconds of TP collectives per step, on the critical path
    slowest: str = ""                 # the tier with the least bandwidth per rank (the outermost among equals)

    @property
    def label(self) -> str:
        """The plan text, with the TP degree when there is one: 'IIG tp=2'."""
        return str(self.plan) if self.tp == 1 else f"{self.plan} tp={self.tp}"

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def exposed(self) -> float:
        return self.step_time - self.compute

    @property
    def headroom(self) -> float:
        """Bytes per device left free under the usable capacity (negative when the plan does not fit)."""
        return self.capacity - self.memory.total

    @property
    def slowest_tier(self) -> str:
        """The slowest tier's name; an estimate made without one (``slowest=""``) takes the outermost."""
        return self.slowest or next(reversed(self.group_sizes))

    @property
    def quantized(self) -> int:
        return int(bool(self.plan.qwz)) + int(bool(self.plan.qgz)) + int(self.plan.outer is not None)

    def bytes_per_group(self, tier: str) -> float:
        """Bytes on ``tier`` per group of the tier inside it: for the world tier, ZeRO++'s bytes per node."""
        return self.tier_bytes.get(tier, 0) * self.group_sizes[tier] / self.world

    @property
    def tflops_per_device(self) -> float:
        """Model flops (no recompute) per device per second, in TFLOPS."""
        return self.model_flops / self.step_time / 1e12

    def as_dict(self) -> dict:
        return {
            "plan": str(self.plan), "tp": self.tp, "fits": self.fits, "comm_tp_s": self.comm_tp, "step_time_s": self.step_time,
            "compute_s": self.compute, "comm_micro_s": self.comm_micro, "comm_boundary_s": self.comm_boundary,
            "exposed_s": self.exposed, "tflops_per_device": self.tflops_per_device,
            "memory_bytes": self.memory.as_dict(), "capacity_bytes": self.capacity,
            "tier_bytes_total": dict(self.tier_bytes),
            "tier_bytes_per_group": {t: self.bytes_per_group(t) for t in self.group_sizes},
            "tier_seconds": dict(self.tier_seconds), "reason": self.reason,
            "headroom_bytes": self.headroom, "slowest_tier": self.slowest_tier,
            "lossy": self.plan.lossy, "quality": self.quality,
        }


def compute_seconds(model: ModelSpec, job: Job, cluster: Cluster) -> float:
    """Seconds of one micro-step's dense-matmul compute on one device."""
    per_token = 2 * model.params * (2 if job.recompute else 1) + 2 * model.params + 2 * model.trainable
    return job.tokens * per_token / (cluster.peak_flops * job.efficiency)


def forward_seconds(model: ModelSpec, job: Job, cluster: Cluster) -> float:
    """Seconds of one micro-step's forward on one device (what the deferred parameter sync can hide behind)."""
    return job.tokens * 2 * model.params / (cluster.peak_flops * job.efficiency)


def evaluate(plan: Plan | str, model: ModelSpec, cluster: Cluster, job: Job, tp: int = 1) -> Estimate:
    """Memory, bytes and step time of one plan; raises PlanError if the plan does not fit the topology. With ``tp``
    the plan shards over the tiers left outside TP groups of ``tp`` ranks ([Note: TP in the cost model])."""
    if tp != 1:      # a TP group of tp devices takes their tp micro-batches together: the same global batch
        group_job = replace(job, micro_batch=job.micro_batch * tp)
        e = evaluate(plan, tp_model(model, tp), tp_cluster(cluster, tp), group_job)
        return _with_tp(e, model, cluster, group_job, tp)
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    pl = plan.resolve(cluster.topology)
    priced = price_plan(pl, model, job, cluster)
    compute = job.accum * compute_seconds(model, job, cluster)
    micro = sum(p.seconds for p in priced if p.micro)
    boundary = sum(p.seconds for p in priced if not p.micro and p.collective.op != "outer_sync")
    overlap = job.overlap if cluster.overlap is None else cluster.overlap
    sync = sum(p.seconds for p in priced if p.collective.op == "param_sync")
    hidden = min(sync, overlap * forward_seconds(model, job, cluster))
    tier_bytes: dict[str, int] = {}
    tier_seconds: dict[str, float] = {t.name: 0.0 for t in cluster.tiers}
    bandwidth = {t.name: t.bandwidth for t in cluster.tiers}
    for p in priced:
        for tier, b in p.tier_bytes.items():
            tier_bytes[tier] = tier_bytes.get(tier, 0) + b
        for tier, b in p.per_rank.items():
            tier_seconds[tier] += b / bandwidth[tier]
    sizes = (1, *(t.size for t in cluster.tiers))
    inner = compute + max(0.0, micro + hidden - overlap * compute) + boundary - hidden
    return Estimate(
        plan=plan, memory=memory(pl, model, job), capacity=cluster.gpu_memory * (1 - job.memory_reserve),
        tier_bytes=tier_bytes, tier_seconds=tier_seconds, compute=compute, comm_micro=micro,
        comm_boundary=boundary, step_time=inner + _outer_exposed(plan, priced, inner),
        world=cluster.world_size, group_sizes={t.name: s for t, s in zip(cluster.tiers, sizes)},
        model_flops=job.accum * job.tokens * (4 * model.params + 2 * model.trainable), overlap=overlap,
        quality=pl.quality, slowest=slowest_tier(cluster))


def slowest_tier(cluster: Cluster) -> str:
    """The tier with the least bandwidth per rank; among equals the outermost (it carries the widest groups)."""
    return min(reversed(cluster.tiers), key=lambda t: t.bandwidth).name


def _with_tp(e: Estimate, model: ModelSpec, cluster: Cluster, job: Job, tp: int) -> Estimate:
    """One TP coordinate's estimate ``e`` as the whole cluster's: bytes of every coordinate, group sizes in ranks,
    and the TP collectives added (exposed)."""
    tier, sent, seconds = tp_collectives(model, job, cluster, tp)
    tier_bytes = {t: b * tp for t, b in e.tier_bytes.items()}
    tier_bytes[tier] = tier_bytes.get(tier, 0) + sent * cluster.world_size
    tier_seconds = dict(e.tier_seconds)
    tier_seconds[tier] = tier_seconds.get(tier, 0.0) + sent / cluster.tiers[0].bandwidth
    return replace(e, tier_bytes=tier_bytes, tier_seconds=tier_seconds, step_time=e.step_time + seconds,
                   world=cluster.world_size, group_sizes=dict(zip(e.group_sizes, (1, *(t.size for t in cluster.tiers)))),
                   tp=tp,
                   comm_tp=seconds)


def _outer_exposed(plan: Plan, priced: Sequence[Priced], inner_step: float) -> float:
    """Seconds per step the outer sync adds to the inner step ([Note: overlap model])."""
    per_step = sum(p.seconds for p in priced if p.collective.op == "outer_sync")   # already / H
    if plan.outer is None or not per_step:
        return 0.0
    spec = plan.outer
    if spec.fragments == 1:
        return per_step
    fragment = per_step * spec.every / spec.fragments          # one fragment's mean
    return spec.fragments / spec.every * max(0.0, fragment - inner_step)


OUTER_CANDIDATES = ("50", "50:f5", "50:int4:128:h", "50:f5:int4:128:h")   # what allow_lossy adds ([Note: quality rule])


def candidate_plans(topology: Topology, options: bool = True, lossy: bool = True, outer: bool = False) -> list[Plan]:
    """Every placement of p, g, os over the topology's levels, with every hpz / cc option that applies, and with
    ``lossy`` the qwz (int8) and qgz (bare ``qgz``, per-hop int8/int4) options too, and with ``lossy`` and
    ``outer`` the outer-sync plans ([Note: quality rule])."""
    top = topology.num_levels - 1
    names = {0: "N", top: "G"}
    if top >= 2:
        names[top - 1] = "I"
    levels = [names.get(lvl, topology.level_name(lvl)) for lvl in range(top + 1)]
    out: list[Plan] = []
    for p, g, os_ in itertools.product(range(top + 1), repeat=3):
        base = Plan(p=levels[p], g=levels[g], os=levels[os_])
        if not options:
            out.append(base)
            continue
        finer = [levels[h] for h in range(1, p)]
        hpz_sets = [tuple(s) for n in range(len(finer) + 1) for s in itertools.combinations(finer, n)]
        for hpz, qwz, qgz, cc in itertools.product(
                hpz_sets, (None, "int8") if p > 0 and lossy else (None,),
                (None, QGZ_DEFAULT) if (g or os_) and lossy else (None,),
                (False, True) if top >= 2 else (False,)):
            out.append(base.with_options(hpz=hpz, qwz=qwz, qgz=qgz, cc=cc))
    if lossy and outer and top >= 2:         # outer sync: islands train the capped placements, each once
        seen = set()
        for p, g, os_ in itertools.product(range(top), repeat=3):
            if (p, g, os_) not in seen:
                seen.add((p, g, os_))
                out += [Plan(p=levels[p], g=levels[g], os=levels[os_], outer=spec) for spec in OUTER_CANDIDATES]
    return out


# [Note: tie rule] Two fitting plans tie when their predicted step times are within REL_TIE (one part per million,
# far below what the model can resolve, far above float noise) of the fastest time of their tie group: plans are
# sorted by exact time and each one that is not within REL_TIE of its group's fastest starts the next group. So the
# groups depend only on the set of times, never on the candidates' order. Ties are common, not rare: wherever the
# model predicts every collective hidden behind compute, every such plan's step is the compute alone (Llama-2 7B on
# 64 A100s: the fastest 8 exact plans tie). Inside a group, in this order (TIE_CRITERIA, shown by `tiershard plan`):
#   1. less quantization: it changes the numerics, which step time cannot price ([Note: quality rule]);
#   2. more memory headroom (usable capacity minus the plan's peak, to the kilobyte): what a tie costs nothing to
#      keep, room for a larger micro-batch or a longer sequence, and a margin for the model's memory error;
#   3. fewer bytes on the slowest tier (least bandwidth per rank, the outermost among equals): the margin for the
#      model's overlap error, since those bytes are the first to show when the link hides less than predicted;
#   4. less tensor parallelism, fewer options, then the plan text with its TP degree, which is unique: the
#      ranking is a function of the set of candidates.
# Plans that do not fit follow, smallest memory first.
REL_TIE = 1e-6
TIE_CRITERIA = ("less quantization", "more memory headroom", "fewer bytes on the slowest tier")


def _tie_key(e: Estimate) -> tuple:
    options = len(e.plan.hpz) + e.quantized + int(e.plan.cc)
    return (e.quantized, -round(e.headroom / 1e3), e.tier_bytes.get(e.slowest_tier, 0), e.tp, options, e.label)


def _ranking_keys(estimates: Sequence[Estimate]) -> list[tuple]:
    """A sort key per estimate: (does not fit, tie group or memory, _tie_key), by the tie rule above."""
    keys: list[tuple] = [()] * len(estimates)
    group, anchor = -1, None
    for i in sorted((i for i, e in enumerate(estimates) if e.fits), key=lambda i: estimates[i].step_time):
        time = estimates[i].step_time
        if anchor is None or time > anchor * (1 + REL_TIE):
            group, anchor = group + 1, time
        keys[i] = (False, group, *_tie_key(estimates[i]))
    for i, e in enumerate(estimates):
        if not e.fits:
            keys[i] = (True, e.memory.total, *_tie_key(e))
    return keys


def rank_estimates(estimates: Iterable[Estimate], allow_lossy: bool = True) -> list[Estimate]:
    """Estimates best first by the tie rule ([Note: tie rule]), each with the reason it loses to the best; the
    best one's names the choice ([Note: quality rule]; ``allow_lossy``: whether lossy plans were generated)."""
    estimates = list(estimates)
    if not estimates:
        return []
    keyed = sorted(zip(_ranking_keys(estimates), estimates), key=lambda ke: ke[0])
    (best_key, best), outer = keyed[0], next(reversed(keyed[0][1].group_sizes))
    ranked = [replace(e, reason=why(e, best, outer, key, best_key)) for key, e in keyed]
    if best.fits:
        ranked[0] = replace(ranked[0], reason=choice(best, allow_lossy))
    return ranked


def choice(best: Estimate, allow_lossy: bool) -> str:
    """Why the planner picks ``best``, naming how quality entered the choice ([Note: quality rule])."""
    if not allow_lossy:
        if best.plan.lossy:       # only a plan named in ``candidates`` can be lossy here
            return f"lossy plan named: fastest that fits ({best.quality.removeprefix('lossy: ')})"
        return "fastest exact plan"
    if best.plan.lossy:
        return f"lossy plan allowed: fastest that fits ({best.quality.removeprefix('lossy: ')})"
    return "lossy plans allowed; the fastest that fits is exact"


def rank_plans(model: ModelSpec, cluster: Cluster, job: Job, candidates: Iterable[Plan | str] | None = None,
               allow_lossy: bool = False, outer: bool = False, tp: Iterable[int] = (1,)) -> list[Estimate]:
    """Estimates of every candidate at every TP degree in ``tp``, best first ([Note: tie rule]), each with the
    reason it loses to the best.

    Without ``candidates`` every plan of ``candidate_plans`` is ranked (on the tiers left outside the TP groups),
    the lossy ones (qwz, qgz) only when ``allow_lossy``, the outer-sync ones only with ``outer`` too ([Note: quality
    rule]); named ``candidates`` are all ranked."""
    if outer and not allow_lossy:
        raise ValueError("outer-sync plans are lossy: allow them with allow_lossy=True (--allow-lossy) as well")
    named = None if candidates is None else [Plan.parse(c) if isinstance(c, str) else c for c in candidates]
    estimates = []
    for degree in dict.fromkeys(tp):
        plans = candidate_plans(tp_cluster(cluster, degree).topology, lossy=allow_lossy, outer=outer) \
            if named is None else named
        for plan in plans:
            try:
                estimates.append(evaluate(plan, model, cluster, job, tp=degree))
            except PlanError:
                if named is not None:
                    raise
    return rank_estimates(estimates, allow_lossy)


def why(e: Estimate, best: Estimate, outer: str, mine: tuple, theirs: tuple) -> str:
    """One phrase for why ``e`` (ranking key ``mine``) ranks below ``best`` (key ``theirs``), or why it is best."""
    gb = 1e9
    if not e.fits:
        return f"does not fit: {e.memory.total / gb:.1f} GB > {e.capacity / gb:.1f} GB usable"
    if e is best:
        return "fastest that fits"
    if mine[1] == theirs[1]:
        return "ties; " + _tie_loss(e, best, mine, theirs)
    parts = []
    deltas = {t: e.tier_seconds.get(t, 0.0) - best.tier_seconds.get(t, 0.0) for t in e.tier_seconds}
    tier, delta = max(deltas.items(), key=lambda kv: kv[1])
    if delta > 0.01 * e.step_time:
        size = e.group_sizes[tier]
        unit = "rank" if size == 1 else "node" if tier == outer else "group"
        label = "inter-node" if tier == outer else f"{tier}-tier"
        parts.append(f"more {label} bytes ({e.bytes_per_group(tier) / gb:.3g} vs "
                     f"{best.bytes_per_group(tier) / gb:.3g} GB/{unit})")
    slower = e.step_time - best.step_time
    if e.comm_tp - best.comm_tp > 0.5 * slower:
        parts.append(f"TP activation collectives exposed ({e.comm_tp:.3g} s)")
    elif e.comm_boundary - best.comm_boundary > 0.5 * slower:
        parts.append(f"boundary sync exposed ({e.comm_boundary:.3g} s)")
    elif e.comm_micro > e.overlap * e.compute and e.comm_micro > best.comm_micro:
        parts.append(f"micro-step comm not hidden ({e.comm_micro:.3g} s vs {e.compute:.3g} s compute)")
    return "; ".join(parts) or "more collective latency"


def _tie_loss(e: Estimate, best: Estimate, mine: tuple, theirs: tuple) -> str:
    """The first criterion of the tie rule on which ``e`` loses to ``best``, with both values."""
    gb = 1e9
    if mine[2] > theirs[2]:
        return "more quantization"
    if mine[3] > theirs[3]:
        return f"less memory headroom ({e.headroom / gb:.4g} vs {best.headroom / gb:.4g} GB free)"
    if mine[4] > theirs[4]:
        tier = e.slowest_tier
        unit = "rank" if e.group_sizes[tier] == 1 else "node" if tier == next(reversed(e.group_sizes)) else "group"
        return (f"more bytes on the slowest tier, {tier} ({e.bytes_per_group(tier) / gb:.4g} vs "
                f"{best.bytes_per_group(tier) / gb:.4g} GB/{unit})")
    if mine[5] > theirs[5]:
        return "more tensor parallelism"
    return "more options" if mine[6] > theirs[6] else "same criteria; later plan text"


def coerce_model(model: object, wrap: object = None) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a torch module, a name such as ``"7b"`` or a parameter count.

    A module is cut into units as ``ts.shard(model, ..., wrap=wrap)`` cuts it; ``wrap=None`` is ts.shard's
    default (a ``transformers`` model's ``_no_split_modules``: ``runtime/wrap.py`` ``default_wrap``)."""
    if wrap is not None and not _is_module(model):
        raise ValueError(f"wrap={wrap!r} cuts a torch module into units; a {type(model).__name__} has none to cut: "
                         "pass the module itself, or drop wrap=")
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            count = float(model)
        except ValueError:
            return ModelSpec.named(model)
        return ModelSpec.from_params(count)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return ModelSpec.from_params(float(model))
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover
        nn = None
    if nn is not None and isinstance(model, nn.Module):
        return ModelSpec.from_module(model, wrap=wrap)
    raise TypeError(f"cannot plan for {type(model).__name__}: pass a ModelSpec, a torch module, "
                    "a name such as '7b' or a parameter count")


def _is_module(model: object) -> bool:
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, nn.Module)


def auto_plan(model: object, cluster: Cluster, job: Job | None = None, *,
              candidates: Sequence[Plan | str] | None = None, wrap: object = None, allow_lossy: bool = False,
              outer: bool = False, tp: Iterable[int] | None = None) -> Plan:
    """The fastest exact plan that fits in memory, or with ``allow_lossy`` the fastest of all, qwz / qgz plans
    included ([Note: quality rule]); ties (times within ``REL_TIE``) go to less quantization, then less TP, fewer
    outermost-tier bytes, less memory, fewer options, the plan text ([Note: tie rule]). Raises NoPlanFits.
    ``auto_estimate`` returns the same choice with its estimate, its TP degree (``.tp``) and the reason.

    ``tp``: the tensor-parallel degrees to weigh beside each placement (default: none). Without it, when no plan
    fits, NoPlanFits names the smallest TP degree under which one does.

    A torch module is counted unit by unit as ``ts.shard(model, ..., wrap=wrap)`` would cut it (the same
    default for ``wrap=None``), so pass the ``wrap`` you will shard with."""
    best = auto_estimate(model, cluster, job, candidates=candidates, wrap=wrap, allow_lossy=allow_lossy,
                         outer=outer, tp=tp)
    if tp is None and best.tp > 1:
        raise NoPlanFits(f"no plan fits without tensor parallelism; {best.label} fits ({best.reason}): parallelise "
                         f"the model over TP groups of {best.tp} ranks (docs/parallelism.md) and plan with "
                         f"tp=({best.tp},), or read auto_estimate(...).tp")
    return best.plan


use_planner(auto_plan)      # Plan.auto ([Note: the planner behind Plan.auto] in plan.py)


def auto_estimate(model: object, cluster: Cluster, job: Job | None = None, *,
                  candidates: Sequence[Plan | str] | None = None, wrap: object = None,
                  allow_lossy: bool = False, outer: bool = False, tp: Iterable[int] | None = None) -> Estimate:
    """``auto_plan``'s choice as an Estimate; its ``reason`` names the choice, e.g. 'fastest exact plan', and its
    ``tp`` the TP degree. Without ``tp``, TP degrees are weighed only when no plan fits without them."""
    if not isinstance(cluster, Cluster):
        raise TypeError("auto_plan needs a tiershard.cost.Cluster (tiers with bandwidth and latency), "
                        "e.g. tiershard.cost.presets.preset('dgx-a100', gpus=64)")
    spec = coerce_model(model, wrap)
    job = job or Job()
    ranked = rank_plans(spec, cluster, job, candidates, allow_lossy, outer, (1,) if tp is None else tp)
    if tp is None and (not ranked or not ranked[0].fits) and len(tp_degrees(cluster)) > 1:
        with_tp = rank_plans(spec, cluster, job, candidates, allow_lossy, outer, tp_degrees(cluster))
        if with_tp and with_tp[0].fits:
            best = with_tp[0]
            return replace(best, reason=f"no plan fits without tensor parallelism; {best.reason}")
        ranked = with_tp or ranked
    if not ranked or not ranked[0].fits:
        raise no_plan_fits(spec, cluster, ranked, job)
    return ranked[0]


def no_plan_fits(model: ModelSpec, cluster: Cluster, ranked: Sequence[Estimate], job: Job | None = None) -> NoPlanFits:
    """The error for a model that fits under none of ``ranked``: the smallest plan's need, and only the remedies
    that ``job`` and ``ranked`` leave open (no "turn on recompute" when it is on, no "lower the micro-batch" at 1,
    tensor parallelism only when ``ranked`` weighed none), with the device count the smallest plan needs."""
    smallest = min(ranked, key=lambda e: e.memory.total) if ranked else None
    need = f"; the smallest, {smallest.label}, needs {smallest.memory.total / 1e9:.1f} GB" if smallest else ""
    remedies = []
    devices = _devices_to_fit(smallest, model, cluster, job) if smallest is not None and job is not None else None
    if devices:
        remedies.append(f"add devices ({smallest.label} fits on {devices})")
    elif job is None:
        remedies.append("add devices")
    if job is None or job.micro_batch > 1:
        remedies.append("lower the micro-batch" + (f" (now {job.micro_batch})" if job else ""))
    remedies.append("shorten the sequence" + (f" (now {job.seq})" if job else ""))
    if job is None or not job.recompute:
        remedies.append("turn on recompute (recompute=True, --recompute)")
    if ranked and all(e.tp == 1 for e in ranked) and len(tp_degrees(cluster)) > 1:
        degrees = tp_degrees(cluster)
        remedies.append(f"weigh tensor parallelism (tp={degrees}, --tp {','.join(map(str, degrees))})")
    listed = ", ".join(remedies[:-1]) + f" or {remedies[-1]}" if len(remedies) > 1 else remedies[0]
    reserve = 1 - smallest.capacity / cluster.gpu_memory if smallest else (job or Job()).memory_reserve
    usable = f"{cluster.gpu_memory * (1 - reserve) / 1e9:.1f} GB usable ({cluster.gpu_memory / 1e9:.1f} GB less " \
        f"the {reserve:.0%} reserve)" if reserve else f"{cluster.gpu_memory / 1e9:.1f} GB"
    return NoPlanFits(
        f"{model.label} ({model.params / 1e9:.3g}B parameters) does not fit in {usable} per device on "
        f"{cluster.world_size} devices under any plan{need}: {listed}")


def _devices_to_fit(smallest: Estimate, model: ModelSpec, cluster: Cluster, job: Job) -> str | None:
    """How many devices ``smallest``'s plan needs to fit, as a phrase: '24' (checked by evaluating it there),
    'about 20,000' (past CHECK_DEVICES, from the fit below), or None where no count does.

    Memory per device is what does not shard plus what does over the world size, m(W) = f + S / W, so two
    evaluations give f and S; the count is rounded up to whole nodes."""
    per_node = cluster.tiers[-2].size if len(cluster.tiers) > 1 else 1
    world = cluster.world_size

    def at(devices: int) -> Estimate | None:
        try:
            return evaluate(smallest.plan, model, cluster.resized(devices), job, tp=smallest.tp)
        except (PlanError, ValueError):
            return None

    doubled = at(2 * world)
    if doubled is None or doubled.memory.total >= smallest.memory.total:
        return None
    sharded = 2 * world * (smallest.memory.total - doubled.memory.total)
    fixed = smallest.memory.total - sharded / world
    if fixed >= smallest.capacity:
        return None
    need = -(-int(sharded / (smallest.capacity - fixed)) // per_node) * per_node
    if need > CHECK_DEVICES:
        return f"about {need:,}"
    for devices in range(need, need + 4 * per_node, per_node):
        e = at(devices)
        if e is not None and e.fits:
            return f"{devices:,}"
    return f"about {need:,}"


CHECK_DEVICES = 8192    # device counts above this are estimated, not evaluated (resolving a plan grows with the world)
