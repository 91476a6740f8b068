"""Plans, topologies and their errors: pure arithmetic, plus the errors that need a process group."""
from __future__ import annotations

import pytest
import torch

import tiershard as ts
from tiershard.plan import all_placements
from _dist import run_ranks
from _models import Block, TinyGPT


@pytest.mark.parametrize("text", ["IIG", "zero3", "zero++", "GGG+hpz+qwz+qgz", "p=pair,g=node,os=world",
                                  "NIG+qgz=int4+ef", "hsdp+cc", "GGG+qwz=int8:1024", "p=N,g=I,os=G+hpz=pair/node",
                                  "zero3+hpz"])
def test_str_round_trips(text):
    plan = ts.Plan.parse(text)
    assert ts.Plan.parse(str(plan)) == plan


def test_presets_are_the_known_placements():
    expect = {"ddp": "NNN", "zero1": "NNG", "zero2": "NGG", "zero3": "GGG", "hsdp": "III",
              "zero++": "GGG+hpz+qwd+qgz"}
    for preset, code in expect.items():
        assert str(ts.Plan.parse(preset)) == code
    assert ts.Plan.parse("IIG") == ts.Plan(p="I", g="I", os="G")
    assert len(set(all_placements())) == 27


@pytest.mark.parametrize("text, fragment", [
    ("zero4", "unknown plan"), ("IXG", "unknown plan"), ("GGG+fast", "unknown plan option"),
    ("GGG+qwz=int3", "unknown qwz codec"), ("p=G,g=G", "lacks os"), ("GGG+ef", "must follow qgz"),
    ("GGG+qwz=int8+ef", "must follow qgz"), ("", "empty plan")])
def test_bad_plans_name_the_fix(text, fragment):
    with pytest.raises(ts.PlanError, match=fragment):
        ts.Plan.parse(text)


@pytest.mark.parametrize("text, fragment", [
    ("p=rack,g=G,os=G", "unknown level 'rack'"), ("NNN+qwz", "replicated and never gathered"),
    ("IIG+hpz=world", "strictly inside"), ("NNN+qgz", "plain all-reduce")])
def test_plans_that_do_not_fit_the_topology(text, fragment):
    with pytest.raises(ts.PlanError, match=fragment):
        ts.Plan.parse(text).resolve(ts.Topology((2, 4)))


def test_level_I_needs_two_tiers():
    with pytest.raises(ts.PlanError, match="single tier"):
        ts.Plan.parse("IIG").resolve(ts.Topology((4,)))


def test_topology_validation():
    with pytest.raises(ts.TopologyError, match="does not divide"):
        ts.Topology((3, 4))
    with pytest.raises(ts.TopologyError, match="distinct"):
        ts.Topology((2, 4), names=("node", "node"))
    topo = ts.Topology((2, 4, 8))
    assert topo.names == ("pair", "node", "world")
    assert [topo.level_of(x) for x in ("N", "pair", "I", "G")] == [0, 1, 2, 3]


def test_ownership_map_nests_finer_shards_inside_coarser():
    """[Note: ownership map]: a rank's chunk at a finer level lies inside its chunk at every coarser level."""
    topo = ts.Topology((2, 4, 8))
    S = 8 * 3
    for rank in range(8):
        ranges = []
        for level in range(topo.num_levels):
            size = S // topo.level_size(level)
            start = topo.chunk_index(rank, level) * size
            ranges.append((start, start + size))
        for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
            assert a0 <= b0 and b1 <= a1, (rank, ranges)
    # every level's chunks are owned exactly once inside each group
    for level in range(topo.num_levels):
        for rank in range(8):
            owners = sorted(topo.chunk_index(r, level) for r in topo.group_ranks(rank, level))
            assert owners == list(range(topo.level_size(level)))


def test_tier_of_link():
    topo = ts.Topology((2, 4, 8))
    assert topo.tier_of_link(0, 1) == "pair"
    assert topo.tier_of_link(1, 2) == "node"
    assert topo.tier_of_link(3, 4) == "world"


def test_shard_before_init_process_group():
    with pytest.raises(ts.TopologyError, match="init_process_group"):
        ts.shard(TinyGPT(), "GGG", ts.Topology((2, 4)), wrap={Block})


def _wrong_world(rank, world):
    try:
        ts.shard(TinyGPT(), "GGG", ts.Topology((2, 8)), wrap={Block})
    except ts.TopologyError as err:
        return str(err)
    return None


def test_topology_that_does_not_match_the_world():
    messages = run_ranks(_wrong_world, 2)
    assert all(m and "covers 8 ranks but the world has 2" in m for m in messages), messages


def test_error_feedback_only_for_gradients():
    with pytest.raises(ts.PlanError, match="error feedback"):
        ts.Plan(qwz="int8+ef")


def _load_cases(rank, world):
    torch.manual_seed(0)
    model = ts.shard(TinyGPT(), "GGG", ts.Topology((2, world)), wrap={Block})
    before = ts.full_state_dict(model)
    new = {k: v + 1 for k, v in before.items()}
    out = {}
    partial = {k: v for k, v in new.items() if k != "ln_f.weight"}
    for strict, state, key in ((True, partial, "missing"), (True, {**new, "ln_f.weight": torch.ones(3)}, "shape")):
        try:
            ts.load_full_state_dict(model, state, strict=strict)
            out[key] = None
        except (KeyError, ValueError) as err:
            out[key] = str(err)
    out["untouched"] = all(torch.equal(v, before[k]) for k, v in ts.full_state_dict(model).items())
    ts.load_full_state_dict(model, partial, strict=False)
    after = ts.full_state_dict(model)
    out["partial_ok"] = torch.equal(after["ln_f.weight"], before["ln_f.weight"]) and all(
        torch.equal(after[k], new[k]) for k in partial)
    return out


def test_load_full_state_dict_errors_and_partial_load():
    for res in run_ranks(_load_cases, 2):
        assert "missing ['ln_f.weight']" in res["missing"], res
        assert "ln_f.weight: shape (3,)" in res["shape"], res
        assert res["untouched"], "a rejected state dict must leave the model as it was"
        assert res["partial_ok"], res


# ---- per-hop qgz specs and plan quality ([Note: qgz specs] in plan.py) ------------------------------------------
@pytest.mark.parametrize("text, shown", [
    ("GGG+qgz=8/4", "GGG+qgz=8/4"), ("IIG+qgz=int8:128:h/int4:128:h:sr", "IIG+qgz"),
    ("IIG+qgz=int8:128:h/int4:128:h", "IIG+qgz=int8:128:h/int4:128:h"), ("zero++", "GGG+hpz+qwd+qgz"),
    ("NIG+qgz=int8:64:h/int4:32:h:sr+ef", "NIG+qgz=int8:64:h/int4:32:h:sr+ef"), ("GGG+qgz+ef", "GGG+qgz+ef"),
    ("GGG+qgz=int4", "GGG+qgz=int4"), ("GGG+qgz=4:h", "GGG+qgz=4:h")])
def test_per_hop_qgz_specs_round_trip(text, shown):
    plan = ts.Plan.parse(text)
    assert str(plan) == shown and ts.Plan.parse(shown) == plan


def test_bare_qgz_is_the_per_hop_default():
    assert ts.Plan.parse("GGG+qgz").qgz == ts.plan.QGZ_DEFAULT == "int8:128:h/int4:128:h:sr"
    assert ts.Plan.parse("zero++").qgz == ts.plan.QGZ_DEFAULT
    assert ts.Plan.parse("GGG+qgz=int4").qgz == "int4"          # int4 on every hop, as before
    # tiers: the last entry is the outermost tier, the first repeats for the inner tiers not named
    three, one = ts.Topology((2, 4, 8)), ts.Topology((8,))
    assert ts.Plan.parse("GGG+qgz=8/4").resolve(three).qgz_spec == "8/8/4"
    assert ts.Plan.parse("GGG+qgz=8/4+ef").qgz_hops(3) == ("8", "8", "4")
    assert ts.Plan.parse("GGG+qgz=4").qgz_hops(3) == ("4", "4", "4")
    assert ts.Plan.parse("GGG+qgz").resolve(one).qgz_spec == "int4:128:h:sr"   # the default's outermost entry
    assert ts.Plan.parse("GGG").resolve(three).qgz_spec is None


@pytest.mark.parametrize("text, fragment", [
    ("GGG+qgz=int3", "unknown qgz codec 'int3'.*e.g. qgz=8/4"), ("GGG+qgz=int4:0", "positive integer"),
    ("GGG+qgz=8//4", "joined by '/'"), ("GGG+qgz=int4:h:h", "each at most once"), ("GGG+qgz=int4+ef+ef", "twice"),
    ("GGG+qgz=int8:h:128", "unknown qgz codec")])
def test_bad_qgz_specs_name_the_fix(text, fragment):
    with pytest.raises(ts.PlanError, match=fragment):
        ts.Plan.parse(text)


def test_a_qgz_list_longer_than_the_tiers_fails_at_resolve():
    plan = ts.Plan.parse("GGG+qgz=8/8/4")                     # a valid text: it fits three tiers
    assert plan.resolve(ts.Topology((2, 4, 8))).qgz_spec == "8/8/4"
    with pytest.raises(ts.PlanError, match="names 3 codecs but the topology has 2 tier.*at most 2"):
        plan.resolve(ts.Topology((4, 8)))


def test_plans_say_whether_they_are_lossy():
    two = ts.Topology((4, 8))
    assert not ts.Plan.parse("IIG").lossy and ts.Plan.parse("IIG").quality(two) == "exact"
    assert ts.Plan.parse("GGG+hpz+cc").quality() == "exact"
    assert ts.Plan.parse("GGG+qwz").lossy and ts.Plan.parse("NIG+qgz=int4").lossy
    assert ts.Plan.parse("zero++").quality(two) == \
        "lossy: weights int4 differences, gradients int8 (node) / int4 (world)"
    assert ts.Plan.parse("zero++").quality() == "lossy: weights int4 differences, gradients int8/int4"
    assert ts.Plan.parse("NIG+qgz=int4+ef").quality(two) == "lossy: gradients int4 +ef"
    # only the tiers the quantized reductions cross count: IIG+qgz reduce-scatters over node, then world (g < os)
    assert ts.Plan.parse("IIG+qgz=8/4").quality(ts.Topology((2, 4, 8))) == \
        "lossy: gradients int8 (pair, node) / int4 (world)"
    assert ts.Plan.parse("IIN+qgz=8/4").quality(ts.Topology((2, 4, 8))) == "lossy: gradients int8"   # no world hop


SPECS = ["int8", "int4", "8", "4", "int8:128", "int4:128:h", "int4:128:h:sr", "int8:h", "4:sr", "8/4",
         "int8:128:h/int4:128:h", "int8/int8/int4", "int3", "int4:0", "int4:sr:h", "int4:h:h", "8//4", "int8:h:128",
         "", "int8:"]


def test_plan_grammar_agrees_with_the_codec_parser():
    """plan.py checks qgz specs with one regex; the codec layer parses them at run time: both accept the same."""
    codecs = pytest.importorskip("tiershard.comm.codecs")
    if not hasattr(codecs, "hop_codecs"):
        pytest.skip("the codec layer has no hop_codecs (per-hop qgz codecs) yet")
    for spec in SPECS:
        try:
            plan = ts.Plan(qgz=spec)
        except ts.PlanError:
            plan = None
        try:
            hops = codecs.hop_codecs(spec, 3)
        except ValueError:
            hops = None
        assert (plan is None) == (hops is None), spec
        if plan is not None:        # and map a list onto the tiers alike
            assert [c.spec for c in codecs.hop_codecs(plan.resolve(ts.Topology((2, 4, 8))).qgz_spec, 3)] == \
                [c.spec for c in hops], spec


def test_qwd_plans_round_trip_and_refuse_what_cannot_work():
    from tiershard.plan import Plan, PlanError

    topo = ts.Topology((2, 4))
    for text in ("GGG+hpz+qwd", "GGG+hpz+qwd=int4:512+qgz", "GGG+hpz+qwd=int8+qgz=8/4+ef"):
        plan = Plan.parse(text)
        assert str(plan) == text and Plan.parse(str(plan)) == plan and plan.lossy
    assert Plan.parse("GGG+hpz+qwd").qwd == "int4:2048"
    assert Plan.parse("GGG+hpz+qwd").quality(topo) == "lossy: weights int4 differences"
    for text, words in (("GGG+qwd", "no hpz"), ("GGG+hpz+qwz+qwd", "keep one"), ("NGG+hpz+qwd", "hpz level"),
                        ("GGG+hpz+qwd=int2", "unknown qwd codec")):
        with pytest.raises(PlanError, match=words):
            Plan.parse(text).resolve(topo)


@pytest.mark.parametrize("tp, fragment", [(0, "tp=0 must be a positive whole number"),
                                          ("2", "tp='2' must be a positive whole number"),
                                          (True, "tp=True must be a positive whole number")])
def test_tp_degree_errors(tp, fragment):
    with pytest.raises(ts.TopologyError, match=fragment):
        ts.Topology((2, 4), tp=tp)


def test_tp_arithmetic():
    """TP groups are tp adjacent ranks; the tiers count TP groups and run within one TP coordinate."""
    topo = ts.Topology((2, 4), tp=2)
    assert (topo.num_ranks, topo.world_size, topo.tp_ranks(5)) == (8, 4, (4, 5))
    assert topo.group_ranks(5, 1) == (5, 7) and topo.group_ranks(5, 2) == (1, 3, 5, 7)
    assert topo.tier_of_link(4, 5) == "node" and topo.tier_of_link(1, 5) == "world"
    assert repr(topo).endswith("tp=2)") and topo != ts.Topology((2, 4))


def test_tp_across_nodes_errors(monkeypatch):
    """TP runs inside the node: a TP group over two hosts, or a tp that does not divide the node, names the fix."""
    with pytest.raises(ts.TopologyError, match=r"tensor-parallel group of ranks 0-1 .* spans hosts 'a', 'b': "
                                               "tensor parallelism runs inside a node"):
        ts.Topology((1, 4), tp=2).check_hosts(list("abcdefgh"))
    ts.Topology((2, 4), tp=2).check_hosts(["a"] * 4 + ["b"] * 4)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("TIERSHARD_TOPOLOGY", raising=False)
    assert ts.Topology.from_env(tp=2) == ts.Topology((2, 4), tp=2)
    with pytest.raises(ts.TopologyError, match="tp=8 does not divide the 4 ranks of a node"):
        ts.Topology.from_env(tp=8)
    with pytest.raises(ts.TopologyError, match="has no tensor parallelism: declare it"):
        ts.Topology((2, 4)).tp_mesh
