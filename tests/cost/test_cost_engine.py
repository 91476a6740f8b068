"""The cost model cuts a torch module into the engine's flat groups and prices exactly cost/traffic.py's bytes.

Pure arithmetic, no process group: the engine's own test checks ``comm_stats`` against ``traffic.rank_traffic``;
this one closes the loop from ``traffic`` to the cost model for the same module and ``wrap``.
"""
from __future__ import annotations

import pytest

import tiershard as ts
from tiershard import cost
from tiershard.cost import traffic
from tiershard.cost import Cluster, Job, Tier

from _models import Block, TinyGPT


def _cluster(sizes):
    names = ("node", "world") if len(sizes) == 2 else ("pair", "node", "world")
    return Cluster(tiers=tuple(Tier(name=n, size=s, bandwidth=1e9) for n, s in zip(names, sizes)),
                   gpu_memory=1e12, peak_flops=1e12)


def _peft_model():
    model = TinyGPT(layers=3)
    for block in model.blocks[:2]:
        block.requires_grad_(False)
    model.wte.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("make", [TinyGPT, _peft_model])
@pytest.mark.parametrize("sizes", [(2, 4), (2, 4, 8)])
def test_cost_bytes_equal_rank_traffic_of_the_engine_shapes(make, sizes):
    model = make()
    cluster = _cluster(sizes)
    topo = cluster.topology
    spec = cost.ModelSpec.from_module(model, wrap={Block})
    job = Job(accum=2, param_bytes=4, reduce_bytes=4)
    for code in ["NNN", "NNG", "GGG", "IIG", "NIG", "ING", "IGG", "GGG+hpz", "III+cc"]:
        pl = ts.Plan.parse(code).resolve(topo)
        cuts = topo.chunking(pl.os), topo.chunking(pl.p)
        engine_shapes = traffic.module_shapes(model, {Block}, *cuts)
        ours = [shape for shape, units in cost.comm.unit_shapes(spec, job, *cuts) for _ in range(units)]
        assert sorted(ours, key=repr) == sorted(engine_shapes, key=repr)
        expected = traffic.step_collectives(pl, engine_shapes, 4, 4, 2)
        per_rank = [traffic.rank_traffic(expected, topo, r)["tiers"] for r in range(topo.world_size)]
        est = cost.evaluate(code, spec, cluster, job)
        for tier in topo.names:
            assert est.tier_bytes.get(tier, 0) == sum(t.get(tier, 0) for t in per_rank), (code, tier)
            # tier_seconds is per rank at 1 GB/s: the mean over ranks of what each rank sends
            assert est.tier_seconds[tier] * 1e9 == pytest.approx(sum(t.get(tier, 0) for t in per_rank) / topo.world_size)
