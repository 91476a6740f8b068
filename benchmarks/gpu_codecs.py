"""The codecs on a CUDA GPU: the Triton kernels' bits against the CPU's, then their throughput against memcpy.

Run on a machine with a CUDA GPU and ``triton`` (``pip install tiershard[gpu]``)::

    python benchmarks/gpu_codecs.py                  # bit check, then throughput at 1M, 16M and 64M values
    python benchmarks/gpu_codecs.py --no-bench       # the bit check alone (exits 1 on any difference)
    python benchmarks/gpu_codecs.py --no-bench --tune  # the bit check, then the grouped kernels' launch shapes

**Bits.** Every codec the plans use (int8 and int4 at several block sizes, rotated ``:h`` and stochastic ``:sr``,
flat and with row layouts, fp32, bf16 and fp16 input, odd sizes, nan and inf) is encoded, decoded and summed
through the wire API once on CUDA tensors (the Triton kernels) and once on CPU tensors (the C kernels, themselves
checked bit for bit against the torch reference); wire bytes and decoded values must be identical.

**Throughput.** As ``codec_throughput.py`` defines it, for N values split into 8 chunks: GB/s = input bytes /
time, memcpy is ``y.copy_(x)`` on the GPU, and e+d/memcpy is memcpy time / (encode + decode time), the fraction
of copy speed at which the codec's round trip moves the input. Each call is timed two ways:

- **device**: the GPU's own time, from a CUDA graph of 20 calls replayed 5 times (no host cost): what a call costs
  when the host runs ahead of the GPU, as it does while a model trains;
- **call**: the median of ``--reps`` calls each timed alone with CUDA events, so the host's cost of the call (the
  Python wrapper and the Triton launch, tens of microseconds) counts: what a call costs when the GPU waits for it.
"""
from __future__ import annotations

import argparse
import sys

import torch

from tiershard.comm.codecs import INT4, INT8, codec_from_spec, kernel_status, same_bits

K = 8
SPECS = ("int8", "int4", "int4:37", "int8:5000", "int4:6000", "int8:128:h", "int4:128:h", "int4:128:h:sr",
         "int8:128:h:sr", "int4:37:h:sr", "int8:100:sr")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _input(k: int, n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(k * n, generator=g) * 3
    if k * n > 100:
        x[7], x[90], x[95] = float("nan"), 0.0, float("inf")
        x[40:60] = 0.0
    return x.to(dtype)


def _row_layout(width: int, align: int = 1) -> tuple[int, ...]:
    """A model-like row of ``width`` values: small segments (norms, biases) between large ones (weight matrices).
    ``align`` 1: odd widths, so most blocks start on odd values (a layout's worst case); 16: every width a multiple
    of 16, as a model whose dimensions are multiples of 16 x the ranks sharing a unit gives (``width`` must be one)."""
    small = (1, 7, 96, 33, 5, 384) if align == 1 else (16, 96, 48, 32, 16, 384)
    rest = width - sum(small)
    large = [rest // (6 * align) * align] * 5
    large.append(rest - sum(large))
    return tuple(w for pair in zip(large, small) for w in pair)


def check_bits(device: torch.device) -> int:
    """Encode, decode and sum on ``device`` and on the CPU; returns the number of cases that differ."""
    g = torch.Generator().manual_seed(0)
    cases = [(None, 3, 203), (None, 2, 1), (None, 8, (1 << 17) + 5), ((1, 64, 37, 3, 34), 2, 2 * 139)]
    cases.append((_row_layout(50_000), 4, 2 * 50_000))
    cases.append((_row_layout(50_000, 16), 4, 2 * 50_000))
    cases.append(((16, 144, 64, 32), 3, 5 * 256))
    failures = checked = 0
    for spec in SPECS:
        codec = codec_from_spec(spec)
        for segments, k, n in cases:
            for dtype in DTYPES:
                if segments is not None and n % sum(segments):
                    continue
                x = _input(k, n, dtype, g)
                order = list(range(k))[::-1]
                seed = 1234 if codec.stochastic else None
                cpu = codec.encode_wire(x, k, order=order, segments=segments, seed=seed)
                gpu = codec.encode_wire(x.to(device), k, order=order, segments=segments, seed=seed)
                problems = []
                if not torch.equal(gpu.cpu(), cpu):
                    bad = (gpu.cpu() != cpu).nonzero()
                    problems.append(f"encode: {bad.numel()} bytes differ, first at {bad[0].item()}")
                wire = cpu.to(device)
                for out_dtype in DTYPES:
                    ref = codec.decode_wire(cpu, k, n, dtype=out_dtype, segments=segments)
                    got = codec.decode_wire(wire, k, n, dtype=out_dtype, segments=segments)
                    if not same_bits(got.cpu(), ref):
                        problems.append(f"decode to {out_dtype}")
                ref = codec.decode_wire_sum(cpu, k, n, segments=segments)
                got = codec.decode_wire_sum(wire, k, n, segments=segments)
                if not same_bits(got.cpu(), ref):
                    problems.append("decode_wire_sum")
                checked += 1
                if problems:
                    failures += 1
                    where = "flat" if segments is None else f"{len(segments)} segments"
                    print(f"DIFFERS {spec} {dtype} k={k} n={n} {where}: {'; '.join(problems)}", flush=True)
    print(f"bits: {checked} cases, {failures} differ from the CPU", flush=True)
    return failures


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _graph_ms(fn, calls: int = 20, replays: int = 5) -> float:
    """Device time of one call: a CUDA graph of ``calls`` calls, replayed (the host's cost of a call is not in it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: compiles, caches device tables
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def _inputs(device: torch.device, sizes: list[int]):
    """(n, chunk, x, y, out) per size (rounded to whole chunks of even length) and input dtype: x random on the
    device, y and out its size."""
    for n in sizes:
        n = n // (2 * K) * (2 * K)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n, device=device).to(dtype)
            yield n, n // K, x, torch.empty_like(x), torch.empty_like(x)


def _wire(codec, chunk: int, layout: str, device: torch.device):
    """(segments, wire buffer) of K chunks: ``flat``, ``rows`` (odd widths) or ``rows16`` (widths multiples of 16)."""
    segments = None if layout == "flat" else _row_layout(chunk // 2, 16 if layout == "rows16" else 1)
    return segments, torch.empty(K * codec.wire_bytes(chunk, segments), dtype=torch.uint8, device=device)


def bench(device: torch.device, sizes: list[int], reps: int) -> None:
    codecs = (INT8, INT4, codec_from_spec("int8:128:h"), codec_from_spec("int4:128:h:sr"))
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; {kernel_status()['cuda']}")
    print(f"{K} chunks. device: GB/s of input bytes by CUDA-graph replay; call: microseconds a call timed alone "
          f"(median of {reps}, host cost included); e+d = memcpy time / (encode + decode time)")
    header = (f"{'values':>9} {'dtype':>8} {'codec':>13} {'layout':>6} | device GB/s: {'memcpy':>6} {'encode':>6} "
              f"{'decode':>6} {'sum':>6} {'e+d':>4} | call us: {'memcpy':>6} {'encode':>6} {'decode':>6} {'e+d':>4}")
    print(header)
    print("-" * len(header), flush=True)
    for n, chunk, x, y, out in _inputs(device, sizes):
        dtype = x.dtype
        total = torch.empty(chunk, device=device)
        order = list(range(K))[::-1]
        copy = (_graph_ms(lambda: y.copy_(x)), _median_ms(lambda: y.copy_(x), reps))
        for codec in codecs:
            for layout in ("flat", "rows", "rows16"):
                segments, wire = _wire(codec, chunk, layout, device)
                seed = 7 if codec.stochastic else None
                calls = (lambda: codec.encode_wire(x, K, wire, order, segments, seed=seed),
                         lambda: codec.decode_wire(wire, K, chunk, out, segments=segments),
                         lambda: codec.decode_wire_sum(wire, K, chunk, total, segments=segments))
                dev = [_graph_ms(fn) for fn in calls]
                alone = [_median_ms(fn, reps) for fn in calls[:2]]
                gbs = [n * dtype.itemsize / (ms * 1e6) for ms in (copy[0], *dev)]
                print(f"{n:>9} {str(dtype)[6:]:>8} {codec.spec:>13} {layout:>6} | {'':>12} "
                      + " ".join(f"{v:>6.0f}" for v in gbs) + f" {100 * copy[0] / (dev[0] + dev[1]):>3.0f}%"
                      + f" | {'':>8} " + " ".join(f"{1000 * ms:>6.1f}" for ms in (copy[1], *alone))
                      + f" {100 * copy[1] / sum(alone):>3.0f}%", flush=True)


TUNE_VALUES = (512, 1024, 2048, 4096)
TUNE_WARPS = (2, 4, 8)


def tune(device: torch.device, sizes: list[int]) -> int:
    """Device e+d of qgZ's two codecs (flat and aligned rows) under every launch shape of the grouped kernels
    (``triton_kernels.X_VALUES_PER_PROGRAM`` x ``X_WARPS``), each shape's bits checked against the CPU's first;
    returns the number of shapes whose bits differ."""
    from tiershard.comm.codecs import triton_kernels as tk
    default = (tk.X_VALUES_PER_PROGRAM, tk.X_WARPS)
    codecs = (codec_from_spec("int8:128:h"), codec_from_spec("int4:128:h:sr"))
    print(f"grouped kernels' launch shapes (default {default[0]} values x {default[1]} warps): device e+d / memcpy")
    print(f"{'values':>9} {'dtype':>8} {'codec':>13} {'layout':>6} " + " ".join(
        f"{v:>5}x{w}" for v in TUNE_VALUES for w in TUNE_WARPS), flush=True)
    g = torch.Generator().manual_seed(1)
    differ = 0
    for n, chunk, x, y, out in _inputs(device, sizes):
        dtype = x.dtype
        copy = _graph_ms(lambda: y.copy_(x))
        small = _input(3, 2 * 50_000, dtype, g)
        for codec in codecs:
            seed = 7 if codec.stochastic else None
            cpu = codec.encode_wire(small, 3, seed=seed)  # the shapes' bit check: the CPU's wire and values
            ref = codec.decode_wire(cpu, 3, 2 * 50_000)
            for layout in ("flat", "rows16"):
                segments, wire = _wire(codec, chunk, layout, device)
                cells = []
                for values in TUNE_VALUES:
                    for warps in TUNE_WARPS:
                        tk.X_VALUES_PER_PROGRAM, tk.X_WARPS = values, warps
                        same = torch.equal(codec.encode_wire(small.to(device), 3, seed=seed).cpu(), cpu) and \
                            same_bits(codec.decode_wire(cpu.to(device), 3, 2 * 50_000).cpu(), ref)
                        enc = _graph_ms(lambda: codec.encode_wire(x, K, wire, None, segments, seed=seed))
                        dec = _graph_ms(lambda: codec.decode_wire(wire, K, chunk, out, segments=segments))
                        cells.append(f"{100 * copy / (enc + dec):>6.0f}%" if same else f"{'BITS':>7}")
                        differ += not same
                print(f"{n:>9} {str(dtype)[6:]:>8} {codec.spec:>13} {layout:>6} " + " ".join(cells), flush=True)
    tk.X_VALUES_PER_PROGRAM, tk.X_WARPS = default
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[1 << 20, 1 << 24, 1 << 26])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--tune", action="store_true", help="time the grouped kernels' launch shapes (1M values)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    status = kernel_status()
    print(f"codec backends: {status}", flush=True)
    failures = check_bits(device)
    if not args.no_bench:
        bench(device, args.sizes, args.reps)
    if args.tune:
        failures += tune(device, [1 << 20])
    return 1 if failures or "triton" not in status["cuda"] else 0


if __name__ == "__main__":
    sys.exit(main())
