"""Quantized collectives: qwZ's block-quantized all-gather and qgZ's hierarchical all-to-all reduce-scatter.

Both move a flat buffer cut into equal chunks (one per slot of the ownership map, see topology.py). Each chunk
is encoded on its own in ``codecs.BlockCodec``'s wire format (payload and fp32 scales in one byte buffer), so
the encodings of several chunks concatenate and one collective moves payload and scales together.

[Note: qgZ hops] A reduce-scatter from level ``a`` to level ``b`` runs one all-to-all per tier between them,
innermost first. Before the hop over tier ``k`` a rank holds the partial sum of its level-``k-1`` chunk; it cuts
that chunk into the slots of its tier-``k`` cross group, quantizes each slot once (straight into the all-to-all
input, in member order), sends slot ``i`` to the member owning it, then decodes what it receives and sums in
fp32 in the same pass. Blocks follow the parameters of each row (``segments``), never spanning two. After the
last hop it holds exactly its level-``b`` chunk: the ownership map is the
"slice reordering" of ZeRO++, so no data is permuted. Error feedback (``+ef``) adds each hop's quantization
residual of the previous reduction to the next one before quantizing.

[Note: qgZ pipeline] With two hops or more the buffer is cut into column chunks at parameter boundaries
(``pipeline_chunks``) and the hops run as a wavefront: while chunk c crosses the slow tier, chunk c+1 crosses
the fast one, as ZeRO++ pipelines its intra- and inter-node all-to-alls. Blocks never span parameters and each
member's sum adds the same values in the same order, so the result is bit-identical to running the hops one
after the other; only the 4-byte padding of each chunk's payload differs (``cost/traffic.py`` counts it).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import collectives as C
from .failure import guard
from .codecs import BlockCodec
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology


class QuantizedGather:
    """qwZ: members send the wire encodings of their chunks; receivers decode into the working dtype."""

    def __init__(self, codec: BlockCodec):
        self.codec = codec

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        """The wire encoding of one chunk (a rank's level-p shard)."""
        return self.codec.encode_wire(shard.view(-1), 1)

    def gather(self, wire: torch.Tensor, group: "TierGroup", chunks: int, chunk_numel: int,
               topology: "Topology", op: str) -> torch.Tensor:
        """All-gather this rank's encodings (``chunks / group.size`` of them) into all ``chunks``, in slot order."""
        out = torch.empty(chunks * self.codec.wire_bytes(chunk_numel), dtype=torch.uint8, device=wire.device)
        C.all_gather(out, wire, group, topology, op)
        return out

    def decode(self, wire_all: torch.Tensor, chunks: int, chunk_numel: int, out: torch.Tensor) -> None:
        self.codec.decode_wire(wire_all, chunks, chunk_numel, out=out)

    def chunk_wires(self, wire_all: torch.Tensor, first: int, count: int, chunk_numel: int) -> torch.Tensor:
        """Encodings ``first .. first + count`` of a gathered buffer (what an hpz band keeps)."""
        size = self.codec.wire_bytes(chunk_numel)
        return wire_all[first * size:(first + count) * size]


PIPELINE_CHUNKS = 4


def pipeline_chunks(segments: tuple[int, ...] | None, chunks: int | None = None) -> list[tuple[int, ...]]:
    """The row layout cut into at most ``chunks`` (default ``PIPELINE_CHUNKS``) runs of whole parameters of
    about equal width (one run when the layout is unknown or too small to be worth cutting)."""
    chunks = PIPELINE_CHUNKS if chunks is None else chunks
    if not segments:
        return [segments] if segments is not None else [()]
    total, target = sum(segments), sum(segments) / chunks
    out, run, width = [], [], 0
    for seg in segments:
        run.append(seg)
        width += seg
        if width >= target * (len(out) + 1) and len(out) < chunks - 1:
            out.append(tuple(run))
            run = []
    if run:
        out.append(tuple(run))
    return [c for c in out if sum(c)] if chunks > 1 and total >= 4096 * chunks else [tuple(segments)]


class QuantizedReduceScatter:
    """qgZ: reduce-scatter as one quantized all-to-all per tier, fp32 sums between hops ([Note: qgZ hops])."""

    def __init__(self, codec: BlockCodec, error_feedback: bool = False):
        self.codec = codec
        self.error_feedback = error_feedback
        self.residuals: dict[tuple, torch.Tensor] = {}

    def __call__(self, full: torch.Tensor, hops: list["TierGroup"], topology: "Topology", op: str,
                 key: object = None, segments: tuple[int, ...] | None = None) -> torch.Tensor:
        """Sum ``full`` (this rank's level-``a`` chunk) over the hops; returns this rank's fp32 level-``b`` chunk.

        ``segments``: the parameters' widths in a row of the slot-major buffer, so that no quantization block
        spans two parameters (a norm's gain never shares a scale with a weight matrix)."""
        buf = full.to(torch.float32)
        active = [group for group in hops if group.size > 1]
        runs = pipeline_chunks(segments)
        if len(active) > 1 and len(runs) > 1 and not self.error_feedback:
            return self._pipelined(buf, active, topology, op, segments, runs)
        for index, group in enumerate(hops):
            if group.size == 1:
                continue
            if self.error_feedback:
                residual = self.residuals.get((key, index))
                if residual is not None:
                    buf = buf + residual
            buf = self._hop(buf, group, topology, op, (key, index), segments)
        return buf

    def _pipelined(self, buf: torch.Tensor, hops: list["TierGroup"], topology: "Topology", op: str,
                   segments: tuple[int, ...], runs: list[tuple[int, ...]]) -> torch.Tensor:
        """The hops as a wavefront over column chunks ([Note: qgZ pipeline])."""
        codec, width = self.codec, sum(segments)
        rows = buf.numel() // width
        starts = [sum(sum(r) for r in runs[:i]) for i in range(len(runs))]
        state = [buf.view(rows, width)[:, a:a + sum(r)].contiguous().view(-1) for a, r in zip(starts, runs)]

        def issue(c: int, group: "TierGroup"):
            wire = codec.encode_wire(state[c], group.size, order=C._slot_index(group, buf.device), segments=runs[c])
            received = torch.empty_like(wire)
            work = dist.all_to_all_single(received, wire, group=group.pg, async_op=True)
            LEDGER.record(op, "all_to_all", group.ranks, wire.numel(), topology.rank, topology)
            return work, received

        def finish(c: int, group: "TierGroup", received: torch.Tensor) -> None:
            k = group.size
            state[c] = codec.decode_wire_sum(received, k, state[c].numel() // k, segments=runs[c])

        C.wavefront(len(runs), hops, issue, finish, topology, op)
        out_rows = rows // math.prod(group.size for group in hops)
        out = torch.empty(out_rows, width, dtype=torch.float32, device=buf.device)
        for a, r, part in zip(starts, runs, state):
            out[:, a:a + sum(r)] = part.view(out_rows, sum(r))
        return out.view(-1)

    def _hop(self, buf: torch.Tensor, group: "TierGroup", topology: "Topology", op: str, ef_key,
             segments: tuple[int, ...] | None) -> torch.Tensor:
        codec, k = self.codec, group.size
        n = buf.numel() // k
        order = C._slot_index(group, buf.device)          # input row i goes to member i, who owns slot slots[i]
        wire = codec.encode_wire(buf, k, order=order, segments=segments)
        if self.error_feedback:
            sent = codec.decode_wire(wire, k, n, segments=segments).view(k, n)
            residual = buf.clone().view(k, n)
            residual.index_copy_(0, order, buf.view(k, n).index_select(0, order) - sent)
            # [Note: finite residuals] An overflowed gradient (an inf or nan that GradScaler will skip) would stay
            # in the residual and poison every later reduction; a residual that is not finite everywhere is reset
            # to zero instead, without waiting for the device (where() selects 0 even over a nan).
            finite = torch.isfinite(residual).all()
            self.residuals[ef_key] = torch.where(finite, residual, torch.zeros((), device=residual.device)).view(-1)
        received = torch.empty_like(wire)
        with guard(op, group, topology):
            dist.all_to_all_single(received, wire, group=group.pg)
        LEDGER.record(op, "all_to_all", group.ranks, wire.numel(), topology.rank, topology)
        return codec.decode_wire_sum(received, k, n, segments=segments)
