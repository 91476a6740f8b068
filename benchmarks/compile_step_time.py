"""Step time of tiershard and FSDP2, eager and with per-block ``torch.compile`` (inductor), on the same GPT and ranks.

Each system trains the built-in GPT (AdamW, fp32) with each block compiled after sharding
(``block.compile(fullgraph=True)``) or not; the first ``--warmup`` steps (which pay the compile) are left out and
the table gives the median step time of the slowest rank, dynamo's graph breaks and graphs, and the largest
relative difference of the final parameters from FSDP2's in the same mode. CPU: ``--nproc`` gloo ranks on this
machine (2 emulated nodes); GPU: under ``torchrun``, one rank per device with NCCL (``--device cuda``)::

    .venv/bin/python benchmarks/compile_step_time.py                          # CPU, 2 gloo ranks, inductor
    torchrun --nproc-per-node 1 benchmarks/compile_step_time.py --device cuda --n-embd 1024 --n-layer 8
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

SYSTEMS = [("fsdp2", False), ("fsdp2", True), ("ts", False), ("ts", True)]


def _job(rank, world, args):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    import tiershard as ts
    from tiershard.train.models.gpt import GPT, Block, gpt_config

    device = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    cfg = gpt_config("small", vocab_size=2048, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)
    rows = []
    for system, compiled in SYSTEMS:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        blocks = [m for m in model.modules() if isinstance(m, Block)]
        if system == "ts":
            model = ts.shard(model, args.plan, ts.Topology((max(1, world // 2), world)), wrap={Block})
        else:
            from torch.distributed.fsdp import fully_shard
            for block in blocks:
                fully_shard(block)
            fully_shard(model)
        if compiled:
            for block in blocks:
                block.compile(fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        times = []
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, 2048, (args.batch, args.seq + 1), generator=g).to(device)
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = model(x[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad()
            if args.device == "cuda":
                torch.cuda.synchronize()
            dt = torch.tensor(time.perf_counter() - t0, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(dt.item())
        full = (ts.full_state_dict(model) if system == "ts"
                else {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()})
        rows.append({"system": system, "compiled": compiled, "ms": 1e3 * statistics.median(times),
                     "graph_breaks": sum(counters["graph_break"].values()),
                     "graphs": counters["stats"]["unique_graphs"], "params": {k: v.cpu() for k, v in full.items()}})
    for row in rows:
        ref = next(r for r in rows if r["system"] == "fsdp2" and r["compiled"] == row["compiled"])["params"]
        row["vs_fsdp2"] = max(((row["params"][k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
    for row in rows:
        del row["params"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--plan", default="IIG")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if args.device == "cuda":       # under torchrun
        import torch.distributed as dist

        dist.init_process_group("nccl")
        rows = _job(dist.get_rank(), dist.get_world_size(), args)
        if dist.get_rank():
            return
    else:
        from tiershard.cluster.local import run_local
        rows = run_local(_job, args.nproc, args, timeout=3000)[0]
    eager = {r["system"]: r["ms"] for r in rows if not r["compiled"]}
    print(f"| system | mode | step ms | vs eager | graph breaks | graphs | max rel. diff from FSDP2 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        name = "FSDP2" if r["system"] == "fsdp2" else f"tiershard {args.plan}"
        mode = "block.compile(fullgraph=True)" if r["compiled"] else "eager"
        print(f"| {name} | {mode} | {r['ms']:.1f} | {r['ms'] / eager[r['system']]:.2f}x | {r['graph_breaks']} "
              f"| {r['graphs']} | {r['vs_fsdp2']:.1e} |")


if __name__ == "__main__":
    main()
