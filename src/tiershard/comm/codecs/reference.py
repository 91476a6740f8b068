"""The reference torch path of the block codecs (format: ``format.py``): plain torch ops, vectorised over k chunks.

Why it exists beside the kernels: it is the definition the C and Triton kernels are checked against bit for bit
(``backends._self_check``, the tests), and the path every device takes when no kernel serves it (no compiler, no
``triton``, ``TIERSHARD_CODEC_KERNELS=torch``, or a device with no kernels). The functions take the codec's scalars
(``bits``, ``block``; qmax follows from ``bits``; ``rotate`` and ``seed`` for the rotated and stochastic formats)
rather than a ``BlockCodec``, so this module needs only the format.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .format import (_HASH_GOLD, _HASH_M1, _HASH_M2, _HASH_SALT, _MASK32, _MASK64, _QMAX, GROUP, Order, _Layout,
                     _order_index, padded_payload_bytes, payload_numel, scales_numel, wire_bytes)

__all__ = ["encode", "decode", "encode_rows", "decode_rows", "wire_views", "fwht", "uniforms", "mix32"]

_NORM = 32 ** -0.5  # rounded to fp32 where it is used, as the kernels' literal is
_NORMAL_MIN = 2.0 ** -126  # the smallest normal fp32
_UP = 2.0 ** 24  # lifts a subnormal scale (and its values) into the normal range, exactly


def mix32(v):
    """The format's 32-bit hash ``mix`` on a Python int or an int64 tensor of values in [0, 2**32) (products are
    split in 16-bit halves so no int64 product overflows)."""
    def mul(a, c):
        return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32
    v = v ^ (v >> 16)
    v = mul(v, _HASH_M1)
    v = v ^ (v >> 15)
    v = mul(v, _HASH_M2)
    return v ^ (v >> 16)


def row_keys(seed: int, k: int, device: torch.device) -> Tensor:
    """The format's ``row_key`` of wire rows 0..k-1 (int64 holding uint32)."""
    seed &= _MASK64
    base = mix32(mix32((seed & _MASK32) ^ _HASH_SALT) ^ (seed >> 32))
    return mix32(base ^ torch.arange(k, dtype=torch.int64, device=device))


def uniforms(seed: int, k: int, nb: int, block: int, device: torch.device) -> Tensor:
    """(k, nb, block) fp32 ``u`` of the stochastic rounding: row i, block b, offset j (see ``format.py``)."""
    bkey = mix32(row_keys(seed, k, device)[:, None] ^ torch.arange(nb, dtype=torch.int64, device=device)[None, :])
    jm = (torch.arange(block, dtype=torch.int64, device=device) * _HASH_GOLD) & _MASK32
    return (mix32(bkey[..., None] ^ jm) >> 8).to(torch.float32) * 2.0 ** -24


def _butterflies(x: Tensor) -> Tensor:
    """The five fp32 butterfly stages of the 32-point transform of the last axis, in the format's order."""
    shape = x.shape
    for h in (1, 2, 4, 8, 16):
        v = x.reshape(*shape[:-1], GROUP // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
    return x


def fwht(x: Tensor) -> Tensor:
    """The normalized 32-point Walsh-Hadamard transform of the last axis (32 values), in the format's order: five
    fp32 butterfly stages, then the product by fp32(32 ** -0.5). Its own inverse."""
    return _butterflies(x) * torch.tensor(_NORM, dtype=torch.float32, device=x.device)


def _rotate(x: Tensor, scales: Tensor, lens: Tensor) -> Tensor:
    """Padded blocks x (k, nb, block) whose real lengths are ``lens`` (nb), each whole 32-value group as
    B(x) * fp32(s * fp32(32 ** -0.5)) with its block's s from ``scales`` (k, nb), the rest as x * s: rotating takes
    s = 1 (both products exact, B(x) * norm is ``fwht``), decoding takes q (integers as fp32, so the butterflies are
    exact) and the block scales."""
    k, nb, block = x.shape
    G = block // GROUP
    plain = x * scales[..., None]
    if G == 0 or nb == 0:
        return plain
    factor = scales * torch.tensor(_NORM, dtype=torch.float32, device=x.device)
    rotated = _butterflies(x[..., :G * GROUP].reshape(k, nb, G, GROUP)) * factor[..., None, None]
    whole = (torch.arange(1, G + 1, device=x.device) * GROUP)[None, :] <= lens[:, None]
    head = torch.where(whole[None, :, :, None], rotated, plain[..., :G * GROUP].reshape(k, nb, G, GROUP))
    return torch.cat((head.reshape(k, nb, G * GROUP), plain[..., G * GROUP:]), dim=2)


def _block_lens(block: int, n: int, nb: int, lay: _Layout | None, device: torch.device) -> Tensor:
    """Real length of each of a chunk's nb blocks."""
    if lay is None:
        lens = torch.full((nb,), block, dtype=torch.int64, device=device)
        if nb:
            lens[-1] = n - (nb - 1) * block
        return lens
    starts = torch.tensor(lay.starts, dtype=torch.int64, device=device)
    return (starts[1:] - starts[:-1]).repeat(nb // lay.nbr)


def _quotients(blocks: Tensor, safe: Tensor) -> Tensor:
    """The rotated and stochastic formats' ``blocks / scale``: the product by the scale's reciprocal, with a subnormal
    scale and its block's values first multiplied by 2**24 (exactly) so the reciprocal stays finite."""
    up = torch.where(safe < _NORMAL_MIN, _UP, 1.0)
    return (blocks * up[..., None]) * (1.0 / (safe * up))[..., None]


@torch.no_grad()
def encode(bits: int, block: int, rows: Tensor, lay: _Layout | None = None, rotate: bool = False,
           seed: int | None = None) -> tuple[Tensor, Tensor]:
    """(k, n) float values -> (k, payload_numel) payload and (k, nblocks) fp32 scales; with a row layout every
    block is first widened to ``block`` values in a padded copy of each row. ``rotate``: the Hadamard rotation;
    ``seed``: stochastic rounding with that key (None: round half to even)."""
    k, n = rows.shape
    qmax = _QMAX[bits]
    nb = scales_numel(block, n, lay)
    x = rows.float()
    if lay is not None:
        gather, place, _ = lay.ref_index(x.device)
        x = torch.nn.functional.pad(x.reshape(-1, lay.U), (0, 1)).index_select(1, gather)  # column U is 0
    elif nb * block != n:  # zero padding: costs no error because 0 encodes exactly
        x = torch.nn.functional.pad(x, (0, nb * block - n))
    blocks = x.reshape(k, nb, block)
    if rotate:
        blocks = _rotate(blocks, blocks.new_ones(k, nb), _block_lens(block, n, nb, lay, x.device))
    amax = blocks.abs().amax(dim=2)  # propagates nan, and inf stays inf
    finite = torch.isfinite(amax)
    scales = torch.where(finite, amax / qmax, torch.full_like(amax, float("nan")))
    # Dividing by 1 in zero blocks gives exact zeros (and no 0/0); scales stay 0 so decoding gives 0 too.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    t = _quotients(blocks, safe) if rotate or seed is not None else blocks / safe[..., None]
    if seed is None:
        q = torch.round(t).clamp_(-qmax, qmax)
    else:
        q = torch.floor(t + uniforms(seed, k, nb, block, x.device)).clamp_(-qmax, qmax)
    q = torch.where(finite[..., None], q, torch.zeros_like(q))
    if lay is not None:  # back from the padded rows to the real columns
        q = q.reshape(-1, lay.nbr * block).index_select(1, place).reshape(k, n)
    else:
        q = q.view(k, -1)[:, :n]
    if bits == 8:
        return q.to(torch.int8), scales
    if n % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    nib = (q + 8).to(torch.uint8).view(k, -1, 2)
    return nib[..., 0] | (nib[..., 1] << 4), scales


@torch.no_grad()
def decode(bits: int, block: int, payload: Tensor, scales: Tensor, n: int, lay: _Layout | None = None,
           rotate: bool = False) -> Tensor:
    """(k, payload_numel) payload and (k, nblocks) fp32 scales -> (k, n) fp32 values (rotated back when
    ``rotate``)."""
    k = payload.shape[0]
    if bits == 8:
        q = payload.view(torch.int8).float()
    else:
        q = torch.stack([payload & 0xF, payload >> 4], dim=2).view(k, -1)[:, :n].float() - 8
    if rotate:
        return _decode_rotated(block, q, scales.float(), n, lay)
    if lay is not None:  # each column's block, row by row
        owner = lay.ref_index(payload.device)[2]
        return q * scales.float().reshape(-1, lay.nbr).index_select(1, owner).reshape(k, n)
    return q * scales.float().repeat_interleave(block, dim=1)[:, :n]


def _decode_rotated(block: int, q: Tensor, scales: Tensor, n: int, lay: _Layout | None) -> Tensor:
    """decode() of a rotated format: in padded blocks, the whole groups rotated back (``_rotate`` with the block
    scales), the padding dropped."""
    k = q.shape[0]
    nb = scales.shape[1]
    if lay is not None:
        gather, place, _ = lay.ref_index(q.device)
        padded = torch.nn.functional.pad(q.reshape(-1, lay.U), (0, 1)).index_select(1, gather)
    else:
        padded = torch.nn.functional.pad(q, (0, nb * block - n))
    values = _rotate(padded.reshape(k, nb, block), scales, _block_lens(block, n, nb, lay, q.device))
    if lay is not None:
        return values.reshape(-1, lay.nbr * block).index_select(1, place).reshape(k, n)
    return values.reshape(k, -1)[:, :n]


@torch.no_grad()
def encode_rows(bits: int, block: int, x: Tensor, k: int, n: int, order: Order, pay: Tensor, sc: Tensor,
                pad: Tensor | None, lay: _Layout | None = None, rotate: bool = False, seed: int | None = None) -> None:
    """Encode chunk order[i] (or i) of flat ``x`` into uint8 row views pay[i], sc[i]; zero ``pad``."""
    if n == 0:
        return
    rows = x.view(k, n)
    idx = _order_index(order, k, x.device)
    if idx is not None:
        rows = rows.index_select(0, idx)
    payload, scales = encode(bits, block, rows, lay, rotate, seed)
    pay.copy_(payload.view(torch.uint8))
    sc.copy_(scales.view(torch.uint8))
    if pad is not None:
        pad.zero_()


@torch.no_grad()
def decode_rows(bits: int, block: int, pay: Tensor, sc: Tensor, k: int, n: int, out: Tensor | None,
                sum_out: Tensor | None, lay: _Layout | None = None, rotate: bool = False) -> None:
    """Decode uint8 row views into flat ``out`` (k*n values) or, summed in fp32, ``sum_out``."""
    if n == 0:
        return
    values = decode(bits, block, pay, sc.contiguous().view(torch.float32), n, lay, rotate)
    if out is not None:
        out.view(k, n).copy_(values)
    elif k == 0:
        sum_out.zero_()
    else:
        sum_out.copy_(values[0])
        for i in range(1, k):  # row order, as the kernels add
            sum_out.add_(values[i])


def wire_views(bits: int, block: int, wire: Tensor, k: int, n: int,
               W: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(payload, scales, padding) row views of a checked wire buffer of k chunks of ``n`` values, W bytes each
    (given with a row layout; the flat chunk size when None)."""
    P, P4 = payload_numel(bits, n), padded_payload_bytes(bits, n)
    rows = wire.view(k, wire_bytes(bits, block, n) if W is None else W)
    return rows[:, :P], rows[:, P4:], rows[:, P:P4] if P4 > P else None
