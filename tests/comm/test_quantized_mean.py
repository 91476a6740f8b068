"""The quantized collectives return the exact result within a bound derived from the codec's bits and the block
absmax, on every rank: qgZ's reduce-scatter (one codec per tier) against the exact sum, qwZ's gather against the
exact gather. Stochastic rounding is unbiased (the mean over many seeds approaches the exact sum, nearest rounding's
does not) and reproducible (the same seed gives the same bits). One launch of 4 ranks, Topology((2, 4)).

The bound. One encoding errs, per value of a (rotated) block b, by at most ``step * s_b`` with ``s_b = absmax_b /
qmax`` (the block's scale, absmax taken after the rotation) and ``step`` = 1/2 (round half to even) or 1
(stochastic); the rotation is orthogonal on each 32-value group, so a chunk's error has
``||e||_2 <= step * sqrt(sum_b m_b * s_b**2)`` (m_b <= block values in block b) whether rotated or not. A rank's n
output values of a reduce-scatter over tier 1 (groups G1) then tier 2 (its group G2) carry the hop-2 errors of the
chunks the members r2 of G2 sent it, and the hop-1 errors of the chunks the members r1 of G1(r2) sent each r2:

    ||q - exact||_2 <= step2 * sum_{r2 in G2} sqrt(sum_b m_b s2_b(r2)**2)
                       + step1 * sum_{r2 in G2} sum_{r1 in G1(r2)} sqrt(sum_b m_b s1_b(r1 -> r2)**2)

where s1(r1 -> r2) are the scales of the chunk r1 encodes for r2 from its input, and s2(r2) those of the chunk r2
encodes for this rank from its hop-1 result (re-encoded here from the hop-1 results every rank shares; the scales do
not depend on the seed). A gather chunk is one encoding: ``||q - exact||_2 <= step * sqrt(sum_b m_b s_b**2)``.
"""
from __future__ import annotations

import math

import torch

from _dist import run_ranks

SR_RUNS = 64
RS_SPECS = ["int4", "int8", "int8:128:h/int4:128:h", "int8:128:h:sr/int4:128:h:sr", "int4:sr"]
GATHER_SPECS = ["int4", "int8", "int8:128:h", "int4:128:h", "int8:128:h:sr", "int4:128:h:sr"]
# (name, real values, rows x segments or None): odd sizes, sizes not divisible by the block or the world
CASES = [("1d-odd", 4003, None), ("2d", 12, (37, 64, 6)), ("2d-wide", 8, (203,))]


def _inputs(case, rank: int, world: int, same: bool) -> tuple[torch.Tensor, tuple | None, int]:
    """Every rank's buffer (padded with zeros to a multiple of the world), its segments and its real length."""
    name, size, segments = case
    numel = size * sum(segments) if segments else size
    padded = -(-numel // world) * world

    def one(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(11 if same else 100 + r)
        x = torch.randn(numel, generator=g) * (1 if same else r + 1)
        x[torch.randint(0, numel, (max(1, numel // 500),), generator=g)] *= 20     # gradient-like outliers
        return torch.nn.functional.pad(x, (0, padded - numel))
    return torch.stack([one(r) for r in range(world)]), segments, numel


def _step(codec) -> float:
    return 1.0 if codec.stochastic else 0.5


def _chunk_bound(codec, x: torch.Tensor, group, member: int, segments) -> float:
    """step * sqrt(sum_b m_b s_b**2) for the chunk ``x`` (a rank's hop input) encodes for ``group.ranks[member]``."""
    k = group.size
    n = x.numel() // k
    wire = codec.encode_wire(x, k, order=list(group.slots), segments=segments, seed=0)
    scales = wire.view(k, -1)[member, codec.padded_payload_bytes(n):].contiguous().view(torch.float32).double()
    return _step(codec) * math.sqrt(min(codec.block, n) * (scales ** 2).sum().item())


def _rs_bound(codecs, xs: torch.Tensor, ys: torch.Tensor, topo, rank: int, segments) -> float:
    """The formula of the module docstring; ``ys`` holds every rank's hop-1 result."""
    g2 = topo.group_for(rank, 1, 2)
    total = 0.0
    for r2 in g2.ranks:
        total += _chunk_bound(codecs[1], ys[r2], g2, g2.ranks.index(rank), segments)
        g1 = topo.group_for(r2, 0, 1)
        for r1 in g1.ranks:
            total += _chunk_bound(codecs[0], xs[r1], topo.group_for(r1, 0, 1), g1.ranks.index(r2), segments)
    return total


def _check(rank, world, sizes):
    import torch.distributed as dist

    import tiershard as ts
    from tiershard.comm import collectives as C
    from tiershard.comm import quantized
    from tiershard.comm.codecs import codec_from_spec, hop_codecs

    topo = ts.Topology(sizes)
    topo.init_process_groups()
    hops = [topo.group_for(rank, k - 1, k) for k in (1, 2)]
    own = topo.chunk_index(rank, 2)
    out = {"rs": [], "gather": [], "sr": {}}
    # reduce-scatter against the exact sum, identical and different inputs, every case and codec list
    for spec in RS_SPECS:
        codecs = hop_codecs(spec, 2)
        reduce = quantized.QuantizedReduceScatter(codecs, seed=5)
        for case in CASES:
            for same in (True, False):
                xs, segments, _ = _inputs(case, rank, world, same)
                n = xs.shape[1] // world
                exact = xs.double().sum(0).view(world, n)[own]
                got = reduce(xs[rank], hops, topo, "test", key=(case[0], same), segments=segments)
                # the hop-1 results: a fresh reducer with the same seed and key draws the same hop-1 stream
                hop1 = quantized.QuantizedReduceScatter(codecs, seed=5)(xs[rank], hops[:1], topo, "test",
                                                                        key=(case[0], same), segments=segments)
                ys = torch.empty(world * hop1.numel()).view(world, -1)
                dist.all_gather_into_tensor(ys.view(-1), hop1)
                err = (got.double() - exact).norm().item()
                bound = _rs_bound(codecs, xs, ys, topo, rank, segments) + 1e-5 * exact.norm().item()
                out["rs"].append((spec, case[0], same, err, bound, exact.norm().item()))
    # stochastic rounding: unbiased over many calls (each call its own seed), reproducible per seed
    xs, segments, _ = _inputs(CASES[1], rank, world, False)
    n = xs.shape[1] // world
    exact = xs.double().sum(0).view(world, n)[own]
    for spec in ("int8:128:h:sr/int4:128:h:sr", "int8:128:h/int4:128:h"):
        reduce = quantized.QuantizedReduceScatter(hop_codecs(spec, 2), seed=1)
        runs = torch.stack([reduce(xs[rank], hops, topo, "test", key="sr", segments=segments).double() - exact
                            for _ in range(SR_RUNS)])
        out["sr"][spec] = ((runs.mean(0)).norm().item(), runs.norm(dim=1).pow(2).mean().sqrt().item())
    one = [quantized.QuantizedReduceScatter(hop_codecs("int4:128:h:sr", 2), seed=s)(
        xs[rank], hops, topo, "test", key="k", segments=segments) for s in (7, 7, 8)]
    out["same_seed"] = (torch.equal(one[0], one[1]), not torch.equal(one[0], one[2]))
    # a checkpoint of the call counters and residuals resumes the same sequence of seeds and corrections
    codecs = hop_codecs("int8:128:h:sr/int4:128:h:sr", 2)
    ef = quantized.QuantizedReduceScatter(codecs, error_feedback=True, seed=3)
    for _ in range(2):
        ef(xs[rank], hops, topo, "test", key="u", segments=segments)
    resumed = quantized.QuantizedReduceScatter(codecs, error_feedback=True, seed=3)
    resumed.load_state_dict(ef.state_dict())
    after, again = (r(xs[rank], hops, topo, "test", key="u", segments=segments) for r in (ef, resumed))
    fresh = quantized.QuantizedReduceScatter(codecs, error_feedback=True, seed=3)(xs[rank], hops, topo, "test",
                                                                                   key="u", segments=segments)
    out["resume"] = (torch.equal(after, again), not torch.equal(after, fresh), ef.residual_bytes(),
                     4 * (xs.shape[1] + xs.shape[1] // 2), ef.state_dict()["counters"])
    # the pipelined wavefront uses each hop's own codec: the same bits as the hops in turn
    wide = (6000, 7, 5000, 12, 4000, 64, 2500, 1, 3000)
    buf = torch.randn(world * sum(wide), generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    reduce = quantized.QuantizedReduceScatter(hop_codecs("int8:128:h/int4:128:h", 2))
    pipelined = reduce(buf, hops, topo, "test", segments=wide)
    quantized.PIPELINE_CHUNKS, saved = 1, quantized.PIPELINE_CHUNKS
    try:
        sequential = reduce(buf, hops, topo, "test", segments=wide)
    finally:
        quantized.PIPELINE_CHUNKS = saved
    out["pipeline"] = (len(quantized.pipeline_chunks(wide)), torch.equal(pipelined, sequential))
    # qwZ gather against the exact gather
    group = topo.group_for(rank, 0, 2)
    for spec in GATHER_SPECS:
        codec = codec_from_spec(spec)
        gather = quantized.QuantizedGather(codec)
        for case in CASES:
            xs, _, _ = _inputs(case, rank, world, False)
            shard = xs[rank][:xs.shape[1] // world]           # this rank's level-2 shard
            n = shard.numel()
            exact = torch.empty(world * n)
            C.all_gather(exact, shard, group, topo, "test")
            wire = gather.gather(gather.encode(shard, seed=rank), group, world, n, topo, "test")
            got = torch.empty(world * n)
            gather.decode(wire, world, n, got)
            for c in range(world):
                e, g = exact.view(world, n)[c], got.view(world, n)[c]
                scales = codec.encode(e, seed=0).scales.double()
                bound = _step(codec) * math.sqrt(min(codec.block, n) * (scales ** 2).sum().item()) + 1e-6
                out["gather"].append((spec, case[0], c, (g - e).double().norm().item(), bound, e.norm().item()))
    # the exact gather itself (on gloo a ring received into the slots) against gloo's own, placed by slot, on
    # every group, from a shard that is not contiguous
    import torch.distributed as dist
    out["ring_gather"] = []
    for inner, outer in ((0, 1), (1, 2), (0, 2)):
        group = topo.group_for(rank, inner, outer)
        src = (torch.arange(100, dtype=torch.float32) + 1000 * rank).view(50, 2)[:, 0]
        ring, by_rank = torch.full((group.size * 50,), -1.0), torch.empty(group.size * 50)
        C.all_gather(ring, src, group, topo, "test")
        dist.all_gather_into_tensor(by_rank, src.contiguous(), group=group.pg)
        want = torch.empty_like(by_rank)
        want.view(group.size, -1)[torch.tensor(group.slots)] = by_rank.view(group.size, -1)
        out["ring_gather"].append((group.size, group.backend, torch.equal(ring, want)))
    codec = codec_from_spec("int4:128:h:sr")
    shard = _inputs(CASES[0], rank, world, False)[0][rank][:1001]
    gather = quantized.QuantizedGather(codec)
    mean = sum(codec.decode_wire(gather.encode(shard, seed=s), 1, 1001) for s in range(SR_RUNS)) / SR_RUNS
    single = codec.decode_wire(gather.encode(shard, seed=0), 1, 1001)
    out["gather_sr"] = ((mean - shard).norm().item(), (single - shard).norm().item(),
                        torch.equal(gather.encode(shard, seed=3), gather.encode(shard, seed=3)))
    return out


def test_quantized_collectives_equal_the_exact_result_within_the_bit_bound():
    results = run_ranks(_check, 4, (2, 4))
    for rank, res in enumerate(results):
        assert len(res["rs"]) == len(RS_SPECS) * len(CASES) * 2
        for spec, case, same, err, bound, norm in res["rs"]:
            assert 0 < err <= bound, (rank, spec, case, same, err, bound)
        for spec, case, chunk, err, bound, norm in res["gather"]:
            assert 0 < err <= bound, (rank, spec, case, chunk, err, bound)
        # stochastic rounding: the mean of SR_RUNS errors shrinks like 1/sqrt(runs); nearest rounding's does not
        bias, rms = res["sr"]["int8:128:h:sr/int4:128:h:sr"]
        assert bias < 3 * rms / math.sqrt(SR_RUNS), (rank, bias, rms)
        bias, rms = res["sr"]["int8:128:h/int4:128:h"]
        assert bias > 0.9 * rms, (rank, bias, rms)
        assert res["same_seed"] == (True, True), rank
        mean_err, one_err, same_bits = res["gather_sr"]
        assert mean_err < 3 * one_err / math.sqrt(SR_RUNS) and same_bits, (rank, mean_err, one_err)
        runs, same = res["pipeline"]
        assert runs > 1 and same, (rank, runs)
        assert [size for size, _, _ in res["ring_gather"]] == [2, 2, 4], res["ring_gather"]
        assert all(backend == "gloo" and same for _, backend, same in res["ring_gather"]), res["ring_gather"]
        same, differs, held, expected, counters = res["resume"]
        assert same and differs and held == expected and counters == {"'u'": 3}, (rank, res["resume"])


def test_reduce_scatter_arguments_are_checked_before_use():
    import pytest

    from tiershard.comm.codecs import INT4, INT8
    from tiershard.comm.quantized import QuantizedReduceScatter

    with pytest.raises(ValueError, match="non-empty sequence"):
        QuantizedReduceScatter([])
    two = QuantizedReduceScatter([INT8, INT4])
    assert two.codec_for(1) == INT8 and two.codec_for(2) == INT4 and QuantizedReduceScatter(INT4).codec_for(5) == INT4
    with pytest.raises(ValueError, match="no codec for the hop over tier 3: 2 codecs"):
        two.codec_for(3)
    with pytest.raises(ValueError, match="exactly the keys"):
        two.load_state_dict({"counters": {}})
    with pytest.raises(ValueError, match="error_feedback=False"):
        two.load_state_dict({"counters": {}, "residuals": {"k@1": torch.zeros(2)}})
    assert two.state_dict() == {"counters": {}, "residuals": {}} and two.residual_bytes() == 0
