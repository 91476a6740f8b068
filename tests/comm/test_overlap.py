"""Overlap never changes results. Every plan at prefetch 2 against prefetch 0, bit for bit and byte for byte, runs
inside the 4-rank parity sweep (tests/runtime/test_engine_parity.py); here: +cc pipelining against its phases in
turn, and the boundary all-gather deferred into the next forward.
"""
from __future__ import annotations

import torch

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn


def _cc_pipeline(rank, world, sizes):
    """A +cc reduce-scatter and all-gather across all tiers, pipelined over chunks and phase after phase."""
    import tiershard as ts
    from tiershard.cost import traffic
    from tiershard.comm import hierarchical as H

    topo = ts.Topology(sizes)
    topo.init_process_groups()
    top = topo.num_levels - 1
    hops = lambda k: topo.group_for(rank, k - 1, k)     # noqa: E731
    buf = torch.randn(topo.world_size * 3 * H.MIN_CHUNK, generator=torch.Generator().manual_seed(rank))
    ts.reset_comm_stats()
    shard = H.reduce_scatter(buf.clone(), 0, top, hops, topo, "grad_reduce")     # the input is spent
    full = torch.empty_like(buf)
    H.all_gather(full, shard, 0, top, hops, topo, "param_gather")
    sent = ts.comm_stats()["ops"]
    H.PIPELINE_CHUNKS, saved = 1, H.PIPELINE_CHUNKS
    try:
        plain_shard = H.reduce_scatter(buf, 0, top, hops, topo, "grad_reduce")
        plain_full = torch.empty_like(buf)
        H.all_gather(plain_full, plain_shard, 0, top, hops, topo, "param_gather")
    finally:
        H.PIPELINE_CHUNKS = saved
    # what cost/traffic.py prices for the same buffer, as the phases of a +cc plan
    pl = ts.Plan.parse("GGG+cc").resolve(topo)
    shape = traffic.FlatGroupShape(buf.numel(), True, backward=False)
    colls = [c for c in traffic.group_collectives(pl, shape, 4, 4) if c.op in ("grad_reduce", "param_gather")]
    formula = traffic.rank_traffic(colls, topo, rank)["ops"]
    return (shard - plain_shard).abs().max().item(), (full - plain_full).abs().max().item(), sent, formula


def test_cc_pipeline_matches_phases_in_turn_and_the_formula():
    """[Note: cc pipeline]: the same sums (to fp32 round-off: a sum replaces the ring) and the same gathered values,
    and the bytes cost/traffic.py prices."""
    for world, sizes in ((4, (2, 4)),):
        for rs_err, ag_err, sent, formula in run_ranks(_cc_pipeline, world, sizes):
            assert rs_err <= 1e-5 and ag_err <= 1e-5, (sizes, rs_err, ag_err)
            assert sent == formula, (sizes, sent, formula)


def _deferred_rebuild(rank, world, plans):
    """For each plan: param_sync bytes right after optimizer.step() and after the next forward, and the formula."""
    import tiershard as ts
    from tiershard.cost import traffic

    topo = ts.Topology((2, 4))
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        model = ts.shard(TinyGPT(), plan, topo, wrap={Block})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = next(iter(batches(8, 1, 1, world)))[0][rank * 2:(rank + 1) * 2]
        loss_fn(model, tokens, 1).backward()
        ts.reset_comm_stats()
        opt.step()
        after_step = ts.comm_stats()["ops"].get("param_sync", 0)
        with torch.no_grad():
            loss_fn(model, tokens, 1)
        after_forward = ts.comm_stats()["ops"].get("param_sync", 0)
        engine = model._tiershard
        colls = traffic.step_collectives(engine.placement, traffic.engine_shapes(engine), 4, 4, 1)
        formula = traffic.rank_traffic([c for c in colls if c.op == "param_sync"], topo, rank)["ops"]
        out[plan] = (after_step, after_forward, formula.get("param_sync", 0))
    return out


def test_the_boundary_all_gather_runs_in_the_next_forward():
    """[Note: deferred rebuild]: optimizer.step() issues no collective; the next forward moves exactly one step's
    param_sync bytes (os -> p), with p replicated (NNG, NIG) or sharded inside the node (IIG+cc)."""
    for res in run_ranks(_deferred_rebuild, 4, ["NNG", "IIG+cc", "NIG"]):
        for plan, (after_step, after_forward, formula) in res.items():
            assert formula > 0, plan
            assert after_step == 0 and after_forward == formula, (plan, after_step, after_forward, formula)
