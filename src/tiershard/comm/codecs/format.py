"""Block-wise symmetric absmax quantization for the qwZ (int8 weights) and qgZ (int4 gradients) wire formats.

Why block-wise: one scale for a whole shard lets a single outlier flatten every other value to zero; a scale
per ``block`` consecutive values confines an outlier's damage to its own block, at a cost of 4 bytes per block
(0.2% of the int8 payload at block 2048, 12.5% of the int4 payload at block 64).

Why symmetric: weights and gradients are roughly zero-centred, so a zero point buys little; without one,
0 encodes exactly (padding and all-zero blocks cost no error) and decoding is one multiply per value.

Format, for a flat tensor of ``numel`` values split into ``nblocks = ceil(numel / block)`` blocks (the last one
may be short): ``scale[b] = absmax(block b) / qmax`` in fp32, ``q = round(x / scale)`` clamped to [-qmax, qmax]
(qmax = 127 for int8, 7 for int4; fp32 division, round half to even), ``x_hat = q * scale`` in fp32, then cast to
the output dtype (round to nearest even). An all-zero block has scale 0 and decodes to exact zeros. The payload
holds only the ``numel`` real values:

- int8: ``numel`` int8 bytes.
- int4: ``ceil(numel / 2)`` uint8 bytes; value ``2i`` sits in the low nibble of byte ``i`` and value ``2i+1`` in
  the high nibble, each stored offset-binary as ``q + 8`` (1..15). An odd ``numel`` pads the last high nibble with 8 (0).

Non-finite input: a block holding nan or inf gets a nan scale and an all-zero ``q``, so it decodes to nan and so
does any sum it enters; the other blocks are unaffected. Nothing raises and nothing waits for the device: an
overflowed fp16 gradient reaches every rank as nan, where the loss scaler sees it and skips the step.

Error bound: every element of a finite block satisfies ``|x - x_hat| <= scale_of_its_block / 2`` (plus fp32
rounding, about ``qmax * 2**-23 * scale``), i.e. at most ``absmax / 254`` (int8) or ``absmax / 14`` (int4).

Wire format (``encode_wire`` / ``decode_wire`` / ``decode_wire_sum``): payload and scales travel in one buffer, so
one collective moves both. ``k`` equal chunks of ``n`` values each take ``wire_bytes(n, segments)`` bytes, chunk
``i`` at byte ``i * wire_bytes(n, segments)``::

    [0, P)        payload, P = payload_numel(n) bytes (int8 values or packed int4, as above)
    [P, P4)       zero bytes, P4 = 4 * ceil(P / 4), so the scales are 4-byte aligned
    [P4, W)       scales_numel(n, segments) fp32 scales in block order, native byte order (little-endian on every
                  supported machine)

``W = wire_bytes(n, segments) = P4 + 4 * scales_numel(n, segments)`` is a multiple of 4, so every chunk's scales
are aligned when the buffer is; it is exactly what goes on the wire, and what the traffic formulas count.

Row layouts (``segments``): a unit's gradient buffer is a (rows x U) matrix whose rows hold one slot of every
parameter side by side, so fixed blocks straddle parameter boundaries and a small tensor (a norm gain, a bias) shares
its scale with a large neighbour that quantizes it to zero. The wire API therefore takes an optional row layout,
``segments``: the widths of the segments of one row (non-negative ints, ``U = sum(segments) >= 1``). A chunk of
``n`` values is then ``n // U`` whole rows of that layout (``n`` must be a multiple of ``U``), and blocks are cut
inside each segment of each row: a segment of width ``w`` gets ``ceil(w / block)`` blocks, all of ``block`` values
except the last, which holds the remaining ``w - (ceil(w / block) - 1) * block`` (a zero-width segment gets none).
Blocks are numbered by their first value (row 0's segments left to right, then row 1's, ...) and scale ``b`` of a
chunk is block ``b``'s, so ``scales_numel(n, segments) = (n // U) * sum(ceil(w / block) for w in segments)``. The
payload is unchanged: the ``n`` values in order, int4 nibbles paired by position (a byte may hold the last value of
one block and the first of the next), and so is the rest of the wire layout above. Without ``segments`` (None, the
default) a chunk is one flat run of blocks. Every block obeys the error bound above with its own scale, so a segment's
values are bounded by that segment's absmax (per block), whatever its neighbours hold.

Rotation (``rotate``, spec flag ``:h``): SDP4Bit's Hadamard rotation spreads an outlier's magnitude over 32 values,
so one spike no longer sets a scale that rounds its 31 neighbours to zero. Each block is cut into groups of 32
consecutive values from its first value; every whole group is replaced by its normalized Walsh-Hadamard transform
``y = (H32 x) * fp32(32 ** -0.5)`` before the scale is taken, and a block's last ``m % 32`` values (the tail of a
short block: the end of a chunk, or of a segment of a row layout) are left as they are. The transform runs in fp32
as five butterfly stages ``h = 1, 2, 4, 8, 16``: values ``p`` and ``p + h`` (``p & h == 0``) become ``a + b`` and
``a - b``; the product by ``fp32(32 ** -0.5)`` comes last. The scale is taken AFTER the rotation
(``absmax(y) / qmax``), the payload holds ``q(y)``, and decoding applies the same transform to each whole group of
``q * scale`` (it is its own inverse) in one rounding: the five stages on ``q`` itself (integers, so exact) and then
the product by ``fp32(scale * fp32(32 ** -0.5))``; the tail decodes as ``q * scale``; then the cast to the output
dtype. Because the transform
is orthogonal, a block's L2 error is that of its rotated values: ``||x - x_hat||_2 <= sqrt(m) * scale / 2`` (plus
fp32 rounding), with ``scale = absmax(H x) / qmax``; per element the half-step bound of the unrotated format no
longer holds (an element may receive up to ``sqrt(32) * scale / 2``).

Stochastic rounding (``stochastic``, flag ``:sr``): ``q = clamp(floor(y / scale + u), -qmax, qmax)`` instead of
round-half-even, with ``y / scale + u`` an fp32 sum, so ``E[q] = y / scale`` (unbiased, up to fp32 rounding) and every
element is within one step (``scale``) of its input. ``u`` in [0, 1) comes from a counter-based hash, never from an
RNG state, so the same ``seed`` gives the same bits on every backend and every run. With ``mix(v)`` the 32-bit hash
``v ^= v >> 16; v *= 0x7FEB352D; v ^= v >> 15; v *= 0x846CA68B; v ^= v >> 16`` (all mod 2**32), the 64-bit ``seed``
(taken mod 2**64) split into ``lo`` and ``hi`` halves, ``i`` the wire row (chunk) being written, ``b`` the block's
scale index in that row and ``j`` the value's offset in its block:
``row_key = mix(mix(mix(lo ^ 0x243F6A88) ^ hi) ^ i)``, ``block_key = mix(row_key ^ b)``,
``u = (mix(block_key ^ (j * 0x9E3779B9 mod 2**32)) >> 8) * 2**-24``. Decoding does not depend on the seed.

Quantizing by the reciprocal (rotated and stochastic formats, the ones qgZ's hops run on every step): their
``y / scale`` is the product ``t = fp32(y * r)`` with ``r = fp32(1 / scale)``, one multiply per value where an exact
quotient costs a division (a vector every 5-10 cycles on x86) or a check of every value against the rounding
boundaries; a subnormal scale first has itself and its block's values multiplied by ``2**24`` (exactly), so ``r``
stays finite. ``q = clamp(round_half_even(t))`` or ``clamp(floor(fp32(t + u)))``. ``t`` is within ``2**-22 |t|`` of
the exact quotient, so the bounds above hold up to fp32 rounding, as they did.

The sizes are pure functions of ``numel`` (and ``segments``), so every rank can pre-allocate matching buffers:
``payload_numel``, ``padded_payload_bytes``, ``scales_numel`` and ``wire_bytes`` below, which ``BlockCodec``'s
methods of the same names call.

This module holds the format and nothing that runs it: the constants, the row layouts, the order and dtype checks.
``reference`` (torch), ``native`` (C) and ``triton_kernels`` implement it, ``backends`` picks one per call, and
``block.BlockCodec`` is the API.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
from torch import Tensor

# Default blocks, measured on CPU (fp32, seed 0) on a gradient-like 4096x768 tensor: N(0,1) rows times a per-row
# lognormal scale (sigma 0.5), 1% of rows x50, 0.01% of elements x100. Median per-row relative L2 error:
#   int4: block 64 0.107, 128 0.117, 256 0.126, 512 0.142, 1024 0.161, 2048 0.223, 4096 0.345
#   int8: block 64 0.006, 256 0.007, 512 0.008, 1024 0.009, 2048 0.013, 4096 0.021
# (plain N(0,1): int8 2048 0.0083, int4 512 0.135). Larger blocks let outlier rows and spikes wipe out their
# neighbours (0.14 -> 0.22 from 512 to 2048). A flat gradient buffer also packs tensors of very different scales
# (norm gains next to embedding rows) into one block, so end to end the small block matters more than the table
# says: 50 AdamW steps of the test transformer on 2x2 ranks with qgZ ended 6.1% above exact ZeRO-3's loss at
# block 512, 2.9% at 128 and 1.6% at 64 (int8: 0.1%). int4 picks 64: scales cost 12.5% of the int4 payload,
# still 3.6x fewer bytes than bf16. int8 weights keep 2048 (0.2% overhead; weights lack gradient spikes, and
# DeepSpeed's qwZ uses even larger groups, 4k-16k).
DEFAULT_BLOCKS = {8: 2048, 4: 64}
_QMAX = {8: 127, 4: 7}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
GROUP = 32                    # values per Hadamard rotation group (SDP4Bit's H32)
_HASH_M1, _HASH_M2 = 0x7FEB352D, 0x846CA68B    # mix(): Wellons' lowbias32 constants
_HASH_SALT, _HASH_GOLD = 0x243F6A88, 0x9E3779B9
_MASK32, _MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF

Order = Union[Sequence[int], Tensor, None]
"""Which input chunk each wire row holds: row ``i`` <- chunk ``order[i]``; None is the identity."""


class Encoded(NamedTuple):
    """One encoding: ``payload`` (int8, or uint8 packed int4), fp32 ``scales`` (one per block), ``numel`` values."""

    payload: Tensor
    scales: Tensor
    numel: int


Segments = Sequence[int]
"""Widths of the segments of one row of a chunk (sum U): blocks never span two segments; see the module docstring."""


def payload_numel(bits: int, numel: int) -> int:
    """Payload bytes (= elements, the payload dtype is one byte) for ``numel`` values."""
    return numel if bits == 8 else (numel + 1) // 2


def padded_payload_bytes(bits: int, numel: int) -> int:
    """Payload bytes rounded up to a multiple of 4: where a wire chunk's scales start."""
    return -(-payload_numel(bits, numel) // 4) * 4


def scales_numel(block: int, numel: int, lay: _Layout | None = None) -> int:
    """fp32 scales (blocks) for ``numel`` values: ``ceil(numel / block)``, or ``lay``'s blocks a row times rows."""
    return -(-numel // block) if lay is None else lay.rows(numel) * lay.nbr


def wire_bytes(bits: int, block: int, numel: int, lay: _Layout | None = None) -> int:
    """Bytes of one wire chunk of ``numel`` values: padded payload plus 4 bytes per scale."""
    return padded_payload_bytes(bits, numel) + 4 * scales_numel(block, numel, lay)


def _check_order(order, k: int) -> list[int]:
    values = [int(o) for o in order]
    if len(values) != k or any(not 0 <= o < k for o in values):
        raise ValueError(f"order must list {k} chunk indices in [0, {k}), got {values}")
    return values


_ORDER_TENSORS: dict[tuple, Tensor] = {}  # (order, device) -> int64 index tensor, made once per group


def _order_index(order: Order, k: int, device: torch.device) -> Tensor | None:
    """``order`` as an int64 index tensor on ``device`` for the torch and Triton paths. A device tensor is used
    unchecked (checking it would wait for the device); a list is copied to the device once and then reused."""
    if order is None:
        return None
    if isinstance(order, Tensor) and order.device.type != "cpu":
        return order if order.dtype == torch.long else order.to(torch.long)
    key = (tuple(order.tolist()) if isinstance(order, Tensor) else tuple(order), str(device))
    index = _ORDER_TENSORS.get(key)
    if index is None:
        index = torch.tensor(_check_order(key[0], k), dtype=torch.long, device=device)
        if len(_ORDER_TENSORS) > 4096:
            _ORDER_TENSORS.clear()
        _ORDER_TENSORS[key] = index
    elif index.numel() != k:
        _check_order(key[0], k)
    return index


def _check_float(x: Tensor, what: str) -> Tensor:
    """``x`` detached and contiguous (codecs are never differentiated; no_grad would cost a microsecond a call)."""
    if x.dtype not in _FLOATS:
        raise ValueError(f"can only encode float32, bfloat16 or float16 tensors, got {x.dtype} for {what}")
    if x.requires_grad:
        x = x.detach()
    return x if x.is_contiguous() else x.contiguous()


class _Layout:
    """One row layout cut into blocks for one block size: built once per distinct (block, segments), then reused by
    every call, because a unit's layout never changes and the tables cost O(blocks per row) to build.

    ``starts`` holds the ``nbr + 1`` block boundaries of one row (``starts[0] = 0``, ``starts[nbr] = U``): block
    ``b`` of a row covers columns ``[starts[b], starts[b + 1])``. The C kernels read it as an int64 array, the
    Triton kernels as an int64 tensor on the device; the reference path uses index tensors derived from it.
    """

    __slots__ = ("block", "widths", "U", "nbr", "starts", "align", "c_starts", "c_addr", "_tables", "_ref")

    def __init__(self, block: int, widths: tuple[int, ...]):
        starts = [0]
        pos = 0
        for w in widths:
            if w:
                starts.extend(range(pos + block, pos + w, block))
                starts.append(pos + w)
                pos += w
        self.block, self.widths, self.U, self.nbr = block, widths, pos, len(starts) - 1
        self.starts = starts
        # the largest power of two up to 16 dividing every block boundary: the GPU kernels read and write 16-byte
        # vectors when a block's first value and length are multiples of it (4 fp32 or 8 bf16 values)
        self.align = math.gcd(16, *starts)
        # For the C kernels, after the starts: how many whole blocks of `block` values follow one another from each
        # block of a row, so those runs take the same straight loop as unsegmented chunks (only where that loop
        # applies: block % 32 == 0).
        runs = [0] * self.nbr
        if block % 32 == 0:
            for b in range(self.nbr - 1, -1, -1):
                if starts[b + 1] - starts[b] == block:
                    runs[b] = 1 + (runs[b + 1] if b + 1 < self.nbr and starts[b + 2] - starts[b + 1] == block else 0)
        self.c_starts = (ctypes.c_int64 * (2 * self.nbr + 1))(*starts, *runs)
        self.c_addr = ctypes.addressof(self.c_starts)
        self._tables: dict[str, Tensor] = {}
        self._ref: dict[str, tuple[Tensor, Tensor, Tensor]] = {}

    def rows(self, n: int) -> int:
        """Rows in a chunk of ``n`` values; a chunk must be whole rows."""
        if n % self.U:
            raise ValueError(f"a chunk of {n} values is not a whole number of rows of the layout: segments sum to "
                             f"U = {self.U}, and n must be a multiple of U")
        return n // self.U

    def table(self, device: torch.device) -> Tensor:
        """``starts`` as an int64 tensor on ``device`` (for the Triton kernels), copied there once."""
        key = str(device)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = torch.tensor(self.starts, dtype=torch.int64, device=device)
        return t

    def ref_index(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Index tensors for the reference path, made once per device. Each row is laid out padded, every block
        widened to ``block`` values (the padding reads column U, a zero column): ``gather`` (nbr * block) is the
        source column of each padded position, ``place`` (U) the padded position of each column, ``owner`` (U) the
        block of each column."""
        key = str(device)
        idx = self._ref.get(key)
        if idx is None:
            starts = torch.tensor(self.starts, dtype=torch.int64)
            lens = starts[1:] - starts[:-1]
            owner = torch.repeat_interleave(torch.arange(self.nbr), lens)
            col = torch.arange(self.U)
            place = owner * self.block + (col - starts[:-1][owner])
            gather = torch.full((self.nbr * self.block,), self.U, dtype=torch.int64)
            gather[place] = col
            idx = self._ref[key] = (gather.to(device), place.to(device), owner.to(device))
        return idx


_LAYOUTS: dict[int, dict[tuple, _Layout]] = {}  # block -> segments -> layout


def _layout(block: int, segments: Segments) -> _Layout:
    """The cached layout of ``segments`` for ``block``; raises ValueError for widths that are not a row layout. A
    tuple is looked up as it is (no allocation: this runs on every call); other sequences are copied to one."""
    if type(segments) is not tuple:
        if isinstance(segments, Tensor):
            segments = segments.tolist()
        try:
            segments = tuple(segments)
        except TypeError:
            raise ValueError(f"segments must be a sequence of segment widths, got {segments!r}") from None
    by_block = _LAYOUTS.get(block)
    if by_block is None:
        by_block = _LAYOUTS[block] = {}
    try:
        lay = by_block.get(segments)
    except TypeError:  # unhashable widths
        raise ValueError(f"segments must be a sequence of segment widths, got {list(segments)!r}") from None
    if lay is None:
        if (not segments or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in segments)
                or sum(segments) < 1):
            raise ValueError(f"segments must be non-negative integer widths with a positive sum, got {list(segments)}")
        lay = _Layout(block, segments)
        if len(by_block) > 1024:
            by_block.clear()
        by_block[segments] = lay
    return lay


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit, except that any nan equals any nan (a nan's payload bits are not part of the format)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype in _FLOATS:
        na, nb_ = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb_):
            return False
        ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
        a, b = a.masked_fill(na, 0).view(ints), b.masked_fill(nb_, 0).view(ints)
    return torch.equal(a, b)

