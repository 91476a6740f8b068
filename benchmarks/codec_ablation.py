"""Where a rotated codec's time goes on this CPU: the fused kernels timed with parts of their work taken out.

Builds ``kernels.c`` three times and times each build in the same process, in alternating rounds, by
``codec_throughput.measure`` (1M values, one thread, flat layout, best of ``--reps``):

- ``as is``: the kernels as shipped;
- ``no rotation``: the 32-point transform removed from the encode and the decode (the decode keeps its product by
  the block's factor);
- ``no rotation, no hash``: also the stochastic rounding's hash (its counter used as the random bits).

The two cut builds give wrong bits; they exist only to be timed, and say how fast the same kernels would be without
the format's rotation and hash: an upper bound on what instruction-level work on the rest can reach.

    .venv/bin/python benchmarks/codec_ablation.py
    .venv/bin/python benchmarks/codec_ablation.py --codecs int8:128:h --dtypes bfloat16 --reps 100
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from codec_throughput import measure
from tiershard.comm.codecs import backends, codec_from_spec, native

# (text in kernels.c, its replacement): each must occur in the source, so a changed source fails loudly
NO_ROTATION = (
    ("            fwht_z(&r0, &r1, TS_NORM32);\n", ""),
    ("        fwht_z(&r0, &r1, f);\n",
     "        r0 = _mm512_mul_ps(r0, _mm512_set1_ps(f)); r1 = _mm512_mul_ps(r1, _mm512_set1_ps(f));\n"),
)
NO_HASH = (
    ("_mm512_srli_epi32(ts_mix16(_mm512_xor_si512(key, *jg)), 8)", "_mm512_srli_epi32(_mm512_xor_si512(key, *jg), 8)"),
)


def cut(source: str, edits: tuple[tuple[str, str], ...]) -> str:
    for old, new in edits:
        if old not in source:
            raise SystemExit(f"kernels.c no longer holds {old.strip()!r}: update this benchmark's edits")
        source = source.replace(old, new)
    return source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", nargs="+", default=["int8:128:h", "int4:128:h:sr"])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shipped = native._SOURCE
    builds = {}
    for name, edits in (("as is", ()), ("no rotation", NO_ROTATION), ("no rotation, no hash", NO_ROTATION + NO_HASH)):
        native._SOURCE = cut(shipped, edits)
        try:
            builds[name] = native.build(("-march=native", "-fopenmp"), Path(tempfile.mkdtemp()))
        finally:
            native._SOURCE = shipped
    if "avx512" not in repr(builds["as is"]):
        raise SystemExit(f"this CPU's build is not the AVX-512 one ({builds['as is']!r}): the cuts would not apply")
    print(f"{'build':22s} {'codec':14s} {'dtype':9s} {'memcpy us':>9s} {'encode us':>9s} {'decode us':>9s} "
          f"{'e+d/memcpy':>10s}")
    rows: dict[tuple, list[float]] = {}
    for _ in range(2):
        for name, lib in builds.items():
            backends._cpu_state = lib
            for spec in args.codecs:
                for dtype in args.dtypes:
                    r = measure(codec_from_spec(spec), 1 << 20, getattr(torch, dtype), args.reps)["flat"]
                    times, key = [r["memcpy"], r["encode"], r["decode"]], (name, spec, dtype)
                    rows[key] = [min(a, b) for a, b in zip(rows.get(key, times), times)]  # best of the rounds
    backends._cpu_state = None
    for (name, spec, dtype), (copy, enc, dec) in rows.items():
        print(f"{name:22s} {spec:14s} {dtype:9s} {copy * 1e6:9.0f} {enc * 1e6:9.0f} {dec * 1e6:9.0f} "
              f"{copy / (enc + dec):10.0%}")


if __name__ == "__main__":
    main()
