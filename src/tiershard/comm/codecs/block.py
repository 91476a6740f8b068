"""``BlockCodec``: block-wise symmetric absmax quantization for the qwZ (int8 weights) and qgZ (int4 gradients) wire
formats, whose definition (the bytes, the error bound, row layouts) is the docstring of ``format.py``.

A codec is two numbers (``bits``, ``block``) and two flags (``rotate``: the Hadamard rotation, ``stochastic``:
stochastic rounding keyed by a ``seed`` the caller passes to every encode); this module holds its API, the spec
strings (``codec_from_spec``, ``hop_codecs``) and sends each call to a backend
(``backends.py``): the C kernels (``native.py``), the Triton kernels (``triton_kernels.py``) or the torch reference
(``reference.py``), which all give the same bits.

The wire API (``encode_wire``, ``decode_wire``, ``decode_wire_sum``) moves payload and scales in one buffer, so one
collective moves both. The separate payload/scales API (``encode``, ``encode_into``, ``decode_chunks``,
``decode_from``, ``decode``; flat blocks only) stays for callers that move the two in separate collectives;
``decode_chunks`` decodes k concatenated encodings at once.
"""
from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ledger import LEDGER
from . import native, reference
from .backends import _cpu_lib, _gpu_lib
from .format import (_FLOATS, _MASK64, _QMAX, DEFAULT_BLOCKS, Encoded, Order, Segments, _check_float, _layout,
                     _Layout, _order_index, padded_payload_bytes, payload_numel, scales_numel, wire_bytes)

__all__ = ["BlockCodec", "INT8", "INT4", "codec_from_spec", "hop_codecs"]

_SPEC = re.compile(r"^(?:int)?(8|4)(?::(\d+))?((?::(?:h|sr))*)$")
_SPEC_HELP = ("valid specs are 'int8' or 'int4' (or '8', '4'), then optionally ':BLOCK' (a positive integer; "
              f"defaults: int8 {DEFAULT_BLOCKS[8]}, int4 {DEFAULT_BLOCKS[4]}), then optionally ':h' (Hadamard "
              "rotation) and ':sr' (stochastic rounding), e.g. 'int4:128:h:sr'; per-hop lists join codecs with '/', "
              "innermost tier first, e.g. 'int8:128:h/int4:128:h'")


def _timed(method: Callable) -> Callable:
    """Adds the call's host seconds to the ledger's ``codec`` clock ([Note: where the time goes], comm/ledger.py)."""
    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            LEDGER.add_seconds("codec", time.perf_counter() - start)
    return timed


@dataclass(frozen=True)
class BlockCodec:
    """Symmetric absmax quantizer with ``bits`` in {8, 4} and one fp32 scale per ``block`` values; ``rotate``
    applies the Hadamard rotation of 32-value groups before quantizing, ``stochastic`` rounds stochastically with a
    counter-based hash of the ``seed`` each encode is given (format: ``format.py``)."""

    bits: int
    block: int
    rotate: bool = False
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"block must be a positive integer, got {self.block!r}")
        for name in ("rotate", "stochastic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def _extended(self) -> bool:
        """Rotated or stochastic: encoded by the kernels' general path (``ts_encode_x``) rather than the fused one."""
        return self.rotate or self.stochastic

    def _key(self, seed: int | None) -> int | None:
        """The 64-bit stochastic-rounding key for one encode (None for round-half-even codecs, which ignore it)."""
        if not self.stochastic:
            return None
        if seed is None:
            raise ValueError(f"codec {self.spec} rounds stochastically and needs a seed: pass seed=<int> to the "
                             "encode call (the caller derives one per call, e.g. from a step counter)")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        return seed & _MASK64

    @property
    def qmax(self) -> int:
        return _QMAX[self.bits]

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def spec(self) -> str:
        """The spec string that ``codec_from_spec`` turns back into this codec."""
        return f"int{self.bits}:{self.block}" + (":h" if self.rotate else "") + (":sr" if self.stochastic else "")

    # ---- sizes: pure functions of numel, identical on every rank (see format.py) -----------------------
    def payload_numel(self, numel: int) -> int:
        """Payload bytes (= elements, the payload dtype is one byte) for ``numel`` values."""
        return payload_numel(self.bits, numel)

    def scales_numel(self, numel: int, segments: Segments | None = None) -> int:
        """Number of fp32 scales (blocks) for ``numel`` values: ``ceil(numel / block)``, or with a row layout
        ``numel // U`` rows of ``sum(ceil(w / block))`` blocks each (``numel`` must be a multiple of ``U``)."""
        return scales_numel(self.block, numel, None if segments is None else _layout(self.block, segments))

    def padded_payload_bytes(self, numel: int) -> int:
        """Payload bytes rounded up to a multiple of 4: where a wire chunk's scales start."""
        return padded_payload_bytes(self.bits, numel)

    def wire_bytes(self, numel: int, segments: Segments | None = None) -> int:
        """Bytes on the wire for one chunk of ``numel`` values: padded payload plus 4 bytes per scale (the payload
        does not depend on ``segments``, only the number of scales does)."""
        return wire_bytes(self.bits, self.block, numel, None if segments is None else _layout(self.block, segments))

    # ---- separate payload / scales API -----------------------------------------------------------------
    def encode(self, x: Tensor, seed: int | None = None) -> Encoded:
        """Quantize ``x`` (any shape, flattened; fp32, bf16 or fp16). Blocks holding nan or inf get a nan scale.
        ``seed``: the stochastic-rounding key (required by stochastic codecs, ignored by the others)."""
        key = self._key(seed)
        x = _check_float(x, "x").view(-1)
        n = x.numel()
        payload = torch.empty(self.payload_numel(n), dtype=self.payload_dtype, device=x.device)
        scales = torch.empty(self.scales_numel(n), dtype=torch.float32, device=x.device)
        self._encode_flat(x, payload, scales, key)
        return Encoded(payload, scales, n)

    def encode_into(self, x: Tensor, payload_out: Tensor, scales_out: Tensor, seed: int | None = None) -> None:
        """Quantize ``x`` into preallocated flat buffers (e.g. this rank's slice of an all-gather input)."""
        key = self._key(seed)
        x = _check_float(x, "x").view(-1)
        n = x.numel()
        if payload_out.numel() != self.payload_numel(n) or payload_out.dtype != self.payload_dtype:
            raise ValueError(f"payload_out must hold {self.payload_numel(n)} {self.payload_dtype} values, "
                             f"got {payload_out.numel()} {payload_out.dtype}")
        if scales_out.numel() != self.scales_numel(n) or scales_out.dtype != torch.float32:
            raise ValueError(f"scales_out must hold {self.scales_numel(n)} float32 values, "
                             f"got {scales_out.numel()} {scales_out.dtype}")
        if payload_out.is_contiguous() and scales_out.is_contiguous():
            self._encode_flat(x, payload_out, scales_out, key)
            return
        enc = self.encode(x, seed)
        payload_out.copy_(enc.payload.view(payload_out.shape))
        scales_out.copy_(enc.scales.view(scales_out.shape))

    def _encode_flat(self, x: Tensor, payload: Tensor, scales: Tensor, key: int | None) -> None:
        n = x.numel()
        lib = _cpu_lib(x, x.dtype)
        if lib is not None and payload.device.type == "cpu" and scales.device.type == "cpu":
            if self._extended:
                native.encode_x(lib, self, x, 1, n, None, None, payload.data_ptr(), 0, scales.data_ptr(), 0, 0, key)
            else:
                native.encode(lib, self.bits, self.block, x, 1, n, None, payload.data_ptr(), 0, scales.data_ptr(), 0,
                              0)
        else:
            reference.encode_rows(self.bits, self.block, x, 1, n, None,
                                  payload.view(torch.uint8).view(1, payload.numel()),
                                  scales.view(torch.uint8).view(1, 4 * scales.numel()), None, None, self.rotate, key)

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
            if self.rotate:
                native.decode_x(lib, self, payload_all.data_ptr(), p, scales_all.data_ptr(), 4 * nb, k, n, None,
                                result, False)
            else:
                native.decode(lib, self.bits, self.block, payload_all.data_ptr(), p, scales_all.data_ptr(), 4 * nb, k,
                              n, result, False)
        else:
            reference.decode_rows(self.bits, self.block, payload_all.view(torch.uint8).view(k, p),
                                  scales_all.view(torch.uint8).view(k, 4 * nb), k, n, result.view(-1), None, None,
                                  self.rotate)
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

    def _seg_wire_bytes(self, n: int, lay: _Layout) -> int:
        return wire_bytes(self.bits, self.block, n, lay)

    def _seg_decode(self, wire: Tensor, k: int, n: int, lay: _Layout, W: int, out: Tensor, sum_rows: bool) -> None:
        """decode_wire / decode_wire_sum with a row layout, on a checked wire buffer (W bytes a chunk) and output."""
        P4 = self.padded_payload_bytes(n)
        lib = _cpu_lib(wire, out.dtype)
        if lib is not None and self.rotate:
            native.decode_x(lib, self, wire.data_ptr(), W, wire.data_ptr() + P4, W, k, n, lay, out, sum_rows)
        elif lib is not None:
            native.decode_seg(lib, self.bits, self.block, wire.data_ptr(), W, wire.data_ptr() + P4, k, n, lay, out,
                              sum_rows)
        elif (tk := _gpu_lib(wire, wire)) is not None and self.rotate:
            tk.decode_wire_x(self, wire, k, n, out.view(-1), lay, sum_rows)
        elif tk is not None:
            (tk.decode_wire_sum_seg if sum_rows else tk.decode_wire_seg)(self, wire, k, n, out.view(-1), lay)
        else:
            pay, sc, _ = reference.wire_views(self.bits, self.block, wire, k, n, W)
            reference.decode_rows(self.bits, self.block, pay, sc, k, n, None if sum_rows else out.view(-1),
                                  out.view(-1) if sum_rows else None, lay, self.rotate)

    @_timed
    def encode_wire(self, x: Tensor, k: int, out: Tensor | None = None, order: Order = None,
                    segments: Segments | None = None, seed: int | None = None) -> Tensor:
        """Encode ``x`` (k*n values) as k wire chunks in ``out`` (uint8, k * wire_bytes(n, segments)): row i <- chunk
        order[i].

        ``order`` (ints, or an int tensor on x's device) writes an all-to-all input in member order without a
        permuted copy of ``x``: member i receives row i. ``segments`` (the widths of one row's segments, see the
        docstring of ``format.py``) keeps every block inside one segment of one row, so a small tensor packed beside
        a large one keeps its own scale. ``seed``: the stochastic-rounding key (required by stochastic codecs,
        ignored by the others; wire row i draws its own stream from it). Returns ``out`` (allocated when None).
        """
        key = self._key(seed)
        x = _check_float(x, "x")
        N = x.numel()
        if k < 1 or N % k:
            raise ValueError(f"x must hold k equal chunks, got {N} values for k={k}")
        n = N // k
        if segments is not None:
            return self._encode_wire_seg(x, k, n, out, order, _layout(self.block, segments), key)
        if out is None:
            out = torch.empty(k * self.wire_bytes(n), dtype=torch.uint8, device=x.device)
        W = self._check_wire(out, k, n)
        if out.device != x.device:
            raise ValueError(f"out is on {out.device}, x on {x.device}")
        lib = _cpu_lib(x, x.dtype)
        if lib is not None:
            P, P4 = self.payload_numel(n), self.padded_payload_bytes(n)
            base = out.data_ptr()
            if self._extended:
                native.encode_x(lib, self, x, k, n, order, None, base, W, base + P4, W, P4 - P, key)
            else:
                native.encode(lib, self.bits, self.block, x, k, n, order, base, W, base + P4, W, P4 - P)
        elif (tk := _gpu_lib(x, out)) is not None:
            if self._extended:
                tk.encode_wire_x(self, x.view(-1), k, n, out, _order_index(order, k, x.device), None, key)
            else:
                tk.encode_wire(self, x.view(-1), k, n, out, _order_index(order, k, x.device))
        else:
            views = reference.wire_views(self.bits, self.block, out, k, n)
            reference.encode_rows(self.bits, self.block, x.view(-1), k, n, order, *views, None, self.rotate, key)
        return out

    def _encode_wire_seg(self, x: Tensor, k: int, n: int, out: Tensor | None, order: Order, lay: _Layout,
                         key: int | None) -> Tensor:
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
            if self._extended:
                native.encode_x(lib, self, x, k, n, order, lay, base, W, base + P4, W, P4 - P, key)
            else:
                native.encode_seg(lib, self.bits, self.block, x, k, n, order, lay, base, W, base + P4, P4 - P)
        elif (tk := _gpu_lib(x, out)) is not None:
            if self._extended:
                tk.encode_wire_x(self, x.view(-1), k, n, out, _order_index(order, k, x.device), lay, key)
            else:
                tk.encode_wire_seg(self, x.view(-1), k, n, out, _order_index(order, k, x.device), lay)
        else:
            views = reference.wire_views(self.bits, self.block, out, k, n, W)
            reference.encode_rows(self.bits, self.block, x.view(-1), k, n, order, *views, lay, self.rotate, key)
        return out

    @_timed
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

    @_timed
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
            if self.rotate:
                native.decode_x(lib, self, base, W, base + self.padded_payload_bytes(n), W, k, n, None, target, summed)
            else:
                native.decode(lib, self.bits, self.block, base, W, base + self.padded_payload_bytes(n), W, k, n,
                              target, summed)
        elif (tk := _gpu_lib(wire, wire)) is not None:
            if self.rotate:
                tk.decode_wire_x(self, wire, k, n, target.view(-1), None, summed)
            else:
                (tk.decode_wire_sum if summed else tk.decode_wire)(self, wire, k, n, target.view(-1))
        else:
            pay, sc, _ = reference.wire_views(self.bits, self.block, wire, k, n)
            flat = target.view(-1)
            reference.decode_rows(self.bits, self.block, pay, sc, k, n, None if summed else flat,
                                  flat if summed else None, None, self.rotate)


INT8 = BlockCodec(8, DEFAULT_BLOCKS[8])
INT4 = BlockCodec(4, DEFAULT_BLOCKS[4])


def codec_from_spec(spec: str) -> BlockCodec:
    """Parse one hop's codec: ``int8`` | ``int4`` (or ``8`` | ``4``), optional ``:BLOCK``, then optional flags
    ``:h`` (rotate) and ``:sr`` (stochastic), e.g. ``"int4:128:h:sr"``; ``.spec`` prints it back. The caller
    strips any ``"+ef"``; a per-hop list (``"8/4"``) goes to ``hop_codecs``."""
    if isinstance(spec, str) and "/" in spec:
        raise ValueError(f"codec spec {spec!r} is a per-hop list: parse it with hop_codecs(spec, tiers)")
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    flags = m.group(3).split(":")[1:] if m is not None else []
    if m is None or (m.group(2) is not None and int(m.group(2)) < 1) or len(set(flags)) != len(flags):
        raise ValueError(f"unknown codec spec {spec!r}: {_SPEC_HELP}")
    bits = int(m.group(1))
    return BlockCodec(bits, int(m.group(2)) if m.group(2) else DEFAULT_BLOCKS[bits], "h" in flags, "sr" in flags)


def hop_codecs(spec: str, tiers: int) -> list[BlockCodec]:
    """The codec of each tier 1..``tiers`` (index k-1 for tier k) from a spec or a ``/`` list, innermost first.

    One entry: every tier. k entries (k <= tiers): the last is the outermost tier's, the others follow it inwards
    in order, and the first also serves every inner tier not named: ``"8/4"`` on three tiers is 8, 8, 4."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"unknown codec spec {spec!r}: {_SPEC_HELP}")
    if not isinstance(tiers, int) or tiers < 1:
        raise ValueError(f"tiers must be a positive integer, got {tiers!r}")
    entries = [codec_from_spec(part) for part in spec.split("/")]
    if len(entries) > tiers:
        raise ValueError(f"codec spec {spec!r} lists {len(entries)} hop codecs but there are only {tiers} tiers: "
                         f"give at most {tiers} ('/'-separated, innermost first)")
    return [entries[0]] * (tiers - len(entries) + 1) + entries[1:]

