"""Which backend runs a codec call, chosen per call by the tensor's device, all giving the same bits on the CPU:

- CPU: fused C kernels (``kernels.c``, built and loaded by ``native.py``), built on first use; if they cannot be
  built, or disagree with the reference on a self-check (``_self_check`` below), the reference torch path
  (``reference.py``; a warning is issued only for a disagreement).
- CUDA: Triton kernels (``triton_kernels.py``) for the wire API when ``triton`` imports (extra ``gpu``); the
  reference torch path otherwise. Neither synchronizes with the host.
- Anything else: the reference torch path.

``TIERSHARD_CODEC_KERNELS=torch`` forces the reference path everywhere (for debugging). ``_cpu_lib`` and ``_gpu_lib``
answer on every call, so they read module state only (the tests flip ``_force_reference`` and ``_cpu_state``).
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from . import native, reference
from .format import _FLOATS, _layout, padded_payload_bytes, payload_numel, same_bits, wire_bytes

__all__ = ["kernel_status"]

# Read once: the hot path must not consult the environment on every call (tests flip the variable below instead).
_force_reference = os.environ.get("TIERSHARD_CODEC_KERNELS", "auto").strip().lower() == "torch"
_select_lock = threading.Lock()
_cpu_state: object = None   # None: not tried; False: unusable; else native.Kernels
_cpu_reason = "not tried yet"
_triton_state: object = None  # None: not tried; False: unusable; else the triton_kernels module
_triton_reason = "not tried yet"


def _cpu_kernels():
    """The fused CPU kernels once built and checked against the reference, else None (the reference is used)."""
    global _cpu_state, _cpu_reason
    if _cpu_state is None:
        with _select_lock:
            if _cpu_state is None:
                lib = native.load()
                if lib is None:
                    _cpu_state, _cpu_reason = False, native.status()
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
                    from . import triton_kernels
                    _triton_state, _triton_reason = triton_kernels, f"triton {triton_kernels.triton.__version__}"
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


class _Spec(NamedTuple):
    """What the kernels read of a codec (``block.BlockCodec`` imports this module, not the other way round)."""

    bits: int
    block: int
    rotate: bool
    stochastic: bool


def _self_check(lib: native.Kernels) -> str | None:
    """Run the fused kernels on a small awkward input against the reference; None if they agree bit for bit."""
    g = torch.Generator().manual_seed(0)
    k, n, order = 3, 203, [2, 0, 1]
    for bits, block in ((8, 96), (8, 48), (4, 64), (4, 37), (8, 5)):
        spec = f"int{bits}:{block}"
        W, P, P4 = wire_bytes(bits, block, n), payload_numel(bits, n), padded_payload_bytes(bits, n)
        for dtype in _FLOATS:
            if dtype is torch.float16 and not lib.has_f16:
                continue
            x = (torch.randn(k * n, generator=g) * 3).to(dtype)
            x[7], x[300], x[400:420] = float("nan"), float("inf"), 0.0
            fused, ref = torch.empty(k * W, dtype=torch.uint8), torch.empty(k * W, dtype=torch.uint8)
            native.encode(lib, bits, block, x, k, n, order, fused.data_ptr(), W, fused.data_ptr() + P4, W, P4 - P)
            reference.encode_rows(bits, block, x, k, n, order, *reference.wire_views(bits, block, ref, k, n))
            if not torch.equal(fused, ref):
                return f"encode {spec} {dtype}"
            pay, sc, _ = reference.wire_views(bits, block, ref, k, n)
            values = reference.decode(bits, block, pay, sc.contiguous().view(torch.float32), n)
            for out_dtype in _FLOATS:
                if out_dtype is torch.float16 and not lib.has_f16:
                    continue
                out = torch.empty(k * n, dtype=out_dtype)
                native.decode(lib, bits, block, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, out, False)
                if not same_bits(out, values.view(-1).to(out_dtype)):
                    return f"decode {spec} {dtype} -> {out_dtype}"
            total = torch.empty(n)
            native.decode(lib, bits, block, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, total, True)
            if not same_bits(total, values[0] + values[1] + values[2]):
                return f"decode_wire_sum {spec} {dtype}"
    # the general path of the rotated and stochastic formats, flat and with a row layout
    for codec, segments in ((_Spec(4, 37, True, True), None), (_Spec(8, 64, True, False), (1, 70, 33)),
                            (_Spec(4, 64, True, True), (1, 70, 33))):
        n = 2 * sum(segments) if segments else 203
        lay = _layout(codec.block, segments) if segments else None
        W, P, P4 = (wire_bytes(codec.bits, codec.block, n, lay), payload_numel(codec.bits, n),
                    padded_payload_bytes(codec.bits, n))
        seed = 0x0123456789ABCDEF if codec.stochastic else None
        x = (torch.randn(k * n, generator=g) * 3)
        x[9], x[300] = float("nan"), float("inf")
        fused, ref = torch.empty(k * W, dtype=torch.uint8), torch.empty(k * W, dtype=torch.uint8)
        native.encode_x(lib, codec, x, k, n, order, lay, fused.data_ptr(), W, fused.data_ptr() + P4, W, P4 - P, seed)
        views = reference.wire_views(codec.bits, codec.block, ref, k, n, W)
        reference.encode_rows(codec.bits, codec.block, x, k, n, order, *views, lay, codec.rotate, seed)
        if not torch.equal(fused, ref):
            return f"encode {codec} segments={segments}"
        values = reference.decode(codec.bits, codec.block, views[0], views[1].contiguous().view(torch.float32), n,
                                  lay, codec.rotate)
        out, total = torch.empty(k * n), torch.empty(n)
        native.decode_x(lib, codec, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, lay, out, False)
        native.decode_x(lib, codec, fused.data_ptr(), W, fused.data_ptr() + P4, W, k, n, lay, total, True)
        if not same_bits(out, values.reshape(-1)) or not same_bits(total, values[0] + values[1] + values[2]):
            return f"decode {codec} segments={segments}"
    # row layouts: blocks starting on odd values, tiny segments, whole-block runs, two rows per chunk
    segments, rows = (1, 64, 37, 96, 3, 33, 128), 2
    n = rows * sum(segments)
    for bits, block in ((4, 32), (8, 48), (4, 37), (4, 2048)):  # 2048: 4-block units
        spec = f"int{bits}:{block}"
        lay = _layout(block, segments)
        W, P, P4 = wire_bytes(bits, block, n, lay), payload_numel(bits, n), padded_payload_bytes(bits, n)
        for dtype in _FLOATS:
            if dtype is torch.float16 and not lib.has_f16:
                continue
            x = (torch.randn(k * n, generator=g) * 3).to(dtype)
            x[9], x[500], x[700:760] = float("nan"), float("inf"), 0.0
            fused, ref = torch.empty(k * W, dtype=torch.uint8), torch.empty(k * W, dtype=torch.uint8)
            native.encode_seg(lib, bits, block, x, k, n, order, lay, fused.data_ptr(), W, fused.data_ptr() + P4, P4 - P)
            reference.encode_rows(bits, block, x, k, n, order, *reference.wire_views(bits, block, ref, k, n, W), lay)
            if not torch.equal(fused, ref):
                return f"encode {spec} {dtype} with segments"
            pay, sc, _ = reference.wire_views(bits, block, ref, k, n, W)
            values = reference.decode(bits, block, pay, sc.contiguous().view(torch.float32), n, lay)
            out = torch.empty(k * n, dtype=dtype)
            native.decode_seg(lib, bits, block, fused.data_ptr(), W, fused.data_ptr() + P4, k, n, lay, out, False)
            if not same_bits(out, values.view(-1).to(dtype)):
                return f"decode {spec} {dtype} with segments"
            total = torch.empty(n)
            native.decode_seg(lib, bits, block, fused.data_ptr(), W, fused.data_ptr() + P4, k, n, lay, total, True)
            if not same_bits(total, values[0] + values[1] + values[2]):
                return f"decode_wire_sum {spec} {dtype} with segments"
    return None
