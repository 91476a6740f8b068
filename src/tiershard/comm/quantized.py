"""Quantized collectives: qwZ's block-quantized all-gather and qgZ's hierarchical all-to-all reduce-scatter.

Both move a flat buffer cut into equal chunks (one per slot of the ownership map, see topology.py), so each
chunk is encoded on its own with ``codecs.BlockCodec`` and the encodings of several chunks concatenate.

[Note: qgZ hops] A reduce-scatter from level ``a`` to level ``b`` runs one all-to-all per tier between them,
innermost first. Before the hop over tier ``k`` a rank holds the partial sum of its level-``k-1`` chunk; it cuts
that chunk into the slots of its tier-``k`` cross group, quantizes each slot once, sends slot ``i`` to the member
owning it, then dequantizes what it receives and sums in fp32. After the last hop it holds exactly its level-``b``
chunk: the ownership map is the "slice reordering" of ZeRO++, so no data is permuted. Error feedback (``+ef``)
adds each hop's quantization residual of the previous reduction to the next one before quantizing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .codecs import BlockCodec
from .collectives import _record, _slot_views
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology


class QuantizedGather:
    """qwZ: every member sends the encodings of its chunks; receivers decode into the working dtype."""

    def __init__(self, codec: BlockCodec):
        self.codec = codec

    def encode(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.codec.encode(shard)
        return enc.payload, enc.scales

    def gather(self, payload: torch.Tensor, scales: torch.Tensor, group: "TierGroup", chunks: int,
               chunk_numel: int, topology: "Topology", op: str) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather this rank's encodings (of ``chunks / group.size`` chunks) into all ``chunks`` chunks."""
        codec = self.codec
        payload_all = torch.empty(chunks * codec.payload_numel(chunk_numel), dtype=payload.dtype)
        scales_all = torch.empty(chunks * codec.scales_numel(chunk_numel), dtype=torch.float32)
        for out, mine in ((payload_all, payload), (scales_all, scales)):
            if group.size == 1:
                out.copy_(mine)
            else:
                dist.all_gather(_slot_views(out, group), mine.contiguous(), group=group.pg)
                _record(op, "all_gather", group, out, topology)
        return payload_all, scales_all

    def decode(self, payload_all: torch.Tensor, scales_all: torch.Tensor, chunks: int, chunk_numel: int,
               out: torch.Tensor) -> None:
        self.codec.decode_chunks(payload_all, scales_all, chunks, chunk_numel, dtype=out.dtype, out=out)


class QuantizedReduceScatter:
    """qgZ: reduce-scatter as one quantized all-to-all per tier, fp32 sums between hops ([Note: qgZ hops])."""

    def __init__(self, codec: BlockCodec, error_feedback: bool = False):
        self.codec = codec
        self.error_feedback = error_feedback
        self.residuals: dict[tuple, torch.Tensor] = {}

    def __call__(self, full: torch.Tensor, hops: list["TierGroup"], topology: "Topology", op: str,
                 key: object = None) -> torch.Tensor:
        """Sum ``full`` (this rank's level-``a`` chunk) over the hops; returns this rank's fp32 level-``b`` chunk."""
        buf = full.to(torch.float32)
        for index, group in enumerate(hops):
            if group.size == 1:
                continue
            if self.error_feedback:
                residual = self.residuals.get((key, index))
                if residual is not None:
                    buf = buf + residual
            buf = self._hop(buf, group, topology, op, (key, index))
        return buf

    def _hop(self, buf: torch.Tensor, group: "TierGroup", topology: "Topology", op: str, ef_key) -> torch.Tensor:
        codec, k = self.codec, group.size
        slot_numel = buf.numel() // k
        slices = buf.chunk(k)
        P, s = codec.payload_numel(slot_numel), codec.scales_numel(slot_numel)
        payload = torch.empty(k * P, dtype=codec.payload_dtype)
        scales = torch.empty(k * s, dtype=torch.float32)
        for member, slot in enumerate(group.slots):       # input in member order: chunk i goes to member i
            codec.encode_into(slices[slot], payload[member * P:(member + 1) * P], scales[member * s:(member + 1) * s])
        if self.error_feedback:
            sent = torch.empty_like(buf)
            for member, slot in enumerate(group.slots):
                codec.decode_from(payload[member * P:(member + 1) * P], scales[member * s:(member + 1) * s],
                                  slot_numel, out=sent[slot * slot_numel:(slot + 1) * slot_numel])
            self.residuals[ef_key] = buf - sent
        payload_in, scales_in = torch.empty_like(payload), torch.empty_like(scales)
        dist.all_to_all_single(payload_in, payload, group=group.pg)
        dist.all_to_all_single(scales_in, scales, group=group.pg)
        nbytes = payload.numel() * payload.element_size() + scales.numel() * 4
        LEDGER.record(op, "all_to_all", group.ranks, nbytes, topology.rank, topology)
        received = codec.decode_chunks(payload_in, scales_in, k, slot_numel, dtype=torch.float32)
        return received.view(k, slot_numel).sum(dim=0)
