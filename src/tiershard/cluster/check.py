"""The check job: a small gloo all-reduce that every rank of an emulated cluster runs
(``python -m tiershard.cluster allreduce``, behind ``tiershard cluster check`` and the tests), timing each op and
reading the node's NIC counters around it, and its summary against the ring formula.
"""
from __future__ import annotations

import json
import os
import time
from typing import Sequence

from .counters import read_nic, ring_allreduce_nic_bytes
from .launch import RankResult

def allreduce_job(nbytes: int, iters: int, warmup: int = 1, phases: Sequence[str] = ("world", "node")) -> list[dict]:
    """Time gloo all_reduces of ``nbytes`` over the world and over each node's ranks, and read this node's NIC
    counters around each op (between barriers, so only that op's bytes are counted). Returns one record per phase.
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node_groups = [dist.new_group(list(range(s, s + per_node))) for s in range(0, world, per_node)]
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        records = []
        for phase in phases:
            group = None if phase == "world" else node_groups[rank // per_node]
            seconds, tx, rx = [], [], []
            for i in range(warmup + iters):
                dist.barrier()
                t0, (tx0, rx0) = time.perf_counter(), read_nic()
                dist.all_reduce(buf, group=group)
                elapsed = time.perf_counter() - t0
                dist.barrier()
                tx1, rx1 = read_nic()
                if i >= warmup:
                    seconds.append(elapsed)
                    tx.append(tx1 - tx0)
                    rx.append(rx1 - rx0)
            records.append({"rank": rank, "node": rank // per_node, "phase": phase, "bytes": buf.numel() * 4,
                            "seconds": seconds, "nic_tx": tx, "nic_rx": rx})
        return records
    finally:
        dist.destroy_process_group()


def summarize_allreduce(results: Sequence[RankResult], nodes: int, ranks_per_node: int) -> list[dict]:
    """Per phase: the slowest rank's median op time and each node's median NIC bytes per op, with the formula."""
    records = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    summary = []
    for phase in dict.fromkeys(rec["phase"] for rec in records):
        recs = [rec for rec in records if rec["phase"] == phase]
        nbytes = recs[0]["bytes"]
        per_node = {}
        for rec in recs:
            per_node.setdefault(rec["node"], {"tx": _median(rec["nic_tx"]), "rx": _median(rec["nic_rx"])})
        summary.append({
            "phase": phase, "bytes": nbytes, "seconds": max(_median(rec["seconds"]) for rec in recs),
            "nic": per_node,
            "expected_nic_bytes": ring_allreduce_nic_bytes(nbytes, nodes, ranks_per_node) if phase == "world" else 0,
        })
    return summary


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiershard.cluster allreduce ...``: one JSON line per phase on stdout."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tiershard.cluster",
                                description="Jobs that run on each rank of an emulated cluster.")
    sub = p.add_subparsers(dest="job", required=True)
    a = sub.add_parser("allreduce", help="time world and intra-node all_reduces; print one JSON line per phase")
    a.add_argument("--bytes", type=int, default=16 * 2**20)
    a.add_argument("--iters", type=int, default=3)
    a.add_argument("--warmup", type=int, default=1)
    a.add_argument("--phases", default="world,node", help="comma list of world, node")
    args = p.parse_args(argv)
    for record in allreduce_job(args.bytes, args.iters, args.warmup, args.phases.split(",")):
        print(json.dumps(record), flush=True)
    return 0
