"""Tensor parallelism under the tiers on 8 loopback gloo ranks: model-state memory per rank at TP 2 and TP 1 against
the cost model's prediction, and step time at TP 2 against the placements without TP, beside FSDP2 (+ TP).

The model is a GPT of separate q/k/v/o and MLP linears, parallelised as Megatron does (q, k, v and the MLP's first
linear column-parallel, o and the second row-parallel, the embedding and the head vocab-parallel, norms whole), so
every matrix is cut as the cost model assumes ([Note: TP in the cost model], cost/tensor_parallel.py). TP 1 is
``Topology((4, 8))`` (2 nodes of 4), TP 2 is ``Topology((2, 4), tp=2)`` (2 nodes of 2 positions of 2 TP ranks).
fp32 throughout, AdamW, one micro-step per step; the time is the median over the measured steps of the slowest
rank's step. On a CPU the TP collectives are gloo all-reduces on loopback: the times show the runtime's costs,
not a GPU node's::

    .venv/bin/python benchmarks/tp_tiers.py                  # about a minute on an idle 8-core machine
    .venv/bin/python benchmarks/tp_tiers.py --steps 20 --layers 8 --hidden 512
    sudo .venv/bin/python benchmarks/tp_tiers.py --cluster 1gbit --rounds 3    # 2 emulated nodes of 4 (root)

With ``--cluster RATE`` the ranks run on an emulated cluster (docs/cluster.md), 2 nodes of 4 ranks linked at RATE,
each TP group inside a node; ``--rounds`` repeats every system that many times, interleaved, and the time is the
median over all rounds' measured steps.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Net(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def megatron_plan(model: Net) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"emb": RowwiseParallel(input_layouts=Replicate()), "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        for name in ("attn.q", "attn.k", "attn.v", "up"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "down"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def run_rank(rank: int, world: int, system: str, args: dict) -> dict:
    """One system's steps on this rank: its model-state bytes and step times."""
    import torch.distributed as dist

    import tiershard as ts
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    kind, _, plan = system.partition(":")
    tp = 2 if "tp2" in kind else 1
    torch.manual_seed(0)
    model = Net(args["vocab"], args["hidden"], args["layers"], args["heads"])
    if kind.startswith("tiershard"):
        topo = ts.Topology((2, 4), tp=2) if tp == 2 else ts.Topology((4, 8))
        topo.init_process_groups("cpu")
        if tp == 2:
            parallelize_module(model, topo.tp_mesh, megatron_plan(model))
        model = ts.shard(model, plan, topo, wrap={Block})
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        if tp == 2:
            parallelize_module(model, mesh["tp"], megatron_plan(model))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per, seq = args["micro_batch"] * tp, args["seq"]      # a TP group takes its ranks' sequences together
    g = torch.Generator().manual_seed(1)
    times, states = [], None
    for step in range(args["steps"]):
        tokens = torch.randint(0, args["vocab"], (world * args["micro_batch"], seq + 1), generator=g)
        x = tokens[rank // tp * per:(rank // tp + 1) * per]
        dist.barrier()
        start = time.perf_counter()
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
        opt.step()
        if step == 0 and kind.startswith("tiershard"):
            stats = ts.memory_stats(model, opt)
            states = sum(stats[k] for k in ("params", "grads", "masters", "optimizer"))
        opt.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return {"states": states, "times": times[args["warmup"]:]}


def predicted_states(plan: str, tp: int, args: dict) -> float:
    """The cost model's model-state bytes per rank (fp32 working weights and gradients, AdamW)."""
    from tiershard import cost

    torch.manual_seed(0)
    spec = cost.ModelSpec.from_module(Net(args["vocab"], args["hidden"], args["layers"], args["heads"]),
                                      wrap={Block})
    cluster = cost.Cluster(tiers=(cost.Tier(name="node", size=4, bandwidth=1e9),
                                  cost.Tier(name="world", size=8, bandwidth=1e9)), gpu_memory=1e12, peak_flops=1e12)
    job = cost.Job(micro_batch=args["micro_batch"], seq=args["seq"], param_bytes=4, reduce_bytes=4, grad_bytes=4)
    return cost.evaluate(plan, spec, cluster, job, tp=tp).memory.model_states


def rank_main(spec_path: str) -> None:
    """One rank of a ``--cluster`` launch: the system of the spec, every rank's result gathered to rank 0's file."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = run_rank(rank, world, spec["system"], spec["args"])
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


def run_on_cluster(cluster, system: str, args: dict) -> list[dict]:
    """Every rank's result of ``system`` launched inside the emulated ``cluster``."""
    with tempfile.TemporaryDirectory(prefix="tiershard-tp-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"system": system, "args": args, "out": str(out)}))
        cluster.launch([sys.executable, __file__, "--rank-spec", str(spec)], env={"OMP_NUM_THREADS": "1"},
                       cwd=Path(__file__).resolve().parents[1])
        return json.loads(out.read_text())


def main() -> None:
    from tiershard.cluster.local import run_local

    if "--rank-spec" in sys.argv:
        return rank_main(sys.argv[sys.argv.index("--rank-spec") + 1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--systems", default="tiershard:NNN,tiershard:IIG,tiershard:GGG,tiershard-tp2:NNN,"
                        "tiershard-tp2:IIG,tiershard-tp2:GGG,fsdp2,fsdp2-tp2")
    parser.add_argument("--cluster", metavar="RATE", help="run on 2 emulated nodes of 4 ranks linked at RATE "
                        "(a tc rate such as 1gbit, or none for uncapped); needs root")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every system, interleaved")
    args = vars(parser.parse_args())
    systems = args["systems"].split(",")
    runs: dict[str, list[list[dict]]] = {system: [] for system in systems}
    if args["cluster"] is None:
        for _ in range(args["rounds"]):
            for system in systems:
                runs[system].append(run_local(run_rank, 8, system, args))
    else:
        from tiershard.cluster.emulated import EmulatedCluster

        rate = None if args["cluster"] == "none" else args["cluster"]
        with EmulatedCluster(nodes=2, ranks_per_node=4, inter_bw=rate, replace=True) as cluster:
            for _ in range(args["rounds"]):
                for system in systems:
                    runs[system].append(run_on_cluster(cluster, system, args))
    where = f"2 emulated nodes of 4 at {args['cluster']}" if args["cluster"] else "8 loopback ranks"
    print(f"{where}, {args['rounds']} round(s) of {args['steps'] - args['warmup']} measured steps")
    print(f"{'system':<22} {'plan':<5} {'tp':>2} {'states MB':>10} {'predicted MB':>13} {'error':>7} {'step ms':>9}"
          f" {'rounds ms':>20}")
    for system in systems:
        results = runs[system][0]
        kind, _, plan = system.partition(":")
        tp = 2 if "tp2" in kind else 1
        per_round = [statistics.median(r[0]["times"]) * 1e3 for r in runs[system]]
        step = statistics.median([t for r in runs[system] for t in r[0]["times"]]) * 1e3
        spread = "/".join(f"{t:.0f}" for t in per_round)
        if results[0]["states"] is None:
            print(f"{kind:<22} {'-':<5} {tp:>2} {'':>10} {'':>13} {'':>7} {step:>9.1f} {spread:>20}")
            continue
        measured = max(r["states"] for r in results)
        predicted = predicted_states(plan, tp, args)
        print(f"{kind:<22} {plan:<5} {tp:>2} {measured / 2**20:>10.2f} {predicted / 2**20:>13.2f} "
              f"{measured / predicted - 1:>+7.1%} {step:>9.1f} {spread:>20}")


if __name__ == "__main__":
    main()
