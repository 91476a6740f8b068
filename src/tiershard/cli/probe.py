"""``tiershard probe``: measure each tier's bandwidth and latency on the running cluster, write a TOML file.

Every tier is measured on the groups whose links are all of that tier (``topology.group_for(rank, k-1, k)``:
the ranks at one position in each of the tier's inner groups), all groups at once, as training loads them.
For a few buffer sizes S it times an all-gather (output S) and an all-to-all (input S); a rank sends
(k-1)/k x S in both, so ``time = (k-1) x latency + sent / bandwidth`` is fitted over the sizes.

Run it under torchrun (``torchrun --nproc-per-node 8 -m tiershard.cli probe --out cluster.toml``) or let it
start its own CPU ranks with gloo (``tiershard probe --nproc 4 --ranks-per-node 2``). The file feeds
``tiershard plan --cluster-file cluster.toml``.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import CliError
from .plan import one_line_errors

DEFAULT_SIZES = "64KB,1MB,8MB"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("probe", help="measure tier bandwidth and latency; write a cluster TOML file",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="cluster.toml", help="file to write (default cluster.toml)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"buffer sizes per collective (default {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size (median is kept)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiers", help="tier sizes innermost first, e.g. 2,8,64 (default: TIERSHARD_TOPOLOGY or "
                                   "LOCAL_WORLD_SIZE,WORLD_SIZE from the launcher)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    p.add_argument("--nproc", type=int, help="start this many local ranks (CPU, gloo) instead of running under torchrun")
    p.add_argument("--ranks-per-node", type=int, help="with --nproc: ranks per emulated node (default all)")
    p.set_defaults(func=run)
    one_line_errors(p)


def run(args: argparse.Namespace) -> int:
    from ..cost.presets import parse_bytes

    try:
        sizes = [int(parse_bytes(s)) for s in args.sizes.split(",")]
    except ValueError as err:
        raise CliError(str(err)) from None
    if any(s < 64 for s in sizes) or args.iters < 1 or args.warmup < 0:
        raise CliError("--sizes must each be at least 64B, --iters at least 1 and --warmup at least 0")
    if args.nproc is not None:
        return launch(args)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CliError("no ranks to measure: run under torchrun, or give --nproc N to start N local ranks")
    return worker(args, sizes)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> int:
    """Start ``--nproc`` ranks on this machine through torch.distributed.run, emulating nodes of ``--ranks-per-node``."""
    nproc, per_node = args.nproc, args.ranks_per_node or args.nproc
    if nproc < 2 or per_node < 1 or nproc % per_node:
        raise CliError(f"--nproc {nproc} must be at least 2 and a multiple of --ranks-per-node {per_node}")
    sizes = args.tiers or (f"{per_node},{nproc}" if per_node < nproc else f"{nproc}")
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERSHARD_TOPOLOGY=sizes)
    forward = ["--out", str(Path(args.out).resolve()), "--sizes", args.sizes, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--backend", args.backend or "gloo"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "tiershard.cli", "probe", *forward]
    code = subprocess.call(cmd, env=env)
    if code:
        raise CliError(f"the probe ranks failed with exit code {code} (their output is above)")
    return 0


def worker(args: argparse.Namespace, sizes: list[int]) -> int:
    import torch
    import torch.distributed as dist

    from ..topology import Topology, TopologyError

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        try:
            topo = Topology([int(s) for s in args.tiers.split(",")]) if args.tiers else Topology.from_env()
            topo.init_process_groups()
        except (TopologyError, ValueError) as err:
            raise CliError(str(err)) from None
        rank = dist.get_rank()
        results = [measure_tier(topo, level, sizes, args, device) for level in range(1, topo.num_levels)]
        device_rates = measure_device(topo, device)
        device_rates["codecs"] = measure_codecs(sizes, device, topo.level_size(1))
        if rank == 0:
            memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
            Path(args.out).write_text(to_toml(topo, results, sizes, args, backend, memory, device_rates))
            print(f"tiershard probe: wrote {args.out}")
            for tier in results:
                others = ", ".join(f"{kind.replace('_', '-')} {tier[kind + '_bandwidth'] / 1e9:.3g}"
                                   for kind in COLLECTIVES[1:])
                print(f"  {tier['name']:>8}: {tier['bandwidth'] / 1e9:.3g} GB/s per rank, "
                      f"{tier['latency'] * 1e6:.3g} us per step (all-gather; {others} GB/s)")
            for spec, rates in device_rates["codecs"].items():
                print(f"  codec {spec:<14} encode {rates['encode'] / 1e9:.3g} GB/s, decode+sum "
                      f"{rates['decode'] / 1e9:.3g} GB/s of fp32 values at {rates['points'][-1]['bytes']} B")
            print(f"  compute {device_rates['peak_flops'] / 1e9:.3g} GFLOP/s per rank (matmul), codecs "
                  f"{device_rates['codec_rate'] / 1e9:.3g} GB/s, overlap {device_rates['overlap']:.2f}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def measure_tier(topo, level: int, sizes: list[int], args: argparse.Namespace, device) -> dict:
    """Median seconds (slowest rank) of an all-gather and an all-to-all per size on this tier's groups, and the fit."""
    import torch
    import torch.distributed as dist

    group = topo.group_for(topo.rank, level - 1, level)
    name = topo.level_name(level)
    if group.size < 2:
        raise CliError(f"tier {name!r} has one group member per group in {topo}: nothing to measure; "
                       "give more ranks or a different --tiers / --ranks-per-node")
    k = group.size
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in COLLECTIVES}
    for size in sizes:
        numel = max(k, size // 4 // k * k)
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // k, device=device)
        root = dist.get_global_rank(group.pg, 0) if hasattr(dist, "get_global_rank") else group.ranks[0]
        ops = {"all_gather": lambda: gather(full, shard, group=group.pg),
               "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full, group=group.pg),
               # as the backend runs it: reduce_scatter_tensor (gloo has none, so the engine's all_to_all + sum)
               "reduce_scatter": lambda: _reduce_scatter(full, shard, group.pg),
               "all_reduce": lambda: dist.all_reduce(full, group=group.pg),
               "broadcast": lambda: dist.broadcast(full, root, group=group.pg)}
        for kind, op in ops.items():
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier(group=group.pg)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                op()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            samples[kind].append((SENT[kind](numel * 4, k), float(slowest)))
    fits = {kind: fit(points, k) for kind, points in samples.items()}
    out = {"name": name, "size": topo.level_size(level), "members": k, "bandwidth": fits["all_gather"][0],
           "latency": fits["all_gather"][1], "samples": samples}
    for kind in COLLECTIVES[1:]:
        out[f"{kind}_bandwidth"], out[f"{kind}_latency"] = fits[kind]
    return out


# what one rank sends of a buffer of S bytes over k members, by collective (ring algorithms; broadcast: a
# pipelined ring forwards the buffer once)
COLLECTIVES = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "broadcast")
SENT = {"all_gather": lambda S, k: (k - 1) * S / k, "all_to_all": lambda S, k: (k - 1) * S / k,
        "reduce_scatter": lambda S, k: (k - 1) * S / k, "all_reduce": lambda S, k: 2 * (k - 1) * S / k,
        "broadcast": lambda S, k: S}


def _reduce_scatter(full, shard, pg) -> None:
    """A reduce-scatter as the backend runs it for the engine: ``reduce_scatter_tensor`` where the backend has one
    (NCCL), else an all-to-all of the chunks and a local sum (gloo)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend(pg) != "gloo":
        dist.reduce_scatter_tensor(shard, full, group=pg)
        return
    k = full.numel() // shard.numel()
    out = torch.empty_like(full)
    dist.all_to_all_single(out, full, group=pg)
    torch.sum(out.view(k, -1), dim=0, out=shard)


def _slowest(seconds: float, device) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def measure_device(topo, device) -> dict:
    """What the cost model needs besides the links, measured with every rank busy as in training:

    - ``peak_flops``: the matmul rate one rank reaches (the training precision: bf16 on a GPU, fp32 on a CPU);
    - ``codec_rate``: bytes of values per second through qgZ's int4 encode + decode-and-sum and qwZ's int8
      encode + decode (the slower of the two);
    - ``overlap``: how much of a matmul loop an all-gather on the engine's own communication stream hides
      behind: (compute + comm - both at once) / the shorter of the two, in [0, 1].
    """
    import torch
    import torch.distributed as dist

    from ..comm import collectives as C
    from ..comm.codecs import INT4, INT8
    from ..comm.stream import stream_for

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n = 4096 if cuda else 384
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn, reps: int) -> float:
        fn()
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - start) / reps

    matmul = _slowest(timed(lambda: a @ b, 10), device)
    x = torch.randn(1 << 22, device=device)
    k = topo.world_size
    int4 = timed(lambda: INT4.decode_wire_sum(INT4.encode_wire(x, k), k, x.numel() // k), 3)
    int8 = timed(lambda: INT8.decode_wire(INT8.encode_wire(x, k), k, x.numel() // k), 3)
    codec = x.numel() * 4 / _slowest(max(int4, int8), device)

    group = topo.group_for(topo.rank, 0, topo.num_levels - 1)
    shard = torch.ones(1 << 20, device=device)
    full = torch.empty(shard.numel() * group.size, device=device)
    stream = stream_for(topo)
    comm = timed(lambda: stream.run(C.all_gather, full, shard, group, topo, "probe"), 3)
    reps = max(1, round(comm / max(matmul, 1e-9)))
    compute = timed(lambda: [a @ b for _ in range(reps)], 2)

    def both():
        future = stream.submit(C.all_gather, full, shard, group, topo, "probe")
        for _ in range(reps):
            a @ b
        future.result()
    together = timed(both, 2)
    overlap = (compute + comm - together) / min(compute, comm)
    overlap = _slowest(-min(1.0, max(0.0, overlap)), device)      # the worst rank's overlap
    return {"peak_flops": 2 * n ** 3 / matmul, "codec_rate": codec, "overlap": -overlap}


# the codecs the plans use: qwz's int8, the bare-qgz hops (QGZ_DEFAULT), qwd's default, plain int4 (qgz=int4)
PROBE_CODECS = ("int8", "int8:128:h", "int4:128:h:sr", "int4:2048", "int4")


def measure_codecs(sizes: list[int], device, k: int, iters: int = 3) -> dict:
    """Per codec of ``PROBE_CODECS``, seconds to encode a rank's ``S`` bytes of fp32 values as ``k`` wire chunks
    and to decode-and-sum them, at each of the probe's sizes, with every rank busy as in training; ``rate`` is
    the bytes of values through encode plus decode per second at the largest size (``Cluster.codec_rates``)."""
    import torch

    from ..comm.codecs import codec_from_spec

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return _slowest((time.perf_counter() - start) / iters, device)

    out = {}
    for spec in PROBE_CODECS:
        codec = codec_from_spec(spec)
        points = []
        for size in sizes:
            numel = max(k, size // 4 // k * k)
            x = torch.randn(numel, device=device)
            wire = codec.encode_wire(x, k, seed=1)
            encode = timed(lambda: codec.encode_wire(x, k, out=wire, seed=1))
            decode = timed(lambda: codec.decode_wire_sum(wire, k, numel // k))
            points.append({"bytes": numel * 4, "encode": encode, "decode": decode})
        last = points[-1]
        out[codec.spec] = {"encode": last["bytes"] / last["encode"], "decode": last["bytes"] / last["decode"],
                     "rate": 2 * last["bytes"] / (last["encode"] + last["decode"]), "points": points}
    return out


def fit(points: list[tuple[float, float]], k: int) -> tuple[float, float]:
    """Least squares ``t = a + x / bandwidth`` over (bytes sent per rank, seconds); latency = a / (k - 1).

    A non-positive slope (timing noise drowns the bytes) falls back to the best observed rate; a non-positive
    intercept to the smallest time, an upper bound on the latency.
    """
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    n = len(points)
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
    bandwidth = 1 / slope if slope > 0 else max(x / t for x, t in points)
    intercept = mt - slope * mx if slope > 0 else 0.0
    if intercept <= 0:
        intercept = min(ts)
    return bandwidth, intercept / (k - 1)


def to_toml(topo, results: list[dict], sizes: list[int], args: argparse.Namespace, backend: str,
            memory: int | None, device_rates: dict | None = None) -> str:
    lines = [
        f"# Written by tiershard probe: {topo.world_size} ranks as tiers {topo.sizes}, backend {backend},",
        f"# sizes {sizes} bytes, median of {args.iters} after {args.warmup} warm-up, slowest rank.",
        "# bandwidth: bytes/s one rank sends on the tier's links (all-gather fit); latency: seconds per step.",
        "# peak_flops: the matmul rate one rank reached; codec_rate: bytes/s through qwZ/qgZ's codecs;",
        "# overlap: fraction of compute an all-gather on the engine's communication stream hid behind.",
        "# <kind>_bandwidth/latency: the same fit for the other collectives the plans run (reduce-scatter as the",
        "# backend runs it); [cluster.codecs.SPEC]: bytes/s of fp32 values through each codec (rate: encode +",
        "# decode together, what the cost model uses; encode, decode: each alone) at the largest size.",
        "[cluster]",
        'name = "probe"',
    ]
    if device_rates:
        lines += [f"peak_flops = {device_rates['peak_flops']:.6e}", f"codec_rate = {device_rates['codec_rate']:.6e}",
                  f"overlap = {device_rates['overlap']:.4f}"]
    if memory is not None:
        lines.append(f"gpu_memory = {memory}")
    for tier in results:
        lines += ["", "[[cluster.tiers]]", f'name = "{tier["name"]}"', f"size = {tier['size']}",
                  f"bandwidth = {tier['bandwidth']:.6e}", f"latency = {tier['latency']:.6e}"]
        lines += [f"{kind}_{what} = {tier[f'{kind}_{what}']:.6e}" for kind in COLLECTIVES[1:] if f"{kind}_bandwidth" in tier
                  for what in ("bandwidth", "latency")]
        for kind, points in tier["samples"].items():
            pairs = ", ".join(f"{x:.0f} B sent in {t:.3e} s" for x, t in points)
            lines.append(f"# {kind} over {tier['members']} members: {pairs}")
    for spec, rates in (device_rates or {}).get("codecs", {}).items():
        lines += ["", f'[cluster.codecs."{spec}"]', f"rate = {rates['rate']:.6e}", f"encode = {rates['encode']:.6e}",
                  f"decode = {rates['decode']:.6e}"]
        pairs = ", ".join(f"{p['bytes']} B: encode {p['encode']:.3e} s, decode+sum {p['decode']:.3e} s"
                          for p in rates["points"])
        lines.append(f"# {pairs}")
    return "\n".join(lines) + "\n"
