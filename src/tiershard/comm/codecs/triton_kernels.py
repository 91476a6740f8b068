"""Triton kernels for the codecs' wire API on CUDA tensors (format: ``format.py``); importing this needs ``triton``.

Same arithmetic as the CPU kernels and the torch reference, so all three give the same bits: IEEE division
(``tl.div_rn``; a plain ``/`` is an approximate division on NVIDIA GPUs) per value for the plain formats and once per
block, for the scale's reciprocal, for the rotated and stochastic ones, round half to even (adding and
subtracting 1.5 * 2**23, exact for |y| < 2**22, and |x / scale| <= 2 * qmax here), fp32 multiply, and kernels
launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA (that would change the
rounding of decode_wire_sum); bf16 outputs are rounded to nearest even by integer arithmetic, as torch does.
Nothing here reads a value back to the host: launches only. Scales are read and written as fp32 through the wire
buffer, which ``backends.py`` only hands over when it is 4-byte aligned; the kernel that writes a row's first scale
also zeroes its alignment bytes (``_zero_padding``), so no encode needs a launch for them.

``tests/comm/test_codecs.py`` runs these kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``) against the
reference, bit for bit, whenever ``triton`` is installed.

Kernels: one program per (chunk, block) encodes a whole block when it fits in registers (int8 any block, int4 an
even block, up to ``_FUSED_MAX`` values); otherwise one program per (chunk, block) writes the scales and a second
kernel quantizes per value (int4 odd blocks pair values across two blocks). Decoding is one program per (chunk,
tile of values); the sum loops over the chunks inside each program. Row layouts (``segments``) have their own
kernels (``*_seg``), driven by the layout's block table: one program per (block, chunk), see below. Plain codecs
whose blocks fit one tile are encoded, and decoded from row layouts, by the general path's grouped kernels instead
(``_grouped``), so the per-block kernels serve blocks of more than ``_TILE`` values. Rotated and
stochastic codecs take one general path (``encode_wire_x``, ``decode_wire_x``), flat or with a row layout, parallel
to the C kernels' ``ts_encode_x`` / ``ts_decode_x``: blocks of up to _TILE values go GB to a program as one [GB, XT]
tile of ``X_VALUES_PER_PROGRAM`` values (``_encode_xg`` / ``_decode_xg``: one program per block of 128 values was too
little work for a GPU), larger
ones one program per (block, chunk) looping over the block in tiles; either way whole 32-value groups are rotated in
registers (butterflies by reshape, split and join, in the format's order).
"""
from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl
from torch import Tensor


class Codec(Protocol):
    """What the kernels read of a ``block.BlockCodec`` (typed here so that this module imports none of the codec's
    modules)."""

    bits: int
    block: int
    rotate: bool
    stochastic: bool

    def payload_numel(self, numel: int) -> int: ...
    def padded_payload_bytes(self, numel: int) -> int: ...
    def wire_bytes(self, numel: int, segments=None) -> int: ...
    def scales_numel(self, numel: int, segments=None) -> int: ...


__all__ = ["encode_wire", "decode_wire", "decode_wire_sum", "encode_wire_seg", "decode_wire_seg", "decode_wire_sum_seg",
           "encode_wire_x", "decode_wire_x", "triton"]

_FUSED_MAX = 4096   # values per block that one program encodes in registers
_SCALE_TILE = 1024  # values per step when a scale program loops over a large block
_TILE = 1024        # values per decode / quantize program
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # read inside kernels: globals there must be constexpr
# Launch shape of the grouped kernels (``_encode_xg``, ``_decode_xg``: every rotated and stochastic default): values
# per program (a power of two) and warps per program. They change no bits; ``benchmarks/gpu_codecs.py --tune``
# times the alternatives on a GPU (each shape compiles on its first launch).
X_VALUES_PER_PROGRAM = _TILE
X_WARPS = 4


@triton.jit
def _rne(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quant(x, scale, QMAX: tl.constexpr):
    """clamp(round_half_even(x / scale)) as int32; 0 where the block is zero (scale 0) or non-finite (nan scale)."""
    ok = scale > 0.0
    safe = tl.where(ok, scale, 1.0)
    q = _rne(tl.div_rn(x, safe))
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return tl.where(ok, q, 0.0).to(tl.int32)


@triton.jit
def _block_scale(amax, nonfinite, QMAX: tl.constexpr):
    return tl.where(nonfinite, float("nan"), tl.div_rn(amax, QMAX * 1.0))


@triton.jit
def _store_scale(row, P4, j, scale):
    """Scale j of a wire row (the caller guarantees the 4-byte alignment of the buffer; P4 and W are multiples of 4)."""
    tl.store((row + P4).to(tl.pointer_type(tl.float32)) + j, scale)


@triton.jit
def _zero_padding(row, n, P4, BITS: tl.constexpr):
    """Program 0 of a wire row zeroes its alignment bytes (payload end to P4), so the wire content is deterministic."""
    if tl.program_id(0) == 0:
        pad = (n if BITS == 8 else (n + 1) // 2) + tl.arange(0, 4)
        tl.store(row + pad, tl.zeros([4], dtype=tl.uint8), mask=pad < P4)


@triton.jit
def _load_scale(row, P4, b):
    """Scales of blocks b (a tensor of block indices) of a wire row."""
    return tl.load((row + P4).to(tl.pointer_type(tl.float32)) + b)


@triton.jit
def _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER: tl.constexpr, ALIGN: tl.constexpr):
    """Where wire row i's chunk starts in x: chunk order[i] with an order, else chunk i."""
    if HAS_ORDER:
        c = tl.load(order_ptr + i)
    else:
        c = i
    return x_ptr + _chunk(c, n, ALIGN)


@triton.jit
def _tiled_block_scale(src, start, m, QMAX: tl.constexpr, TILE: tl.constexpr):
    """The scale of the m values at src + start (a block of any size), read TILE values at a time."""
    amax = tl.zeros([TILE], dtype=tl.float32)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for t in range(0, m, TILE):
        offs = t + tl.arange(0, TILE)
        mask = offs < m
        a = tl.abs(tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.where(mask, a, 0.0))
        bad = bad + tl.where(mask & ~(a <= _FLT_MAX), 1, 0)
    return _block_scale(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, QMAX)


@triton.jit
def _unpack(row, e, mask, BITS: tl.constexpr):
    """The quantized values e (a tensor of value indices) of one wire row, as fp32 integers."""
    if BITS == 8:
        q = tl.load(row + e, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    else:
        b = tl.load(row + e // 2, mask=mask, other=0).to(tl.int32)
        q = tl.where(e % 2 == 0, b & 15, b >> 4).to(tl.float32) - 8.0
    return q


@triton.jit
def _store_values(out, v, mask):
    """Store fp32 values v in out's dtype; bf16 rounds to nearest even by hand, as torch and the CPU kernels do (a
    nan comes from a nan scale)."""
    if out.dtype.element_ty == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        r = tl.where(v != v, 0x7FC0, (b + 0x7FFF + ((b >> 16) & 1)) >> 16)
        tl.store(out, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out, v.to(out.dtype.element_ty), mask=mask)


# Flat chunks: one program per (block or tile, chunk), the blocks or tiles on grid axis 0 (limit 2**31 - 1) and the
# chunk on axis 1 (limit 65535, far above any group size): with blocks on axis 1 a rank's chunk could hold at most
# 65535 blocks or tiles, about 67M values.
@triton.jit
def _encode_fused(x_ptr, order_ptr, out_ptr, n, block, W, P4,
                  HAS_ORDER: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, 1)
    row = out_ptr + i.to(tl.int64) * W
    start = j * block
    m = tl.minimum(block, n - start)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    if BITS == 8:
        offs = tl.arange(0, BLOCK)
        mask = offs < m
        x = tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        amax = tl.max(tl.where(mask, ax, 0.0), axis=0)
        nonfinite = tl.max(tl.where(mask & ~(ax <= _FLT_MAX), 1, 0), axis=0) > 0
        scale = _block_scale(amax, nonfinite, QMAX)
        q = _quant(x, scale, QMAX)
        tl.store(row + start + offs, (q & 0xFF).to(tl.uint8), mask=mask)
    else:
        half = tl.arange(0, BLOCK // 2)
        m0 = 2 * half < m
        m1 = 2 * half + 1 < m
        x0 = tl.load(src + start + 2 * half, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(src + start + 2 * half + 1, mask=m1, other=0.0).to(tl.float32)
        a0 = tl.abs(x0)
        a1 = tl.abs(x1)
        amax = tl.maximum(tl.max(tl.where(m0, a0, 0.0), axis=0), tl.max(tl.where(m1, a1, 0.0), axis=0))
        bad = tl.where(m0 & ~(a0 <= _FLT_MAX), 1, 0) + tl.where(m1 & ~(a1 <= _FLT_MAX), 1, 0)
        scale = _block_scale(amax, tl.max(bad, axis=0) > 0, QMAX)
        lo = _quant(x0, scale, QMAX) + 8
        hi = tl.where(m1, _quant(x1, scale, QMAX) + 8, 8)
        tl.store(row + start // 2 + half, (lo | (hi << 4)).to(tl.uint8), mask=m0)
    _store_scale(row, P4, j, scale)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _encode_scales(x_ptr, order_ptr, out_ptr, n, block, W, P4,
                   HAS_ORDER: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, 1)
    start = j * block
    m = tl.minimum(block, n - start)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    scale = _tiled_block_scale(src, start, m, QMAX, TILE)
    row = out_ptr + i.to(tl.int64) * W
    _store_scale(row, P4, j, scale)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _encode_values(x_ptr, order_ptr, out_ptr, n, block, W, P4,
                   HAS_ORDER: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Quantize with the scales _encode_scales wrote: TILE values (int8) or TILE bytes of value pairs (int4)."""
    t = tl.program_id(0)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, 1)
    row = out_ptr + i.to(tl.int64) * W
    offs = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    if BITS == 8:
        mask = offs < n
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        s = _load_scale(row, P4, tl.where(mask, offs // block, 0))
        tl.store(row + offs, (_quant(x, s, QMAX) & 0xFF).to(tl.uint8), mask=mask)
    else:
        e0 = 2 * offs
        m0 = e0 < n
        m1 = e0 + 1 < n
        x0 = tl.load(src + e0, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(src + e0 + 1, mask=m1, other=0.0).to(tl.float32)
        s0 = _load_scale(row, P4, tl.where(m0, e0 // block, 0))
        s1 = _load_scale(row, P4, tl.where(m1, (e0 + 1) // block, 0))
        lo = _quant(x0, s0, QMAX) + 8
        hi = tl.where(m1, _quant(x1, s1, QMAX) + 8, 8)
        tl.store(row + offs, (lo | (hi << 4)).to(tl.uint8), mask=m0)


@triton.jit
def _dequant(row, P4, e, mask, block, BITS: tl.constexpr):
    """fp32 values e (a tensor of value indices) of one wire row."""
    return _unpack(row, e, mask, BITS) * _load_scale(row, P4, tl.where(mask, e // block, 0))


@triton.jit
def _decode(wire_ptr, out_ptr, n, block, W, P4, BITS: tl.constexpr, TILE: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    i = tl.program_id(1)
    mask = e < n
    v = _dequant(wire_ptr + i.to(tl.int64) * W, P4, e, mask, block, BITS)
    _store_values(out_ptr + i.to(tl.int64) * n + e, v, mask)


@triton.jit
def _decode_sum(wire_ptr, out_ptr, k, n, block, W, P4, BITS: tl.constexpr, TILE: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = e < n
    acc = _dequant(wire_ptr, P4, e, mask, block, BITS)
    row = wire_ptr
    for _ in range(1, k):  # row order, as the CPU kernels and the reference add
        row += W  # a pointer: 64-bit arithmetic however large k * W is
        acc = acc + _dequant(row, P4, e, mask, block, BITS)
    tl.store(out_ptr + e, acc, mask=mask)


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def encode_wire(codec: Codec, x: Tensor, k: int, n: int, out: Tensor, order: Tensor | None) -> None:
    """Launch the encode kernels: x (k*n values, contiguous), out (k * wire_bytes(n) uint8), order (int64 or None)."""
    W, P, P4 = codec.wire_bytes(n), codec.payload_numel(n), codec.padded_payload_bytes(n)
    nb = codec.scales_numel(n)
    if nb == 0:
        return
    if _grouped(codec):
        encode_wire_x(codec, x, k, n, out, order, None, None)
        return
    has_order = order is not None
    order_arg = order if has_order else out  # any pointer; unused without HAS_ORDER
    block = codec.block
    if block <= _FUSED_MAX and (codec.bits == 8 or block % 2 == 0):
        _encode_fused[(nb, k)](x, order_arg, out, n, block, W, P4, HAS_ORDER=has_order, BITS=codec.bits,
                               BLOCK=max(_pow2(block), 2), enable_fp_fusion=False)
        return
    _encode_scales[(nb, k)](x, order_arg, out, n, block, W, P4, HAS_ORDER=has_order, BITS=codec.bits,
                            TILE=_SCALE_TILE, enable_fp_fusion=False)
    units = P if codec.bits == 4 else n
    _encode_values[(triton.cdiv(units, _TILE), k)](x, order_arg, out, n, block, W, P4, HAS_ORDER=has_order,
                                                   BITS=codec.bits, TILE=_TILE, enable_fp_fusion=False)


def decode_wire(codec: Codec, wire: Tensor, k: int, n: int, out: Tensor) -> None:
    """Launch the decode kernel: row i of wire -> out[i*n:(i+1)*n] in out's dtype."""
    if n == 0 or k == 0:
        return
    _decode[(triton.cdiv(n, _TILE), k)](wire, out, n, codec.block, codec.wire_bytes(n),
                                       codec.padded_payload_bytes(n), BITS=codec.bits, TILE=_TILE,
                                       enable_fp_fusion=False)


def decode_wire_sum(codec: Codec, wire: Tensor, k: int, n: int, out: Tensor) -> None:
    """Launch the fused decode-and-sum kernel: out (n fp32) = rows 0..k-1 of wire, decoded and added in order."""
    if k == 0:
        out.zero_()
        return
    if n == 0:
        return
    _decode_sum[(triton.cdiv(n, _TILE),)](wire, out, k, n, codec.block, codec.wire_bytes(n),
                                          codec.padded_payload_bytes(n), BITS=codec.bits, TILE=_TILE,
                                          enable_fp_fusion=False)


# ---- row layouts (segments) ----------------------------------------------------------------------------------
# Block j of a chunk is block j % nbr of row j // nbr; ``tab`` holds the nbr + 1 block offsets of one row (int64,
# on the device). One program per (block, chunk), blocks on grid axis 0 (whose limit is 2**31 - 1, not 65535), and
# per tile of the block where a block is larger than one program's tile. An int4 byte is written by the program
# that owns its even value; when a block ends on an odd value, its program also quantizes the next block's first
# value, with that block's scale (recomputed, or read back in the two-kernel path).


@triton.jit
def _seg_block(tab_ptr, j, nbr, U, ALIGN: tl.constexpr):
    """First value (in the chunk) and length of block j. The division is in 32 bits (a chunk's block indices fit:
    ``_seg_blocks``): a 64-bit one is a long software routine on a GPU, and the grouped kernels divide once per block
    in every thread (rows 2-3x slower than flat chunks on an H200 before). Both are multiples of ALIGN (the
    layout's ``align``): said to the compiler, which then reads and writes whole 16-byte vectors as in flat chunks."""
    j32 = j.to(tl.int32)
    r = j32 // nbr
    b = j32 - r * nbr
    lo = tl.load(tab_ptr + b)
    start = r.to(tl.int64) * U + lo
    m = tl.load(tab_ptr + b + 1) - lo
    if ALIGN > 1:  # hints stick to values made in the function that gives them, so they are given here
        start = tl.multiple_of(start, ALIGN)
        m = tl.multiple_of(m, ALIGN)
    return start, m


@triton.jit
def _chunk(c, n, ALIGN: tl.constexpr):
    """Where chunk c starts (c * n values): a multiple of ALIGN, as a chunk is whole rows of its layout."""
    off = c.to(tl.int64) * n
    if ALIGN > 1:
        off = tl.multiple_of(off, ALIGN)
    return off


def _seg_blocks(layout, n: int) -> int:
    """Blocks in a chunk of n values with a row layout; below 2**31, as ``_seg_block`` requires."""
    nbt = n // layout.U * layout.nbr
    if nbt >= 1 << 31:
        raise ValueError(f"a chunk of {n} values has {nbt} blocks, more than the GPU kernels index (2**31 - 1): "
                         f"use a larger block or split the collective")
    return nbt


@triton.jit
def _block_absmax(src, start, m, BLOCK: tl.constexpr):
    """(absmax, non-finite) of the m <= BLOCK values at src + start."""
    offs = tl.arange(0, BLOCK)
    mask = offs < m
    ax = tl.abs(tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32))
    return tl.max(tl.where(mask, ax, 0.0), axis=0), tl.max(tl.where(mask & ~(ax <= _FLT_MAX), 1, 0), axis=0) > 0


@triton.jit
def _store_pairs(src, row, lo_v, hi_v, end, n, scale, scale_next, QMAX: tl.constexpr, PAIRS: tl.constexpr):
    """int4 bytes for the even values e in [lo_v, hi_v) of a block ending at ``end``: e with ``scale``, and e + 1 with
    ``scale`` inside the block, ``scale_next`` when it starts the next block, or the padding nibble past n."""
    e = lo_v + (lo_v % 2) + 2 * tl.arange(0, PAIRS)
    ok = e < hi_v
    inside = e + 1 < end
    nxt = (e + 1 == end) & (e + 1 < n)
    x0 = tl.load(src + e, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + e + 1, mask=ok & (inside | nxt), other=0.0).to(tl.float32)
    lo = _quant(x0, scale, QMAX) + 8
    hi = tl.where(inside, _quant(x1, scale, QMAX), tl.where(nxt, _quant(x1, scale_next, QMAX), 0)) + 8
    tl.store(row + e // 2, (lo | (hi << 4)).to(tl.uint8), mask=ok)


@triton.jit
def _encode_seg_fused(x_ptr, order_ptr, out_ptr, tab_ptr, n, nbr, U, nbt, W, P4,
                      HAS_ORDER: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, ALIGN)
    row = out_ptr + i.to(tl.int64) * W
    start, m = _seg_block(tab_ptr, j, nbr, U, ALIGN)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    amax, bad = _block_absmax(src, start, m, BLOCK)
    scale = _block_scale(amax, bad, QMAX)
    if BITS == 8:
        offs = tl.arange(0, BLOCK)
        mask = offs < m
        x = tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(row + start + offs, (_quant(x, scale, QMAX) & 0xFF).to(tl.uint8), mask=mask)
    else:
        end = start + m
        # the next block's scale, needed only when this block ends on an odd value inside the chunk
        start1, m1 = _seg_block(tab_ptr, tl.minimum(j + 1, nbt - 1), nbr, U, ALIGN)
        m1 = tl.where((end % 2 == 1) & (j + 1 < nbt), m1, 0)
        amax1, bad1 = _block_absmax(src, start1, m1, BLOCK)
        _store_pairs(src, row, start, end, end, n, scale, _block_scale(amax1, bad1, QMAX), QMAX, BLOCK // 2)
    _store_scale(row, P4, j, scale)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _encode_seg_scales(x_ptr, order_ptr, out_ptr, tab_ptr, n, nbr, U, W, P4,
                       HAS_ORDER: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, ALIGN)
    start, m = _seg_block(tab_ptr, j, nbr, U, ALIGN)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    scale = _tiled_block_scale(src, start, m, QMAX, TILE)
    row = out_ptr + i.to(tl.int64) * W
    _store_scale(row, P4, j, scale)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _encode_seg_values(x_ptr, order_ptr, out_ptr, tab_ptr, n, nbr, U, nbt, W, P4,
                       HAS_ORDER: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr):
    """Quantize tile t of block j with the scales _encode_seg_scales wrote."""
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, ALIGN)
    row = out_ptr + i.to(tl.int64) * W
    start, m = _seg_block(tab_ptr, j, nbr, U, ALIGN)
    end = start + m
    lo_v = start + t * TILE
    hi_v = tl.minimum(lo_v + TILE, end)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    scale = _load_scale(row, P4, j)
    if BITS == 8:
        offs = lo_v + tl.arange(0, TILE)
        mask = offs < hi_v
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(row + offs, (_quant(x, scale, QMAX) & 0xFF).to(tl.uint8), mask=mask)
    else:
        scale_next = _load_scale(row, P4, tl.minimum(j + 1, nbt - 1))
        _store_pairs(src, row, lo_v, hi_v, end, n, scale, scale_next, QMAX, TILE // 2)


@triton.jit
def _dequant_seg(row, P4, e, mask, j, BITS: tl.constexpr):
    """fp32 values e (value indices, all in block j) of one wire row."""
    return _unpack(row, e, mask, BITS) * _load_scale(row, P4, j)


@triton.jit
def _decode_seg(wire_ptr, out_ptr, tab_ptr, n, nbr, U, W, P4, BITS: tl.constexpr, TILE: tl.constexpr,
                ALIGN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    start, m = _seg_block(tab_ptr, j, nbr, U, ALIGN)
    offs = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < m
    e = start + offs
    v = _dequant_seg(wire_ptr + i * W, P4, e, mask, j, BITS)
    _store_values(out_ptr + _chunk(i, n, ALIGN) + e, v, mask)


@triton.jit
def _decode_seg_sum(wire_ptr, out_ptr, tab_ptr, k, n, nbr, U, W, P4, BITS: tl.constexpr, TILE: tl.constexpr,
                    ALIGN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    start, m = _seg_block(tab_ptr, j, nbr, U, ALIGN)
    offs = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < m
    e = start + offs
    acc = _dequant_seg(wire_ptr, P4, e, mask, j, BITS)
    row = wire_ptr
    for _ in range(1, k):  # row order, as the CPU kernels and the reference add
        row += W
        acc = acc + _dequant_seg(row, P4, e, mask, j, BITS)
    tl.store(out_ptr + e, acc, mask=mask)


def encode_wire_seg(codec: Codec, x: Tensor, k: int, n: int, out: Tensor, order: Tensor | None,
                    layout) -> None:
    """``encode_wire`` for chunks cut by a row layout (``format._Layout``): blocks never span two segments."""
    if _grouped(codec):
        encode_wire_x(codec, x, k, n, out, order, layout, None)
        return
    P4 = codec.padded_payload_bytes(n)
    nbt = _seg_blocks(layout, n)
    W = P4 + 4 * nbt
    if nbt == 0:
        return
    tab = layout.table(x.device)
    has_order = order is not None
    order_arg = order if has_order else out
    block = codec.block
    if block <= _FUSED_MAX:
        _encode_seg_fused[(nbt, k)](x, order_arg, out, tab, n, layout.nbr, layout.U, nbt, W, P4, HAS_ORDER=has_order,
                                   BITS=codec.bits, BLOCK=max(_pow2(block), 2), ALIGN=layout.align,
                                   enable_fp_fusion=False)
        return
    _encode_seg_scales[(nbt, k)](x, order_arg, out, tab, n, layout.nbr, layout.U, W, P4, HAS_ORDER=has_order,
                                 BITS=codec.bits, TILE=_SCALE_TILE, ALIGN=layout.align,
                                 enable_fp_fusion=False)
    _encode_seg_values[(nbt, k, triton.cdiv(block, _TILE))](x, order_arg, out, tab, n, layout.nbr, layout.U, nbt, W,
                                                            P4, HAS_ORDER=has_order, BITS=codec.bits, TILE=_TILE,
                                                            ALIGN=layout.align, enable_fp_fusion=False)


def decode_wire_seg(codec: Codec, wire: Tensor, k: int, n: int, out: Tensor, layout) -> None:
    """``decode_wire`` for chunks cut by a row layout: one program per (block, chunk, tile of the block); blocks
    that fit one tile go through the grouped kernels (``_grouped``)."""
    if _grouped(codec):
        decode_wire_x(codec, wire, k, n, out, layout, False)
        return
    nbt = _seg_blocks(layout, n)
    if nbt == 0 or k == 0:
        return
    P4 = codec.padded_payload_bytes(n)
    _decode_seg[(nbt, k, triton.cdiv(codec.block, _TILE))](wire, out, layout.table(wire.device), n, layout.nbr,
                                                           layout.U, P4 + 4 * nbt, P4, BITS=codec.bits, TILE=_TILE,
                                                           ALIGN=layout.align, enable_fp_fusion=False)


def decode_wire_sum_seg(codec: Codec, wire: Tensor, k: int, n: int, out: Tensor, layout) -> None:
    """``decode_wire_sum`` for chunks cut by a row layout: rows added in order inside each program."""
    if _grouped(codec):
        decode_wire_x(codec, wire, k, n, out, layout, True)
        return
    if k == 0:
        out.zero_()
        return
    nbt = _seg_blocks(layout, n)
    if nbt == 0:
        return
    P4 = codec.padded_payload_bytes(n)
    _decode_seg_sum[(nbt, triton.cdiv(codec.block, _TILE))](wire, out, layout.table(wire.device), k, n, layout.nbr,
                                                            layout.U, P4 + 4 * nbt, P4, BITS=codec.bits, TILE=_TILE,
                                                            ALIGN=layout.align, enable_fp_fusion=False)


# ---- rotated and stochastic formats (format.py: "Rotation", "Stochastic rounding") ----------------------------
# Parallel to kernels.c's ts_encode_x / ts_decode_x. One program per (block, chunk), blocks on grid axis 0; the
# block is read in tiles of XT values (a multiple of 32, so rotation groups never straddle two tiles): a first pass
# takes the absmax of the rotated values, a second quantizes them. int8 values go straight to the wire. int4 values
# of flat chunks with an even block, and of row layouts aligned for 16-byte loads, are packed by the grouped kernel
# itself (every block starts on an even value); otherwise they go one a byte to a staging tensor that a second kernel
# packs (a block may start on an odd value, and no two programs may write one byte). Row layouts with even but
# smaller alignment stay staged: packing them in the encode kernel, with 4-byte loads, took 25% longer on an H200;
# with 16-byte loads (`align` 16) rows encode 1.7-2x as fast as odd-width ones, staged (docs/codecs.md).
_NORM32 = tl.constexpr(0.17677669529663687)  # fp32(32 ** -0.5); read inside kernels: constexpr


@triton.jit
def _mix(v):
    """The format's 32-bit hash (uint32 arithmetic wraps mod 2**32)."""
    v = v ^ (v >> 16)
    v = v * tl.full(v.shape, 0x7FEB352D, tl.uint32)
    v = v ^ (v >> 15)
    v = v * tl.full(v.shape, 0x846CA68B, tl.uint32)
    return v ^ (v >> 16)


@triton.jit
def _block_key(seed_lo, seed_hi, i, j):
    """The stochastic-rounding key of block(s) j of wire row i (the format's hash of the seed, the row, the block)."""
    rkey = _mix(_mix(_mix(seed_lo.to(tl.uint32) ^ tl.full([], 0x243F6A88, tl.uint32)) ^ seed_hi.to(tl.uint32))
                ^ i.to(tl.uint32))
    return _mix(rkey ^ j.to(tl.uint32))


@triton.jit
def _quantize_x(y, scale, offs, bkey, QMAX: tl.constexpr, SR: tl.constexpr, RECIP: tl.constexpr):
    """q of fp32 values y with their block's scale, as int32: t = y / scale, round half to even, or (SR) floor(t + u)
    with u from the block key and each value's offset in its block; clamped; 0 where the scale is zero or not
    finite. RECIP (rotated and stochastic formats): t = y * fp32(1 / scale), a subnormal scale and its values first
    lifted by 2**24; plain formats divide exactly. Launched without fp fusion, so t is rounded before u is added."""
    ok = scale > 0.0
    safe = tl.where(ok, scale, 1.0)
    if RECIP:
        up = tl.where(safe < 1.1754943508222875e-38, 16777216.0, 1.0)  # 2**-126, 2**24
        t = (y * up) * tl.div_rn(1.0, safe * up)
    else:
        t = tl.div_rn(y, safe)
    if SR:
        h = _mix(bkey ^ (offs.to(tl.uint32) * tl.full(offs.shape, 0x9E3779B9, tl.uint32)))
        u = (h >> 8).to(tl.float32) * 5.960464477539063e-08  # 2**-24
        q = tl.floor(t + u)
    else:
        q = _rne(t)
    return tl.where(ok, tl.minimum(tl.maximum(q, -QMAX), QMAX), 0.0).to(tl.int32)


@triton.jit
def _butterfly(x, G: tl.constexpr, H: tl.constexpr):
    """One stage of the 32-point transform on [G, 32] values: p and p + H (p & H == 0) -> a + b, a - b."""
    v = tl.permute(tl.reshape(x, [G, 32 // (2 * H), 2, H]), (0, 1, 3, 2))
    a, b = tl.split(v)
    v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(v, [G, 32])


@triton.jit
def _butterflies(x, G: tl.constexpr):
    """The transform's five butterfly stages on [G, 32] values, without the normalization."""
    r = _butterfly(x, G, 1)
    r = _butterfly(r, G, 2)
    r = _butterfly(r, G, 4)
    r = _butterfly(r, G, 8)
    return _butterfly(r, G, 16)


@triton.jit
def _rotate_tile(x, s, t, m, XT: tl.constexpr):
    """The whole 32-value groups of a tile (values t .. t + XT of a block of m values) as B(x) * fp32(s * norm), the
    rest as x * s: rotating takes s = 1 (both products exact), decoding takes q (integers as fp32, so the butterflies
    are exact) and its block's scale."""
    G: tl.constexpr = XT // 32
    x2 = tl.reshape(x, [G, 32])
    r = _butterflies(x2, G) * (s * _NORM32)
    whole = t + tl.arange(0, G) * 32 + 32 <= m
    return tl.reshape(tl.where(whole[:, None], r, x2 * s), [XT])


@triton.jit
def _rotate_rows(y, s, m, GB: tl.constexpr, XT: tl.constexpr):
    """``_rotate_tile`` of GB blocks at once: row b of y ([GB, XT]) holds block b's first m[b] values, s is 1 or their
    scales ([GB, 1])."""
    G: tl.constexpr = XT // 32
    r = tl.reshape(_butterflies(tl.reshape(y, [GB * G, 32]), GB * G), [GB, XT]) * (s * _NORM32)
    whole = (tl.arange(0, XT) // 32 * 32 + 32)[None, :] <= m[:, None]
    return tl.where(whole, r, y * s)


@triton.jit
def _block_of(tab_ptr, j, nbr, U, n, block, SEG: tl.constexpr, ALIGN: tl.constexpr):
    """First value and length of block j of a chunk: flat, or by the row layout's table."""
    if SEG:
        return _seg_block(tab_ptr, j, nbr, U, ALIGN)
    start = j * block
    return start, tl.minimum(block, n - start)


@triton.jit
def _encode_x(x_ptr, order_ptr, out_ptr, q_ptr, tab_ptr, n, nbr, U, block, W, P4, seed_lo, seed_hi,
              HAS_ORDER: tl.constexpr, SEG: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr,
              SR: tl.constexpr, XT: tl.constexpr, ALIGN: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, ALIGN)
    row = out_ptr + i.to(tl.int64) * W
    start, m = _block_of(tab_ptr, j, nbr, U, n, block, SEG, ALIGN)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    amax = tl.zeros([XT], dtype=tl.float32)
    bad = tl.zeros([XT], dtype=tl.int32)
    for t in range(0, m, XT):
        offs = t + tl.arange(0, XT)
        mask = offs < m
        y = tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            y = _rotate_tile(y, 1.0, t, m, XT)
        a = tl.abs(y)
        amax = tl.maximum(amax, tl.where(mask, a, 0.0))
        bad = bad + tl.where(mask & ~(a <= _FLT_MAX), 1, 0)
    scale = _block_scale(tl.max(amax, axis=0), tl.max(bad, axis=0) > 0, QMAX)
    bkey = _block_key(seed_lo, seed_hi, i, j) if SR else 0
    for t in range(0, m, XT):
        offs = t + tl.arange(0, XT)
        mask = offs < m
        y = tl.load(src + start + offs, mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            y = _rotate_tile(y, 1.0, t, m, XT)
        q = _quantize_x(y, scale, offs, bkey, QMAX, SR, ROTATE or SR)
        if BITS == 8:
            tl.store(row + start + offs, (q & 0xFF).to(tl.uint8), mask=mask)
        else:
            tl.store(q_ptr + i.to(tl.int64) * n + start + offs, q.to(tl.int8), mask=mask)
    _store_scale(row, P4, j, scale)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _decoded(row, P4, e, mask, j, m, t, BITS: tl.constexpr, ROTATE: tl.constexpr, XT: tl.constexpr,
             GB: tl.constexpr):
    """One wire row's values e, rotated back: an [XT] tile at offset t of block j (GB == 0), or GB blocks at once
    ([GB, XT], j a [GB, 1] column, m their lengths)."""
    if not ROTATE:
        return _dequant_seg(row, P4, e, mask, j, BITS)
    q, s = _unpack(row, e, mask, BITS), _load_scale(row, P4, j)
    if GB == 0:
        return _rotate_tile(q, s, t, m, XT)
    return _rotate_rows(q, s, m, GB, XT)


@triton.jit
def _decode_tile(wire_ptr, out_ptr, k, n, W, P4, e, mask, j, m, t, BITS: tl.constexpr, ROTATE: tl.constexpr,
                 SUM: tl.constexpr, XT: tl.constexpr, GB: tl.constexpr, ALIGN: tl.constexpr):
    """Store the values e of row i (SUM: of every row, added in row order), as ``_decoded`` gives them."""
    if SUM:
        row = wire_ptr
        acc = _decoded(row, P4, e, mask, j, m, t, BITS, ROTATE, XT, GB)
        for _ in range(1, k):
            row += W
            acc = acc + _decoded(row, P4, e, mask, j, m, t, BITS, ROTATE, XT, GB)
        tl.store(out_ptr + e, acc, mask=mask)
    else:
        i = tl.program_id(1).to(tl.int64)
        v = _decoded(wire_ptr + i * W, P4, e, mask, j, m, t, BITS, ROTATE, XT, GB)
        _store_values(out_ptr + _chunk(i, n, ALIGN) + e, v, mask)


# Blocks that fit one tile (block <= _TILE, every default): GB blocks per program as a [GB, XT] tile, so that a
# program holds about _TILE values however small the blocks; the same arithmetic per value as _encode_x/_decode_x.
@triton.jit
def _encode_xg(x_ptr, order_ptr, out_ptr, q_ptr, tab_ptr, n, nbr, U, block, W, P4, nbt, seed_lo, seed_hi,
               HAS_ORDER: tl.constexpr, SEG: tl.constexpr, BITS: tl.constexpr, ROTATE: tl.constexpr,
               SR: tl.constexpr, XT: tl.constexpr, GB: tl.constexpr, PACK: tl.constexpr, ALIGN: tl.constexpr):
    """GB blocks of chunk order[i] into wire row i; int4 values are packed here (PACK: every block starts on an even
    value), else staged for _pack4_x."""
    jj = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
    i = tl.program_id(1)
    valid = jj < nbt
    j = tl.where(valid, jj, 0)
    src = _chunk_src(x_ptr, order_ptr, i, n, HAS_ORDER, ALIGN)
    row = out_ptr + i.to(tl.int64) * W
    start, m = _block_of(tab_ptr, j, nbr, U, n, block, SEG, ALIGN)
    m = tl.where(valid, m, 0)
    QMAX: tl.constexpr = 127 if BITS == 8 else 7
    offs = tl.arange(0, XT)
    mask = offs[None, :] < m[:, None]
    y = tl.load(src + start[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        y = _rotate_rows(y, 1.0, m, GB, XT)
    a = tl.abs(y)
    amax = tl.max(tl.where(mask, a, 0.0), axis=1)
    bad = tl.max(tl.where(mask & ~(a <= _FLT_MAX), 1, 0), axis=1) > 0
    scale = _block_scale(amax, bad, QMAX)
    bkey = _block_key(seed_lo, seed_hi, i, j)[:, None] if SR else 0
    q = _quantize_x(y, scale[:, None], offs[None, :], bkey, QMAX, SR, ROTATE or SR)
    e = start[:, None] + offs[None, :]
    if BITS == 8:
        tl.store(row + e, (q & 0xFF).to(tl.uint8), mask=mask)
    elif PACK:  # q is 0 past m (the padding nibble 8), as _pack4_x writes it
        p = tl.arange(0, XT // 2)
        lo, hi = tl.split(tl.reshape(q, [GB, XT // 2, 2]))
        tl.store(row + start[:, None] // 2 + p[None, :], ((lo + 8) | ((hi + 8) << 4)).to(tl.uint8),
                 mask=2 * p[None, :] < m[:, None])
    else:
        tl.store(q_ptr + i.to(tl.int64) * n + e, q.to(tl.int8), mask=mask)
    tl.store((row + P4).to(tl.pointer_type(tl.float32)) + j, scale, mask=valid)
    _zero_padding(row, n, P4, BITS)


@triton.jit
def _decode_xg(wire_ptr, out_ptr, tab_ptr, k, n, nbr, U, block, W, P4, nbt, SEG: tl.constexpr, BITS: tl.constexpr,
               ROTATE: tl.constexpr, SUM: tl.constexpr, XT: tl.constexpr, GB: tl.constexpr, ALIGN: tl.constexpr):
    """GB blocks of row i (SUM: of every row, added in row order): dequantize, rotate back, store."""
    jj = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
    valid = jj < nbt
    j = tl.where(valid, jj, 0)
    start, m = _block_of(tab_ptr, j, nbr, U, n, block, SEG, ALIGN)
    m = tl.where(valid, m, 0)
    offs = tl.arange(0, XT)
    mask = offs[None, :] < m[:, None]
    e = start[:, None] + offs[None, :]
    _decode_tile(wire_ptr, out_ptr, k, n, W, P4, e, mask, j[:, None], m, 0, BITS, ROTATE, SUM, XT, GB, ALIGN)


@triton.jit
def _pack4_x(q_ptr, out_ptr, n, P, W, TILE: tl.constexpr):
    """int4 bytes p of wire row i from the staged values 2p, 2p + 1 (the padding nibble 8 past n)."""
    p = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    i = tl.program_id(1).to(tl.int64)
    ok = p < P
    src = q_ptr + i * n
    lo = tl.load(src + 2 * p, mask=ok, other=0).to(tl.int32) + 8
    hi = tl.load(src + 2 * p + 1, mask=ok & (2 * p + 1 < n), other=0).to(tl.int32) + 8
    tl.store(out_ptr + i * W + p, (lo | (hi << 4)).to(tl.uint8), mask=ok)


@triton.jit
def _decode_x(wire_ptr, out_ptr, tab_ptr, k, n, nbr, U, block, W, P4, SEG: tl.constexpr, BITS: tl.constexpr,
              ROTATE: tl.constexpr, SUM: tl.constexpr, XT: tl.constexpr, ALIGN: tl.constexpr):
    """Block j of row i (SUM: of every row, added in row order): dequantize, rotate back, store."""
    j = tl.program_id(0).to(tl.int64)
    start, m = _block_of(tab_ptr, j, nbr, U, n, block, SEG, ALIGN)
    for t in range(0, m, XT):
        offs = t + tl.arange(0, XT)
        mask = offs < m
        e = start + offs
        _decode_tile(wire_ptr, out_ptr, k, n, W, P4, e, mask, j, m, t, BITS, ROTATE, SUM, XT, 0, ALIGN)


def _grouped(codec: Codec) -> bool:
    """Whether a plain codec's chunks go through the grouped kernels of the general path (``_encode_xg``,
    ``_decode_xg``: no rotation, no stochastic rounding, the same arithmetic): when its blocks fit one tile. One
    program per block, as the plain kernels give, is too little work for a GPU: on an H200 int4:64 ran at 6-15% of a
    copy flat and 3-6% on row layouts, 35-59% and 16-42% grouped (flat decoding already runs tiles of values)."""
    return bool(_x_group(codec))


def _x_tile(codec: Codec) -> int:
    return min(max(_pow2(codec.block), 32), _TILE)


def _x_group(codec: Codec) -> int:
    """Blocks per program of the grouped kernels (about X_VALUES_PER_PROGRAM values, at least one block), or 0 when
    a block needs several tiles."""
    return max(1, X_VALUES_PER_PROGRAM // _x_tile(codec)) if codec.block <= _TILE else 0


def encode_wire_x(codec: Codec, x: Tensor, k: int, n: int, out: Tensor, order: Tensor | None, layout,
                  seed: int | None) -> None:
    """``encode_wire`` / ``encode_wire_seg`` for a rotated or stochastic codec (``layout`` None: flat chunks;
    ``seed``: the 64-bit stochastic-rounding key, None for round half to even)."""
    P, P4 = codec.payload_numel(n), codec.padded_payload_bytes(n)
    nbt = codec.scales_numel(n) if layout is None else _seg_blocks(layout, n)
    W = P4 + 4 * nbt
    if nbt == 0:
        return
    seg = layout is not None
    tab = layout.table(x.device) if seg else out  # any pointer; unused without SEG
    nbr, U = (layout.nbr, layout.U) if seg else (0, 0)
    has_order = order is not None
    order_arg = order if has_order else out
    key = 0 if seed is None else seed
    XT, GB = _x_tile(codec), _x_group(codec)
    align = layout.align if seg else 1
    # every block starts and ends on an even value, so no byte has two writers; a row layout also loads 16-byte
    # vectors, without which packing here measured slower than staging (see above)
    pack = codec.bits == 4 and bool(GB) and (align * x.element_size() >= 16 if seg else codec.block % 2 == 0)
    staged = x.new_empty(k * n, dtype=torch.int8) if codec.bits == 4 and not pack else out
    if GB:
        _encode_xg[(triton.cdiv(nbt, GB), k)](x, order_arg, out, staged, tab, n, nbr, U, codec.block, W, P4, nbt,
                                              key & 0xFFFFFFFF, key >> 32, HAS_ORDER=has_order, SEG=seg,
                                              BITS=codec.bits, ROTATE=codec.rotate, SR=seed is not None, XT=XT,
                                              GB=GB, PACK=pack, ALIGN=align, enable_fp_fusion=False,
                                              num_warps=X_WARPS)
    else:
        _encode_x[(nbt, k)](x, order_arg, out, staged, tab, n, nbr, U, codec.block, W, P4, key & 0xFFFFFFFF,
                            key >> 32, HAS_ORDER=has_order, SEG=seg, BITS=codec.bits, ROTATE=codec.rotate,
                            SR=seed is not None, XT=XT, ALIGN=align, enable_fp_fusion=False)
    if codec.bits == 4 and not pack:
        _pack4_x[(triton.cdiv(P, _TILE), k)](staged, out, n, P, W, TILE=_TILE)


def decode_wire_x(codec: Codec, wire: Tensor, k: int, n: int, out: Tensor, layout, sum_rows: bool) -> None:
    """``decode_wire`` / ``decode_wire_sum`` (``sum_rows``) of a rotated codec, flat or with a row layout."""
    if sum_rows and k == 0:
        out.zero_()
        return
    nbt = codec.scales_numel(n) if layout is None else _seg_blocks(layout, n)
    if nbt == 0 or k == 0:
        return
    seg = layout is not None
    tab = layout.table(wire.device) if seg else wire
    nbr, U = (layout.nbr, layout.U) if seg else (0, 0)
    P4 = codec.padded_payload_bytes(n)
    XT, GB = _x_tile(codec), _x_group(codec)
    align = layout.align if seg else 1
    if GB:
        blocks = triton.cdiv(nbt, GB)
        _decode_xg[(blocks,) if sum_rows else (blocks, k)](wire, out, tab, k, n, nbr, U, codec.block, P4 + 4 * nbt,
                                                            P4, nbt, SEG=seg, BITS=codec.bits, ROTATE=codec.rotate,
                                                            SUM=sum_rows, XT=XT, GB=GB, ALIGN=align,
                                                            enable_fp_fusion=False, num_warps=X_WARPS)
        return
    grid = (nbt,) if sum_rows else (nbt, k)
    _decode_x[grid](wire, out, tab, k, n, nbr, U, codec.block, P4 + 4 * nbt, P4, SEG=seg, BITS=codec.bits,
                    ROTATE=codec.rotate, SUM=sum_rows, XT=XT, ALIGN=align, enable_fp_fusion=False)
