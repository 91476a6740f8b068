"""The cost model: memory against hand-computed values, bytes against cost/traffic.py, time sanity, the planner."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch.nn as nn

import tiershard as ts
from tiershard.cost import presets as clusters, traffic
from tiershard import cost
from tiershard.comm.codecs import DEFAULT_BLOCKS
from tiershard.plan import all_placements
from tiershard.cost import Cluster, Job, ModelSpec, Tier

GB = 1e9
SEVEN_B = ModelSpec(params=7_000_000_000, layers=32, hidden=4096, name="7B")
DGX64 = Cluster.two_tier(gpus=64, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9, gpu_memory=80e9, peak_flops=312e12)

# reference/papers.md section 3.5: 7B on 8 nodes x 8 GPUs, model states only, GB, for Ψ'/Ψ = 1, 1/16, 3/1000.
PARO_TABLE = {
    "NNN": (112.0, 20.1, 14.3), "NNG": (29.3, 15.0, 14.1), "NGG": (15.5, 14.1, 14.0),
    "GGG": (1.75, 0.31, 0.22), "NII": (26.3, 14.8, 14.0), "NIG": (17.1, 14.2, 14.0),
    "ING": (17.1, 2.7, 1.8), "IIG": (4.8, 1.9, 1.8), "IGG": (3.3, 1.9, 1.8), "III": (14.0, 2.5, 1.8),
}


def paper_working_copy(pl, model: ModelSpec, job: Job) -> float:
    """The bf16 weight shard the papers count at p = os and the engine does not keep (each gather casts the
    masters' band): the one stated input between the PaRO table and ``cost.memory``."""
    return job.param_bytes * model.trainable / pl.size(pl.p) if pl.p == pl.os and pl.p > 0 else 0.0


@pytest.mark.parametrize("code", sorted(PARO_TABLE))
@pytest.mark.parametrize("column,fraction", [(0, 1.0), (1, 1 / 16), (2, 3 / 1000)])
def test_model_states_match_the_paro_table(code, column, fraction):
    model = SEVEN_B.with_trainable(fraction)
    pl = ts.Plan.parse(code).resolve(DGX64.topology)
    mem = cost.memory(pl, model, Job())
    expected = PARO_TABLE[code][column]
    # the table rounds to one decimal (two for GGG), and writes IGG at 1/16 (1.846) as 1.9
    assert (mem.model_states + paper_working_copy(pl, model, Job())) / GB == \
        pytest.approx(expected, abs=0.06 if expected >= 1 else 0.011)


def test_a_placement_with_p_at_os_holds_no_working_copy():
    """GGG and III keep no bf16 shard beside the masters: 14 bytes a parameter over the level, not the papers' 16."""
    for code, d in (("GGG", 64), ("III", 8)):
        mem = cost.memory(ts.Plan.parse(code).resolve(DGX64.topology), SEVEN_B, Job())
        assert mem.params == 0 and mem.model_states == pytest.approx(14 * 7e9 / d)
    frozen = SEVEN_B.with_trainable(1 / 16)   # frozen weights are the working copy: still counted
    assert cost.memory(ts.Plan.parse("GGG").resolve(DGX64.topology), frozen, Job()).params == \
        pytest.approx(2 * 7e9 * 15 / 16 / 64)


def test_model_states_exact_values():
    topo = DGX64.topology
    peft = SEVEN_B.with_trainable(1 / 16)     # Ψ' = 437.5e6
    assert cost.memory(ts.Plan.parse("IGG").resolve(topo), peft, Job()).model_states == \
        pytest.approx(2 * 7e9 / 8 + 2 * 437.5e6 / 64 + 12 * 437.5e6 / 64)
    assert cost.memory(ts.Plan.parse("NIG").resolve(topo), SEVEN_B, Job(grad_bytes=4)).model_states == \
        pytest.approx(2 * 7e9 + 4 * 7e9 / 8 + 12 * 7e9 / 64)


def test_hpz_copy_costs_two_bytes_per_param_over_the_node():
    plain = cost.memory(ts.Plan.parse("zero3").resolve(DGX64.topology), SEVEN_B, Job())
    zpp = cost.memory(ts.Plan.parse("zero++").resolve(DGX64.topology), SEVEN_B, Job())
    assert zpp.hpz == pytest.approx(2 * 7e9 / 8)
    pl = ts.Plan.parse("zero++").resolve(DGX64.topology)
    assert (zpp.model_states + paper_working_copy(pl, SEVEN_B, Job()) + zpp.hpz) / GB == \
        pytest.approx(3.5)                                            # papers.md 3.5, last row
    assert plain.hpz == 0 and zpp.model_states == plain.model_states


def test_buffers_and_activations_follow_the_stated_formulas():
    job = Job(micro_batch=2, seq=1024, recompute=False)
    model = SEVEN_B
    sbh = 2 * 1024 * 4096
    assert cost.memory(ts.Plan.parse("NNN").resolve(DGX64.topology), model, job).activations == \
        (32 + 1) * 34 * sbh + 8 * 2048 * model.vocab    # every layer's, and one layer's working set in backward
    mem = cost.memory(ts.Plan.parse("GGG").resolve(DGX64.topology), model, job)
    unit = max(model.layer_params(), model.root_params())
    assert mem.buffers == 2 * unit * 2 + unit * 2     # two gathered units + one unit's full gradient
    assert cost.memory(ts.Plan.parse("NNN").resolve(DGX64.topology), model, job).buffers == 0


def test_backward_peak_follows_the_activations_freed_and_the_gradients_made():
    from tiershard.cost.memory import activations, backward_peak
    model = ModelSpec(params=1000, layers=2, hidden=16, vocab=50, trainable=1000)
    job = Job(micro_batch=1, seq=8, recompute=False)
    acts, layer = activations(model, job), 34 * 8 * 16
    # a block's gradients smaller than its layer's activations: the peak is backward's start
    assert backward_peak(100, [(5, 0, 0), (1, 0, 0), (1, 0, 0)], model, job) == 100 + acts
    # larger: its end, every gradient made (the root's last), the blocks' saved activations and working set gone
    big = 3 * layer
    assert backward_peak(100, [(5, 0, 0), (big, 0, 0), (big, 0, 0)], model, job) == \
        100 + acts + 2 * big - 2 * layer - layer + 5
    # accumulators of the micro-steps before: alive from the start, turned into the gradients unit by unit
    assert backward_peak(100, [(0, 0, 0), (7, 7, 0), (7, 7, 0)], model, job) == 100 + 14 + acts
    # a reduction's transient bytes, in place of the working set of its block's backward, which is done
    assert backward_peak(100, [(0, 0, 0), (1, 0, 0), (1, 0, 3 * layer)], model, job) == 100 + acts + 1 + layer


def test_unit_gradients_transients_follow_the_reduction():
    """A replicated g sums the whole (slots x U) matrix in fp32 beside it; a sharded one only its level-g chunk,
    so cutting the matrix from the working gradients is the larger moment."""
    from tiershard.cost.memory import GroupLayout, unit_gradients
    topo = ts.Topology((2, 4))
    groups = [GroupLayout(0, True, 800, ()), GroupLayout(1, True, 1600, ())]
    for plan, g_size in (("NNG", 1), ("GGG", 8)):
        units = unit_gradients(ts.Plan.parse(plan).resolve(topo), groups, 0, 1, 2, 2)
        for (_, acc, transient), group in zip(units, groups):
            S = group.numel
            assert acc == 0
            assert transient == max(4 * S, 2 * S + 4 * S // g_size)


# ---- bytes: the cost model prices cost/traffic.py's collectives, nothing else --------------------------
SMALL = ModelSpec(params=40_000, layers=3, hidden=16, vocab=50, trainable=10_000)


@pytest.mark.parametrize("sizes", [(2, 4), (2, 4, 8), (4, 8)])
def test_tier_bytes_equal_traffic_totals_for_every_candidate(sizes):
    cluster = Cluster(tiers=tuple(Tier(name=n, size=s, bandwidth=1e9) for n, s in
                                  zip(("pair", "node", "world")[-len(sizes):], sizes)),
                      gpu_memory=1e12, peak_flops=1e12)
    job = Job(accum=3)
    topo = cluster.topology
    plans = cost.candidate_plans(topo)
    for plan in plans if len(sizes) == 2 else plans[::2]:
        pl = plan.resolve(topo)
        collectives = cost.plan_collectives(pl, SMALL, job)
        est = cost.evaluate(plan, SMALL, cluster, job)
        assert est.tier_bytes == {t: b for t, b in traffic.total_traffic(collectives, topo).items() if b}, str(plan)
        per_rank = [traffic.rank_traffic(collectives, topo, r)["tiers"] for r in range(topo.world_size)]
        for tier, seconds in est.tier_seconds.items():
            mean = sum(t.get(tier, 0) for t in per_rank) / topo.world_size
            assert seconds * 1e9 == pytest.approx(mean), (str(plan), tier)


def test_unquantized_collectives_are_traffic_step_collectives_per_unit():
    pl = ts.Plan.parse("IIG").resolve(DGX64.topology)
    job = Job(accum=4)
    shapes = [s for s, units in cost.comm.unit_shapes(SEVEN_B, job, DGX64.topology.chunking(pl.os)) for _ in range(units)]
    expected = traffic.total_traffic(traffic.step_collectives(pl, shapes, 2, 2, 4), DGX64.topology)
    assert cost.evaluate("IIG", SEVEN_B, DGX64, job).tier_bytes == expected


def _m(est: cost.Estimate, model: ModelSpec = SEVEN_B) -> float:
    """Inter-node bytes per node per step in units of M = the model in working precision."""
    return est.bytes_per_group("world") / (2 * model.params)


def test_zero3_moves_3m_and_zeropp_075m_per_node():
    v100 = clusters.preset("v100-100g", 384)
    model = ModelSpec.named("18b")
    zero3 = cost.evaluate("zero3", model, v100, Job())
    zpp = cost.evaluate("GGG+hpz+qwz+qgz=int4", model, v100, Job())     # the paper's ZeRO++: int4 on every hop
    int8_weights = cost.evaluate("GGG+hpz+qwz+qgz", model, v100, Job())  # gradients int8 inside a node, int4:128 between
    default = cost.evaluate("zero++", model, v100, Job())               # the same gradients, int4 weight differences
    # forward gathers, backward gathers (all but the root, which stays gathered for its backward), reduce-scatters
    assert _m(zero3, model) == pytest.approx((3 - model.root_params() / model.params) * 383 / 384, rel=1e-3)
    # 0.5M (int8 payload + 4 B per block) + 0 (hpZ) + 0.25M x 23/24 (int4 payload + 4 B per block of 0.5 B values)
    int8, int4 = 1 + 4 / DEFAULT_BLOCKS[8], 1 + 8 / DEFAULT_BLOCKS[4]
    assert _m(zpp, model) == pytest.approx(0.5 * int8 * 383 / 384 + 0.25 * int4 * 23 / 24, rel=2e-3)
    grads = 0.25 * (1 + 8 / 128) * 23 / 24
    assert _m(int8_weights, model) == pytest.approx(0.5 * int8 * 383 / 384 + grads, rel=2e-3)
    # qwd: each node gathers the other nodes' int4:2048 differences once per step (its hpZ copy serves the rest)
    assert _m(default, model) == pytest.approx(0.25 * (1 + 8 / 2048) * 23 / 24 + grads, rel=2e-3)
    payload = 0.5 * 383 / 384 + 0.25 * 23 / 24
    assert payload == pytest.approx(0.75, abs=0.015)      # the paper's 0.75M, which drops the (k-1)/k factors
    assert zpp.step_time < zero3.step_time


def test_paro_strategies_cross_nodes_once_per_step():
    for accum in (1, 4, 16):
        job = Job(accum=accum)
        root = SEVEN_B.root_params() / SEVEN_B.params       # the root skips its backward gather
        assert _m(cost.evaluate("GGG", SEVEN_B, DGX64, job)) == pytest.approx((3 - root) * accum * 63 / 64,
                                                                              rel=1e-3)
        assert _m(cost.evaluate("IIG", SEVEN_B, DGX64, job)) == pytest.approx(2 * 7 / 8, rel=1e-3)
        assert _m(cost.evaluate("IGG", SEVEN_B, DGX64, job)) == pytest.approx(accum * 63 / 64 + 7 / 8, rel=1e-3)


# ---- time -------------------------------------------------------------------------------------
def _with_inter(cluster: Cluster, bandwidth: float, latency: float | None = None) -> Cluster:
    outer = cluster.tiers[-1]
    return replace(cluster, tiers=(*cluster.tiers[:-1], replace(
        outer, bandwidth=bandwidth, latency=outer.latency if latency is None else latency)))


@pytest.mark.parametrize("base", ["dgx-a100", "frontier"])
def test_a_slower_inter_link_never_makes_a_plan_faster(base):
    cluster = clusters.preset(base, 64)
    job = Job(accum=2)
    model = ModelSpec.named("7b")
    for plan in cost.candidate_plans(cluster.topology)[::3]:
        times = [cost.evaluate(plan, model, _with_inter(cluster, bw, lat), job).step_time
                 for bw, lat in ((50e9, 5e-6), (25e9, 10e-6), (5e9, 10e-6), (1e9, 50e-6))]
        assert times == sorted(times), str(plan)


def test_step_time_composition_and_overlap():
    job = Job(accum=4, overlap=0.5)
    est = cost.evaluate("GGG", SEVEN_B, _with_inter(DGX64, 2e9), job)
    assert est.compute == pytest.approx(4 * cost.compute_seconds(SEVEN_B, job, DGX64))
    assert est.step_time == pytest.approx(est.compute + max(0, est.comm_micro - 0.5 * est.compute) + est.comm_boundary)
    # IIG's inter-node traffic is all at the boundary: the gradient sync is exposed, the parameter sync hides
    # behind at most the next forward of one micro-step ([Note: deferred rebuild])
    iig = cost.evaluate("IIG", SEVEN_B, _with_inter(DGX64, 2e9), job)
    forward = cost.planner.forward_seconds(SEVEN_B, job, DGX64)
    assert forward == pytest.approx(est.compute / 4 / 4)      # 2 of the 8 flops per param and token (recompute)
    assert iig.comm_boundary > 0.5 * forward
    assert iig.step_time == pytest.approx(iig.compute + iig.comm_boundary - 0.5 * forward
                                          + max(0, iig.comm_micro + 0.5 * forward - 0.5 * iig.compute))


def test_compute_is_six_flops_per_param_per_token_without_recompute():
    job = Job(micro_batch=2, seq=1000, recompute=False, efficiency=0.5)
    assert cost.compute_seconds(SEVEN_B, job, DGX64) == pytest.approx(6 * 7e9 * 2000 / (312e12 * 0.5))
    assert cost.compute_seconds(SEVEN_B, replace(job, recompute=True), DGX64) == \
        pytest.approx(8 * 7e9 * 2000 / (312e12 * 0.5))


def test_cc_runs_one_phase_per_tier():
    """NIG's global parameter gather as an inter-node then an intra-node phase: fewer cross-node bytes in the
    ring model ((g-1)/g instead of (n-1)/n of the data per node) and fewer latency steps. The phases run one
    after the other while a flat ring keeps both tiers busy at once, so cc wins where latency dominates."""
    flat = cost.evaluate("NIG", SEVEN_B, DGX64, Job())
    hier = cost.evaluate("NIG+cc", SEVEN_B, DGX64, Job())
    assert hier.tier_bytes["world"] < flat.tier_bytes["world"]
    small = ModelSpec(params=2_000_000, layers=2, hidden=256, name="2M")
    assert cost.evaluate("NIG+cc", small, DGX64, Job()).step_time < cost.evaluate("NIG", small, DGX64, Job()).step_time
    assert cost.evaluate("GGG+qgz+cc", SEVEN_B, DGX64, Job()).tier_bytes["world"] < \
        cost.evaluate("GGG+qgz", SEVEN_B, DGX64, Job()).tier_bytes["world"]


def test_zeropp_gains_more_on_the_slower_network():
    model = ModelSpec.named("18b")
    job = Job(seq=1024)
    speedup = {}
    for gbps in (100, 400):
        cluster = _with_inter(clusters.preset("v100-100g", 384), gbps * 1e9 / 8 / 16)
        speedup[gbps] = cost.evaluate("zero3", model, cluster, job).step_time / \
            cost.evaluate("zero++", model, cluster, job).step_time
    assert speedup[100] > speedup[400] > 1.1


# ---- the planner ------------------------------------------------------------------------------
def test_auto_plan_is_the_argmin_of_the_plans_that_fit():
    job = Job(accum=4, micro_batch=2)
    cluster = _with_inter(DGX64, 3e9)
    ranked = cost.rank_plans(SEVEN_B, cluster, job)
    fitting = [e for e in ranked if e.fits]
    assert any(not e.fits for e in ranked)
    best = cost.auto_plan(SEVEN_B, cluster, job)
    assert best == fitting[0].plan
    assert fitting[0].step_time == min(e.step_time for e in fitting)
    assert ts.Plan.auto(SEVEN_B, cluster, job) == best
    assert fitting[0].memory.total <= fitting[0].capacity


def test_ties_go_to_less_quantization():
    # a network so fast that every plan hides its communication: all fitting plans tie
    fast = replace(DGX64, tiers=tuple(replace(t, bandwidth=1e15, latency=0.0) for t in DGX64.tiers))
    plan = cost.auto_plan(SEVEN_B, fast, Job(overlap=1.0))
    assert not plan.qwz and not plan.qgz
    # a slow network makes quantization worth it
    slow = cost.auto_plan(SEVEN_B, _with_inter(DGX64, 0.5e9), Job(), candidates=["zero3", "zero++"])
    assert str(slow) == "GGG+hpz+qwd+qgz"


def test_a_model_that_fits_nowhere_raises():
    small = Cluster.two_tier(gpus=8, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9, gpu_memory=16e9,
                             peak_flops=312e12)
    with pytest.raises(cost.NoPlanFits, match="does not fit"):
        cost.auto_plan("65b", small, Job())


def test_auto_plan_counts_a_torch_module():
    net = nn.Sequential(nn.Embedding(100, 32), nn.ModuleList([nn.Linear(32, 32) for _ in range(4)]))
    spec = cost.coerce_model(net)
    assert spec.params == 100 * 32 + 4 * (32 * 32 + 32) and spec.layers == 4 and spec.hidden == 32
    # a tiny model is latency-bound: the pick is no slower than replicating (NNN) or any PaRO placement
    best = cost.evaluate(cost.auto_plan(net, DGX64, Job()), spec, DGX64, Job()).step_time
    assert all(best <= cost.evaluate(code, spec, DGX64, Job()).step_time for code in all_placements())


@pytest.mark.parametrize("make,message", [
    (lambda: Tier(name="world", size=8, bandwidth=-1e9), "bandwidth"),
    (lambda: Tier(name="world", size=8, bandwidth=1e9, latency=-1), "latency"),
    (lambda: Cluster.two_tier(gpus=60, gpus_per_node=8, intra_bw=1e9, inter_bw=1e9, gpu_memory=1e9,
                              peak_flops=1e12), "not divisible by 8"),
    (lambda: Cluster(tiers=(Tier(name="node", size=3, bandwidth=1e9), Tier(name="world", size=8, bandwidth=1e9)),
                     gpu_memory=1e9, peak_flops=1e12), "does not divide"),
    (lambda: Cluster(tiers=(Tier(name="world", size=8, bandwidth=1e9),), gpu_memory=0, peak_flops=1e12), "gpu_memory"),
    (lambda: Job(accum=0), "accum"),
    (lambda: Job(overlap=1.5), "overlap"),
    (lambda: Job(efficiency=0), "efficiency"),
    (lambda: ModelSpec(params=100, layers=1, hidden=4, trainable=200), "trainable"),
    (lambda: ModelSpec.named("7x"), "unknown model"),
    (lambda: SEVEN_B.with_trainable(1.5), "fraction"),
    (lambda: ModelSpec.from_params(-3), "positive"),
])
def test_bad_inputs_raise_clear_value_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_candidates_cover_every_placement_and_option():
    plans = cost.candidate_plans(DGX64.topology)
    codes = {f"{p.p}{p.g}{p.os}" for p in plans}
    assert codes == set(ts.plan.all_placements())
    assert "GGG+hpz+qwz+qgz" in {str(p) for p in plans}
    three = clusters.preset("frontier", 64).topology
    assert len({(p.p, p.g, p.os) for p in cost.candidate_plans(three)}) == 64
    assert any(p.hpz == ("pair", "I") for p in cost.candidate_plans(three))


def test_paper_tables_doc_is_current():
    """docs/paper-tables.md holds the output of benchmarks/paper_tables.py for the current model."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("paper_tables", root / "benchmarks" / "paper_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check", str(root / "docs" / "paper-tables.md")]) == 0


# ---- outer sync ([Note: outer sync] in plan.py) ------------------------------------------------------------
def _two_islands(inter_bw: float) -> Cluster:
    return Cluster(tiers=(Tier(name="node", size=2, bandwidth=2e9), Tier(name="world", size=4, bandwidth=inter_bw)),
                   gpu_memory=80e9, peak_flops=1e13)


def test_outer_sync_bytes_and_exposed_time():
    model, job = ModelSpec.from_params(3.7e6, layers=4, hidden=256, vocab=2048), Job(seq=128, accum=1)
    slow = _two_islands(25e6 / 8)
    plain = cost.evaluate("III", model, slow, job)
    every = {H: cost.evaluate(f"IIG+outer={H}", model, slow, job) for H in (10, 100)}
    # nothing crosses the world but the sync: its bytes per step scale as 1/H; one fragment is all exposed
    assert "world" in plain.tier_bytes and every[10].tier_bytes["world"] == pytest.approx(
        10 * every[100].tier_bytes["world"], rel=1e-5)
    inner = cost.evaluate("IIG+outer=100:lr1", model, _two_islands(1e15), job).step_time
    sync = every[10].step_time - inner
    assert sync > 0 and every[100].step_time - inner == pytest.approx(sync / 10, rel=1e-3)
    # int4 outer gradients: about 1/8 of the fp32 all-reduce's bytes (2 islands: all-gather of one encoding each)
    q4 = cost.evaluate("IIG+outer=10:int4:128:h", model, slow, job)
    assert 0.10 < q4.tier_bytes["world"] / every[10].tier_bytes["world"] < 0.15
    # streamed: the same bytes, and a fragment that one inner step hides costs nothing
    fast = _two_islands(1e12)
    streamed = cost.evaluate("IIG+outer=10:f5", model, fast, job)
    assert streamed.tier_bytes == cost.evaluate("IIG+outer=10", model, fast, job).tier_bytes
    one = cost.evaluate("IIG+outer=10", model, fast, job)
    sync = sum(p.seconds for p in cost.price_plan(ts.Plan.parse("IIG+outer=10").resolve(fast.topology), model, job,
                                                  fast) if p.collective.op == "outer_sync")
    assert sync > 0 and one.step_time - sync == pytest.approx(streamed.step_time, rel=1e-9)
    # the planner ranks outer plans only when asked, and only with allow_lossy
    assert not any(p.outer for p in cost.candidate_plans(slow.topology))
    best = cost.auto_plan(model, slow, job, allow_lossy=True, outer=True)
    assert best.outer is not None and cost.auto_plan(model, slow, job, allow_lossy=True).outer is None
    with pytest.raises(ValueError, match="allow_lossy"):
        cost.rank_plans(model, slow, job, outer=True)
    # memory: anchor and momentum beside the masters
    assert cost.evaluate("IIG+outer=10", model, slow, job).memory.optimizer == pytest.approx(
        plain.memory.optimizer + 8 * model.trainable / 2)


# ---- where the step goes (tiershard plan --explain) ---------------------------------------------------------------
@pytest.mark.parametrize("plan", ["GGG", "IIG", "zero++", "GGG+hpz+qgz+cc", "IIG+outer=50:f5"])
@pytest.mark.parametrize("inter", [25e9, 31.25e6])
def test_tier_terms_add_up_to_the_estimate(plan, inter):
    from tiershard.cost.explain import tier_terms

    cluster = replace(_with_inter(DGX64, inter), codec_rates=(("int8:128:h", 20e9), ("int4:128:h:sr", 5e9)),
                      codec_rate=10e9)
    for job in (Job(), Job(accum=4, overlap=0.3)):
        est, rows = tier_terms(plan, SEVEN_B, cluster, job)
        assert sum(r.exposed for r in rows) == pytest.approx(est.exposed, rel=1e-9, abs=1e-12)
        assert {r.tier: r.link for r in rows} == pytest.approx(est.tier_seconds)
        assert all(r.exposed >= -1e-12 and r.codec >= 0 for r in rows)


def test_a_codec_pays_where_its_time_is_below_the_link_time_it_saves():
    from tiershard.cost.explain import tier_terms

    def world(inter, rate):
        cluster = replace(_with_inter(DGX64, inter), codec_rates=(("int8:128:h", rate), ("int4:128:h:sr", rate)))
        return next(r for r in tier_terms("GGG+qgz", SEVEN_B, cluster, Job())[1] if r.tier == "world")

    slow_link = world(31.25e6, 1e9)         # 250 Mbit/s per GPU: the codec saves far more than it costs
    assert slow_link.codec_pays and slow_link.saved > slow_link.codec > 0
    slow_codec = world(25e9, 1e8)           # a fast link, a slow codec: it costs more than it saves
    assert slow_codec.codec_pays is False and slow_codec.codec > slow_codec.saved
    assert world(25e9, 1e8).codec == pytest.approx(10 * world(25e9, 1e9).codec)    # priced at its own rate
    exact = tier_terms("GGG", SEVEN_B, DGX64, Job())[1]
    assert all(r.saved is None and r.codec_pays is None for r in exact)


def test_each_codec_is_priced_at_its_own_rate():
    fast = replace(DGX64, codec_rates=(("int8:128:h", 1e12), ("int4:128:h:sr", 1e12)), codec_rate=1e6)
    slow = replace(fast, codec_rates=(("int8:128:h", 1e9), ("int4:128:h:sr", 1e9)))
    plan = "GGG+qgz"
    assert cost.evaluate(plan, SEVEN_B, slow, Job()).comm_micro > cost.evaluate(plan, SEVEN_B, fast, Job()).comm_micro
    # a codec the table lacks falls back to the one rate; no rate at all: codecs are free, as before
    only_one = replace(DGX64, codec_rates=(("int8:128:h", 1e9),), codec_rate=1e9)
    assert cost.evaluate(plan, SEVEN_B, only_one, Job()).step_time == pytest.approx(
        cost.evaluate(plan, SEVEN_B, replace(DGX64, codec_rate=1e9), Job()).step_time)
    with pytest.raises(ValueError, match="codec_rates entry"):
        replace(DGX64, codec_rates=(("int8", -1.0),))
