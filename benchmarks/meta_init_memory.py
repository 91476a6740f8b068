"""Peak memory per rank while sharding a GPT: built in full on every rank, or on the meta device.

Each mode runs in fresh processes (4 gloo ranks as 2 nodes of 2, plan GGG) and reports the growth of the peak
resident set over the process's baseline (after imports, the process group and a warm-up), next to the full fp32
size, this rank's shards (``ts.memory_stats``) and the largest module's parameters::

    .venv/bin/python benchmarks/meta_init_memory.py                  # a 12 x 768 GPT (~92M parameters)
    .venv/bin/python benchmarks/meta_init_memory.py --layers 6 --width 512
"""
from __future__ import annotations

import argparse
import resource


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(rank: int, world: int, mode: str, layers: int, width: int) -> dict:
    import torch

    import tiershard as ts
    from tiershard.train.models import GPT, Block, gpt_config

    cfg = gpt_config("small", n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=8192, block_size=256)
    ts.shard(GPT(gpt_config("tiny")), "GGG", ts.Topology((2, world)), wrap={Block})   # warm-up: groups, meshes
    base = peak_mb()
    torch.manual_seed(0)
    if mode == "eager":
        model = ts.shard(GPT(cfg), "GGG", ts.Topology((2, world)), wrap={Block})
    else:
        with torch.device("meta"):
            model = GPT(cfg)
        model = ts.shard(model, "GGG", ts.Topology((2, world)), wrap={Block}, init=GPT.init_weights)
    stats = ts.memory_stats(model)
    params = sum(p.numel() for p in model.parameters())
    biggest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {"peak_growth_mb": peak_mb() - base, "full_mb": params * 4 / 2**20,
            "shards_mb": (stats["params"] + stats["masters"]) / 2**20, "module_mb": biggest * 4 / 2**20,
            "params": params}


def main() -> None:
    from tiershard.cluster.local import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    print("| mode | params | full fp32 MB | shards MB (per rank) | largest module MB | peak growth MB (max over ranks) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in ("eager", "meta"):
        results = run_local(run, 4, mode, args.layers, args.width)
        r = results[0]
        peak = max(x["peak_growth_mb"] for x in results)
        print(f"| {mode} | {r['params'] / 1e6:.1f}M | {r['full_mb']:.0f} | {r['shards_mb']:.0f} | "
              f"{r['module_mb']:.0f} | {peak:.0f} |")


if __name__ == "__main__":
    main()
