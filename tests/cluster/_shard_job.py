"""The per-rank job of the emulated-cluster tests that shard a model (run under `EmulatedCluster.launch` or under
torchrun inside the cluster's node namespaces): the topology from the launcher's environment, one ts.shard step
against an unsharded reference, a mismatched topology refused at ts.shard, and, on a three-tier cluster, the
link counters around one world all_reduce. Prints one JSON line."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import tiershard as ts
from tiershard.cluster.emulated import IFNAME, NODE_NETNS_ENV, read_node_uplink

ALLREDUCE_BYTES = 4 * 2**20


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))


def link_bytes(reads_uplink: bool) -> dict:
    stats = Path(f"/sys/class/net/{IFNAME}/statistics")
    out = {"eth0": int((stats / "tx_bytes").read_text())}
    if reads_uplink:
        out["uplink"] = read_node_uplink()["tx"]
    return out


def main(plan: str) -> dict:
    if os.environ.get("SHARD_JOB_WATCHDOG_S"):      # a hung rank prints where it hangs and exits, so a test says why
        faulthandler.dump_traceback_later(float(os.environ["SHARD_JOB_WATCHDOG_S"]), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = ts.Topology.from_env()
    out = {"rank": rank, "sizes": list(topo.sizes), "names": list(topo.names),
           "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"])}
    if os.environ.get(NODE_NETNS_ENV):           # three tiers: counters around one world all_reduce
        buf = torch.ones(ALLREDUCE_BYTES // 4)
        first_of_ns, first_of_node = rank % topo.sizes[0] == 0, rank % topo.sizes[1] == 0
        dist.barrier()
        before = link_bytes(first_of_node) if first_of_ns else None
        dist.barrier()
        dist.all_reduce(buf)
        dist.barrier()
        after = link_bytes(first_of_node) if first_of_ns else None
        out["links"] = None if before is None else {k: after[k] - before[k] for k in before}
    sharded = ts.shard(model(), plan, topo)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    sharded(batch(rank)).pow(2).mean().backward()
    opt.step()
    state = ts.full_state_dict(sharded)
    reference = model()                               # one step on every rank's rows at once
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    reference(torch.cat([batch(r) for r in range(world)])).pow(2).mean().backward()
    ref_opt.step()
    out["max_diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    try:
        ts.shard(model(), plan, ts.Topology((world, world)))        # one "node" of every rank: spans the hosts
        out["mismatch"] = None
    except ts.TopologyError as err:
        out["mismatch"] = str(err)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    line = json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "IIG")) + "\n"
    os.write(sys.stdout.fileno(), line.encode())      # one write: the ranks of a torchrun share its stdout
