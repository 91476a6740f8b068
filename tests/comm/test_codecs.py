"""Block codecs: error bound, exact layout against a loop reference, zero/non-finite handling, sizes, chunked decode,
the wire format (flat and with a row layout of segments), and the fused CPU and Triton kernels against the torch
reference, bit for bit."""
from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tiershard.comm.codecs import backends, native
from tiershard.comm.codecs import DEFAULT_BLOCKS, INT4, INT8, BlockCodec, Encoded, codec_from_spec, same_bits

CODECS = [INT8, INT4, BlockCodec(8, 100), BlockCodec(4, 37)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HAVE_CC = native._compiler() is not None


def _sizes(block: int) -> list[int]:
    return [1, 7, block - 1, block + 1, 3 * block + 5]


def _per_element_scale(codec: BlockCodec, scales: torch.Tensor, n: int) -> torch.Tensor:
    return scales.repeat_interleave(codec.block)[:n]


def _reference(codec: BlockCodec, x: torch.Tensor) -> tuple[list[int], list[float]]:
    """Block-by-block loop with explicit byte packing: the layout the module docstring promises."""
    x = x.reshape(-1).float()
    qs: list[int] = []
    scales: list[float] = []
    for start in range(0, x.numel(), codec.block):
        blk = x[start:start + codec.block]
        s = blk.abs().max() / codec.qmax
        scales.append(float(s))
        q = torch.round(blk / s) if s > 0 else torch.zeros_like(blk)
        qs += [int(v) for v in q.clamp(-codec.qmax, codec.qmax)]
    if codec.bits == 8:
        return qs, scales
    if len(qs) % 2:
        qs.append(0)
    return [(qs[i] + 8) | ((qs[i + 1] + 8) << 4) for i in range(0, len(qs), 2)], scales


@pytest.fixture
def reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the codecs on the plain torch path, as on a machine where the kernels cannot be built."""
    monkeypatch.setattr(backends, "_force_reference", True)


@pytest.fixture(params=["default", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test on the default backend (the C kernels where a compiler exists) and on the plain torch path."""
    if request.param == "torch":
        monkeypatch.setattr(backends, "_force_reference", True)
    return request.param


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_within_half_step(backend: str, codec: BlockCodec, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(codec.bits * 1000 + codec.block)
    for n in _sizes(codec.block) + [100_003]:
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        enc = codec.encode(x)
        xf = x.float()
        # scales are exactly absmax / qmax per block
        ref_scales = xf[: n // codec.block * codec.block].view(-1, codec.block).abs().amax(1)
        if n % codec.block:
            ref_scales = torch.cat([ref_scales, xf[n // codec.block * codec.block:].abs().amax().view(1)])
        assert torch.equal(enc.scales, ref_scales / codec.qmax)
        s = _per_element_scale(codec, enc.scales, n)
        for out_dtype in (torch.float32, dtype):
            err = (xf - codec.decode(enc, dtype=out_dtype).float()).abs()
            # fp32 output: half a step plus fp32 rounding; a 16-bit output adds its own half ulp of the value
            slack = s * codec.qmax * 2.0**-22 + (0 if out_dtype == torch.float32 else xf.abs() * 2.0**-8)
            assert torch.all(err <= s / 2 + slack), (n, out_dtype, float((err / s).max()))
        assert enc.numel == n


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_payload_matches_loop_reference(codec: BlockCodec) -> None:
    g = torch.Generator().manual_seed(7)
    for n in (1, 2, 7, codec.block + 1, 2 * codec.block + 3):
        x = torch.randn(n, generator=g)
        x[0] = 0.0
        enc = codec.encode(x)
        ref_payload, ref_scales = _reference(codec, x)
        assert enc.payload.dtype == codec.payload_dtype
        assert enc.payload.tolist() == ref_payload
        assert enc.scales.tolist() == ref_scales


def test_int4_nibble_layout_explicit(backend: str) -> None:
    codec = BlockCodec(4, 4)
    # block 0 absmax 7 -> scale 1: q = x; block 1 absmax 14 -> scale 2
    x = torch.tensor([1.0, -7.0, 0.0, 7.0, 14.0, -2.0, 3.0])
    enc = codec.encode(x)
    assert enc.scales.tolist() == [1.0, 2.0]
    q = [1, -7, 0, 7, 7, -1, 2, 0]  # 3.0 / 2 = 1.5 rounds half to even -> 2; last nibble is padding
    assert enc.payload.tolist() == [(q[i] + 8) | ((q[i + 1] + 8) << 4) for i in range(0, 8, 2)]
    assert codec.decode(enc).tolist() == [1.0, -7.0, 0.0, 7.0, 14.0, -2.0, 4.0]
    # the wire chunk: 4 payload bytes (already a multiple of 4), then the two scales' bytes
    wire = codec.encode_wire(x, 1)
    assert wire.numel() == codec.wire_bytes(7) == 4 + 8
    assert wire[:4].tolist() == enc.payload.tolist()
    assert wire[4:].view(torch.float32).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_exactly_representable_values_roundtrip_exactly(codec: BlockCodec) -> None:
    n = 2 * codec.block + 3
    q = torch.randint(-codec.qmax, codec.qmax + 1, (n,), generator=torch.Generator().manual_seed(1)).float()
    q[:: codec.block] = codec.qmax  # every block reaches +qmax, so scale = 0.25 exactly
    x = q * 0.25
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_blocks_decode_to_exact_zeros(backend: str, codec: BlockCodec, dtype: torch.dtype) -> None:
    b = codec.block
    zeros = torch.zeros(3 * b + 5, dtype=dtype)
    enc = codec.encode(zeros)
    assert torch.equal(enc.scales, torch.zeros(4))
    out = codec.decode(enc, dtype=dtype)
    assert torch.equal(out, zeros) and not torch.isnan(out).any()

    x = torch.randn(3 * b + 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[b:2 * b] = 0  # block 1 all zero, others not
    enc = codec.encode(x)
    assert enc.scales[1] == 0 and bool((enc.scales[[0, 2, 3]] > 0).all())
    dec = codec.decode(enc)
    assert not torch.isnan(dec).any()
    assert torch.equal(dec[b:2 * b], torch.zeros(b))
    s = _per_element_scale(codec, enc.scales, x.numel())
    assert torch.all((x.float() - dec).abs() <= s / 2 + s * codec.qmax * 2.0**-22)


@pytest.mark.parametrize("codec", [INT8, INT4], ids=lambda c: c.spec)
def test_subnormal_blocks_stay_finite(backend: str, codec: BlockCodec) -> None:
    x = torch.full((codec.block + 1,), 1e-44)  # absmax / qmax underflows towards zero
    x[1] = -3e-45
    dec = codec.decode(codec.encode(x))
    assert torch.isfinite(dec).all()
    assert torch.all((dec - x).abs() <= 1e-44)


@pytest.mark.parametrize("codec", [INT8, INT4, BlockCodec(4, 37)], ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_non_finite_blocks_decode_to_nan_and_spare_the_rest(backend: str, codec: BlockCodec, dtype: torch.dtype,
                                                            bad: float) -> None:
    b, n = codec.block, 3 * codec.block + 3
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(dtype)
    clean = codec.decode(codec.encode(x))
    for pos in (0, b + 2, n - 1):  # first block, a middle one, and the short last block
        y = x.clone()
        y[pos] = bad
        enc = codec.encode(y)  # no exception, no host sync
        j = pos // b
        assert torch.isnan(enc.scales[j]) and torch.isfinite(torch.cat([enc.scales[:j], enc.scales[j + 1:]])).all()
        dec = codec.decode(enc, dtype=dtype)
        lo, hi = j * b, min(n, (j + 1) * b)
        assert torch.isnan(dec[lo:hi]).all()
        others = torch.cat([dec[:lo], dec[hi:]])
        assert torch.equal(others, torch.cat([clean[:lo], clean[hi:]]).to(dtype))
        # the same through the wire format, with the poisoned chunk moved by the order, and through the sum
        k = 3
        z = torch.cat([y, x, x])
        wire = codec.encode_wire(z, k, order=[1, 0, 2])
        rows = codec.decode_wire(wire, k, n).view(k, n)
        assert torch.isnan(rows[1, lo:hi]).all() and not torch.isnan(rows[[0, 2]]).any()
        total = codec.decode_wire_sum(wire, k, n)
        assert torch.isnan(total[lo:hi]).all() and not torch.isnan(torch.cat([total[:lo], total[hi:]])).any()


def test_rejects_non_float_input() -> None:
    with pytest.raises(ValueError, match="float32"):
        INT8.encode(torch.arange(10))
    with pytest.raises(ValueError, match="float32"):
        INT8.encode_wire(torch.arange(10), 2)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_sizes_match_tensors(backend: str, codec: BlockCodec) -> None:
    for n in [0] + _sizes(codec.block):
        enc = codec.encode(torch.randn(n))
        payload_bytes = n if codec.bits == 8 else (n + 1) // 2
        assert codec.payload_numel(n) == enc.payload.numel() == payload_bytes
        assert codec.scales_numel(n) == enc.scales.numel() == math.ceil(n / codec.block)
        assert enc.payload.element_size() == 1 and enc.scales.dtype == torch.float32
        separate = enc.payload.numel() + enc.scales.numel() * 4
        # one wire chunk: the payload padded to 4 bytes, then the scales
        assert codec.padded_payload_bytes(n) == -(-payload_bytes // 4) * 4
        assert codec.wire_bytes(n) == codec.padded_payload_bytes(n) + 4 * enc.scales.numel()
        assert separate <= codec.wire_bytes(n) < separate + 4 and codec.wire_bytes(n) % 4 == 0
        assert codec.encode_wire(torch.randn(2 * n), 2).numel() == 2 * codec.wire_bytes(n)
        assert codec.decode(enc).numel() == n
    assert BlockCodec(4, 512).wire_bytes(1001) == 504 + 4 * 2
    assert INT4.wire_bytes(1001) == 504 + 4 * 16
    assert INT8.wire_bytes(2049) == 2052 + 4 * 2
    assert INT8.wire_bytes(2048) == 2048 + 4


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_decode_chunks_equals_individual_decodes(backend: str, codec: BlockCodec) -> None:
    k, n = 3, codec.block + 3  # ragged last block and, for int4, an odd byte count per chunk
    p, s = codec.payload_numel(n), codec.scales_numel(n)
    chunks = [torch.randn(n, generator=torch.Generator().manual_seed(10 + r)) * (r + 1) for r in range(k)]
    payload_all = torch.empty(k * p, dtype=codec.payload_dtype)
    scales_all = torch.empty(k * s)
    for r, c in enumerate(chunks):  # what each rank writes into its slice of the all-gather input
        codec.encode_into(c, payload_all[r * p:(r + 1) * p], scales_all[r * s:(r + 1) * s])
    singles = [codec.decode(codec.encode(c)) for c in chunks]
    assert torch.equal(codec.decode_chunks(payload_all, scales_all, k, n), torch.cat(singles))
    for r in range(k):
        assert torch.equal(codec.decode_from(payload_all[r * p:(r + 1) * p], scales_all[r * s:(r + 1) * s], n),
                           singles[r])
    out = torch.empty(k * n, dtype=torch.bfloat16)
    res = codec.decode_chunks(payload_all, scales_all, k, n, out=out)
    assert res is out and torch.equal(out, torch.cat(singles).to(torch.bfloat16))
    with pytest.raises(ValueError, match="chunks"):
        codec.decode_chunks(payload_all[:-1], scales_all, k, n)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wire_roundtrip_with_order(backend: str, codec: BlockCodec, dtype: torch.dtype) -> None:
    k, n = 4, 2 * codec.block + 3
    g = torch.Generator().manual_seed(11)
    chunks = [(torch.randn(n, generator=g) * (r + 1)).to(dtype) for r in range(k)]
    x = torch.cat(chunks)
    order = [2, 0, 3, 1]  # all-to-all: member i receives chunk order[i]
    W = codec.wire_bytes(n)
    wire = torch.full((k * W,), 0xAB, dtype=torch.uint8)
    assert codec.encode_wire(x, k, wire, order=order) is wire
    P, P4 = codec.payload_numel(n), codec.padded_payload_bytes(n)
    for i, c in enumerate(order):  # row i is chunk order[i]'s own encoding, padding zeroed
        row = wire[i * W:(i + 1) * W]
        enc = codec.encode(chunks[c])
        assert torch.equal(row[:P], enc.payload.view(torch.uint8))
        assert torch.equal(row[P:P4], torch.zeros(P4 - P, dtype=torch.uint8))
        assert torch.equal(row[P4:].view(torch.float32), enc.scales)
    # an int tensor order gives the same bytes
    assert torch.equal(codec.encode_wire(x, k, order=torch.tensor(order)), wire)
    singles = [codec.decode(codec.encode(chunks[c])) for c in order]
    for out_dtype in DTYPES:
        out = torch.empty(k * n, dtype=out_dtype)
        assert codec.decode_wire(wire, k, n, out) is out
        assert same_bits(out, torch.cat(singles).to(out_dtype))
    # a non-contiguous out (a strided view) is filled in place
    big = torch.zeros(k * n, 2)
    codec.decode_wire(wire, k, n, big[:, 0])
    assert torch.equal(big[:, 0], torch.cat(singles)) and not big[:, 1].any()
    # the receive side of a quantized reduce-scatter: rows decoded and added in fp32, row 0 first
    total = codec.decode_wire_sum(wire, k, n)
    assert total.dtype == torch.float32 and same_bits(total, ((singles[0] + singles[1]) + singles[2]) + singles[3])
    with pytest.raises(ValueError, match="order"):
        codec.encode_wire(x, k, order=[0, 1, 2])
    with pytest.raises(ValueError, match="order"):
        codec.encode_wire(x, k, order=[0, 1, 2, 4])
    with pytest.raises(ValueError, match="wire"):
        codec.decode_wire(wire[:-1], k, n)
    with pytest.raises(ValueError, match="equal chunks"):
        codec.encode_wire(x[:-1], k)


def test_decode_dtype_and_out() -> None:
    x = torch.randn(5000)
    enc = INT8.encode(x.view(50, 100))  # any shape is flattened
    ref = INT8.decode(enc)
    assert torch.equal(INT8.decode(enc, dtype=torch.bfloat16), ref.to(torch.bfloat16))
    assert torch.equal(INT8.decode(enc, dtype=torch.float16), ref.to(torch.float16))
    out = torch.empty(50, 100, dtype=torch.float16)
    assert INT8.decode(enc, out=out) is out and torch.equal(out.view(-1), ref.to(torch.float16))
    with pytest.raises(ValueError, match="out"):
        INT8.decode(enc, out=torch.empty(4999))
    # non-contiguous input encodes in its logical order
    xt = x.view(50, 100).t()
    assert torch.equal(INT8.encode(xt).payload, INT8.encode(xt.contiguous()).payload)


def test_buffer_validation() -> None:
    x = torch.randn(100)
    int4 = BlockCodec(4, 512)
    with pytest.raises(ValueError, match="payload_out"):
        int4.encode_into(x, torch.empty(49, dtype=torch.uint8), torch.empty(1))
    with pytest.raises(ValueError, match="payload_out"):
        int4.encode_into(x, torch.empty(50, dtype=torch.int8), torch.empty(1))
    with pytest.raises(ValueError, match="scales_out"):
        int4.encode_into(x, torch.empty(50, dtype=torch.uint8), torch.empty(2))
    enc = INT8.encode(x)
    with pytest.raises(ValueError, match="payload must be"):
        INT8.decode(Encoded(enc.payload.view(torch.uint8), enc.scales, enc.numel))


def test_codec_from_spec() -> None:
    assert codec_from_spec("int8") == BlockCodec(8, DEFAULT_BLOCKS[8]) == INT8
    assert codec_from_spec("int4") == BlockCodec(4, DEFAULT_BLOCKS[4]) == INT4
    assert (DEFAULT_BLOCKS[8], DEFAULT_BLOCKS[4]) == (2048, 64)
    assert codec_from_spec("int8:4096") == BlockCodec(8, 4096)
    assert codec_from_spec("int4:64") == BlockCodec(4, 64)
    for c in CODECS:
        assert codec_from_spec(c.spec) == c
    for bad in ["int8+ef", "int2", "fp8", "int8:", "int8:0", "int4:-1", "INT8", "", "int8:abc", "int4:64:2", None]:
        with pytest.raises(ValueError, match="valid specs"):
            codec_from_spec(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bits"):
        BlockCodec(2, 64)
    with pytest.raises(ValueError, match="block"):
        BlockCodec(8, 0)


def test_measured_error_int8_below_int4_and_bounded() -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))

    def rel(codec: BlockCodec) -> float:
        return float((x - codec.decode(codec.encode(x))).norm() / x.norm())

    e8, e4 = rel(INT8), rel(BlockCodec(4, 512))
    # Uniform rounding error: rel ~ absmax / (qmax * sqrt(12)) with absmax ~ 3.5 sigma per block,
    # i.e. ~0.008 for int8 at block 2048 and ~0.13 for int4 at block 512 (measured 0.0083 and 0.135 on 4M values).
    assert e8 < 0.01
    assert 0.10 < e4 < 0.16
    assert e8 * 10 < e4
    assert rel(INT4) < e4   # the default int4 block (64) is finer, so more accurate
    # on the same block size, more bits are strictly better
    assert rel(BlockCodec(8, 512)) * 10 < rel(BlockCodec(4, 512))


# ---- fused kernels against the reference path --------------------------------------------------------------

def _awkward(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values that exercise every corner: spread magnitudes, exact half-step ties, zero blocks, a nan, an inf,
    subnormals, and values near the dtype's largest finite one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)
    if n > 64:
        x[5:40] = torch.arange(35, dtype=torch.float32) * 0.125 - 2.0   # k + 0.5 steps once the scale is 0.25
        x[40] = 127 * 0.25
        x[50:60] = 0.0
    if n > 300:
        x[64:100] = 0.0
        x[128:192] = 1e-41 * torch.randn(64, generator=g)  # a whole block of 64 subnormals: a subnormal scale
        x[200] = float("nan")
        x[250] = float("inf")
        x[290] = torch.finfo(dtype).max * 0.999
    return x.to(dtype)


def _encode_both(codec: BlockCodec, x: torch.Tensor, k: int, order, monkeypatch) -> tuple:
    n = x.numel() // k
    fused = codec.encode_wire(x, k, order=order)
    with monkeypatch.context() as m:
        m.setattr(backends, "_force_reference", True)
        ref = codec.encode_wire(x, k, order=order)
        ref_dec = {d: codec.decode_wire(ref, k, n, dtype=d) for d in DTYPES}
        ref_sum = codec.decode_wire_sum(ref, k, n)
    return fused, ref, ref_dec, ref_sum


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the codecs run on the reference path only")
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_kernels_equal_reference_bit_for_bit(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = [(INT8, 3, 5000), (INT4, 4, 1001), (BlockCodec(4, 37), 3, 777), (BlockCodec(8, 100), 2, 999),
                 (BlockCodec(4, 96), 2, 515), (BlockCodec(8, 16), 1, 33), (BlockCodec(4, 5000), 2, 12001),
                 (BlockCodec(8, 1), 2, 9), (BlockCodec(4, 1), 2, 9), (INT4, 2, 40000)]  # the last: > 64K values
        for i, (codec, k, n) in enumerate(cases):
            for dtype in DTYPES:
                x = _awkward(k * n, dtype, seed=i)
                order = list(reversed(range(k)))
                fused, ref, ref_dec, ref_sum = _encode_both(codec, x, k, order, monkeypatch)
                assert torch.equal(fused, ref), (codec, k, n, dtype)
                for out_dtype in DTYPES:
                    assert same_bits(codec.decode_wire(fused, k, n, dtype=out_dtype), ref_dec[out_dtype]), \
                        (codec, n, dtype, out_dtype)
                assert same_bits(codec.decode_wire_sum(fused, k, n), ref_sum), (codec, n, dtype)
                # the separate payload / scales API goes through the same kernels
                enc = codec.encode(x)
                with monkeypatch.context() as m:
                    m.setattr(backends, "_force_reference", True)
                    enc_ref = codec.encode(x)
                    dec_ref = codec.decode(enc_ref, dtype=dtype)
                assert torch.equal(enc.payload, enc_ref.payload) and same_bits(enc.scales, enc_ref.scales)
                assert same_bits(codec.decode(enc, dtype=dtype), dec_ref)
    finally:
        torch.set_num_threads(before)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return set()


_AVX512 = {"avx512f", "avx512bw", "avx512vl"} <= _cpu_flags()


def _random_cases(seed: int, count: int):
    """``count`` random encodes of the rotated and stochastic formats: (codec, x, k, n, order, segments, key), with
    block sizes that leave tails of every kind, odd row layouts, bf16 / fp16 / fp32 input, nans, infinities, zeros
    and scales from 1e-30 to 1e30."""
    import random

    rng = random.Random(seed)
    for _ in range(count):
        rotate, stochastic = rng.choice([(True, False), (True, True), (False, True)])
        codec = BlockCodec(rng.choice([4, 8]), rng.choice([32, 37, 64, 96, 100, 128, 160, 2048]), rotate=rotate,
                           stochastic=stochastic)
        k, dtype = rng.choice([1, 2, 3, 8]), rng.choice(DTYPES)
        segments = None
        if rng.random() < 0.4:
            segments = tuple(rng.choice([1, 2, 5, 32, 33, 64, 96, 200, 256]) for _ in range(rng.randint(1, 6)))
            n = sum(segments) * rng.randint(1, 3)
        else:
            n = rng.randint(1, 3000)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        x = torch.randn(k * n, generator=g) * 10.0 ** rng.uniform(-30, 30 if dtype is torch.float32 else 3)
        if rng.random() < 0.3:
            x[rng.randrange(k * n)] = rng.choice([float("nan"), float("inf"), -float("inf")])
        if rng.random() < 0.2:
            x[: k * n // 2] = 0.0
        order = list(range(k))
        rng.shuffle(order)
        yield codec, x.to(dtype), k, n, order, segments, rng.randrange(1 << 64) if stochastic else None


def _equal_reference(cases, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each case's wire, decode to every dtype and sum from the kernels equal the reference's, bit for bit."""
    for codec, x, k, n, order, segments, key in cases:
        wire = codec.encode_wire(x, k, order=order, segments=segments, seed=key)
        got = [codec.decode_wire(wire, k, n, dtype=d, segments=segments) for d in DTYPES]
        got.append(codec.decode_wire_sum(wire, k, n, segments=segments))
        with monkeypatch.context() as m:
            m.setattr(backends, "_force_reference", True)
            ref = codec.encode_wire(x, k, order=order, segments=segments, seed=key)
            want = [codec.decode_wire(ref, k, n, dtype=d, segments=segments) for d in DTYPES]
            want.append(codec.decode_wire_sum(ref, k, n, segments=segments))
        assert torch.equal(wire, ref), (codec.spec, k, n, x.dtype, segments)
        assert all(same_bits(a, b) for a, b in zip(got, want)), (codec.spec, k, n, x.dtype, segments)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the codecs run on the reference path only")
def test_random_rotated_and_stochastic_cases_equal_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The general path (ts_encode_x / ts_decode_x) on random cases, beyond the hand-picked ones above."""
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    _equal_reference(_random_cases(11, 150), monkeypatch)


_AVX2 = {"avx2", "fma", "f16c"} <= _cpu_flags()


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("flags", [(), pytest.param(("-march=x86-64-v3",), marks=pytest.mark.skipif(
    not _AVX2, reason="this CPU cannot run AVX2 code")), pytest.param(("-march=x86-64-v4",), marks=pytest.mark.skipif(
    not _AVX512, reason="this CPU cannot run AVX-512 code"))], ids=["portable", "avx2", "avx512-without-bf16"])
def test_other_builds_equal_reference(flags: tuple[str, ...], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels built without -march=native give the same bits: the compiler-vectorized code that CPUs without
    AVX2 run, the 8-lane code of AVX2 CPUs, and the AVX-512 code without the bf16 conversion instruction."""
    lib = native.build(flags, tmp_path)
    assert lib.simd == ("avx512" if "-march=x86-64-v4" in flags else "compiler-vectorized")
    assert backends._self_check(lib) is None
    monkeypatch.setattr(backends, "_cpu_state", lib)
    dtypes = DTYPES if lib.has_f16 else DTYPES[:2]
    flat = [(codec, _awkward(2 * 1500, dtype, seed=3), 2, 1500, [1, 0], None, None)
            for codec in (INT8, INT4, BlockCodec(4, 37), BlockCodec(8, 96)) for dtype in dtypes]
    laid_out = [(codec, _awkward(k * nrows * sum(segments), dtype, seed=5), k, nrows * sum(segments),
                 list(reversed(range(k))), segments, None)
                for codec, segments, nrows, k in _seg_cases()[:6] for dtype in dtypes]
    _equal_reference(flat + laid_out + list(_random_cases(13, 40)), monkeypatch)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_self_check_disables_kernels_that_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels that disagree with the reference are caught by the self-check, reported, and never used."""
    good = native.load()
    assert good is not None, native.status()

    class Off:  # the real kernels, except that encode flips the low bit of the first payload byte
        has_f16, decode, encode_seg, decode_seg = good.has_f16, good.decode, good.encode_seg, good.decode_seg

        def encode(self, *args):
            rc = good.encode(*args)
            ctypes.c_uint8.from_address(args[7]).value ^= 1
            return rc

    assert backends._self_check(good) is None
    assert backends._self_check(Off()) == "encode int8:96 torch.float32"
    for name in ("_force_reference", "_cpu_state", "_cpu_reason"):
        monkeypatch.setattr(backends, name, getattr(backends, name))  # restored after the test
    monkeypatch.setattr(backends, "_force_reference", False)
    monkeypatch.setattr(backends, "_cpu_state", None)
    monkeypatch.setattr(native, "load", Off)
    with pytest.warns(RuntimeWarning, match="differs from the reference: encode int8:96"):
        assert backends._cpu_kernels() is None
    assert backends.kernel_status()["cpu"].startswith("torch: disabled, differs from the reference")
    assert backends._cpu_lib(torch.empty(1), torch.float32) is None


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_kernel_cache_folder_others_can_write_is_not_used(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder writable by group or others, or another user's, could hold anyone's library: the kernels are
    built in a private folder instead, with a warning naming the refused one, and nothing is written there."""
    import re

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    folders = [shared]
    if hasattr(os, "getuid") and os.getuid() == 0:        # root can hand a folder to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 4242, 4242)
        folders.append(theirs)
    for folder in folders:
        monkeypatch.setenv("TIERSHARD_CACHE_DIR", str(folder))
        with pytest.warns(RuntimeWarning, match=f"not using the cache folder {re.escape(str(folder))}"):
            lib = native.build(())
        assert lib.path.parent != folder and list(folder.iterdir()) == [], lib
        st = lib.path.parent.stat()
        assert st.st_uid == os.getuid() and st.st_mode & 0o077 == 0, oct(st.st_mode)
    fresh = tmp_path / "new" / "cache"                       # a folder that does not exist yet is created 0o700
    assert native._cache(fresh) == fresh and fresh.stat().st_mode & 0o777 == 0o700


_PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("TIERSHARD_TEST_MARKER"), "w");
    if (f) fclose(f);
}
"""


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_planted_kernel_library_is_not_loaded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library in the cache under the kernels' name whose SHA-256 is not the one recorded at build time is never
    loaded (loading runs its constructors): the kernels are rebuilt and ``kernel_status()`` says why."""
    import shutil

    built = native.load()                                   # the cache as this process left it: a library, its record
    assert built is not None, native.status()
    cache = tmp_path / "cache"
    shutil.copytree(built.path.parent, cache, ignore=lambda _, names: [n for n in names if "kernels" not in n])
    (tmp_path / "planted.c").write_text(_PLANTED)
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(tmp_path / "planted.c"), "-o",
                    str(cache / built.path.name)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("TIERSHARD_TEST_MARKER", str(marker))
    monkeypatch.setenv("TIERSHARD_CACHE_DIR", str(cache))
    for module, names in ((native, ("_loaded", "_reason", "_tried", "FLAG_SETS")),
                          (backends, ("_force_reference", "_cpu_state", "_cpu_reason"))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(native, "FLAG_SETS", (built.flags,))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(backends, "_force_reference", False)
    monkeypatch.setattr(backends, "_cpu_state", None)
    with pytest.warns(RuntimeWarning, match="SHA-256 differs"):
        status = backends.kernel_status()["cpu"]
    assert not marker.exists(), "the planted library was loaded"
    assert status.startswith("c: ") and "rebuilt" in status and "SHA-256 differs" in status, status  # self-checked


def test_reference_path_without_kernels(reference_path: None) -> None:
    """What a machine without a compiler runs: the same format and results through plain torch ops."""
    assert backends._cpu_lib(torch.empty(1), torch.float32) is None
    x = torch.randn(3 * 700)
    wire = INT4.encode_wire(x, 3, order=[2, 1, 0])
    assert wire.numel() == 3 * INT4.wire_bytes(700)
    dec = INT4.decode_wire(wire, 3, 700).view(3, 700)
    assert torch.allclose(dec[0], x[1400:], atol=float(x.abs().max()) / 14)
    assert torch.equal(INT4.decode_wire_sum(wire, 3, 700), (dec[0] + dec[1]) + dec[2])


# ---- row layouts: blocks never span two segments ---------------------------------------------------------------

SEG_LAYOUTS = [(1, 64, 37, 96, 3, 33, 130), (7,), (0, 5, 0, 200), (64, 64), (2, 1, 1, 300)]


def _seg_reference(codec: BlockCodec, x: torch.Tensor, segments,
                   payload: bool = True) -> tuple[list[int], list[float], torch.Tensor]:
    """Row-by-row, segment-by-segment loop, cutting each segment into blocks from its own first value: the layout the
    module docstring promises. Returns payload bytes (if asked), scales in block order, and each value's scale."""
    x = x.reshape(-1).float()
    U = sum(segments)
    qs: list[int] = []
    scales: list[float] = []
    per_value = torch.empty_like(x)
    for row in range(0, x.numel(), U):
        col = row
        for w in segments:
            for start in range(col, col + w, codec.block):
                blk = x[start:min(start + codec.block, col + w)]
                s = blk.abs().max() / codec.qmax
                scales.append(float(s))
                per_value[start:start + blk.numel()] = s
                if payload:
                    q = torch.round(blk / s) if s > 0 else torch.zeros_like(blk)
                    qs += q.clamp(-codec.qmax, codec.qmax).to(torch.int64).tolist()
            col += w
    if codec.bits == 4:
        if len(qs) % 2:
            qs.append(0)
        qs = [(qs[i] + 8) | ((qs[i + 1] + 8) << 4) for i in range(0, len(qs), 2)]
    return [q & 0xFF for q in qs], scales, per_value


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_segments_layout_matches_loop_reference(backend: str, codec: BlockCodec) -> None:
    g = torch.Generator().manual_seed(21)
    for segments in SEG_LAYOUTS:
        U = sum(segments)
        for rows in (1, 3):
            n = rows * U
            x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
            x[0] = 0.0
            pay, scales, _ = _seg_reference(codec, x, segments)
            wire = codec.encode_wire(x, 1, segments=segments)
            P, P4 = codec.payload_numel(n), codec.padded_payload_bytes(n)
            assert wire.numel() == codec.wire_bytes(n, segments) == P4 + 4 * len(scales)
            assert wire[:P].tolist() == pay, (segments, rows)
            assert not wire[P:P4].any()
            assert wire[P4:].view(torch.float32).tolist() == scales, (segments, rows)


@pytest.mark.parametrize("codec", [INT8, INT4, BlockCodec(4, 37)], ids=lambda c: c.spec)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_segments_roundtrip_within_half_step_per_block(backend: str, codec: BlockCodec, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(codec.bits + codec.block)
    segments = (3, 2 * codec.block + 5, 1, codec.block, 70)
    rows, k = 2, 3
    n = rows * sum(segments)
    x = (torch.randn(k * n, generator=g) * 3).to(dtype)
    xf = x.float()
    wire = codec.encode_wire(x, k, segments=segments)
    s = torch.cat([_seg_reference(codec, xf[i * n:(i + 1) * n], segments, payload=False)[2] for i in range(k)])
    for out_dtype in (torch.float32, dtype):
        err = (xf - codec.decode_wire(wire, k, n, dtype=out_dtype, segments=segments).float()).abs()
        slack = s * codec.qmax * 2.0**-22 + (0 if out_dtype == torch.float32 else xf.abs() * 2.0**-8)
        assert torch.all(err <= s / 2 + slack), (out_dtype, float((err / s).max()))


def test_segments_keep_a_small_tensor_beside_a_large_one(backend: str) -> None:
    """A norm gain's few values packed beside a large weight: with fixed blocks they share the weight's scale and
    decode to zero; with segments they get their own block and keep int4 precision for their own absmax."""
    g = torch.Generator().manual_seed(4)
    big, small, tail = 100, 6, 90  # the small segment sits inside the second fixed block of 64
    segments = (big, small, tail)
    rows = 4
    x = torch.randn(rows, big + small + tail, generator=g) * 1000.0
    x[:, big:big + small] = torch.randn(rows, small, generator=g) * 1e-3
    x = x.view(-1)
    n = x.numel()
    fixed = INT4.decode_wire(INT4.encode_wire(x, 1), 1, n).view(rows, -1)[:, big:big + small]
    assert not fixed.any()  # quantized to nothing by the neighbour's scale
    seg = INT4.decode_wire(INT4.encode_wire(x, 1, segments=segments), 1, n, segments=segments)
    small_x, small_dec = x.view(rows, -1)[:, big:big + small], seg.view(rows, -1)[:, big:big + small]
    for r in range(rows):
        amax = float(small_x[r].abs().max())
        err = (small_x[r] - small_dec[r]).abs()
        assert float(err.max()) <= amax / 14 * (1 + 1e-5), r  # half a step of its own scale, amax / 7
        assert float(err.norm() / small_x[r].norm()) < 0.2
    assert float((seg - x).abs().max()) <= float(x.abs().max()) / 14 * (1 + 1e-5)


def test_segment_sizes() -> None:
    # int4, block 64: segments 1, 64, 65, 0, 130 -> 1 + 1 + 2 + 0 + 3 = 7 blocks a row
    segments = [1, 64, 65, 0, 130]
    U = 260
    for rows in (0, 1, 3):
        n = rows * U
        assert INT4.scales_numel(n, segments) == 7 * rows
        assert INT4.payload_numel(n) == (n + 1) // 2  # the payload does not depend on the layout
        assert INT4.wire_bytes(n, segments) == INT4.padded_payload_bytes(n) + 4 * 7 * rows
        assert INT4.wire_bytes(n, tuple(segments)) == INT4.wire_bytes(n, torch.tensor(segments))
        assert INT4.wire_bytes(n, segments) % 4 == 0
    assert INT4.wire_bytes(3 * 7, [7]) == 12 + 4 * 3  # 21 values: 11 payload bytes padded to 12, one block a row
    assert INT8.scales_numel(2 * 5000, [1, 4999]) == 2 * (1 + 3)
    assert BlockCodec(4, 37).scales_numel(74, [74]) == 2 == BlockCodec(4, 37).scales_numel(74)
    # segments=None is the flat layout, unchanged
    for codec in CODECS:
        for n in (0, 1, 1001, 4096):
            assert codec.wire_bytes(n, None) == codec.wire_bytes(n)
            assert codec.scales_numel(n, None) == codec.scales_numel(n) == -(-n // codec.block)
    x = torch.randn(2 * U)
    assert INT4.encode_wire(x, 2, segments=segments).numel() == 2 * INT4.wire_bytes(U, segments)


def test_segments_none_and_whole_block_layouts_give_the_flat_format(backend: str) -> None:
    g = torch.Generator().manual_seed(9)
    for codec in CODECS:
        k, rows = 3, 2
        n = rows * 2 * codec.block
        x = torch.randn(k * n, generator=g)
        flat = codec.encode_wire(x, k, order=[1, 2, 0])
        assert torch.equal(codec.encode_wire(x, k, order=[1, 2, 0], segments=None), flat)
        # segments that are whole blocks cut exactly where the flat layout does
        for segments in ([n], [2 * codec.block], [codec.block, codec.block]):
            assert torch.equal(codec.encode_wire(x, k, order=[1, 2, 0], segments=segments), flat), segments
            assert torch.equal(codec.decode_wire(flat, k, n, segments=segments), codec.decode_wire(flat, k, n))
            assert torch.equal(codec.decode_wire_sum(flat, k, n, segments=segments), codec.decode_wire_sum(flat, k, n))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.spec)
def test_segments_wire_roundtrip_with_order_and_sum(backend: str, codec: BlockCodec) -> None:
    segments = (5, codec.block + 3, 1, 40)
    k, rows = 4, 2
    n = rows * sum(segments)
    g = torch.Generator().manual_seed(12)
    chunks = [torch.randn(n, generator=g) * (r + 1) for r in range(k)]
    x = torch.cat(chunks).to(torch.bfloat16)
    order = [2, 0, 3, 1]
    W = codec.wire_bytes(n, segments)
    wire = torch.full((k * W,), 0xAB, dtype=torch.uint8)
    assert codec.encode_wire(x, k, wire, order=order, segments=segments) is wire
    assert torch.equal(codec.encode_wire(x, k, order=torch.tensor(order), segments=segments), wire)
    singles = []
    for i, c in enumerate(order):  # row i is chunk order[i]'s own encoding
        one = codec.encode_wire(x[c * n:(c + 1) * n], 1, segments=segments)
        assert torch.equal(wire[i * W:(i + 1) * W], one)
        singles.append(codec.decode_wire(one, 1, n, segments=segments))
    for out_dtype in DTYPES:
        out = torch.empty(k * n, dtype=out_dtype)
        assert codec.decode_wire(wire, k, n, out, segments=segments) is out
        assert same_bits(out, torch.cat(singles).to(out_dtype))
    big = torch.zeros(k * n, 2)
    codec.decode_wire(wire, k, n, big[:, 0], segments=segments)
    assert torch.equal(big[:, 0], torch.cat(singles)) and not big[:, 1].any()
    total = codec.decode_wire_sum(wire, k, n, segments=segments)
    assert same_bits(total, ((singles[0] + singles[1]) + singles[2]) + singles[3])
    # a nan poisons only its own block, in the decode and in the sum
    y = x.clone()
    y[order[1] * n + 2] = float("nan")  # segment 0 of row 0 of the chunk member 1 receives
    rows_out = codec.decode_wire(codec.encode_wire(y, k, order=order, segments=segments), k, n,
                                 segments=segments).view(k, n)
    assert torch.isnan(rows_out[1, :5]).all() and not torch.isnan(rows_out[1, 5:]).any()
    assert not torch.isnan(rows_out[[0, 2, 3]]).any()


def test_bad_segments_raise() -> None:
    x = torch.randn(2 * 130)
    for bad in ([], [0], [0, 0], [-1, 131], [1.5, 128.5], [True, 129], "abc", 130, [[130]]):
        with pytest.raises(ValueError, match="segments"):
            INT4.encode_wire(x, 2, segments=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="segments"):
            INT4.wire_bytes(130, bad)  # type: ignore[arg-type]
    # a chunk must be whole rows of the layout
    with pytest.raises(ValueError, match="multiple of U"):
        INT4.encode_wire(x, 2, segments=[100])
    with pytest.raises(ValueError, match="multiple of U"):
        INT4.scales_numel(130, [100])
    with pytest.raises(ValueError, match="multiple of U"):
        INT4.wire_bytes(131, [65, 65])
    wire = INT4.encode_wire(x, 2, segments=[65, 65])
    with pytest.raises(ValueError, match="multiple of U"):
        INT4.decode_wire(wire, 2, 130, segments=[100])
    with pytest.raises(ValueError, match="multiple of U"):
        INT4.decode_wire_sum(wire, 2, 130, segments=[100])
    # a wire encoded with another layout has another size
    with pytest.raises(ValueError, match="wire"):
        INT4.decode_wire(wire, 2, 130, segments=[130])
    with pytest.raises(ValueError, match="wire"):
        INT4.decode_wire_sum(wire, 2, 130)


def _seg_cases() -> list[tuple[BlockCodec, tuple[int, ...], int, int]]:
    """(codec, segments, rows, k): odd-aligned int4 blocks, tiny segments, whole-block runs, blocks of a multiple of
    32 that are not whole, one unit ending on an odd value, and chunks over 64K values (several threads)."""
    return [(INT4, (1, 64, 37, 96, 3, 33, 130), 2, 3), (INT8, (1, 64, 37, 96, 3, 33, 130), 2, 3),
            (BlockCodec(4, 37), (5, 80, 1), 3, 2), (BlockCodec(8, 100), (7, 300), 2, 2),
            (BlockCodec(4, 96), (1, 192, 32, 65), 1, 2), (BlockCodec(4, 1), (1, 2, 1), 2, 2),
            (BlockCodec(4, 5000), (3, 12001), 1, 2), (INT4, (3, 40001, 7, 20000, 96), 1, 2),
            (INT8, (1, 64 * 600 + 1, 5), 2, 2), (INT4, (2, 8190, 1), 3, 2)]


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the codecs run on the reference path only")
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_segment_kernels_equal_reference_bit_for_bit(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (codec, segments, rows, k) in enumerate(_seg_cases()):
            n = rows * sum(segments)
            for dtype in DTYPES:
                x = _awkward(k * n, dtype, seed=100 + i)
                order = list(reversed(range(k)))
                fused = codec.encode_wire(x, k, order=order, segments=segments)
                with monkeypatch.context() as m:
                    m.setattr(backends, "_force_reference", True)
                    ref = codec.encode_wire(x, k, order=order, segments=segments)
                    ref_dec = {d: codec.decode_wire(ref, k, n, dtype=d, segments=segments) for d in DTYPES}
                    ref_sum = codec.decode_wire_sum(ref, k, n, segments=segments)
                assert torch.equal(fused, ref), (codec, segments, dtype)
                for out_dtype in DTYPES:
                    assert same_bits(codec.decode_wire(fused, k, n, dtype=out_dtype, segments=segments),
                                     ref_dec[out_dtype]), (codec, segments, dtype, out_dtype)
                assert same_bits(codec.decode_wire_sum(fused, k, n, segments=segments), ref_sum), (codec, segments)
    finally:
        torch.set_num_threads(before)


_TRITON_SCRIPT = textwrap.dedent("""
    import torch
    import triton.runtime.interpreter as interpreter
    # Triton 3.6's interpreter turns a scalar argument into an int with int() of a 1-element array, which NumPy
    # >= 2.4 refuses: every loop over a runtime bound (range(1, k)) failed. Read the element instead.
    _patch = interpreter._patch_lang_tensor
    def _patch_index(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interpreter._patch_lang_tensor = _patch_index
    from tiershard.comm.codecs import triton_kernels as T
    from tiershard.comm.codecs import BlockCodec, INT8, INT4, same_bits
    from tiershard.comm.codecs.format import _layout
    g = torch.Generator().manual_seed(0)
    for codec in (INT8, INT4, BlockCodec(4, 37), BlockCodec(4, 6000), BlockCodec(8, 5000), BlockCodec(8, 100),
                  BlockCodec(4, 1501)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for k, n in ((3, 203), (2, 1), (4, 130)):
                x = (torch.randn(k * n, generator=g) * 3).to(dtype)
                if k * n > 100:
                    x[7], x[90], x[95] = float("nan"), 0.0, float("inf")
                order = torch.tensor(list(range(k))[::-1])
                ref = codec.encode_wire(x, k, order=order.tolist())
                wire = torch.full_like(ref, 77)
                T.encode_wire(codec, x, k, n, wire, order)
                assert torch.equal(wire, ref), (codec, dtype, k, n)
                for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                    out = torch.empty(k * n, dtype=out_dtype)
                    T.decode_wire(codec, ref, k, n, out)
                    assert same_bits(out, codec.decode_wire(ref, k, n, dtype=out_dtype)), (codec, dtype, out_dtype)
                total = torch.empty(n)
                T.decode_wire_sum(codec, ref, k, n, total)
                assert same_bits(total, codec.decode_wire_sum(ref, k, n)), (codec, dtype)
    # row layouts: odd-aligned int4 blocks (grouped and staged; above one tile, with the next block's scale), odd
    # chunks, aligned layouts (int4 packed in the grouped kernel), the two-kernel path for big blocks
    for codec, segs, rows, k in ((INT4, (1, 64, 37, 3, 34), 1, 2), (INT4, (2, 33, 96), 2, 2),
                                 (BlockCodec(4, 37), (1, 80, 2), 1, 2), (INT8, (1, 64, 37, 3, 34), 1, 2),
                                 (BlockCodec(4, 6000), (3, 7001), 1, 2), (BlockCodec(8, 5000), (3, 7001), 1, 1),
                                 (INT4, (16, 144, 64, 32), 2, 2), (INT8, (8, 24, 4), 3, 2),
                                 (BlockCodec(8, 100), (1, 64, 37, 3, 34), 2, 2),
                                 (BlockCodec(4, 1501), (1, 3001, 2), 1, 2)):
        lay = _layout(codec.block, segs)
        n = rows * sum(segs)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(k * n, generator=g) * 3).to(dtype)
            x[7], x[90], x[95] = float("nan"), 0.0, float("inf")
            order = torch.tensor(list(range(k))[::-1])
            ref = codec.encode_wire(x, k, order=order.tolist(), segments=segs)
            wire = torch.full_like(ref, 77)
            T.encode_wire_seg(codec, x, k, n, wire, order, lay)
            assert torch.equal(wire, ref), (codec, segs, dtype)
            out = torch.empty(k * n, dtype=dtype)
            T.decode_wire_seg(codec, ref, k, n, out, lay)
            assert same_bits(out, codec.decode_wire(ref, k, n, dtype=dtype, segments=segs)), (codec, segs, dtype)
            total = torch.empty(n)
            T.decode_wire_sum_seg(codec, ref, k, n, total, lay)
            assert same_bits(total, codec.decode_wire_sum(ref, k, n, segments=segs)), (codec, segs, dtype)
    # the general path of the rotated and stochastic formats, flat and with a row layout
    from tiershard.comm.codecs import codec_from_spec
    for spec in ("int8:128:h", "int4:37:h:sr", "int4:64:h", "int8:100:sr", "int4:2048:h:sr", "int8:1500:h",
                 "int4:128:h:sr", "int4:30:sr"):
        codec = codec_from_spec(spec)
        for segs, k, n in ((None, 3, 203), ((1, 64, 37, 3, 34), 2, 2 * 139), ((2, 130, 64, 4), 2, 3 * 200),
                           ((16, 144, 64, 32), 2, 2 * 256)):
            lay = None if segs is None else _layout(codec.block, segs)
            x = (torch.randn(k * n, generator=g) * 3).to(torch.bfloat16)
            x[7], x[95] = float("nan"), float("inf")
            order = torch.tensor(list(range(k))[::-1])
            ref = codec.encode_wire(x, k, order=order.tolist(), segments=segs, seed=99)
            wire = torch.full_like(ref, 77)
            T.encode_wire_x(codec, x, k, n, wire, order, lay, 99 if codec.stochastic else None)
            assert torch.equal(wire, ref), (spec, segs)
            out, total = torch.empty(k * n), torch.empty(n)
            T.decode_wire_x(codec, ref, k, n, out, lay, False)
            T.decode_wire_x(codec, ref, k, n, total, lay, True)
            assert same_bits(out, codec.decode_wire(ref, k, n, segments=segs)), (spec, segs)
            assert same_bits(total, codec.decode_wire_sum(ref, k, n, segments=segs)), (spec, segs)
    # the dispatch from the wire API (what a CUDA tensor takes), here forced onto the interpreted kernels
    from tiershard.comm.codecs import block  # the wire API calls the backend choosers it imported from backends
    segs, x = (1, 64, 37, 3, 34), (torch.randn(2 * 139, generator=g) * 3).to(torch.bfloat16)
    ref = INT4.encode_wire(x, 2, order=[1, 0], segments=segs)
    ref_dec, ref_sum = INT4.decode_wire(ref, 2, 139, segments=segs), INT4.decode_wire_sum(ref, 2, 139, segments=segs)
    block._cpu_lib, block._gpu_lib = (lambda t, dtype: None), (lambda t, wire: T)
    wire = INT4.encode_wire(x, 2, order=[1, 0], segments=segs)
    assert torch.equal(wire, ref)
    assert same_bits(INT4.decode_wire(wire, 2, 139, segments=segs), ref_dec)
    assert same_bits(INT4.decode_wire_sum(wire, 2, 139, segments=segs), ref_sum)
    print("triton kernels match")
""")


def test_triton_kernels_match_in_interpreter() -> None:
    """The Triton kernels, run by Triton's CPU interpreter, give the reference's bits (skips without triton)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "triton kernels match" in proc.stdout


# ---- rotated (":h") and stochastic (":sr") formats ----------------------------------------------------------------
EXTENDED = [codec_from_spec(s) for s in ("int8:128:h", "int4:64:h", "int4:37:h:sr", "int8:100:sr", "int4:5:h",
                                          "int8:2048:h:sr")]
SEED = 0xDEADBEEF12345678


def _hadamard32() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 32:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_rotation_is_the_normalized_hadamard_transform_and_its_own_inverse() -> None:
    from tiershard.comm.codecs import reference

    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(3))
    exact = (x.double() @ _hadamard32().T) / math.sqrt(32)
    assert torch.allclose(reference.fwht(x).double(), exact, atol=1e-5)
    assert torch.allclose(reference.fwht(reference.fwht(x)), x, atol=1e-5)


def test_spec_flags_round_trip_and_hop_codecs() -> None:
    from tiershard.comm.codecs import hop_codecs

    assert codec_from_spec("int4:128:h:sr") == BlockCodec(4, 128, rotate=True, stochastic=True)
    assert codec_from_spec("int8:128:h") == BlockCodec(8, 128, True, False)
    assert codec_from_spec("4:sr") == BlockCodec(4, 64, False, True) and codec_from_spec("8") == INT8
    assert codec_from_spec("int4:sr:h").spec == "int4:64:h:sr"
    for c in EXTENDED + CODECS:
        assert codec_from_spec(c.spec) == c
    for bad in ["int4:h:h", "int4:128:x", "int4:sr:128", "int8:128:h+ef", "8/4", "int4:128:hsr"]:
        with pytest.raises(ValueError, match="valid specs|per-hop list"):
            codec_from_spec(bad)
    i8, i4 = codec_from_spec("int8:128:h"), codec_from_spec("int4:128:h")
    assert hop_codecs("int8:128:h/int4:128:h", 2) == [i8, i4]
    assert hop_codecs("8/4", 3) == [INT8, INT8, INT4]
    assert hop_codecs("int4", 3) == [INT4] * 3
    assert hop_codecs("4:128/8/4", 4) == [BlockCodec(4, 128), BlockCodec(4, 128), INT8, INT4]
    with pytest.raises(ValueError, match="3 hop codecs but there are only 2 tiers"):
        hop_codecs("8/8/4", 2)
    with pytest.raises(ValueError, match="valid specs"):
        hop_codecs("8//4", 2)


def _extended_cases(codecs, layouts, sizes, threads: int, monkeypatch, dtypes=DTYPES) -> None:
    """Every codec on every (layout, (k, n)): the C kernels (on ``threads`` threads) against the reference."""
    before = torch.get_num_threads()
    try:
        for ci, codec in enumerate(codecs):
            for li, (segs, (k, n)) in enumerate(zip(layouts, sizes)):
                for dtype in dtypes:
                    x = _awkward(k * n, dtype, seed=100 * ci + li)
                    order = list(reversed(range(k)))
                    torch.set_num_threads(threads)
                    fused = codec.encode_wire(x, k, order=order, segments=segs, seed=SEED)
                    dec = {d: codec.decode_wire(fused, k, n, dtype=d, segments=segs) for d in DTYPES}
                    total = codec.decode_wire_sum(fused, k, n, segments=segs)
                    torch.set_num_threads(before)
                    with monkeypatch.context() as m:
                        m.setattr(backends, "_force_reference", True)
                        ref = codec.encode_wire(x, k, order=order, segments=segs, seed=SEED)
                        ref_dec = {d: codec.decode_wire(ref, k, n, dtype=d, segments=segs) for d in DTYPES}
                        ref_sum = codec.decode_wire_sum(ref, k, n, segments=segs)
                        enc_ref = codec.encode(x, seed=SEED) if segs is None else None
                    assert torch.equal(fused, ref), (codec, segs, k, n, dtype)
                    for d in DTYPES:
                        assert same_bits(dec[d], ref_dec[d]), (codec, segs, dtype, d)
                    assert same_bits(total, ref_sum), (codec, segs)
                    if enc_ref is not None:
                        enc = codec.encode(x, seed=SEED)
                        assert torch.equal(enc.payload, enc_ref.payload) and same_bits(enc.scales, enc_ref.scales)
                        with monkeypatch.context() as m:
                            m.setattr(backends, "_force_reference", True)
                            dec_ref = codec.decode(enc_ref, dtype=dtype)
                        assert same_bits(codec.decode(enc, dtype=dtype), dec_ref), (codec, dtype)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the codecs run on the reference path only")
def test_rotated_and_stochastic_kernels_equal_reference_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C general path against the torch reference: flat chunks and row layouts, fp32/bf16/fp16, odd sizes,
    blocks shorter than a rotation group, tails, non-finite and subnormal values; encode, decode, decode-sum and
    the separate payload/scales API."""
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    layouts = [None, None, (1, 64, 37, 96, 3, 33, 128), (300,), (7, 1, 29)]
    sizes = [(3, 1001), (2, 9001), (3, 2 * 362), (2, 3 * 300), (1, 37)]
    _extended_cases(EXTENDED, layouts, sizes, 1, monkeypatch)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the codecs run on the reference path only")
def test_rotated_and_stochastic_kernels_on_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Work units split across threads (over 64K values): int4 units start on even values, odd blocks included."""
    codecs = [codec_from_spec("int4:37:h:sr"), codec_from_spec("int8:128:h")]
    _extended_cases(codecs, [None, (7, 1, 29)], [(2, 40001), (2, 37 * 1001)], 2, monkeypatch, [torch.bfloat16])


@pytest.mark.parametrize("spec", ["int8:128:h", "int4:64:h", "int4:37:h", "int4:128:h:sr"])
def test_rotated_roundtrip_within_the_l2_bound_per_block(backend: str, spec: str) -> None:
    """format.py: ||x - x_hat||_2 <= sqrt(m) * scale / 2 per block (nearest; one step, not half, with sr), scale
    taken from the rotated values; blocks shorter than a group keep the unrotated half-step bound per element."""
    codec = codec_from_spec(spec)
    n = 5 * codec.block + 17
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 3
    x[::53] *= 30
    enc = codec.encode(x, seed=9)
    err = (codec.decode(enc) - x).double()
    step = 1.0 if codec.stochastic else 0.5
    for b, scale in enumerate(enc.scales.tolist()):
        e = err[b * codec.block:(b + 1) * codec.block]
        assert e.norm() <= math.sqrt(e.numel()) * scale * step * (1 + 1e-5) + 1e-6, (spec, b)
    tail = n % codec.block % 32
    assert (err[n - tail:].abs() <= enc.scales[-1] * step * (1 + 1e-5)).all()


def test_rotation_lowers_int4_error_on_gradient_like_data() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64 * 1024, generator=g)
    x[torch.randint(0, x.numel(), (64,), generator=g)] *= 50            # a few outliers
    errors = {}
    for spec in ("int4:128", "int4:128:h"):
        c = codec_from_spec(spec)
        errors[spec] = ((c.decode(c.encode(x)) - x).norm() / x.norm()).item()
    assert errors["int4:128:h"] < 0.9 * errors["int4:128"], errors


def test_stochastic_rounding_needs_a_seed_is_reproducible_and_unbiased(backend: str) -> None:
    codec = codec_from_spec("int4:64:h:sr")
    x = torch.randn(3 * 64 + 5, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="needs a seed"):
        codec.encode_wire(x, 1)
    with pytest.raises(ValueError, match="needs a seed"):
        codec.encode(x)
    a, b, other = (codec.encode_wire(x, 1, seed=s) for s in (7, 7, 8))
    assert torch.equal(a, b) and not torch.equal(a, other)
    assert torch.equal(INT4.encode_wire(x, 1, seed=7), INT4.encode_wire(x, 1))   # nearest codecs ignore a seed
    # unbiased: the mean over S seeds approaches x (within 5 standard errors of one step / sqrt(S)); nearest
    # rounding's bias on the same values does not shrink
    S = 256
    mean = sum(codec.decode_wire(codec.encode_wire(x, 1, seed=s), 1, x.numel()) for s in range(S)) / S
    scale = codec.encode(x, seed=0).scales.max().item()
    assert (mean - x).abs().max() < 5 * scale / math.sqrt(S) + 1e-6, (mean - x).abs().max()
    plain = codec_from_spec("int4:64:h")
    bias = (plain.decode(plain.encode(x)) - x).abs().max()
    assert bias > 3 * (mean - x).abs().max()
