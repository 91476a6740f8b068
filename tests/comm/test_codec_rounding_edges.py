"""The C kernels of the rotated and stochastic formats against the reference on values built to sit next to a
rounding boundary, where the exact quotient ``v / scale`` rounds the other way than the format's product
``fp32(v * fp32(1 / scale))`` (format.py: "Quantizing by the reciprocal"), and where a multiply-add fused with the
stochastic ``+ u`` would too: the kernels must give the reference's bits."""
from __future__ import annotations

import pytest
import torch

from tiershard.comm.codecs import backends, codec_from_spec, native, reference, same_bits

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler: the reference path only")
F32 = torch.float32
SEED = 0x0123456789ABCDEF


def _f(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=F32)


def _near(v: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """v and its fp32 neighbours up to ``steps`` away."""
    out, lo, hi = [v], v, v
    for _ in range(steps):
        lo, hi = torch.nextafter(lo, _f(-1e30)), torch.nextafter(hi, _f(1e30))
        out += [lo, hi]
    return out


def _both_ways(codec, x: torch.Tensor, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n = x.numel() // k
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    wire = codec.encode_wire(x, k, seed=SEED)
    dec = codec.decode_wire(wire, k, n)
    with monkeypatch.context() as m:
        m.setattr(backends, "_force_reference", True)
        ref = codec.encode_wire(x, k, seed=SEED)
        ref_dec = codec.decode_wire(ref, k, n)
    assert torch.equal(wire, ref)
    assert same_bits(dec, ref_dec)


def test_rotated_nearest_next_to_half_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8:128:h blocks of four groups [c, 0, ..., 0], which rotate to 32 copies of fp32(c * 32 ** -0.5): group 0
    sets the scale, the others hold values v with v / scale at or beside k + 0.5."""
    norm = _f(32 ** -0.5)
    big = _f(100.0) * norm
    scale = big / 127
    inv = 1 / scale
    picked, disagree = [], 0
    for k in range(1, 127):
        for v in _near(_f(k + 0.5) * scale, 2):
            for c in _near(v / norm, 3):
                if torch.equal(c * norm, v):
                    disagree += int(torch.round(v * inv) != torch.round(v / scale))
                    picked.append(c)
                    break
    assert disagree > 10  # the case the kernels must not get wrong
    picked += [picked[0]] * (-len(picked) % 3)
    blocks = torch.zeros(len(picked) // 3, 4, 32, dtype=F32)
    blocks[:, 0, 0] = 100.0
    blocks[:, 1:, 0] = torch.stack(picked).view(-1, 3)
    blocks[1::2] *= -1
    _both_ways(codec_from_spec("int8:128:h"), blocks.reshape(-1), 1, monkeypatch)


def test_stochastic_next_to_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8:128:sr blocks whose value j sits where v / scale + u_j is at or beside an integer (u_j from the format's
    hash for that position), so the sum floors differently if the quotient is off by one ulp."""
    nb, block = 16, 128
    u = reference.uniforms(SEED, 1, nb, block, torch.device("cpu"))[0]
    scale = _f(100.0) / 127
    inv = 1 / scale
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(nb, block, dtype=F32)
    x[:, 0] = 100.0
    disagree = 0
    for b in range(nb):
        for j in range(1, block):
            target = _f(float(torch.randint(-100, 100, (1,), generator=gen))) - u[b, j]
            for v in _near(target * scale, 2):
                fast, exact = torch.floor(v * inv + u[b, j]), torch.floor(v / scale + u[b, j])
                if fast != exact:
                    disagree += 1
                    break
            x[b, j] = v
    assert disagree > 10
    _both_ways(codec_from_spec("int8:128:sr"), x.reshape(-1), 1, monkeypatch)


def test_stochastic_clamps_past_the_largest_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8:128:sr blocks whose largest |value| a has fp32(a / fp32(a / 127)) > 127 (the scale rounded down), at the
    positions whose u is small enough that v / scale + u floors to -128 or, for +a, u large enough to reach 128: the
    format clamps both to 127 in magnitude, and so must every kernel."""
    block, nb = 128, 1 << 13
    gen = torch.Generator().manual_seed(5)
    a = next(c for c in 1 + torch.rand(4096, generator=gen) if c / (c / 127) > 127)
    scale = a / 127
    u = reference.uniforms(SEED, 1, nb, block, torch.device("cpu"))[0]
    low = torch.floor(-a / scale + u) < -127
    high = torch.floor(a / scale + u) > 127
    assert int(low.sum()) > 0 and int(high.sum()) > 0  # both cases occur
    x = torch.randn(nb, block, generator=gen) * 0.3 * a
    x[:, 0] = a
    x[low], x[high] = -a, a
    _both_ways(codec_from_spec("int8:128:sr"), x.reshape(-1), 1, monkeypatch)


@pytest.mark.parametrize("spec", ["int8:128:h", "int4:128:h:sr"])
def test_rotated_bf16_output_at_extreme_scales(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotated blocks decoded to bf16 where the outputs are subnormal (scales near the smallest normal, subnormal
    ones among them) or overflow (scales near the largest): the kernels round every one as the reference does (the
    AVX-512 conversion instruction, which flushes subnormals, must not be used there)."""
    gen = torch.Generator().manual_seed(3)
    exps = [-124, -122, -118, -112, -106, -101, -100, -99, -90, 0, 100, 114, 115, 116, 120, 126]
    x = torch.cat([torch.randn(4, 128, generator=gen) * 2.0 ** e for e in exps]).reshape(-1)
    x = x * torch.where(torch.arange(x.numel()) % 7 == 0, 1.0, 1e-3)  # small values beside each block's largest
    codec = codec_from_spec(spec)
    k, n = 2, x.numel() // 2
    assert backends._cpu_kernels() is not None, backends.kernel_status()
    dec = codec.decode_wire(codec.encode_wire(x, k, seed=SEED), k, n, dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        m.setattr(backends, "_force_reference", True)
        ref = codec.decode_wire(codec.encode_wire(x, k, seed=SEED), k, n, dtype=torch.bfloat16)
    tiny = (dec != 0) & (dec.float().abs() < 2.0 ** -126)
    assert int(tiny.sum()) > 10 and not torch.isfinite(ref.float()).all()  # both cases occur
    assert same_bits(dec, ref)
