"""Measurements taken on running ranks, shared by the benchmarks and the tests that check them."""
from __future__ import annotations

import torch
import torch.distributed as dist


def cross_node_volume(rank: int, world: int, plans: list[str], ranks_per_node: int = 2) -> dict:
    """Per plan: (measured, closed form) world-tier bytes of a training step after the first, summed over ranks
    / nodes / M, and the root unit's share of M (the root stays gathered for its backward, so ZeRO-3 moves
    (3 - share) (n-1)/n). Runs on every rank."""
    import tiershard as ts
    from tiershard.cost import traffic
    from tiershard.train.models import GPT, Block, gpt_config

    topo = ts.Topology((ranks_per_node, world))
    nodes = world // ranks_per_node
    out = {}
    for plan in plans:
        torch.manual_seed(0)
        model = ts.shard(GPT(gpt_config("tiny")), plan, topo, wrap={Block}, param_dtype=torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):    # the second step is measured: the steady state (qwd's first gather is exact)
            ts.reset_comm_stats()
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
        measured = torch.tensor([ts.comm_stats()["tiers"].get("world", 0)], dtype=torch.float64)
        dist.all_reduce(measured)
        engine = model._tiershard
        M = sum(g.S for g in engine.groups()) * 2
        shapes = traffic.engine_shapes(engine)
        closed = traffic.total_traffic(traffic.step_collectives(engine.placement, shapes, 2, 2), topo)
        root = sum(g.S for g in engine.root.groups) * 2 / M
        out[plan] = (measured.item() / nodes / M, closed.get("world", 0) / nodes / M, root)
    return out
