"""Save on one world and plan, load on another: ``ts.save``/``ts.load``, and torch's own DCP calls beside them.

    torchrun --nproc-per-node 4 examples/checkpoints.py save IIG      # writes ckpts/step_1 and plain/step_1
    torchrun --nproc-per-node 2 examples/checkpoints.py load zero3    # loads both; the losses agree
    tiershard convert ckpts --to safetensors gpt-safetensors          # one process, no process group

The built-in tiny GPT after one AdamW step; on load every rank starts from other weights, so everything it
then computes comes from the checkpoint.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tiershard as ts
from tiershard.train.models import GPT, Block, gpt_config, lm_loss


def build(plan: str, seed: int):
    torch.manual_seed(seed)
    model = ts.shard(GPT(gpt_config("tiny")), plan, ts.Topology.from_env(), wrap={Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(mode: str, plan: str = "IIG") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    if mode == "save":
        model, opt = build(plan, seed=0)
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        ts.save("ckpts/step_1", model, opt, extra={"step": 1, "rank": rank})    # then ckpts/latest names step_1
        model_sd, optim_sd = get_state_dict(model, opt)                          # the standard route: the same
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="plain/step_1")   # state, no manifest
        if rank == 0:
            print(f"saved on {world} ranks under {plan}: ckpts/step_1 and plain/step_1")
    else:
        model, opt = build(plan, seed=1)
        extra = ts.load("ckpts", model, opt)          # the folder's `latest`; returns this rank's extra
        with torch.no_grad():
            loss = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
        other, other_opt = build(plan, seed=2)
        model_sd, optim_sd = get_state_dict(other, other_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id="plain/step_1")
        set_state_dict(other, other_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        with torch.no_grad():
            other_loss = lm_loss(other(x[:, :-1]), x[:, 1:]).item()
        print(f"rank {rank} of {world} under {plan}: extra {extra}; loss {loss:.6f} after ts.load, "
              f"{other_loss:.6f} after dcp.load")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
