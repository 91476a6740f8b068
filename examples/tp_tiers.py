"""Tensor parallelism inside the node, tiershard's tiers over the rest (docs/parallelism.md).

    torchrun --nproc-per-node 8 examples/tp_tiers.py            # 2 emulated nodes x 2 positions x TP 2, gloo
    torchrun --nproc-per-node 8 examples/tp_tiers.py --fsdp2    # the same job with FSDP2 + TP: the same losses

The order is torchtitan's: ``parallelize_module`` over the TP mesh first (here the built-in GPT's MLPs, column-
then row-parallel; attention and the tied embedding stay replicated over TP), then ``ts.shard`` over the tiers,
which count TP groups: ``Topology((2, 4), tp=2)`` is 8 ranks, 2 nodes of 2 positions of 2 TP ranks.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tiershard as ts
from tiershard.train.models import GPT, Block, gpt_config, lm_loss


def build(tp_mesh) -> GPT:
    """The tiny GPT, its MLPs tensor-parallel over ``tp_mesh``."""
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    plan = {}
    for i in range(len(model.transformer.h)):
        plan[f"transformer.h.{i}.mlp.c_fc"] = ColwiseParallel()
        plan[f"transformer.h.{i}.mlp.c_proj"] = RowwiseParallel()
    return parallelize_module(model, tp_mesh, plan)


def train(topology: ts.Topology, steps: int = 5, plan: str = "IIG", fsdp2_mesh=None) -> float:
    """``steps`` AdamW steps on fixed batches; the last loss. With ``fsdp2_mesh`` (a ``("dp", "tp")`` mesh of the
    same ranks) the model is sharded by FSDP2 instead, for comparison."""
    topology.init_process_groups("cpu")
    if fsdp2_mesh is None:
        model = ts.shard(build(topology.tp_mesh), plan, topology, wrap={Block})
    else:
        from torch.distributed.fsdp import fully_shard

        model = build(fsdp2_mesh["tp"])
        for block in model.transformer.h:
            fully_shard(block, mesh=fsdp2_mesh["dp"])
        fully_shard(model, mesh=fsdp2_mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    position, positions = dist.get_rank() // topology.tp, topology.world_size     # the TP ranks share a batch
    data = torch.randint(0, 256, (steps, positions * 2, 33), generator=torch.Generator().manual_seed(0))
    for tokens in data:
        x = tokens[position * 2:(position + 1) * 2]
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()       # the mean over the batch


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    world, tp = dist.get_world_size(), 2
    topology = ts.Topology((2, world // tp), tp=tp)
    mesh = None
    if "--fsdp2" in argv:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    loss = train(topology, fsdp2_mesh=mesh)
    if dist.get_rank() == 0:
        print(f"{'FSDP2 + TP' if mesh is not None else 'tiershard IIG'} on {topology}: loss {loss:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
