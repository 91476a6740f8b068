"""The mean over islands of one flat fp32 buffer, started now and finished later: the outer sync's collective.

[Note: island mean] The outer sync (runtime/outer.py) averages each fragment's parameter change over the islands'
cross group (the ranks at the same position in every island), behind the inner steps that follow. Exact, it is
one all-reduce of the fp32 buffer, divided by the island count. With a codec, each rank encodes its buffer once
(``BlockCodec``'s wire format: the per-hop codecs of qgz), all-gathers the encodings and sums their decodings in
fp32, row 0 first: every member decodes the same bytes in the same order, so every island gets the same mean,
bit for bit, and islands never drift through the codec. Both are started asynchronously (``async_op``) from the
calling thread, as NCCL requires, and counted in the ledger when started.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from .codecs import BlockCodec
from .failure import guard
from .ledger import LEDGER

if TYPE_CHECKING:
    from ..topology import TierGroup, Topology

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PendingMean:
    """A mean in flight: ``finish()`` waits for it and returns the mean (a new fp32 tensor, or ``buf`` itself)."""

    def __init__(self, work, collective: guard | None, done):
        self.work, self.collective, self.done = work, collective, done

    def finish(self) -> torch.Tensor:
        if self.work is not None:
            with self.collective:              # the same collective again: a failure is named, not counted twice
                self.work.wait()
        return self.done()


class IslandMean:
    """Averages a flat fp32 buffer over a cross group, exactly or through ``codec`` ([Note: island mean])."""

    def __init__(self, codec: BlockCodec | None = None, seed: int = 0):
        self.codec, self.seed = codec, seed

    def key(self, call: int, fragment: int, rank: int) -> int:
        """A stochastic codec's key: every call, fragment and rank draws its own stream, repeatably."""
        text = repr((self.seed, call, fragment, rank)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def wire_bytes(self, numel: int) -> int:
        """What one rank sends per member for ``numel`` values: the encoding, or the fp32 values."""
        return self.codec.wire_bytes(numel) if self.codec is not None else numel * 4

    def start(self, buf: torch.Tensor, group: "TierGroup", topology: "Topology", op: str,
              seed: int | None = None, pieces: Sequence[int] | None = None) -> PendingMean:
        """Issue the mean of ``buf`` (flat fp32, spent: the mean is written into it) over ``group``; finish it with
        the result's ``finish()``. ``pieces``: sizes of consecutive parts the codec encodes each on its own (one
        per flat group, as the cost model counts them); ``seed`` keys a stochastic codec (part j: seed + j)."""
        k = group.size
        if self.codec is None:
            if k == 1:
                return PendingMean(None, None, lambda: buf)
            with guard(op, group, topology) as collective:
                work = dist.all_reduce(buf, group=group.pg, async_op=True)
            LEDGER.record(op, "all_reduce", group.ranks, buf.numel() * 4, topology.rank, topology)
            return PendingMean(work, collective, lambda: buf.div_(k))
        pieces = list(pieces or [buf.numel()])
        wires = [self.codec.encode_wire(part, 1, seed=None if seed is None else seed + j)
                 for j, part in enumerate(buf.split(pieces))]
        widths = [w.numel() for w in wires]
        wire = torch.cat(wires)
        gathered = wire if k == 1 else torch.empty(k * wire.numel(), dtype=torch.uint8, device=buf.device)

        def done() -> torch.Tensor:
            rows, out, start = gathered.view(k, -1), buf, 0
            for part, (n, w) in zip(out.split(pieces), zip(pieces, widths)):
                self.codec.decode_wire_sum(rows[:, start:start + w].contiguous().view(-1), k, n, out=part)
                start += w
            return out.div_(k)

        if k == 1:
            return PendingMean(None, None, done)
        with guard(op, group, topology) as collective:
            work = _all_gather_flat(gathered, wire, group=group.pg, async_op=True)
        LEDGER.record(op, "all_gather", group.ranks, gathered.numel(), topology.rank, topology)
        return PendingMean(work, collective, done)
