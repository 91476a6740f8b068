"""Bytes crossing node boundaries per optimizer step, in units of M, measured by comm_stats and by formula.

M = parameters x bytes of the param dtype (bf16 here). The ZeRO++ paper's accounting: ZeRO-3 moves about 3M
across nodes per step, ZeRO++ about 0.75M. Measured on gloo ranks of this machine (2 ranks per emulated
node), one micro-step per optimizer step:

    .venv/bin/python benchmarks/zeropp_volume.py              # 4 ranks = 2 nodes of 2
    .venv/bin/python benchmarks/zeropp_volume.py --ranks 8    # 4 nodes of 2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

PLANS = ["zero3", "zero++", "GGG+qwz", "GGG+hpz", "GGG+qgz", "IIG", "NIG", "hsdp"]


def cross_node_volume(rank: int, world: int, plans: list[str], ranks_per_node: int = 2) -> dict:
    """Per plan: (measured, closed form) world-tier bytes summed over ranks / nodes / M. Runs on every rank."""
    import tiershard as ts
    from tiershard import traffic
    from tiershard.models import GPT, Block, gpt_config

    topo = ts.Topology((ranks_per_node, world))
    nodes = world // ranks_per_node
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        model = ts.shard(GPT(gpt_config("tiny")), plan, topo, wrap={Block}, param_dtype=torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))
        ts.reset_comm_stats()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        measured = torch.tensor([ts.comm_stats()["tiers"].get("world", 0)], dtype=torch.float64)
        dist.all_reduce(measured)
        engine = model._tiershard
        M = sum(g.S for g in engine.groups()) * 2
        shapes = [traffic.FlatGroupShape(g.S, g.trainable) for g in engine.groups()]
        closed = traffic.total_traffic(traffic.step_collectives(engine.placement, shapes, 2, 2), topo)
        out[plan] = (measured.item() / nodes / M, closed.get("world", 0) / nodes / M)
    return out


def main() -> None:
    from tiershard.local import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--plans", default=",".join(PLANS))
    args = parser.parse_args()
    results = run_local(cross_node_volume, args.ranks, args.plans.split(","))[0]
    print(f"{args.ranks} ranks, {args.ranks // 2} nodes of 2, bf16, one micro-step per optimizer step")
    print(f"{'plan':<18}{'measured / M':>14}{'formula / M':>14}")
    for plan, (measured, closed) in results.items():
        print(f"{plan:<18}{measured:>14.4f}{closed:>14.4f}")
    z3, zpp = results.get("zero3"), results.get("zero++")
    if z3 and zpp:
        print(f"zero3 / zero++ cross-node bytes: {z3[0] / zpp[0]:.2f}x")


if __name__ == "__main__":
    main()
