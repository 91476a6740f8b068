"""Outer sync (DiLoCo) on 4 CPU ranks as 2 islands of 2: the islands meet every 8 steps (docs/outer-sync.md).

    torchrun --nproc-per-node 4 examples/outer_sync.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn

import tiershard as ts

dist.init_process_group("gloo")
topo = ts.Topology((2, 4))                    # islands = the 2 groups of the tier below world ("node")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 1))
model = ts.shard(model, "IIG+outer=8:f2", topo, wrap={nn.Sequential})   # sync every 8 steps, 2 fragments
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(1, 25):
    x = torch.randn(16, 32, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step % 8 == 0:
        ts.save(f"runs/outer_sync/step_{step}", model, opt)        # islands' own states and the outer state, resumable
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} world bytes {ts.comm_stats()['tiers'].get('world', 0)}")
dist.destroy_process_group()
