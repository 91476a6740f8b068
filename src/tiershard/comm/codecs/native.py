"""Fused CPU kernels for the block codecs: ``kernels.c``, compiled with the system C compiler on first use, cached.

Why C through ``ctypes`` rather than a torch extension: the kernels need no torch headers, so a build takes under a
second with only ``gcc`` (``torch.utils.cpp_extension`` takes about a minute and needs ninja), and one build serves
any torch version. The library is keyed by its source, the flags, the compiler and this CPU's feature flags
(``-march=native``), so a cache shared between machines never hands one CPU a binary built for another. Nothing is
built at import: ``load()`` runs on the first encode or decode of a CPU tensor.

Each encode or decode is one call: a pass over the input per block (the block stays in L1 between its absmax and
its quantization), no fp32 copy, no padding, no Python loop over chunks; work is split into units of about 8192
values across ``torch.get_num_threads()`` OpenMP threads (the library shares torch's OpenMP runtime). The ctypes
call releases the GIL. Row layouts (``segments``) run through their own entry points driven by a small per-layout
block table; runs of whole blocks there take the same inner loops as flat chunks, and int4 blocks that start on an
odd value (the high nibble of a byte) are encoded or decoded as if aligned through a staging buffer shifted by
one nibble.

When no compiler works, ``load()`` returns None and the codecs use their torch path (``reference.py``), which gives
the same bits; ``backends.py`` checks the library against that path before its first use. The functions ``encode``,
``decode``, ``encode_seg`` and ``decode_seg`` at the end make one kernel call each from a codec's scalars (``bits``,
``block``), buffer addresses and strides, and raise if the kernel reports an error.

Environment: ``CC`` (compiler, default ``gcc`` then ``cc``), ``TIERSHARD_CACHE_DIR`` (default
``$XDG_CACHE_HOME/tiershard`` or ``~/.cache/tiershard``).

[Note: the kernel cache is private] Loading a library runs its code, so the cache must hold only what this user
built. The cache folder is created 0o700; one that exists but belongs to another user or is writable by group or
others is not used (a warning names it, and the kernels are built in a fresh private temporary folder instead).
Each build records the library's SHA-256 in ``codec_kernels-<key>.sha256``, and the library is named by that hash
(``codec_kernels-<key>-<hash>.so``: ranks building at once never overwrite one library with another); a library is
loaded only if it is this user's, not writable by others, and hashes to what the record says, else it is rebuilt
and ``kernel_status()`` says why.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from .format import _DTYPE_CODE, Order, _check_order, _Layout

__all__ = ["Kernels", "load", "build", "status", "encode", "decode", "encode_seg", "decode_seg", "encode_x", "decode_x"]

# Tried in order; the first that compiles and loads is used. Without -march=native the compiler still vectorizes
# for the baseline ISA; without OpenMP every call runs on the calling thread.
FLAG_SETS: tuple[tuple[str, ...], ...] = (("-march=native", "-fopenmp"), ("-march=native",), ("-fopenmp",), ())
_BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off")

_SOURCE = (Path(__file__).parent / "kernels.c").read_text()


class Kernels:
    """A loaded kernel library and how it was built.

    ``encode(x, dtype_code, n, k, order, block, bits, payload, payload_stride, scales, scales_stride, pad, threads)``
    encodes k chunks of n values (chunk ``order[i]`` of x, or i; ``order`` an int64 array address or None) into row
    i of the payload and scale buffers (addresses and byte strides), then ``pad`` zero bytes after each payload.
    ``decode(payload, payload_stride, scales, scales_stride, k, n, block, bits, out, dtype_code, out_stride, sum,
    threads)`` decodes row i to ``out + i * out_stride`` values, or with ``sum`` adds the k rows into n fp32 values,
    row 0 first. ``encode_seg(x, dtype_code, n, k, order, table, nbr, U, block, bits, payload, payload_stride,
    scales, scales_stride, pad, threads)`` and ``decode_seg(payload, payload_stride, scales, scales_stride, k, n,
    table, nbr, U, block, bits, out, dtype_code, out_stride, sum, threads)`` do the same for chunks of ``n = rows * U``
    values cut by a row layout: ``table`` is the address of ``2 * nbr + 1`` int64 values, the ``nbr + 1`` block
    offsets of one row, then for each block the number of whole blocks of ``block`` values that follow one another
    from it (``format._Layout`` builds it). dtype codes: 0 float32, 1 bfloat16, 2 float16. All are the raw ctypes
    functions (a Python wrapper would double the call's cost) and return 0, or a negative code for an unsupported
    dtype or a chunk that is not whole rows. ``encode_x(x, dtype_code, n, k, order, table, nbr, U, block, bits,
    rotate, stochastic, seed, payload, payload_stride, scales, scales_stride, pad, threads)`` and ``decode_x(payload,
    payload_stride, scales, scales_stride, k, n, table, nbr, U, block, bits, rotate, out, dtype_code, out_stride,
    sum, threads)`` are the general path of the rotated and stochastic formats, flat (``table`` None) or with a row
    layout.
    """

    def __init__(self, path: Path, flags: tuple[str, ...], notes: tuple[str, ...] = ()):
        lib = ctypes.CDLL(str(path))
        v, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.ts_encode.argtypes = [v, i32, i64, i64, v, i64, i32, v, i64, v, i64, i64, i32]
        lib.ts_encode.restype = i32
        lib.ts_decode.argtypes = [v, i64, v, i64, i64, i64, i64, i32, v, i32, i64, i32, i32]
        lib.ts_decode.restype = i32
        lib.ts_encode_seg.argtypes = [v, i32, i64, i64, v, v, i64, i64, i64, i32, v, i64, v, i64, i64, i32]
        lib.ts_encode_seg.restype = i32
        lib.ts_decode_seg.argtypes = [v, i64, v, i64, i64, i64, v, i64, i64, i64, i32, v, i32, i64, i32, i32]
        lib.ts_decode_seg.restype = i32
        u64 = ctypes.c_uint64
        lib.ts_encode_x.argtypes = [v, i32, i64, i64, v, v, i64, i64, i64, i32, i32, i32, u64, v, i64, v, i64, i64,
                                    i32]
        lib.ts_encode_x.restype = i32
        lib.ts_decode_x.argtypes = [v, i64, v, i64, i64, i64, v, i64, i64, i64, i32, i32, v, i32, i64, i32, i32]
        lib.ts_decode_x.restype = i32
        lib.ts_has_f16.restype = i32
        lib.ts_simd.restype = i32
        self._lib, self.path, self.flags, self.notes = lib, path, flags, notes
        self.encode, self.decode = lib.ts_encode, lib.ts_decode
        self.encode_seg, self.decode_seg = lib.ts_encode_seg, lib.ts_decode_seg
        self.encode_x, self.decode_x = lib.ts_encode_x, lib.ts_decode_x
        self.has_f16 = bool(lib.ts_has_f16())
        self.simd = "avx512" if lib.ts_simd() == 512 else "compiler-vectorized"

    def __repr__(self) -> str:
        notes = "".join(f"; {note}" for note in self.notes)
        return f"Kernels({self.simd}, flags={' '.join(self.flags) or '-'}, {self.path}{notes})"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("flags", "Features", "model name", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("TIERSHARD_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tiershard"


_fallback: Path | None = None  # this process's private build folder, when the cache folder is refused


def _not_private(path: Path) -> str | None:
    """Why another user could have written ``path`` (its owner, or write access for group or others); None if
    only this user can. Windows has no owners or mode bits to check here."""
    if not hasattr(os, "getuid"):
        return None
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"group or others can write it (mode {st.st_mode & 0o777:o})"
    return None


def _cache(directory: Path | None) -> Path:
    """A folder only this user can write ([Note: the kernel cache is private]): ``directory`` or the default cache,
    created 0o700 if absent; else this process's fresh private temporary folder, with a warning naming the other."""
    global _fallback
    folder = Path(directory) if directory is not None else _cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _not_private(folder)
        if problem is None:
            probe = folder / f".write-{os.getpid()}"
            probe.touch()
            probe.unlink()
            return folder
    except OSError as err:
        problem = f"it cannot be used ({err})"
    if _fallback is None:
        _fallback = Path(tempfile.mkdtemp(prefix="tiershard-kernels-"))
        atexit.register(shutil.rmtree, _fallback, True)
    warnings.warn(f"tiershard codec kernels: not using the cache folder {folder}: {problem}; building in the "
                  f"private folder {_fallback} instead (make {folder} yours and chmod go-w it, or set "
                  "TIERSHARD_CACHE_DIR to a folder only you can write)", RuntimeWarning, stacklevel=3)
    return _fallback


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cached(directory: Path, stem: str) -> tuple[Path | None, str | None]:
    """The cached library of ``stem`` if it is this user's and hashes to its record; else None and why (None for
    no build yet)."""
    record = directory / f"{stem}.sha256"
    if not record.is_file():
        return None, None
    digest = record.read_text().strip()
    problem = _not_private(record) or (None if re.fullmatch(r"[0-9a-f]{64}", digest) else "not a SHA-256")
    if problem is not None:
        return None, f"rebuilt: the record {record} was not used: {problem}"
    path = directory / f"{stem}-{digest[:16]}.so"
    if not path.is_file():
        return None, None
    problem = _not_private(path)
    if problem is not None:
        return None, f"rebuilt: {path} was not loaded: {problem}"
    if _sha256(path) != digest:
        return None, (f"rebuilt: {path} was not loaded: its SHA-256 differs from the one recorded when it was built "
                      f"({record}); planted or damaged")
    return path, None


def build(flags: tuple[str, ...], directory: Path | None = None) -> Kernels:
    """Compile (or reuse a verified cached build of) the kernels with ``flags`` and load them; raises on any
    failure. ``directory``: the cache folder (default ``_cache_dir()``), used only if private to this user."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    all_flags = _BASE_FLAGS + tuple(flags)
    key = hashlib.sha256("\0".join([_SOURCE, cc, *all_flags, platform.machine(), _cpu_fingerprint()]).encode())
    directory = _cache(directory)
    stem = f"codec_kernels-{key.hexdigest()[:20]}"
    path, problem = _cached(directory, stem)
    if problem is not None:
        warnings.warn(f"tiershard codec kernels {problem}", RuntimeWarning, stacklevel=2)
    if path is None:
        with tempfile.TemporaryDirectory(prefix="tiershard-build-") as tmp:
            src = Path(tmp) / "codec_kernels.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / "codec_kernels.so"
            proc = subprocess.run([cc, *all_flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} {' '.join(all_flags)} failed: {proc.stderr.strip()[-2000:]}")
            digest = _sha256(out)
            path = directory / f"{stem}-{digest[:16]}.so"
            for target, write in ((path, lambda f: shutil.copyfile(out, f)),
                                  (directory / f"{stem}.sha256", lambda f: f.write_text(digest + "\n"))):
                staged = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
                write(staged)
                os.chmod(staged, 0o600)
                os.replace(staged, target)  # atomic; the library first, so a record always names a complete one
    return Kernels(path, tuple(flags), () if problem is None else (problem,))


_lock = threading.Lock()
_loaded: Kernels | None = None
_reason = "not loaded yet"
_tried = False


def load() -> Kernels | None:
    """The kernels, built on first call with the first flag set that compiles and loads; None if none does."""
    global _loaded, _reason, _tried
    with _lock:
        if not _tried:
            _tried = True
            errors = []
            for flags in FLAG_SETS:
                try:
                    _loaded = build(flags)
                    _reason = repr(_loaded)
                    break
                except Exception as exc:  # noqa: BLE001 - any failure means: try the next flags, then fall back
                    errors.append(f"[{' '.join(flags) or 'no extra flags'}] {exc}")
            else:
                _reason = "unavailable: " + "; ".join(errors)
        return _loaded


def status() -> str:
    """How the kernels were built, or why they are not available."""
    return _reason


# ---- one kernel call each, from a codec's scalars ---------------------------------------------------------
_PARALLEL_MIN = 1 << 16  # values below which one thread beats waking the pool


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


def encode(lib: Kernels, bits: int, block: int, x: Tensor, k: int, n: int, order: Order, pay: int, pstride: int,
           sc: int, sstride: int, pad: int) -> None:
    """Encode chunk order[i] (or i) of ``x`` into row i of the payload and scale buffers (addresses and byte
    strides), then ``pad`` zero bytes after each payload."""
    arr = _order_array(order, k)
    rc = lib.encode(x.data_ptr(), _DTYPE_CODE[x.dtype], n, k, None if arr is None else ctypes.addressof(arr),
                    block, bits, pay, pstride, sc, sstride, pad, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel encode failed ({rc}) for {x.dtype}")


def decode(lib: Kernels, bits: int, block: int, pay: int, pstride: int, sc: int, sstride: int, k: int, n: int,
           out: Tensor, sum_rows: bool) -> None:
    """Decode k rows into flat ``out`` (k*n values), or with ``sum_rows`` add them into its n fp32 values."""
    rc = lib.decode(pay, pstride, sc, sstride, k, n, block, bits, out.data_ptr(), _DTYPE_CODE[out.dtype],
                    n, sum_rows, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel decode failed ({rc}) for {out.dtype}")


def encode_seg(lib: Kernels, bits: int, block: int, x: Tensor, k: int, n: int, order: Order, lay: _Layout, pay: int,
               stride: int, sc: int, pad: int) -> None:
    """``encode`` with the row layout ``lay``, into wire rows of ``stride`` bytes."""
    arr = _order_array(order, k)
    rc = lib.encode_seg(x.data_ptr(), _DTYPE_CODE[x.dtype], n, k, None if arr is None else ctypes.addressof(arr),
                        lay.c_addr, lay.nbr, lay.U, block, bits, pay, stride, sc, stride, pad, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel encode failed ({rc}) for {x.dtype}")


def decode_seg(lib: Kernels, bits: int, block: int, pay: int, stride: int, sc: int, k: int, n: int, lay: _Layout,
               out: Tensor, sum_rows: bool) -> None:
    """``decode`` with the row layout ``lay``, from wire rows of ``stride`` bytes."""
    rc = lib.decode_seg(pay, stride, sc, stride, k, n, lay.c_addr, lay.nbr, lay.U, block, bits,
                        out.data_ptr(), _DTYPE_CODE[out.dtype], n, sum_rows, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel decode failed ({rc}) for {out.dtype}")


def encode_x(lib: Kernels, codec, x: Tensor, k: int, n: int, order: Order, lay: _Layout | None, pay: int,
             pstride: int, sc: int, sstride: int, pad: int, seed: int | None) -> None:
    """``encode`` / ``encode_seg`` for a rotated or stochastic codec (``codec``: a ``BlockCodec``; ``seed`` its
    64-bit key, None for round half to even)."""
    arr = _order_array(order, k)
    table, nbr, U = (None, 0, 0) if lay is None else (lay.c_addr, lay.nbr, lay.U)
    rc = lib.encode_x(x.data_ptr(), _DTYPE_CODE[x.dtype], n, k, None if arr is None else ctypes.addressof(arr),
                      table, nbr, U, codec.block, codec.bits, codec.rotate, seed is not None, seed or 0, pay, pstride,
                      sc, sstride, pad, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel encode failed ({rc}) for {x.dtype}")


def decode_x(lib: Kernels, codec, pay: int, pstride: int, sc: int, sstride: int, k: int, n: int,
             lay: _Layout | None, out: Tensor, sum_rows: bool) -> None:
    """``decode`` / ``decode_seg`` for a rotated codec: each block rotated back after dequantizing."""
    table, nbr, U = (None, 0, 0) if lay is None else (lay.c_addr, lay.nbr, lay.U)
    rc = lib.decode_x(pay, pstride, sc, sstride, k, n, table, nbr, U, codec.block, codec.bits, codec.rotate,
                      out.data_ptr(), _DTYPE_CODE[out.dtype], n, sum_rows, _threads(k * n))
    if rc:
        raise RuntimeError(f"codec kernel decode failed ({rc}) for {out.dtype}")
