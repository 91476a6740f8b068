"""Where a plan's predicted step goes, tier by tier: what ``tiershard plan --explain`` shows for the chosen plan.

[Note: terms per tier] The step is ``compute + exposed`` ([Note: overlap model] in cost/planner.py). Each collective
is booked to the tier that bounds it (the tier where its bytes take longest: ``max over tiers`` in [Note: time
model], cost/comm.py), with its latency and its codec time. Its exposed share is what the overlap model leaves of
it: all of a boundary collective; of the parameter sync what the next forward does not hide; of the micro-step
collectives the exposed micro-step time split in proportion to their seconds; of the outer sync what the planner
adds for it. So the tiers' exposed times add up to the estimate's ``exposed``, and each tier says what it costs.

A codec is worth its time on a tier only where its encode + decode time there is below the link time it saves
against the same plan without codecs (``codec_pays``): both sides are shown per tier, as priced with the codec
rates the probe measured (``Cluster.codec_rates``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from .comm import Priced, price_plan
from .planner import Estimate, compute_seconds, evaluate, forward_seconds
from .specs import Cluster, Job, ModelSpec


@dataclass(frozen=True)
class TierTerms:
    """One tier's share of a plan's step (seconds per optimizer step, bytes per rank)."""

    tier: str
    bytes_per_rank: float      # what one rank sends on this tier per step
    link: float                # those bytes / the tier's bandwidth
    latency: float             # latency of the collectives booked to this tier
    codec: float               # encode + decode time of the collectives booked to this tier
    exposed: float             # what the overlap model leaves of them on the critical path
    saved: float | None = None     # with a codec: link time it saves against the plan without codecs

    @property
    def codec_pays(self) -> bool | None:
        """Whether the codecs on this tier cost less than the link time they save (None: no codec here)."""
        return None if self.saved is None else self.codec < self.saved


def exact_twin(plan: Plan) -> Plan:
    """The same placement without codecs (qwz, qwd, qgz), the baseline a codec's savings are counted against."""
    return Plan(p=plan.p, g=plan.g, os=plan.os, hpz=plan.hpz, cc=plan.cc, outer=plan.outer)


def tier_terms(plan: Plan | str, model: ModelSpec, cluster: Cluster, job: Job) -> tuple[Estimate, list[TierTerms]]:
    """The estimate of ``plan`` and its terms per tier, innermost first ([Note: terms per tier])."""
    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    est = evaluate(plan, model, cluster, job)
    pl = plan.resolve(cluster.topology)
    priced = price_plan(pl, model, job, cluster)
    exposed = _exposed_per_collective(priced, est, model, cluster, job)
    tiers = {t.name: t for t in cluster.tiers}
    rows = {name: dict(bytes=0.0, link=0.0, latency=0.0, codec=0.0, exposed=0.0, coded=False) for name in tiers}
    for p, shown in zip(priced, exposed):
        for tier, b in p.per_rank.items():
            rows[tier]["bytes"] += b
            rows[tier]["link"] += b / tiers[tier].bandwidth
        if not p.per_rank:
            continue
        c = p.collective
        bound = max(p.per_rank, key=lambda t: p.per_rank[t] / tiers[t].bandwidth)
        codec = cluster.codec_seconds(c.codec, c.codec_bytes) * c.count / c.every
        link = max(b / tiers[t].bandwidth for t, b in p.per_rank.items())
        rows[bound]["codec"] += codec
        rows[bound]["coded"] |= bool(c.codec)
        rows[bound]["latency"] += max(0.0, p.seconds - link - codec)
        rows[bound]["exposed"] += shown
    saved: dict[str, float] = {}
    if plan.qwz or plan.qgz or plan.qwd:
        twin = evaluate(exact_twin(plan), model, cluster, job)
        saved = {t: twin.tier_seconds.get(t, 0.0) - rows[t]["link"] for t in rows if rows[t]["coded"]}
    out = [TierTerms(t, r["bytes"], r["link"], r["latency"], r["codec"], r["exposed"], saved.get(t))
           for t, r in rows.items()]
    return est, out


def _exposed_per_collective(priced: list[Priced], est: Estimate, model: ModelSpec, cluster: Cluster,
                            job: Job) -> list[float]:
    """Each collective's exposed seconds per step, by the overlap model, adding up to ``est.exposed``.

    exposed = X + boundary - hidden (+ the outer sync's), X = max(0, micro + hidden - overlap x compute): a
    boundary collective shows all of its time, the parameter sync its unhidden part, and X is split over the
    micro-step collectives and the sync's hidden part in proportion to their seconds."""
    compute = job.accum * compute_seconds(model, job, cluster)
    sync = sum(p.seconds for p in priced if p.collective.op == "param_sync")
    hidden = min(sync, est.overlap * forward_seconds(model, job, cluster))
    micro = sum(p.seconds for p in priced if p.micro)
    boundary = sum(p.seconds for p in priced if not p.micro and p.collective.op != "outer_sync")
    x = max(0.0, micro + hidden - est.overlap * compute)
    weight = micro + hidden
    outer = sum(p.seconds for p in priced if p.collective.op == "outer_sync")
    outer_exposed = est.step_time - est.compute - (x + boundary - hidden)
    out = []
    for p in priced:
        op = p.collective.op
        if op == "outer_sync":
            out.append(outer_exposed * p.seconds / outer if outer else 0.0)
        elif p.micro:
            out.append(x * p.seconds / weight if weight else 0.0)
        elif op == "param_sync":
            share = p.seconds / sync if sync else 0.0
            out.append(p.seconds - hidden * share + (x * hidden * share / weight if weight else 0.0))
        else:
            out.append(p.seconds)
    return out
