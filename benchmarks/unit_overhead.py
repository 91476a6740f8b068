"""Forward + backward of one unit of many tensors on one rank (no communication): tiershard, FSDP2, plain torch.

What it isolates: the engine's per-unit work (copy-out of the gathered weights into per-parameter working
tensors, one interleaving copy of the gradients, the hooks), which must not grow with tensors x unit size::

    .venv/bin/python benchmarks/unit_overhead.py                   # 64 Linear(256, 256) in one unit
    .venv/bin/python benchmarks/unit_overhead.py --layers 16 --width 512
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn


def measure(layers: int, width: int, batch: int, reps: int) -> dict:
    import tiershard as ts

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    from torch.distributed.fsdp import fully_shard

    x = torch.randn(batch, width)
    models = {"torch": build(), "FSDP2 fully_shard": fully_shard(build()),
              "tiershard GGG": ts.shard(build(), "GGG", ts.Topology((1,))),
              "tiershard NNN": ts.shard(build(), "NNN", ts.Topology((1,)))}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):              # interleaved rounds
        for name, model in models.items():
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            times[name].append(time.perf_counter() - t0)
            for p in model.parameters():
                p.grad = None
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    import os

    import torch.distributed as dist

    from tiershard.cluster.local import free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    result = measure(args.layers, args.width, args.batch, args.reps)
    base = result["torch"]
    print(f"one unit of {args.layers} x Linear({args.width}, {args.width}) = {2 * args.layers} tensors, "
          f"batch {args.batch}, 1 thread, median of {args.reps - 1}")
    for name, seconds in result.items():
        print(f"{name:<16}{seconds * 1e3:8.2f} ms  {seconds / base:5.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
