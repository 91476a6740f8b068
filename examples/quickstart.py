"""Train a small model with a PaRO plan on 4 CPU ranks emulating 2 nodes of 2.

    torchrun --nproc-per-node 4 examples/quickstart.py            # plan IIG
    torchrun --nproc-per-node 4 examples/quickstart.py zero++     # any plan text
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import tiershard as ts


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(x)


def main(plan_text="IIG"):
    dist.init_process_group("gloo")
    os.environ.setdefault("TIERSHARD_TOPOLOGY", "2,4")        # 2 ranks per emulated node, 4 ranks in all
    topo = ts.Topology.from_env()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), *[Block(64) for _ in range(4)], nn.Linear(64, 1))
    model = ts.shard(model, ts.Plan.parse(plan_text), topo, wrap={Block})
    # parameters keep their names and shapes: the usual groups, no weight decay on biases and norms
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for name, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(20):
        for micro in range(2):                               # two accumulation micro-steps
            x = torch.randn(8, 16, generator=g)
            loss = (model(x).squeeze(-1) - x.sum(-1)).pow(2).mean() / 2
            if micro == 0:
                with ts.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the global norm on every rank
        opt.step()
        opt.zero_grad()
    stats = ts.comm_stats()
    if dist.get_rank() == 0:
        print(f"plan {plan_text}: last loss {loss.item() * 2:.4f}; rank 0 sent {stats['tiers']} bytes by tier")
    state = ts.full_state_dict(model)                         # original names, fp32, on every rank
    if dist.get_rank() == 0:
        print(f"{len(state)} tensors, e.g. {next(iter(state))}: {tuple(next(iter(state.values())).shape)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
