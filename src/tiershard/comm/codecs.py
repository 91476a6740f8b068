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

The sizes are pure functions of ``numel`` (and ``segments``), so every rank can pre-allocate matching buffers. The
separate payload/scales API (``encode``, ``encode_into``, ``decode_chunks``, ``decode_from``, ``decode``; flat
blocks only) stays for callers that move the two in separate collectives; ``decode_chunks`` decodes k concatenated
encodings at once.

Backends, chosen per call by the tensor's device, all giving the same bits on the CPU:

- CPU: fused C kernels (``codec_kernels.py``), built on first use; if they cannot be built, or disagree with the
  reference on a self-check, the reference torch path (a warning is issued only for a disagreement).
- CUDA: Triton kernels (``codec_triton.py``) for the wire API when ``triton`` imports (extra ``gpu``); the
  reference torch path otherwise. Neither synchronizes with the host.
- Anything else: the reference torch path.

``TIERSHARD_CODEC_KERNELS=torch`` forces the reference path everywhere (for debugging).
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch
from torch import Tensor

__all__ = ["BlockCodec", "Encoded", "INT8", "INT4", "codec_from_spec", "DEFAULT_BLOCKS", "Order", "kernel_status",
           "same_bits"]

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
_SPEC = re.compile(r"^int(8|4)(?::(\d+))?$")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_PARALLEL_MIN = 1 << 16  # values below which one thread beats waking the pool

Order = Union[Sequence[int], Tensor, None]
"""Which input chunk each wire row holds: row ``i`` <- chunk ``order[i]``; None is the identity."""


class Encoded(NamedTuple):
    """One encoding: ``payload`` (int8, or uint8 packed int4), fp32 ``scales`` (one per block), ``numel`` values."""

    payload: Tensor
    scales: Tensor
    numel: int


# ---- backend selection ------------------------------------------------------------------------------------
# Read once: the hot path must not consult the environment on every call (tests flip the variable below instead).
_force_reference = os.environ.get("TIERSHARD_CODEC_KERNELS", "auto").strip().lower() == "torch"
_select_lock = threading.Lock()
_cpu_state: object = None   # None: not tried; False: unusable; else codec_kernels.Kernels
_cpu_reason = "not tried yet"
_triton_state: object = None  # None: not tried; False: unusable; else the codec_triton module
_triton_reason = "not tried yet"


def _cpu_kernels():
    """The fused CPU kernels once built and checked against the reference, else None (the reference is used)."""
    global _cpu_state, _cpu_reason
    if _cpu_state is None:
        with _select_lock:
            if _cpu_state is None:
                from . import codec_kernels
                lib = codec_kernels.load()
                if lib is None:
                    _cpu_state, _cpu_reason = False, codec_kernels.status()
                else:
                    problem = _self_check(lib)
                    if problem is None:
                        _cpu_state, _cpu_reason = lib, repr(lib)
                    else:
                        _cpu_state, _cpu_reason = False, f"disabled, differs from the reference: {problem}"
                        warnings.warn(f"tiershard codec kernels {lib!r} {_cpu_reason}; using the torch path",
                                      RuntimeWarning, stacklevel=3)
    return _cpu_state or None


def _triton_kernels():
    """The Triton module when ``triton`` imports, else None."""
    global _triton_state, _triton_reason
    if _triton_state is None:
        with _select_lock:
            if _triton_state is None:
                try:
                    from . import codec_triton
                    _triton_state, _triton_reason = codec_triton, f"triton {codec_triton.triton.__version__}"
                except Exception as exc:  # noqa: BLE001 - no triton (or a broken one) means the torch path
                    _triton_state, _triton_reason = False, f"torch path: triton unavailable ({exc})"
    return _triton_state or None


def _cpu_lib(t: Tensor, dtype: torch.dtype):
    """The CPU kernels if ``t`` is a CPU tensor and they handle ``dtype``, else None."""
    if _force_reference or t.device.type != "cpu":
        return None
    lib = _cpu_state if _cpu_state is not None else _cpu_kernels()
    if not lib or (dtype is torch.float16 and not lib.has_f16):
        return None
    return lib


def _gpu_lib(t: Tensor, wire: Tensor):
    """The Triton kernels if ``t`` is a CUDA tensor, triton imports and ``wire`` is 4-byte aligned, else None."""
    if _force_reference or t.device.type != "cuda" or wire.data_ptr() % 4:
        return None
    return _triton_kernels()


def kernel_status() -> dict[str, str]:
    """Which codec backend each device uses and why (builds the CPU kernels if not built yet)."""
    if _force_reference:
        return {"cpu": "torch (TIERSHARD_CODEC_KERNELS=torch)", "cuda": "torch (TIERSHARD_CODEC_KERNELS=torch)"}
    _cpu_kernels()
    _triton_kernels()
    return {"cpu": f"c: {_cpu_reason}" if _cpu_state else f"torch: {_cpu_reason}", "cuda": _triton_reason}


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= _PARALLEL_MIN else 1


_ORDERS: dict[tuple, ctypes.Array] = {}  # order -> int64 array for the kernels; a group's order repeats every call


def _order_array(order: Order, k: int) -> ctypes.Array | None:
    if order is None:
        return None
    key = tuple(order.tolist()) if isinstance(order, Tensor) else tuple(order)
    arr = _ORDERS.get(key)
    if arr is None or len(key) != k:
        values = _check_order(key, k)
        arr = (ctypes.c_int64 * k)(*values)
        if len(_ORDERS) > 4096:
            _ORDERS.clear()
        _ORDERS[key] = arr
    return arr


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


Segments = Sequence[int]
"""Widths of the segments of one row of a chunk (sum U): blocks never span two segments; see the module docstring."""


class _Layout:
    """One row layout cut into blocks for one block size: built once per distinct (block, segments), then reused by
    every call, because a unit's layout never changes and the tables cost O(blocks per row) to build.

    ``starts`` holds the ``nbr + 1`` block boundaries of one row (``starts[0] = 0``, ``starts[nbr] = U``): block
    ``b`` of a row covers columns ``[starts[b], starts[b + 1])``. The C kernels read it as an int64 array, the
    Triton kernels as an int64 tensor on the device; the reference path uses index tensors derived from it.
    """

    __slots__ = ("block", "widths", "U", "nbr", "starts", "c_starts", "c_addr", "_tables", "_ref")

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


@dataclass(frozen=True)
class BlockCodec:
    """Symmetric absmax quantizer with ``bits`` in {8, 4} and one fp32 scale per ``block`` values."""

    bits: int
    block: int

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}")

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def spec(self) -> str:
        """The spec string that ``codec_from_spec`` turns back into this codec."""
        return f"int{self.bits}:{self.block}"

    # ---- sizes: pure functions of numel, identical on every rank --------------------------------------
    def payload_numel(self, numel: int) -> int:
        """Payload bytes (= elements, the payload dtype is one byte) for ``numel`` values."""
        return numel if self.bits == 8 else (numel + 1) // 2

    def scales_numel(self, numel: int, segments: Segments | None = None) -> int:
        """Number of fp32 scales (blocks) for ``numel`` values: ``ceil(numel / block)``, or with a row layout
        ``numel // U`` rows of ``sum(ceil(w / block))`` blocks each (``numel`` must be a multiple of ``U``)."""
        if segments is None:
            return -(-numel // self.block)
        lay = _layout(self.block, segments)
        return lay.rows(numel) * lay.nbr

    def padded_payload_bytes(self, numel: int) -> int:
        """Payload bytes rounded up to a multiple of 4: where a wire chunk's scales start."""
        return -(-self.payload_numel(numel) // 4) * 4

    def wire_bytes(self, numel: int, segments: Segments | None = None) -> int:
        """Bytes on the wire for one chunk of ``numel`` values: padded payload plus 4 bytes per scale (the payload
        does not depend on ``segments``, only the number of scales does)."""
        return self.padded_payload_bytes(numel) + 4 * self.scales_numel(numel, segments)

    # ---- reference path: plain torch, vectorised over k chunks ------------------------------------------
    @torch.no_grad()
    def _ref_encode(self, rows: Tensor, lay: _Layout | None = None) -> tuple[Tensor, Tensor]:
        """(k, n) float values -> (k, payload_numel) payload and (k, nblocks) fp32 scales; with a row layout every
        block is first widened to ``block`` values in a padded copy of each row."""
        k, n = rows.shape
        nb = self.scales_numel(n) if lay is None else lay.rows(n) * lay.nbr
        x = rows.float()
        if lay is not None:
            gather, place, _ = lay.ref_index(x.device)
            x = torch.nn.functional.pad(x.reshape(-1, lay.U), (0, 1)).index_select(1, gather)  # column U is 0
        elif nb * self.block != n:  # zero padding: costs no error because 0 encodes exactly
            x = torch.nn.functional.pad(x, (0, nb * self.block - n))
        blocks = x.reshape(k, nb, self.block)
        amax = blocks.abs().amax(dim=2)  # propagates nan, and inf stays inf
        finite = torch.isfinite(amax)
        scales = torch.where(finite, amax / self.qmax, torch.full_like(amax, float("nan")))
        # Dividing by 1 in zero blocks gives exact zeros (and no 0/0); scales stay 0 so decoding gives 0 too.
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / safe[..., None]).clamp_(-self.qmax, self.qmax)
        q = torch.where(finite[..., None], q, torch.zeros_like(q))
        if lay is not None:  # back from the padded rows to the real columns
            q = q.reshape(-1, lay.nbr * self.block).index_select(1, place).reshape(k, n)
        else:
            q = q.view(k, -1)[:, :n]
        if self.bits == 8:
            return q.to(torch.int8), scales
        if n % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        nib = (q + 8).to(torch.uint8).view(k, -1, 2)
        return nib[..., 0] | (nib[..., 1] << 4), scales

    @torch.no_grad()
    def _ref_decode(self, payload: Tensor, scales: Tensor, n: int, lay: _Layout | None = None) -> Tensor:
        """(k, payload_numel) payload and (k, nblocks) fp32 scales -> (k, n) fp32 values."""
        k = payload.shape[0]
        if self.bits == 8:
            q = payload.view(torch.int8).float()
        else:
            q = torch.stack([payload & 0xF, payload >> 4], dim=2).view(k, -1)[:, :n].float() - 8
        if lay is not None:  # each column's block, row by row
            owner = lay.ref_index(payload.device)[2]
            return q * scales.float().reshape(-1, lay.nbr).index_select(1, owner).reshape(k, n)
        return q * scales.float().repeat_interleave(self.block, dim=1)[:, :n]

    @torch.no_grad()
    def _ref_encode_rows(self, x: Tensor, k: int, n: int, order: Order, pay: Tensor, sc: Tensor,
                         pad: Tensor | None, lay: _Layout | None = None) -> None:
        """Reference encode of chunk order[i] (or i) of flat ``x`` into uint8 row views pay[i], sc[i]; zero pad."""
        if n == 0:
            return
        rows = x.view(k, n)
        idx = _order_index(order, k, x.device)
        if idx is not None:
            rows = rows.index_select(0, idx)
        payload, scales = self._ref_encode(rows, lay)
        pay.copy_(payload.view(torch.uint8))
        sc.copy_(scales.view(torch.uint8))
        if pad is not None:
            pad.zero_()

    @torch.no_grad()
    def _ref_decode_rows(self, pay: Tensor, sc: Tensor, k: int, n: int, out: Tensor | None,
                         sum_out: Tensor | None, lay: _Layout | None = None) -> None:
        """Reference decode of uint8 row views into flat ``out`` (k*n values) or, summed in fp32, ``sum_out``."""
        if n == 0:
            return
        values = self._ref_decode(pay, sc.contiguous().view(torch.float32), n, lay)
        if out is not None:
            out.view(k, n).copy_(values)
        elif k == 0:
            sum_out.zero_()
        else:
            sum_out.copy_(values[0])
            for i in range(1, k):  # row order, as the kernels add
                sum_out.add_(values[i])

    def _c_encode(self, lib, x: Tensor, k: int, n: int, order: Order, pay: int, pstride: int, sc: int,
                  sstride: int, pad: int) -> None:
        arr = _order_array(order, k)
        rc = lib.encode(x.data_ptr(), _DTYPE_CODE[x.dtype], n, k, None if arr is None else ctypes.addressof(arr),
                        self.block, self.bits, pay, pstride, sc, sstride, pad, _threads(k * n))
        if rc:
            raise RuntimeError(f"codec kernel encode failed ({rc}) for {x.dtype}")

    def _c_decode(self, lib, pay: int, pstride: int, sc: int, sstride: int, k: int, n: int, out: Tensor,
                  sum_rows: bool) -> None:
        rc = lib.decode(pay, pstride, sc, sstride, k, n, self.block, self.bits, out.data_ptr(), _DTYPE_CODE[out.dtype],
                        n, sum_rows, _threads(k * n))
        if rc:
            raise RuntimeError(f"codec kernel decode failed ({rc}) for {out.dtype}")

    def _c_encode_seg(self, lib, x: Tensor, k: int, n: int, order: Order, lay: _Layout, pay: int, stride: int,
                      sc: int, pad: int) -> None:
        arr = _order_array(order, k)
        rc = lib.encode_seg(x.data_ptr(), _DTYPE_CODE[x.dtype], n, k, None if arr is None else ctypes.addressof(arr),
                            lay.c_addr, lay.nbr, lay.U, self.block, self.bits, pay, stride, sc, stride, pad,
                            _threads(k * n))
        if rc:
            raise RuntimeError(f"codec kernel encode failed ({rc}) for {x.dtype}")

    def _c_decode_seg(self, lib, pay: int, stride: int, sc: int, k: int, n: int, lay: _Layout, out: Tensor,
                      sum_rows: bool) -> None:
        rc = lib.decode_seg(pay, stride, sc, stride, k, n, lay.c_addr, lay.nbr, lay.U, self.block, self.bits,
                            out.data_ptr(), _DTYPE_CODE[out.dtype], n, sum_rows, _threads(k * n))
        if rc:
            raise RuntimeError(f"codec kernel decode failed ({rc}) for {out.dtype}")

    # ---- separate payload / scales API -----------------------------------------------------------------
    def encode(self, x: Tensor) -> Encoded:
        """Quantize ``x`` (any shape, flattened; fp32, bf16 or fp16). Blocks holding nan or inf get a nan scale."""
        x = _check_float(x, "x").view(-1)
        n = x.numel()
        payload = torch.empty(self.payload_numel(n), dtype=self.payload_dtype, device=x.device)
        scales = torch.empty(self.scales_numel(n), dtype=torch.float32, device=x.device)
        self._encode_flat(x, payload, scales)
        return Encoded(payload, scales, n)

    def encode_into(self, x: Tensor, payload_out: Tensor, scales_out: Tensor) -> None:
        """Quantize ``x`` into preallocated flat buffers (e.g. this rank's slice of an all-gather input)."""
        x = _check_float(x, "x").view(-1)
        n = x.numel()
        if payload_out.numel() != self.payload_numel(n) or payload_out.dtype != self.payload_dtype:
            raise ValueError(f"payload_out must hold {self.payload_numel(n)} {self.payload_dtype} values, "
                             f"got {payload_out.numel()} {payload_out.dtype}")
        if scales_out.numel() != self.scales_numel(n) or scales_out.dtype != torch.float32:
            raise ValueError(f"scales_out must hold {self.scales_numel(n)} float32 values, "
                             f"got {scales_out.numel()} {scales_out.dtype}")
        if payload_out.is_contiguous() and scales_out.is_contiguous():
            self._encode_flat(x, payload_out, scales_out)
            return
        enc = self.encode(x)
        payload_out.copy_(enc.payload.view(payload_out.shape))
        scales_out.copy_(enc.scales.view(scales_out.shape))

    def _encode_flat(self, x: Tensor, payload: Tensor, scales: Tensor) -> None:
        n = x.numel()
        lib = _cpu_lib(x, x.dtype)
        if lib is not None and payload.device.type == "cpu" and scales.device.type == "cpu":
            self._c_encode(lib, x, 1, n, None, payload.data_ptr(), 0, scales.data_ptr(), 0, 0)
        else:
            self._ref_encode_rows(x, 1, n, None, payload.view(torch.uint8).view(1, payload.numel()),
                                  scales.view(torch.uint8).view(1, 4 * scales.numel()), None)

    def decode_chunks(self, payload_all: Tensor, scales_all: Tensor, k: int, numel_per_chunk: int,
                      dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
        """Decode ``k`` concatenated encodings of ``numel_per_chunk`` values each into one flat tensor, at once."""
        n, p, nb = numel_per_chunk, self.payload_numel(numel_per_chunk), self.scales_numel(numel_per_chunk)
        if payload_all.dtype != self.payload_dtype:
            raise ValueError(f"{self.spec} payload must be {self.payload_dtype}, got {payload_all.dtype}")
        if payload_all.numel() != k * p or scales_all.numel() != k * nb:
            raise ValueError(f"{k} chunks of {n} values need {k * p} payload and {k * nb} scale elements, "
                             f"got {payload_all.numel()} and {scales_all.numel()}")
        if out is not None and out.numel() != k * n:
            raise ValueError(f"out must hold {k * n} values, got {out.numel()}")
        target_dtype = out.dtype if out is not None else dtype
        if target_dtype not in _FLOATS:
            raise ValueError(f"can only decode to float32, bfloat16 or float16, got {target_dtype}")
        payload_all = payload_all if payload_all.is_contiguous() else payload_all.contiguous()
        if scales_all.dtype != torch.float32 or not scales_all.is_contiguous():
            scales_all = scales_all.to(torch.float32).contiguous()
        direct = out is not None and out.is_contiguous() and out.device == payload_all.device
        result = out if direct else torch.empty(k * n, dtype=target_dtype, device=payload_all.device)
        lib = _cpu_lib(payload_all, target_dtype)
        if lib is not None and scales_all.device.type == "cpu":
            self._c_decode(lib, payload_all.data_ptr(), p, scales_all.data_ptr(), 4 * nb, k, n, result, False)
        else:
            self._ref_decode_rows(payload_all.view(torch.uint8).view(k, p),
                                  scales_all.view(torch.uint8).view(k, 4 * nb), k, n, result.view(-1), None)
        if out is None:
            return result.view(-1)
        if not direct:
            out.copy_(result.view(out.shape))
        return out

    def decode_from(self, payload: Tensor, scales: Tensor, numel: int, dtype: torch.dtype = torch.float32,
                    out: Tensor | None = None) -> Tensor:
        """Decode one encoding held in flat buffers (e.g. a slice of a received buffer)."""
        return self.decode_chunks(payload, scales, 1, numel, dtype, out)

    def decode(self, enc: Encoded, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
        """The ``enc.numel`` decoded values as a flat ``dtype`` tensor, or written into ``out``."""
        return self.decode_chunks(enc.payload, enc.scales, 1, enc.numel, dtype, out)

    # ---- wire API: payload and scales in one buffer, one collective ----------------------------------------
    def _check_wire(self, wire: Tensor, k: int, n: int, W: int | None = None) -> int:
        """W, the bytes of one chunk (given with a row layout), after checking the wire buffer holds k chunks."""
        seg = W is not None
        W = self.wire_bytes(n) if W is None else W
        if wire.dtype != torch.uint8 or wire.numel() != k * W or not wire.is_contiguous():
            what = f"wire_bytes({n}, segments)" if seg else f"wire_bytes({n})"
            raise ValueError(f"wire must be a contiguous uint8 tensor of {k} x {what} = {k * W} bytes, "
                             f"got {wire.numel()} {wire.dtype}{'' if wire.is_contiguous() else ' (non-contiguous)'}")
        return W

    def _wire_views(self, wire: Tensor, k: int, n: int, W: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(payload, scales, padding) row views of a checked wire buffer, for the reference path."""
        P, P4 = self.payload_numel(n), self.padded_payload_bytes(n)
        rows = wire.view(k, self.wire_bytes(n) if W is None else W)
        return rows[:, :P], rows[:, P4:], rows[:, P:P4] if P4 > P else None

    def _seg_wire_bytes(self, n: int, lay: _Layout) -> int:
        return self.padded_payload_bytes(n) + 4 * lay.rows(n) * lay.nbr

    def _seg_decode(self, wire: Tensor, k: int, n: int, lay: _Layout, W: int, out: Tensor, sum_rows: bool) -> None:
        """decode_wire / decode_wire_sum with a row layout, on a checked wire buffer (W bytes a chunk) and output."""
        P4 = self.padded_payload_bytes(n)
        lib = _cpu_lib(wire, out.dtype)
        if lib is not None:
            self._c_decode_seg(lib, wire.data_ptr(), W, wire.data_ptr() + P4, k, n, lay, out, sum_rows)
        elif (tk := _gpu_lib(wire, wire)) is not None:
            (tk.decode_wire_sum_seg if sum_rows else tk.decode_wire_seg)(self, wire, k, n, out.view(-1), lay)
        else:
            pay, sc, _ = self._wire_views(wire, k, n, W)
            self._ref_decode_rows(pay, sc, k, n, None if sum_rows else out.view(-1), out.view(-1) if sum_rows else None,
                                  lay)

    def encode_wire(self, x: Tensor, k: int, out: Tensor | None = None, order: Order = None,
                    segments: Segments | None = None) -> Tensor:
        """Encode ``x`` (k*n values) as k wire chunks in ``out`` (uint8, k * wire_bytes(n, segments)): row i <- chunk
        order[i].

        ``order`` (ints, or an int tensor on x's device) writes an all-to-all input in member order without a
        permuted copy of ``x``: member i receives row i. ``segments`` (the widths of one row's segments, see the
        module docstring) keeps every block inside one segment of one row, so a small tensor packed beside a large
        one keeps its own scale. Returns ``out`` (allocated when None).
        """
        x = _check_float(x, "x")
        N = x.numel()
        if k < 1 or N % k:
            raise ValueError(f"x must hold k equal chunks, got {N} values for k={k}")
        n = N // k
        if segments is not None:
            return self._encode_wire_seg(x, k, n, out, order, _layout(self.block, segments))
        if out is None:
            out = torch.empty(k * self.wire_bytes(n), dtype=torch.uint8, device=x.device)
        W = self._check_wire(out, k, n)
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
        lib = _cpu_lib(x, x.dtype)
        if lib is not None:
            P, P4 = self.payload_numel(n), self.padded_payload_bytes(n)
            base = out.data_ptr()
            self._c_encode(lib, x, k, n, order, base, W, base + P4, W, P4 - P)
        elif (tk := _gpu_lib(x, out)) is not None:
            tk.encode_wire(self, x.view(-1), k, n, out, _order_index(order, k, x.device))
        else:
            self._ref_encode_rows(x.view(-1), k, n, order, *self._wire_views(out, k, n))
        return out

    def _encode_wire_seg(self, x: Tensor, k: int, n: int, out: Tensor | None, order: Order, lay: _Layout) -> Tensor:
        W = self._seg_wire_bytes(n, lay)
        if out is None:
            out = torch.empty(k * W, dtype=torch.uint8, device=x.device)
        self._check_wire(out, k, n, W)
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
        lib = _cpu_lib(x, x.dtype)
        if lib is not None:
            P, P4 = self.payload_numel(n), self.padded_payload_bytes(n)
            base = out.data_ptr()
            self._c_encode_seg(lib, x, k, n, order, lay, base, W, base + P4, P4 - P)
        elif (tk := _gpu_lib(x, out)) is not None:
            tk.encode_wire_seg(self, x.view(-1), k, n, out, _order_index(order, k, x.device), lay)
        else:
            self._ref_encode_rows(x.view(-1), k, n, order, *self._wire_views(out, k, n, W), lay)
        return out

    def decode_wire(self, wire: Tensor, k: int, n: int, out: Tensor | None = None,
                    dtype: torch.dtype = torch.float32, segments: Segments | None = None) -> Tensor:
        """Decode k wire chunks of n values into flat ``out`` (k*n values, any float dtype; a new ``dtype`` tensor
        when None), with the ``segments`` they were encoded with. Returns ``out``."""
        lay = None if segments is None else _layout(self.block, segments)
        W = self._check_wire(wire, k, n, None if lay is None else self._seg_wire_bytes(n, lay))
        if out is None:
            out = torch.empty(k * n, dtype=dtype, device=wire.device)
        if out.numel() != k * n or out.dtype not in _FLOATS or out.device != wire.device:
            raise ValueError(f"out must hold {k * n} float32, bfloat16 or float16 values on {wire.device}, "
                             f"got {out.numel()} {out.dtype} on {out.device}")
        target = out if out.is_contiguous() else torch.empty(k * n, dtype=out.dtype, device=out.device)
        self._decode(wire, k, n, lay, W, target, summed=False)
        if target is not out:
            out.copy_(target.view(out.shape))
        return out

    def decode_wire_sum(self, wire: Tensor, k: int, n: int, out: Tensor | None = None,
                        segments: Segments | None = None) -> Tensor:
        """Decode k wire chunks of n values (encoded with ``segments``) and add them in fp32, row 0 first, in one
        pass: the receive side of a quantized reduce-scatter. Returns ``out`` (n fp32 values, allocated when None)."""
        lay = None if segments is None else _layout(self.block, segments)
        W = self._check_wire(wire, k, n, None if lay is None else self._seg_wire_bytes(n, lay))
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=wire.device)
        if out.numel() != n or out.dtype != torch.float32 or not out.is_contiguous() or out.device != wire.device:
            raise ValueError(f"out must be a contiguous float32 tensor of {n} values on {wire.device}")
        self._decode(wire, k, n, lay, W, out, summed=True)
        return out

    def _decode(self, wire: Tensor, k: int, n: int, lay, W: int, target: Tensor, summed: bool) -> None:
        """The backend that decodes ``wire`` into ``target``: every chunk (``summed`` False) or their fp32 sum."""
        if lay is not None:
            self._seg_decode(wire, k, n, lay, W, target, summed)
        elif (lib := _cpu_lib(wire, target.dtype)) is not None:
            base = wire.data_ptr()
            self._c_decode(lib, base, W, base + self.padded_payload_bytes(n), W, k, n, target, summed)
        elif (tk := _gpu_lib(wire, wire)) is not None:
            (tk.decode_wire_sum if summed else tk.decode_wire)(self, wire, k, n, target.view(-1))
        else:
            pay, sc, _ = self._wire_views(wire, k, n)
            flat = target.view(-1)
            self._ref_decode_rows(pay, sc, k, n, None if summed else flat, flat if summed else None)


INT8 = BlockCodec(8, DEFAULT_BLOCKS[8])
INT4 = BlockCodec(4, DEFAULT_BLOCKS[4])


def codec_from_spec(spec: str) -> BlockCodec:
    """Parse ``"int8"``, ``"int8:BLOCK"``, ``"int4"`` or ``"int4:BLOCK"`` (the caller strips any ``"+ef"``)."""
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    if m is None or (m.group(2) is not None and int(m.group(2)) < 1):
        raise ValueError(f"unknown codec spec {spec!r}: valid specs are 'int8', 'int8:BLOCK', 'int4', 'int4:BLOCK' "
                         f"with BLOCK a positive integer (defaults: int8 {DEFAULT_BLOCKS[8]}, int4 {DEFAULT_BLOCKS[4]})")
    bits = int(m.group(1))
    return BlockCodec(bits, int(m.group(2)) if m.group(2) else DEFAULT_BLOCKS[bits])


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


def _self_check(lib) -> str | None:
    """Run the fused kernels on a small awkward input against the reference; None if they agree bit for bit."""
    g = torch.Generator().manual_seed(0)
    k, n, order = 3, 203, [2, 0, 1]
    for codec in (BlockCodec(8, 96), BlockCodec(8, 48), BlockCodec(4, 64), BlockCodec(4, 37), BlockCodec(8, 5)):
        W, P, P4 = codec.wire_bytes(n), codec.payload_numel(n), codec.padded_payload_bytes(n)
        for dtype in _FLOATS:
            if dtype is torch.float16 and not lib.has_f16:
                continue
            x = (torch.randn(k * n, generator=g) * 3).to(dtype)
            x[7], x[300], x[400:420] = float("nan"), float("inf"), 0.0
            fused, ref = torch.empty(k * W, dtype=torch.uint8), torch.empty(k * W, dtype=torch.uint8)
            codec._c_encode(lib, x, k, n, order, fused.data_ptr(), W, fused.data_ptr() + P4, W, P4 - P)
            codec._ref_encode_rows(x, k, n, order, *codec._wire_views(ref, k, n))
            if not torch.equal(fused, ref):
                return f"encode {codec.spec} {dtype}"
            pay, sc, _ = codec._wire_views(ref, k, n)
            values = codec._ref_decode(pay, sc.contiguous().view(torch.float32), n)
            for out_dtype in _FLOATS:
                if out_dtype is torch.float16 and not lib.has_f16:
                    continue
                out = torch.empty(k * n, dtype=out_dtype)
                codec._c_decode(lib, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, out, False)
                if not same_bits(out, values.view(-1).to(out_dtype)):
                    return f"decode {codec.spec} {dtype} -> {out_dtype}"
            total = torch.empty(n)
            codec._c_decode(lib, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, total, True)
            if not same_bits(total, values[0] + values[1] + values[2]):
                return f"decode_wire_sum {codec.spec} {dtype}"
    # row layouts: blocks starting on odd values, tiny segments, whole-block runs, two rows per chunk
    segments, rows = (1, 64, 37, 96, 3, 33, 128), 2
    n = rows * sum(segments)
    for codec in (BlockCodec(4, 32), BlockCodec(8, 48), BlockCodec(4, 37), BlockCodec(4, 2048)):  # 2048: 4-block units
        lay = _layout(codec.block, segments)
        W, P, P4 = codec._seg_wire_bytes(n, lay), codec.payload_numel(n), codec.padded_payload_bytes(n)
        for dtype in _FLOATS:
            if dtype is torch.float16 and not lib.has_f16:
                continue
            x = (torch.randn(k * n, generator=g) * 3).to(dtype)
            x[9], x[500], x[700:760] = float("nan"), float("inf"), 0.0
            fused, ref = torch.empty(k * W, dtype=torch.uint8), torch.empty(k * W, dtype=torch.uint8)
            codec._c_encode_seg(lib, x, k, n, order, lay, fused.data_ptr(), W, fused.data_ptr() + P4, P4 - P)
            codec._ref_encode_rows(x, k, n, order, *codec._wire_views(ref, k, n, W), lay)
            if not torch.equal(fused, ref):
                return f"encode {codec.spec} {dtype} with segments"
            pay, sc, _ = codec._wire_views(ref, k, n, W)
            values = codec._ref_decode(pay, sc.contiguous().view(torch.float32), n, lay)
            out = torch.empty(k * n, dtype=dtype)
            codec._c_decode_seg(lib, fused.data_ptr(), W, fused.data_ptr() + P4, k, n, lay, out, False)
            if not same_bits(out, values.view(-1).to(dtype)):
                return f"decode {codec.spec} {dtype} with segments"
            total = torch.empty(n)
            codec._c_decode_seg(lib, fused.data_ptr(), W, fused.data_ptr() + P4, k, n, lay, total, True)
            if not same_bits(total, values[0] + values[1] + values[2]):
                return f"decode_wire_sum {codec.spec} {dtype} with segments"
    return None
