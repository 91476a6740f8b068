"""Codec throughput against memcpy: does quantizing pay for itself on this CPU?

Definition. For a flat tensor of N values of dtype D (fp32 or bf16), split into K = 8 equal chunks as a qgZ hop or
a qwZ gather would:

- memcpy GB/s   = N * sizeof(D) / time of ``y.copy_(x)``
- encode GB/s   = N * sizeof(D) / time of ``codec.encode_wire(x, K, wire, order)`` (order reversed, as an all-to-all)
- decode GB/s   = N * sizeof(D) / time of ``codec.decode_wire(wire, K, N // K, out)`` (out of dtype D)
- sum GB/s      = N * sizeof(D) / time of ``codec.decode_wire_sum(wire, K, N // K)`` (qgZ's receive side)
- e+d vs memcpy = time(memcpy) / (time(encode) + time(decode)), in percent: the codec's round trip moves the input's
  bytes at that fraction of the speed of copying them.

Layouts (``--layouts``): ``flat`` encodes each chunk as one run of blocks (``segments=None``, qwZ's case); ``rows``
cuts each chunk into 2 rows of a model-like row layout (qgZ's case: ``segments=``, blocks never span two segments),
24 segments per row: 12 small ones (1, 7, 96, 96, 33, 288, 96, 12, 96, 384, 5, 96 values: norm gains, biases, two
odd-sized) between 12 large ones in proportions 3:1:4:4 of the rest. The odd widths put most int4 blocks on an odd
first value, the costlier case for the packed nibbles.

Every time is the best of ``--reps`` runs of one operation repeated back to back (its buffers hot in cache, which
favours memcpy most), spread over 4 rounds that alternate between the operations of both layouts: the machine is
shared, so the best run is the least disturbed one, and alternating exposes all of them to the same disturbances.
``torch.set_num_threads(T)`` applies to memcpy and the codecs alike, for each T in ``--threads``.

    .venv/bin/python benchmarks/codec_throughput.py                 # fused kernels (the default backend)
    TIERSHARD_CODEC_KERNELS=torch .venv/bin/python benchmarks/codec_throughput.py --sizes 1M   # reference path
    .venv/bin/python benchmarks/codec_throughput.py --sizes 1M --dtypes float32 --codecs int8:128:h int4:128:h:sr
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from tiershard.comm.codecs import INT4, INT8, BlockCodec, codec_from_spec, kernel_status

K = 8


def _size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1].upper()] if text[-1].upper() in mult else int(text)


ROWS = 2
SMALL = (1, 7, 96, 96, 33, 288, 96, 12, 96, 384, 5, 96)


def row_layout(U: int) -> list[int]:
    """The ``rows`` layout of one row of U values: the small segments of SMALL, each after a large one."""
    rest = U - sum(SMALL)
    if rest < 12:
        raise ValueError(f"a row of {U} values cannot hold the layout's segments")
    props = [3, 1, 4, 4] * 3
    large = [rest * p // sum(props) for p in props]
    large[-1] += rest - sum(large)
    return [w for pair in zip(large, SMALL) for w in pair]


def measure(codec: BlockCodec, n: int, dtype: torch.dtype, reps: int,
            layouts: tuple[str, ...] = ("flat",)) -> dict[str, dict[str, float]]:
    """Best seconds of memcpy, encode, decode and decode-sum of n values of dtype (K chunks), per layout. Each
    operation runs back to back in 4 rounds that alternate with the others' (both layouts' included), so a
    disturbance from other processes cannot hit only one of them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g).to(dtype)
    y = torch.empty_like(x)
    chunk = n // K
    out = torch.empty_like(x)
    total = torch.empty(chunk)
    order = list(reversed(range(K)))
    ops = {}
    for layout in layouts:
        segments = None if layout == "flat" else tuple(row_layout(chunk // ROWS))
        wire = torch.empty(K * codec.wire_bytes(chunk, segments), dtype=torch.uint8)
        ops[layout, "memcpy"] = lambda: y.copy_(x)
        seed = {"seed": 1} if codec.stochastic else {}
        ops[layout, "encode"] = lambda w=wire, s=segments: codec.encode_wire(x, K, w, order, s, **seed)
        ops[layout, "decode"] = lambda w=wire, s=segments: codec.decode_wire(w, K, chunk, out, segments=s)
        ops[layout, "sum"] = lambda w=wire, s=segments: codec.decode_wire_sum(w, K, chunk, total, segments=s)
    best = dict.fromkeys(ops, float("inf"))
    rounds = 4
    for _ in range(rounds):
        for key, fn in ops.items():
            fn()  # warm-up: each operation is timed with its own buffers hot in cache, memcpy included
            for _ in range(-(-reps // rounds)):
                t0 = time.perf_counter()
                fn()
                best[key] = min(best[key], time.perf_counter() - t0)
    return {layout: {op: best[layout, op] for op in ("memcpy", "encode", "decode", "sum")} for layout in layouts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["64K", "1M", "16M"], help="values per tensor (K, M suffixes)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layouts", nargs="+", default=["flat", "rows"], choices=["flat", "rows"])
    ap.add_argument("--codecs", nargs="+", default=[INT8.spec, INT4.spec],
                    help="codec specs, e.g. int8:128:h int4:128:h:sr (qgZ's default hops)")
    args = ap.parse_args()

    status = kernel_status()
    machine = platform.processor() or platform.machine()
    print(f"{machine}, torch {torch.__version__}; codec backend (cpu): {status['cpu']}")
    print(f"GB/s of input bytes (N values x dtype size), {K} chunks, best of {args.reps}; "
          f"e+d = memcpy time / (encode + decode time)")
    header = (f"{'threads':>7} {'values':>9} {'dtype':>8} {'codec':>9} {'layout':>6} {'memcpy':>8} {'encode':>8} "
              f"{'decode':>8} {'sum':>8} {'e+d/memcpy':>10}")
    print(header)
    print("-" * len(header))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for size in args.sizes:
            n = _size(size) // (K * ROWS) * (K * ROWS)
            for dname in args.dtypes:
                dtype = getattr(torch, dname)
                nbytes = n * dtype.itemsize
                for codec in map(codec_from_spec, args.codecs):
                    times = measure(codec, n, dtype, args.reps, tuple(args.layouts))
                    for layout, t in times.items():
                        gbs = {key: nbytes / sec / 1e9 for key, sec in t.items()}
                        ratio = 100 * t["memcpy"] / (t["encode"] + t["decode"])
                        print(f"{threads:>7} {size:>9} {dname:>8} {codec.spec:>9} {layout:>6} {gbs['memcpy']:>8.1f} "
                              f"{gbs['encode']:>8.1f} {gbs['decode']:>8.1f} {gbs['sum']:>8.1f} {ratio:>9.0f}%",
                              flush=True)


if __name__ == "__main__":
    main()
