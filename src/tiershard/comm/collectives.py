"""Collectives on tier groups: pure functions over ``torch.distributed``, each recorded in the ledger.

Buffers are laid out in *slot* order (the ownership map of topology.py), which is not always the group's rank
order, so the list forms of the collectives are used with views taken in slot order; no copy is made.
Groups of one rank are a local copy and send nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology


def _slot_views(flat: torch.Tensor, group: "TierGroup") -> list[torch.Tensor]:
    chunks = flat.chunk(group.size)
    return [chunks[slot] for slot in group.slots]


def _record(op: str, kind: str, group: "TierGroup", tensor: torch.Tensor, topology: "Topology") -> None:
    LEDGER.record(op, kind, group.ranks, tensor.numel() * tensor.element_size(), topology.rank, topology)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: "TierGroup", topology: "Topology", op: str) -> None:
    """``out`` (flat, ``group.size`` x shard) receives every member's shard at that member's slot."""
    if group.size == 1:
        out.copy_(shard)
        return
    dist.all_gather(_slot_views(out, group), shard.contiguous(), group=group.pg)
    _record(op, "all_gather", group, out, topology)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: "TierGroup", topology: "Topology",
                   op: str) -> None:
    """``out`` receives the sum over members of the slot of ``full`` that this rank owns."""
    if group.size == 1:
        out.copy_(full)
        return
    dist.reduce_scatter(out, _slot_views(full, group), group=group.pg)
    _record(op, "reduce_scatter", group, full, topology)


def all_reduce(buf: torch.Tensor, group: "TierGroup", topology: "Topology", op: str) -> None:
    """Sum ``buf`` over the group in place."""
    if group.size == 1:
        return
    dist.all_reduce(buf, group=group.pg)
    _record(op, "all_reduce", group, buf, topology)


def broadcast(buf: torch.Tensor, src: int, group: "TierGroup", topology: "Topology", op: str) -> None:
    """Copy ``src``'s ``buf`` to every member. Set-up only (before training), so not in the ledger."""
    if group.size == 1:
        return
    dist.broadcast(buf, src=src, group=group.pg)
