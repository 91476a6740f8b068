"""qWD: a parameter all-gather that sends block-quantized *differences* against a band every member already holds.

[Note: weight differences] Between two optimizer steps a weight moves little. Instead of its value, each member of
the gather group sends ``codec(new - reference)`` for its chunk, where ``reference`` is its chunk of a band that
every member holds bit for bit (the hpz band of the previous weights). Every member, the sender too, rebuilds the
band as ``reference + decode(difference)`` in fp32, rounded once to the band's dtype, so the copies stay identical
on all members and the next difference is taken against what the receivers really hold: one step's rounding error
is sent again with the next step's difference, never accumulated (SDP4Bit's qWD, with the hpz band as the
replicated reference). A 4-bit difference is exact only up to its block's scale: a write that is not a small step
(``ts.load``, ``.data``, a re-initialisation, an in-place write between backward and the step, a ``copy_`` inside
an optimizer's ``step()``: ``WatchedMaster`` and ``note_writes_before_step`` in runtime/flat.py) drops the
reference, and the next gather sends values exactly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import collectives as C
from .codecs import BlockCodec

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology


class DiffGather:
    """All-gather of quantized differences against a shared reference band ([Note: weight differences])."""

    def __init__(self, codec: BlockCodec):
        if codec.rotate or codec.stochastic:
            raise ValueError(f"qwd takes a plain codec (intN:BLOCK), got {codec.spec!r}")
        self.codec = codec

    def wire_bytes(self, chunk_numel: int) -> int:
        """Bytes one member sends for a chunk of ``chunk_numel`` values."""
        return self.codec.wire_bytes(chunk_numel)

    def gather(self, chunk: torch.Tensor, reference: torch.Tensor, group: "TierGroup", topology: "Topology",
               op: str) -> torch.Tensor:
        """The new band: ``reference`` (``group.size`` chunks in slot order, the same bits on every member) plus each
        member's decoded difference; ``chunk`` is this rank's new values for its slot. Returns a new tensor in the
        reference's dtype; ``reference`` is left as it was."""
        k, n = group.size, chunk.numel()
        if reference.numel() != k * n:
            raise ValueError(f"reference of {reference.numel()} values for {k} chunks of {n}")
        slot = group.slot_of(topology.rank)
        own = reference.view(k, n)[slot]
        wire = self.codec.encode_wire(chunk.view(-1).float() - own.float(), 1)
        received = torch.empty(k * wire.numel(), dtype=torch.uint8, device=wire.device)
        C.all_gather(received, wire, group, topology, op)
        band = self.codec.decode_wire(received, k, n)
        band += reference.view(-1)
        return band.to(reference.dtype)
