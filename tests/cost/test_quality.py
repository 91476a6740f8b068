"""How quality enters the planner ([Note: quality rule] in cost/planner.py): exact plans unless lossy ones are
allowed, the choice named, and the per-hop qgz codecs priced in bytes and memory."""
from __future__ import annotations

from dataclasses import replace

import pytest

import tiershard as ts
from tiershard import cost
from tiershard.cost import Cluster, Job, ModelSpec, traffic
from tiershard.cost.memory import feedback_bytes
from tiershard.plan import QGZ_DEFAULT

SEVEN_B = ModelSpec(params=7_000_000_000, layers=32, hidden=4096, name="7B")
DGX64 = Cluster.two_tier(gpus=64, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9, gpu_memory=80e9, peak_flops=312e12)
SLOW = replace(DGX64, tiers=(DGX64.tiers[0], replace(DGX64.tiers[1], bandwidth=0.5e9)))


def test_the_planner_picks_the_fastest_exact_plan_unless_lossy_ones_are_allowed():
    exact = cost.auto_estimate(SEVEN_B, SLOW, Job())
    assert not exact.plan.lossy and exact.quality == "exact" and exact.reason == "fastest exact plan"
    every = cost.rank_plans(SEVEN_B, SLOW, Job(), allow_lossy=True)
    assert exact.step_time == min(e.step_time for e in every if e.fits and not e.plan.lossy)
    lossy = cost.auto_estimate(SEVEN_B, SLOW, Job(), allow_lossy=True)
    assert lossy.plan.lossy and lossy.step_time == every[0].step_time < exact.step_time
    assert lossy.reason == f"lossy plan allowed: fastest that fits ({lossy.quality.removeprefix('lossy: ')})"
    assert "int4 (world)" in lossy.quality
    assert ts.Plan.auto(SEVEN_B, SLOW, Job()) == exact.plan
    assert ts.Plan.auto(SEVEN_B, SLOW, Job(), allow_lossy=True) == lossy.plan
    # allowed, but not worth it on a fast network: the pick is exact, and says so
    fast = replace(DGX64, tiers=tuple(replace(t, bandwidth=1e15, latency=0.0) for t in DGX64.tiers))
    assert cost.auto_estimate(SEVEN_B, fast, Job(overlap=1.0), allow_lossy=True).reason == \
        "lossy plans allowed; the fastest that fits is exact"
    # named candidates are ranked as given
    named = cost.auto_estimate(SEVEN_B, SLOW, Job(), candidates=["zero3", "zero++"])
    assert str(named.plan) == "GGG+hpz+qwd+qgz" and named.reason.startswith("lossy plan named: fastest that fits")


def test_lossy_candidates_use_the_per_hop_default():
    plans = cost.candidate_plans(DGX64.topology)
    assert {p.qgz for p in plans} == {None, QGZ_DEFAULT} and {p.qwz for p in plans} == {None, "int8"}
    exact = cost.candidate_plans(DGX64.topology, lossy=False)
    assert exact and not any(p.lossy for p in exact)
    assert {str(p) for p in exact} == {str(p) for p in plans if not p.lossy}
    est = cost.evaluate("zero++", SEVEN_B, DGX64, Job()).as_dict()
    assert est["lossy"] and est["quality"] == "lossy: weights int4 differences, gradients int8 (node) / int4 (world)"


@pytest.mark.parametrize("sizes", [(2, 4), (2, 4, 8)])
def test_per_hop_bytes_use_each_tiers_codec(sizes):
    """qgz=8/4: each inner hop moves int8 wire chunks, the outermost int4 ones (default blocks)."""
    from tiershard.comm.codecs import codec_from_spec

    topo = ts.Topology(sizes)
    pl = ts.Plan.parse("GGG+qgz=8/4").resolve(topo)
    shape = traffic.FlatGroupShape(numel=topo.world_size * 4096, trainable=True, backward=False)
    hops = [c for c in traffic.group_collectives(pl, shape, 4, 4) if c.kind == "all_to_all"]
    assert [c.outer for c in hops] == list(range(1, len(sizes) + 1))
    int8, int4 = codec_from_spec("int8"), codec_from_spec("int4")
    d = (1, *sizes)
    for c in hops:
        codec = int4 if c.outer == len(sizes) else int8
        part = shape.numel // d[c.outer]
        assert c.nbytes == d[c.outer] // d[c.outer - 1] * codec.wire_bytes(part), c


def test_memory_counts_feedback_residuals_and_the_codec_scratch():
    job = Job()
    pl = ts.Plan.parse("GGG+qgz+ef").resolve(DGX64.topology)
    with_ef = cost.evaluate("GGG+qgz+ef", SEVEN_B, DGX64, job).memory
    without = cost.evaluate("GGG+qgz", SEVEN_B, DGX64, job).memory
    # an fp32 copy of each hop's input: the whole unit before the node hop, 1/8 of it before the world hop
    assert with_ef.feedback == feedback_bytes(pl, SEVEN_B.trainable) == 4 * SEVEN_B.trainable * (1 + 1 / 8)
    assert without.feedback == 0
    unit = max(t for t, _, _ in SEVEN_B.unit_sizes())
    exact = cost.evaluate("GGG", SEVEN_B, DGX64, job).memory
    # the node hop (the first) sends and receives int8:128: 1 B + 4 B / 128 per value, twice
    assert without.buffers - exact.buffers == pytest.approx(2 * unit * (1 + 4 / 128))
    assert with_ef.buffers - without.buffers == pytest.approx(8 * unit)      # the decoded sent values, the residual


def test_train_auto_is_exact_unless_allowed(capsys):
    from tiershard.cli import train as train_cli
    from tiershard.train.config import JobConfig

    def cfg(**parallel):
        return JobConfig.from_dict({"model": {"preset": "tiny"}, "data": {"max_bytes": 20_000},
                                    "parallel": {"plan": "auto", **parallel}})

    topo = ts.Topology((2, 4))
    chosen = train_cli.check(cfg(), topo)
    assert not ts.Plan.parse(chosen.parallel.plan).lossy
    assert "(fastest exact plan)" in capsys.readouterr().out
    train_cli.check(cfg(allow_lossy=True), topo)
    assert "lossy plan" in capsys.readouterr().out
    train_cli.check(cfg(plan="zero++"), topo)
    assert "plan zero++ is lossy: weights int4 differences, gradients int8 (node) / int4 (world)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="allow_lossy must be true or false"):
        cfg(allow_lossy="yes")
