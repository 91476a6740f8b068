"""Collectives on tier groups: pure functions over ``torch.distributed``, each recorded in the ledger.

Buffers are laid out in *slot* order (the ownership map of topology.py). Torch orders a group's ranks by global
rank, which matches the slots for a group inside one tier but not for a group spanning several (for 2 nodes of
2, the world group's slots are 0, 2, 1, 3). There the joint buffer is permuted into rank order (one row copy)
around the collective.

Per backend, the algorithm that moves the fewest bytes: gloo's own reduce-scatter is an all-reduce (twice the
bytes), so on gloo a reduce-scatter is a ring of point-to-point exchanges, (k-1)/k of the buffer per rank to its
ring successor; NCCL's is already a ring. On gloo an all-gather is the same ring too, received straight into the
output (gloo's own stages a second output-sized buffer). ``comm/volume.py`` models exactly these rings, so the
ledger counts what the NICs see. Groups of one rank are a local copy and send nothing.

Each collective runs inside ``failure.guard``: a failure (a rank skipped it or died) becomes one
``CollectiveError`` naming the operation, the unit, the tier and the missing ranks ([Note: bounded collectives]).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from .failure import guard
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology

_SLOT_INDEX: dict[tuple, torch.Tensor] = {}
# torch 2.13 renamed the flat-tensor forms (the old names warn); older releases only have the old ones
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _slot_index(group: "TierGroup", device: torch.device) -> torch.Tensor:
    key = (group.slots, str(device))
    index = _SLOT_INDEX.get(key)
    if index is None:
        index = _SLOT_INDEX[key] = torch.tensor(group.slots, dtype=torch.long, device=device)
    return index


def _record(op: str, kind: str, group: "TierGroup", tensor: torch.Tensor, topology: "Topology") -> None:
    LEDGER.record(op, kind, group.ranks, tensor.numel() * tensor.element_size(), topology.rank, topology)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: "TierGroup", topology: "Topology", op: str) -> None:
    """``out`` (flat, ``group.size`` x shard) receives every member's shard at that member's slot."""
    if group.size == 1:
        out.copy_(shard)
        return
    if group.backend == "gloo":
        with guard(op, group, topology):
            _ring_all_gather(out, shard, group, topology.rank)
    elif group.in_rank_order:
        with guard(op, group, topology):
            _all_gather_flat(out, shard.contiguous(), group=group.pg)
    else:
        by_rank = torch.empty_like(out)
        with guard(op, group, topology):
            _all_gather_flat(by_rank, shard.contiguous(), group=group.pg)
        out.view(group.size, -1).index_copy_(0, _slot_index(group, out.device), by_rank.view(group.size, -1))
    _record(op, "all_gather", group, out, topology)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: "TierGroup", topology: "Topology",
                   op: str) -> None:
    """``out`` receives the sum over members of the slot of ``full`` that this rank owns. ``full`` is spent: on
    gloo its values are the ring's scratch afterwards (every caller reduces a buffer of its own)."""
    if group.size == 1:
        out.copy_(full)
        return
    by_rank = full if group.in_rank_order else \
        full.view(group.size, -1).index_select(0, _slot_index(group, full.device)).view(-1)
    with guard(op, group, topology):
        if group.backend == "gloo":
            _ring_reduce_scatter(out, by_rank, group, topology.rank)
        else:
            _reduce_scatter_flat(out, by_rank.contiguous(), group=group.pg)
    _record(op, "reduce_scatter", group, full, topology)


def _ring_reduce_scatter(out: torch.Tensor, by_rank: torch.Tensor, group: "TierGroup", rank: int) -> None:
    """k-1 steps: pass a partial sum to the ring successor and add what arrives into this rank's next chunk of
    ``by_rank``, which serves as the scratch (one chunk-sized receive buffer besides); after the last step this
    rank's own chunk holds the whole sum. The sums are the ones a fresh buffer would make (a + b = b + a)."""
    k, me = group.size, group.ranks.index(rank)
    chunks = by_rank.view(k, -1)
    after, before = group.ranks[(me + 1) % k], group.ranks[(me - 1) % k]
    recv = torch.empty_like(chunks[0])
    for step in range(k - 1):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[(me - step - 1) % k], after, group.pg),
                                        dist.P2POp(dist.irecv, recv, before, group.pg)])
        for work in works:
            work.wait()
        chunks[(me - step - 2) % k] += recv
    out.copy_(chunks[me])


def _ring_all_gather(out: torch.Tensor, shard: torch.Tensor, group: "TierGroup", rank: int) -> None:
    """k-1 steps: pass the shard received last to the ring successor while the predecessor's arrives, straight
    into its member's slot of ``out`` (in slot order, so no permuted copy either). gloo's own all-gather stages
    the whole output in a buffer of its own and copies it out: one more output's bytes for as long as it runs,
    which on the communication thread overlaps the backward computation it prefetches for."""
    k, me = group.size, group.ranks.index(rank)
    rows, slots = out.view(k, -1), group.slots
    after, before = group.ranks[(me + 1) % k], group.ranks[(me - 1) % k]
    mine = rows[slots[me]]
    if shard.data_ptr() != mine.data_ptr():    # packed into its own slot already: nothing to copy
        mine.copy_(shard.reshape(-1))
    for step in range(k - 1):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, rows[slots[(me - step) % k]], after, group.pg),
                                        dist.P2POp(dist.irecv, rows[slots[(me - step - 1) % k]], before, group.pg)])
        for work in works:
            work.wait()


def gather_to_first(out: torch.Tensor, shard: torch.Tensor, group: "TierGroup", topology: "Topology",
                    op: str) -> None:
    """Like ``all_gather``, but only the group's first rank receives (``out`` is ignored elsewhere): what a
    state dict for one rank needs, without the whole model on every rank."""
    if group.size == 1:
        out.copy_(shard)
        return
    first = group.ranks[0]
    if topology.rank == first:
        rows = out.view(group.size, -1)         # each member's shard lands in its slot's row: no copy of the whole
        by_rank = [rows[slot] for slot in group.slots]
        with guard(op, group, topology):
            dist.gather(shard.contiguous(), by_rank, dst=first, group=group.pg)
    else:
        with guard(op, group, topology):
            dist.gather(shard.contiguous(), None, dst=first, group=group.pg)
    LEDGER.record(op, "gather", group.ranks, out.numel() * out.element_size() if topology.rank == first else
                  shard.numel() * shard.element_size() * group.size, topology.rank, topology)


def all_reduce(buf: torch.Tensor, group: "TierGroup", topology: "Topology", op: str) -> None:
    """Sum ``buf`` over the group in place."""
    if group.size == 1:
        return
    with guard(op, group, topology):
        dist.all_reduce(buf, group=group.pg)
    _record(op, "all_reduce", group, buf, topology)


def broadcast(buf: torch.Tensor, src: int, group: "TierGroup", topology: "Topology", op: str) -> None:
    """Copy ``src``'s ``buf`` to every member. Set-up only (before training), so not in the ledger."""
    if group.size == 1:
        return
    with guard(op, group, topology):
        dist.broadcast(buf, src=src, group=group.pg)


def wavefront(chunks: int, phases: Sequence["TierGroup"], issue: Callable[[int, "TierGroup"], tuple[Any, Any]],
              finish: Callable[[int, "TierGroup", Any], None], topology: "Topology", op: str) -> None:
    """Run every phase (one collective per tier) over ``chunks`` column chunks as a pipeline: at tick t phase s
    works on chunk t - s, so chunk c+1 crosses one tier while chunk c crosses the next. ``issue(c, group)``
    starts phase ``group`` of chunk c asynchronously and returns (its work handle, what ``finish`` needs);
    ``finish(c, group, that)`` runs once the handle completes, before the next tick. Each phase of each chunk
    is one collective of its group (``guard``)."""
    for tick in range(chunks + len(phases) - 1):
        flying = []
        for stage, group in enumerate(phases):
            if 0 <= tick - stage < chunks:
                with guard(op, group, topology) as collective:
                    flying.append((tick - stage, group, collective, issue(tick - stage, group)))
        for c, group, collective, (work, started) in flying:
            with collective:          # the same collective again: counted once
                work.wait()
            finish(c, group, started)
