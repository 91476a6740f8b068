"""Every plan trains a few steps on CUDA with NCCL and must match one process on the concatenated batch.

Run on a machine with GPUs, one rank per GPU (ranks of a node share it as a tier)::

    torchrun --nproc-per-node 8 benchmarks/gpu_check.py                   # all 27 placements + ZeRO++ options
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py --plans GGG,IIG,zero++
    TIERSHARD_TOPOLOGY=2,4 torchrun --nproc-per-node 4 benchmarks/gpu_check.py   # emulate 2 nodes of 2
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py --device cpu      # the same check on CPU with gloo

Exact plans train with SGD + momentum in fp32 (TF32 off) and must match every parameter within 1e-5 relative
(``--tol``); quantized plans (qwz, qgz) train with AdamW and must end within 3% of the exact loss. A bf16 run of
``GGG`` checks that mixed precision runs on the device. Prints one line per plan and exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

EXACT = [a + b + c for a in "NIG" for b in "NIG" for c in "NIG"]
QUANTIZED = ["zero++", "GGG+qwz", "IIG+qgz", "GGG+hpz"]
STEPS, MICRO, PER_RANK = 3, 2, 2


def batches(world: int, vocab: int, seq: int, device: torch.device) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (world * PER_RANK, seq + 1), generator=g).to(device) for _ in range(MICRO)]
            for _ in range(STEPS)]


def train(model, data, rank, world, quantized: bool, sharded: bool) -> list[float]:
    import tiershard as ts

    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if quantized
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for step in data:
        total = 0.0
        for i, tokens in enumerate(step):
            if sharded:
                tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
            sync = not sharded or i == MICRO - 1
            with (ts.no_sync(model) if not sync else _Null()):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / MICRO
                loss.backward()
            total += loss.detach()
        if sharded:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
        opt.step()
        opt.zero_grad()
    return losses


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    import tiershard as ts
    from tiershard.train.models import GPT, Block, gpt_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", default=",".join(EXACT + QUANTIZED))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tol", type=float, default=1e-5)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = ts.Topology.from_env()
    cfg = gpt_config("tiny", vocab_size=97, n_embd=48)
    data = batches(world, cfg.vocab_size, cfg.block_size, device)
    references = {}
    failures = 0
    for plan in args.plans.split(","):
        quantized = "qwz" in plan or "qgz" in plan or plan == "zero++"
        if quantized not in references:
            torch.manual_seed(0)
            ref = GPT(cfg).to(device)
            references[quantized] = (train(ref, data, rank, world, quantized, sharded=False),
                                     {k: v.detach() for k, v in ref.state_dict().items()})
        ref_losses, ref_state = references[quantized]
        torch.manual_seed(0)
        model = ts.shard(GPT(cfg).to(device), plan, topo, wrap={Block})
        losses = train(model, data, rank, world, quantized, sharded=True)
        state = ts.full_state_dict(model)
        devices = {str(t.device) for t in state.values()}
        if quantized:
            err = abs(losses[-1] - ref_losses[-1]) / abs(ref_losses[-1])
            ok = err <= 0.03
        else:
            err = max(((state[k] - ref_state[k]).abs().max() / ref_state[k].abs().max().clamp_min(1e-12)).item()
                      for k in ref_state)
            ok = err <= args.tol
        ok = ok and devices == {str(device)}
        failures += not ok
        if rank == 0:
            print(f"{plan:<22} {'ok  ' if ok else 'FAIL'} error {err:.2e}  losses {[round(x, 4) for x in losses]}"
                  f"  tensors on {sorted(devices)}", flush=True)
    torch.manual_seed(0)
    model = ts.shard(GPT(cfg).to(device), "GGG", topo, wrap={Block}, param_dtype=torch.bfloat16)
    losses = train(model, data, rank, world, quantized=True, sharded=True)
    bf16_ok = abs(losses[-1] - references[True][0][-1]) <= 0.03 * abs(references[True][0][-1]) \
        if True in references else all(map(torch.isfinite, map(torch.tensor, losses)))
    failures += not bf16_ok
    if rank == 0:
        print(f"{'GGG bf16':<22} {'ok  ' if bf16_ok else 'FAIL'} losses {[round(x, 4) for x in losses]}")
        print(f"{world} ranks on {device.type}, topology {topo.sizes}: {failures} failure(s)")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
