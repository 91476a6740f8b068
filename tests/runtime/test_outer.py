"""Outer sync (``+outer=H``, DiLoCo / Streaming DiLoCo) against the plan without it, and across a checkpoint.

One launch of 4 gloo ranks as 2 islands of 2 (``Topology((2, 4))``) runs every multi-rank check:

- H=1, outer lr 1, no momentum, inner SGD: the same parameters as the plan without the option after every step
  (the outer step averages the islands' masters; equal up to the rounding of that mean);
- the islands hold different masters between syncs and the same bits after each (exact and int4 outer
  gradients, one fragment and streamed), and nothing but the outer sync crosses the world tier;
- a run saved in the middle of an outer period (a streamed fragment in flight) and resumed into a new model and
  optimizer gives bit for bit the parameters of the uninterrupted run; resumed under another inner plan
  (``NNN``) it matches to rounding.
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn

PER_RANK = 2


def _train(model, opt, rank, world, steps, start=0, seed=1, after=None):
    import tiershard as ts

    data = batches(seed, start + steps, 1, world, PER_RANK)
    for s in range(start, start + steps):
        tokens = data[s][0][rank * PER_RANK:(rank + 1) * PER_RANK]
        loss_fn(model, tokens, 1).backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(s + 1, ts.full_state_dict(model))


def _build(plan, topo, opt="adamw"):
    import tiershard as ts

    torch.manual_seed(0)
    model = ts.shard(TinyGPT(), plan, topo, wrap={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optimizer


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _gap(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _islands_agree(model, state: dict) -> tuple[bool, bool]:
    """Whether the islands (ranks 0 and 2, and 1 and 3) hold the same parameters, and the same outer anchors."""
    import torch.distributed as dist

    outer = model._tiershard.outer
    anchors = {f"{gid}.{i}": a for gid, (g, group) in enumerate(zip(outer.groups, outer.anchors.values()))
               for i, a in enumerate(group)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (state, anchors))
    return _same(everyone[0][0], everyone[2][0]), all(_same(everyone[r][1], everyone[r + 2][1]) for r in (0, 1))


def _predicted_sync(model, rank) -> int:
    """The cost model's bytes of one full outer sync (every fragment once) for this rank."""
    from dataclasses import replace

    from tiershard.cost import traffic

    engine = model._tiershard
    colls = traffic.step_collectives(engine.placement, traffic.engine_shapes(engine))
    once = [replace(c, every=1) for c in colls if c.op == "outer_sync"]
    return traffic.rank_traffic(once, engine.topology, rank)["ops"]["outer_sync"]


def outer_checks(rank, world, folder):
    import tiershard as ts

    topo = ts.Topology((2, 4))
    out = {}
    # 1. H=1, lr 1, no momentum: the plan without the option (inner SGD)
    gaps = []
    plain, plain_opt = _build("IIG", topo, "sgd")
    ref = []
    _train(plain, plain_opt, rank, world, 3, after=lambda s, st: ref.append(st))
    model, opt = _build("IIG+outer=1:lr1:m0", topo, "sgd")
    _train(model, opt, rank, world, 3, after=lambda s, st: gaps.append(_gap(st, ref[s - 1])))
    out["h1_gaps"] = gaps
    # 2. islands apart between syncs, equal after; the world tier carries only the outer sync
    for plan in ("IIG+outer=3", "IIG+outer=4:f2:int4:128:h"):
        model, opt = _build(plan, topo)
        ts.reset_comm_stats()
        agree = []
        _train(model, opt, rank, world, 8, after=lambda s, st: agree.append((s, *_islands_agree(model, st))))
        out[plan] = agree, ts.comm_stats(), _predicted_sync(model, rank)
    # 3. a save in the middle of an outer period (step 5 of H=4, fragment 0 of 2 in flight), resumed
    plan = "IIG+outer=4:f2:m0.8"
    model, opt = _build(plan, topo)
    _train(model, opt, rank, world, 8)
    uninterrupted = ts.full_state_dict(model)
    model, opt = _build(plan, topo)
    _train(model, opt, rank, world, 5)
    ts.save(f"{folder}/ckpt", model, opt)
    _train(model, opt, rank, world, 3, start=5)
    out["saved_then_on"] = _same(ts.full_state_dict(model), uninterrupted)
    for resumed_plan in (plan, "NNN+outer=4:f2:m0.8"):
        model, opt = _build(resumed_plan, topo)
        ts.load(f"{folder}/ckpt", model, opt)
        assert model._tiershard.outer.steps == 5
        _train(model, opt, rank, world, 3, start=5)
        out[resumed_plan] = _gap(ts.full_state_dict(model), uninterrupted)
    # 4. a warm-up of 2 step-synchronous steps: the plan without the option (AdamW), the islands one model
    plain, plain_opt = _build("IIG", topo)
    ref = []
    _train(plain, plain_opt, rank, world, 2, after=lambda s, st: ref.append(st))
    model, opt = _build("IIG+outer=2:w2:lr1:m0", topo)
    warm = []
    _train(model, opt, rank, world, 4, after=lambda s, st: warm.append(
        (_islands_agree(model, st)[0], _gap(st, ref[s - 1]) if s <= 2 else None)))
    out["warmup"] = warm
    # a checkpoint of islands does not load into a plan without outer sync
    model, opt = _build("IIG", topo)
    try:
        ts.load(f"{folder}/ckpt", model, opt)
        out["refused"] = None
    except ts.CheckpointError as err:
        out["refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(outer_checks, 4, str(tmp_path_factory.mktemp("outer")))


def test_h1_equals_the_plan_without_outer_sync(results):
    for res in results:
        assert max(res["h1_gaps"]) < 1e-6, res["h1_gaps"]


@pytest.mark.parametrize("plan,every,streamed", [("IIG+outer=3", 3, False), ("IIG+outer=4:f2:int4:128:h", 4, True)])
def test_islands_meet_at_each_sync_and_only_the_sync_crosses_the_world(results, plan, every, streamed):
    for res in results:
        agree, stats, predicted = res[plan]
        for step, islands, anchors in agree:
            assert anchors, (plan, step)       # the outer state is the same on every island, at every step
            # one fragment: the same weights right after each sync, different between; streamed: a fragment
            # lands with its island's own progress of the step it was in flight, so the weights never meet
            assert islands == (not streamed and step % every == 0), (plan, step)
        assert set(stats["ops"]) >= {"outer_sync"}
        world_ops = {op for op, b in stats["ops"].items() if b and op != "outer_sync"}
        assert stats["tiers"].get("world", 0) == stats["ops"]["outer_sync"], (stats, world_ops)
        # 8 steps: two full syncs (steps 3 and 6; streamed: fragment 0 at steps 3 and 7, fragment 1 at 4 and 8)
        assert stats["ops"]["outer_sync"] == 2 * predicted > 0


def test_a_warmup_trains_as_the_plan_without_the_option_then_the_periods_begin(results):
    for res in results:
        (one, gap1), (two, gap2), (third, _), (fourth, _) = res["warmup"]
        assert one and two and gap1 < 1e-5 and gap2 < 1e-5, res["warmup"]   # step-synchronous: one model
        assert not third and fourth           # step 3 is the first local step; step 4 ends the first period


def test_resume_inside_an_outer_period_is_exact(results):
    for res in results:
        assert res["saved_then_on"]
        assert res["IIG+outer=4:f2:m0.8"] == 0.0
        assert res["NNN+outer=4:f2:m0.8"] < 1e-5
        assert "saved with outer sync" in res["refused"]


def test_fragment_schedule_syncs_every_parameter_once_per_period():
    from tiershard.plan import OuterSpec
    from tiershard.runtime.outer import fragment_schedule

    sizes = [5, 100, 3, 40, 40, 7, 60]
    for fragments in range(1, len(sizes) + 1):
        runs = fragment_schedule(sizes, fragments)
        assert [i for run in runs for i in run] == list(range(len(sizes))) and all(runs)
        for every in (fragments, 10, 17):
            spec = OuterSpec(every, fragments)
            for first in range(every):          # any window of H consecutive steps
                synced = [i for t in range(first, first + every) for f, run in enumerate(runs)
                          if spec.offset(f) == t % every for i in run]
                assert sorted(synced) == list(range(len(sizes)))
    with pytest.raises(ValueError, match="at most 7"):
        fragment_schedule(sizes, 8)


def test_outer_gradient_codec_round_trip():
    from tiershard.comm.codecs import codec_from_spec
    from tiershard.comm.island_mean import IslandMean
    from tiershard.topology import TierGroup, Topology

    torch.manual_seed(0)
    delta = torch.randn(1000) * 1e-3
    alone = TierGroup((0,), (0,))
    for spec, bound in (("int8:128:h", 2e-2), ("int4:128:h", 0.2), ("int4:128:h:sr", 0.3)):
        mean = IslandMean(codec_from_spec(spec), seed=1)
        got = mean.start(delta.clone(), alone, Topology((1,)), "outer_sync", seed=mean.key(1, 0, 0)).finish()
        rel = ((got - delta).norm() / delta.norm()).item()
        assert 0 < rel < bound, (spec, rel)
    assert torch.equal(IslandMean().start(delta.clone(), alone, Topology((1,)), "outer_sync").finish(), delta)


def test_outer_plans_parse_and_refuse():
    import tiershard as ts

    warm = ts.Plan.parse("IIG+outer=10:w500:lr1:m0")
    assert warm.outer.warmup == 500 and str(warm) == "IIG+outer=10:lr1:m0:w500" and ts.Plan.parse(str(warm)) == warm
    assert "after 500 step-synchronous steps" in warm.quality()
    plan = ts.Plan.parse("zero3+outer=100:f4:lr0.5:int4:128:h")
    assert str(plan) == "GGG+outer=100:f4:lr0.5:int4:128:h" and ts.Plan.parse(str(plan)) == plan
    assert (plan.outer.every, plan.outer.fragments, plan.outer.lr, plan.outer.momentum) == (100, 4, 0.5, 0.9)
    assert plan.lossy and "outer sync every 100 steps in 4 fragments, outer gradients int4" in plan.quality()
    placement = plan.resolve(ts.Topology((2, 4)))
    assert (placement.p, placement.g, placement.os, placement.dp_level) == (1, 1, 1, 1)
    for bad, words in (("IIG+outer", "period"), ("IIG+outer=0", "positive"), ("IIG+outer=4:f5", "1 to the period"),
                       ("IIG+outer=4:x2", "unknown outer option"), ("IIG+outer=4:int3", "unknown outer option"),
                       ("IIG+outer=4:m1", "momentum"), ("IIG+outer=4:w2.5", "warm-up")):
        with pytest.raises(ts.PlanError, match=words):
            ts.Plan.parse(bad)
    with pytest.raises(ts.PlanError, match="one tier"):
        ts.Plan.parse("GGG+outer=4").resolve(ts.Topology((4,)))
