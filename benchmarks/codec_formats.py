"""Rotated (``:h``) and stochastic (``:sr``) codec formats: speed against memcpy, and round-trip error.

Throughput: for N fp32 values split into 8 chunks, the best of ``--reps`` runs of ``torch.clone`` (memcpy, measured
again for each codec) and of ``encode_wire`` + ``decode_wire`` (C backend unless ``TIERSHARD_CODEC_KERNELS=torch``);
the last column is time(memcpy) / (time(encode) + time(decode)).

Error: a gradient-like tensor (N(0, 1) rows times a lognormal row scale, 0.1% of values x50) encoded once per seed;
``rel L2`` is ||x_hat - x|| / ||x||, ``bias`` is ||mean over seeds of (x_hat - x)|| / ||x||: what is left of the error
after averaging (nearest rounding gives the same x_hat every time, so its bias equals its error; stochastic
rounding's shrinks like 1/sqrt(seeds)).

    .venv/bin/python benchmarks/codec_formats.py
"""
from __future__ import annotations

import argparse
import time

import torch

from tiershard.comm.codecs import codec_from_spec, kernel_status

SPEED_SPECS = ["int8:128", "int8:128:sr", "int4:64", "int4:64:sr", "int4:128:h", "int4:128:h:sr", "int8:128:h"]
ERROR_SPECS = ["int4:64", "int4:64:sr", "int4:128:h", "int4:128:h:sr", "int8:128:h", "int8:128:h:sr", "int8:2048"]


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def throughput(n: int, reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    print(f"{'codec':>15} {'memcpy us':>10} {'encode us':>10} {'decode us':>10} {'e+d/memcpy':>11}")
    for spec in SPEED_SPECS:
        codec = codec_from_spec(spec)
        wire = codec.encode_wire(x, 8, seed=1)
        out = torch.empty(n)
        copy = _best(lambda: x.clone(), reps)  # per row, so a busy machine slows both sides of the ratio alike
        enc = _best(lambda: codec.encode_wire(x, 8, wire, seed=1), reps)
        dec = _best(lambda: codec.decode_wire(wire, 8, n // 8, out), reps)
        print(f"{spec:>15} {copy * 1e6:10.0f} {enc * 1e6:10.0f} {dec * 1e6:10.0f} {copy / (enc + dec):11.0%}")


def errors(rows: int, cols: int, seeds: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.exp(0.5 * torch.randn(rows, 1, generator=g))
    spikes = torch.rand(rows, cols, generator=g) < 1e-3
    x = torch.where(spikes, x * 50, x).view(-1)
    print(f"{'codec':>15} {'rel L2':>8} {'bias':>8}")
    for spec in ERROR_SPECS:
        codec = codec_from_spec(spec)
        total, l2 = torch.zeros_like(x), 0.0
        for s in range(seeds):
            err = codec.decode_wire(codec.encode_wire(x, 1, seed=s), 1, x.numel()) - x
            total += err
            l2 += (err.norm() / x.norm()).item() / seeds
        print(f"{spec:>15} {l2:8.4f} {(total / seeds).norm().item() / x.norm().item():8.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=16)
    args = parser.parse_args()
    print(f"codec backend (cpu): {kernel_status()['cpu']}; {args.values} fp32 values, {args.threads} thread(s)")
    throughput(args.values, args.reps, args.threads)
    print(f"\nround-trip error, 1024 x 1024 gradient-like values, {args.seeds} seeds")
    errors(1024, 1024, args.seeds)


if __name__ == "__main__":
    main()
