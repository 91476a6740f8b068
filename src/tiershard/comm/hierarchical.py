"""PaRO-CC: a collective that spans several tiers, run as one phase per tier on the cross groups.

With the ownership map of topology.py a level-``a`` chunk is the concatenation, in slot order, of the level-``b``
chunks of its cross group, so a reduce-scatter from ``a`` to ``b`` is one reduce-scatter per tier, innermost
first (intra-node, then inter-node with 1/m of the data), and an all-gather is the same phases in reverse
(inter-node first on the small chunks, then intra-node). An all-reduce is the reduce-scatter phases followed by
the all-gather phases. ``groups(k)`` is the cross group from level ``k - 1`` to ``k``.

[Note: cc pipeline] With two phases or more, and enough data, the phases run as a wavefront over column chunks:
view the buffer as one row per finest piece (``K`` rows of ``L`` values; row ``r`` is the level-``b`` chunk of
the member owning slot ``r``) and cut ``L``; every phase splits rows, never columns, so chunk c's inter-node
phase runs while chunk c+1's intra-node phase does. A pipelined reduce-scatter phase is an all-to-all and a sum
in place of the ring: inside one tier both send ``(k-1)/k`` of their input per rank over that tier's links, so
``comm_stats`` and ``cost/traffic.py`` count the same bytes, chunk by chunk.
"""
from __future__ import annotations

import math
from typing import Callable, TYPE_CHECKING

import torch
import torch.distributed as dist

from . import collectives as C
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology

Groups = Callable[[int], "TierGroup"]
PIPELINE_CHUNKS = 4
MIN_CHUNK = 4096          # values per piece and chunk below which pipelining costs more than it hides


def _phases(inner: int, outer: int, groups: Groups) -> list["TierGroup"]:
    return [groups(k) for k in range(inner + 1, outer + 1)]


def _chunks(length: int) -> list[tuple[int, int]]:
    n = min(PIPELINE_CHUNKS, length // MIN_CHUNK)
    step = -(-length // max(n, 1))
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def all_gather(out: torch.Tensor, shard: torch.Tensor, inner: int, outer: int, groups: Groups,
               topology: "Topology", op: str) -> None:
    """``out`` (the level-``inner`` chunk) from every level-``outer`` shard, outermost tier first."""
    phases = [g for g in reversed(_phases(inner, outer, groups)) if g.size > 1]
    if len(phases) > 1 and len(_chunks(shard.numel())) > 1:
        return _pipelined_all_gather(out, shard, phases, topology, op)
    buf = shard
    for k in range(outer, inner, -1):
        group = groups(k)
        target = out if k == inner + 1 else torch.empty(buf.numel() * group.size, dtype=buf.dtype, device=buf.device)
        C.all_gather(target, buf, group, topology, op)
        buf = target


def reduce_scatter(buf: torch.Tensor, inner: int, outer: int, groups: Groups, topology: "Topology",
                   op: str) -> torch.Tensor:
    """This rank's level-``outer`` chunk of the sum of ``buf`` (a level-``inner`` chunk), innermost tier first."""
    phases = [g for g in _phases(inner, outer, groups) if g.size > 1]
    pieces = math.prod(g.size for g in phases)
    if len(phases) > 1 and len(_chunks(buf.numel() // pieces)) > 1:
        return _pipelined_reduce_scatter(buf, phases, topology, op)
    for k in range(inner + 1, outer + 1):
        group = groups(k)
        out = torch.empty(buf.numel() // group.size, dtype=buf.dtype, device=buf.device)
        C.reduce_scatter(out, buf, group, topology, op)
        buf = out
    return buf


def all_reduce(buf: torch.Tensor, inner: int, outer: int, groups: Groups, topology: "Topology", op: str) -> None:
    """Sum ``buf`` in place over the (inner -> outer) group: reduce-scatter phases, then all-gather phases."""
    if outer == inner:
        return
    if outer - inner == 1:
        C.all_reduce(buf, groups(outer), topology, op)
        return
    shard = reduce_scatter(buf, inner, outer, groups, topology, op)
    all_gather(buf, shard, inner, outer, groups, topology, op)


# ---- the wavefront ([Note: cc pipeline]) ------------------------------------------------------------------
def _pipelined_reduce_scatter(buf: torch.Tensor, phases: list["TierGroup"], topology: "Topology",
                              op: str) -> torch.Tensor:
    rows = math.prod(g.size for g in phases)
    length = buf.numel() // rows
    spans = _chunks(length)
    state = [buf.view(rows, length)[:, a:b].contiguous() for a, b in spans]

    def issue(c: int, group: "TierGroup"):
        # rows in member order: member i owns slot slots[i], the i-th block of rows goes to it
        send = state[c].view(group.size, -1).index_select(0, C._slot_index(group, buf.device))
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=group.pg, async_op=True)
        LEDGER.record(op, "reduce_scatter", group.ranks, send.numel() * send.element_size(), topology.rank, topology)
        return work, received

    def finish(c: int, group: "TierGroup", received: torch.Tensor) -> None:
        k, (height, width) = group.size, state[c].shape
        state[c] = received.view(k, height // k, width).sum(dim=0, dtype=torch.float32).to(received.dtype)

    C.wavefront(len(spans), phases, issue, finish, topology, op)
    out = torch.empty(length, dtype=buf.dtype, device=buf.device)
    for (a, b), part in zip(spans, state):
        out[a:b] = part.view(-1)
    return out


def _pipelined_all_gather(out: torch.Tensor, shard: torch.Tensor, phases: list["TierGroup"],
                          topology: "Topology", op: str) -> None:
    rows, length = math.prod(g.size for g in phases), shard.numel()
    spans = _chunks(length)
    state = [shard[a:b].reshape(1, -1).contiguous() for a, b in spans]

    def issue(c: int, group: "TierGroup"):
        x = state[c]
        gathered = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
        work = C._all_gather_flat(gathered, x.view(-1), group=group.pg, async_op=True)
        LEDGER.record(op, "all_gather", group.ranks, gathered.numel() * gathered.element_size(), topology.rank,
                      topology)
        return work, gathered

    def finish(c: int, group: "TierGroup", gathered: torch.Tensor) -> None:
        height, width = state[c].shape
        by_rank = gathered.view(group.size, height, width)
        ordered = torch.empty_like(by_rank)
        ordered.index_copy_(0, C._slot_index(group, gathered.device), by_rank)
        state[c] = ordered.view(group.size * height, width)

    C.wavefront(len(spans), phases, issue, finish, topology, op)
    view = out.view(rows, length)
    for (a, b), part in zip(spans, state):
        view[:, a:b] = part
