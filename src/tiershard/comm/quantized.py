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
"slice reordering" of ZeRO++, so no data is permuted. Each tier has its own codec (SDP4Bit's default: int8 with
rotation inside a node, int4 with rotation across nodes): a hop decodes what it receives, sums in fp32 and the next
hop re-encodes with its own codec, so nothing is summed in low precision and the fine int4 steps are taken once, on
the slow tier only. Error feedback (``+ef``) adds each hop's quantization residual of the previous reduction to the
next one before quantizing.

[Note: qgZ seeds] Stochastic codecs need a key per encode. Each hop's key is a hash of (the reducer's ``seed``, its
call counter for this ``key``, ``key``, the hop's tier, this rank, and the pipeline chunk): two runs with the same
seed and the same calls give the same bits, every rank and hop draws its own stream, and the counters travel in
``state_dict()`` so a resumed run continues the sequence.

[Note: qgZ pipeline] With two hops or more the buffer is cut into column chunks at parameter boundaries
(``pipeline_chunks``) and the hops run as a wavefront: while chunk c crosses the slow tier, chunk c+1 crosses
the fast one, as ZeRO++ pipelines its intra- and inter-node all-to-alls. Blocks never span parameters and each
member's sum adds the same values in the same order, so the result is bit-identical to running the hops one
after the other with round-half-even codecs; only the 4-byte padding of each chunk's payload differs
(``cost/traffic.py`` counts it). Stochastic codecs draw a stream per pipeline chunk ([Note: qgZ seeds]), so their
pipelined result is as unbiased as the sequential one but not the same bits.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
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

    def encode(self, shard: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """The wire encoding of one chunk (a rank's level-p shard); ``seed`` keys a stochastic codec."""
        return self.codec.encode_wire(shard.view(-1), 1, seed=seed)

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
    """qgZ: reduce-scatter as one quantized all-to-all per tier, fp32 sums between hops ([Note: qgZ hops]).

    ``codecs``: one codec for every tier, or one per tier (``codecs[k-1]`` for the hop over tier k, e.g. from
    ``codecs.hop_codecs(spec, tiers)``). ``seed`` keys stochastic codecs ([Note: qgZ seeds])."""

    def __init__(self, codecs: BlockCodec | Sequence[BlockCodec], error_feedback: bool = False, seed: int = 0):
        if isinstance(codecs, BlockCodec):
            per_tier: tuple[BlockCodec, ...] | None = None
        else:
            per_tier = tuple(codecs)
            if not per_tier or not all(isinstance(c, BlockCodec) for c in per_tier):
                raise ValueError(f"codecs must be a BlockCodec or a non-empty sequence of them (one per tier, "
                                 f"innermost first), got {codecs!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.codec = codecs if per_tier is None else per_tier[0]
        self.codecs = per_tier
        self.error_feedback = error_feedback
        self.seed = seed
        self.counters: dict[str, int] = {}           # repr(key) -> calls so far
        self.residuals: dict[str, torch.Tensor] = {}  # "repr(key)@tier" -> the last residual of that hop

    def codec_for(self, tier: int) -> BlockCodec:
        """The codec of the hop over ``tier`` (1 = innermost)."""
        if self.codecs is None:
            return self.codec
        if not 1 <= tier <= len(self.codecs):
            raise ValueError(f"no codec for the hop over tier {tier}: {len(self.codecs)} codecs were given "
                             f"({'/'.join(c.spec for c in self.codecs)}); give one per tier (hop_codecs(spec, tiers))")
        return self.codecs[tier - 1]

    @staticmethod
    def _tiers(hops: list["TierGroup"], topology: "Topology", first_tier: int | None) -> list[int]:
        """The tier of each hop: ``first_tier`` onwards, or found by matching the groups against the topology's."""
        if first_tier is not None:
            return list(range(first_tier, first_tier + len(hops)))
        rank, found = topology.rank, []
        for index, group in enumerate(hops):
            tier = next((k for k in range(1, topology.num_levels) if topology.group_for(rank, k - 1, k) == group), None)
            if tier is None:
                raise ValueError(f"hop {index} ({group.ranks}) is not the cross group of any tier of {topology}: "
                                 "pass first_tier= (the tier of hops[0])")
            found.append(tier)
        return found

    def _hop_seed(self, name: str, call: int, tier: int, rank: int, run: int | None = None) -> int:
        """[Note: qgZ seeds] a 64-bit key from (seed, call counter, key, tier, rank, pipeline chunk)."""
        text = repr((self.seed, call, name, tier, rank, run)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")

    def __call__(self, full: torch.Tensor, hops: list["TierGroup"], topology: "Topology", op: str,
                 key: object = None, segments: tuple[int, ...] | None = None,
                 first_tier: int | None = None) -> torch.Tensor:
        """Sum ``full`` (this rank's level-``a`` chunk) over the hops (tiers a+1..b, innermost first); returns this
        rank's fp32 level-``b`` chunk.

        ``segments``: the parameters' widths in a row of the slot-major buffer, so that no quantization block
        spans two parameters (a norm's gain never shares a scale with a weight matrix). ``key`` names the
        reduction (its call counter and residuals); ``first_tier``: the tier of ``hops[0]`` (found from the
        topology when None)."""
        tiers = self._tiers(hops, topology, first_tier)
        codecs = [self.codec_for(t) for t in tiers]
        name = repr(key)
        call = self.counters.get(name, 0)
        self.counters[name] = call + 1
        buf = full.to(torch.float32)
        active = [(group, codec, tier) for group, codec, tier in zip(hops, codecs, tiers) if group.size > 1]
        runs = pipeline_chunks(segments)
        if len(active) > 1 and len(runs) > 1 and not self.error_feedback:
            return self._pipelined(buf, active, topology, op, segments, runs, name, call)
        for group, codec, tier in active:
            ef_key = f"{name}@{tier}"
            if self.error_feedback:
                residual = self.residuals.get(ef_key)
                if residual is not None:
                    buf = buf + residual
            seed = self._hop_seed(name, call, tier, topology.rank) if codec.stochastic else None
            buf = self._hop(buf, group, codec, seed, topology, op, ef_key, segments)
        return buf

    def state_dict(self) -> dict:
        """The call counters and error-feedback residuals (plain ints and tensors), for a checkpoint."""
        return {"counters": dict(self.counters), "residuals": dict(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (checked first; nothing changes on bad input)."""
        if not isinstance(state, dict) or set(state) != {"counters", "residuals"}:
            raise ValueError("state must be a dict with exactly the keys 'counters' and 'residuals', as "
                             f"QuantizedReduceScatter.state_dict() returns; got {state!r:.200}")
        counters, residuals = state["counters"], state["residuals"]
        if not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in counters.items()):
            raise ValueError("state['counters'] must map key names to non-negative ints")
        if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in residuals.items()):
            raise ValueError("state['residuals'] must map hop names to tensors")
        if residuals and not self.error_feedback:
            raise ValueError("state holds error-feedback residuals but this reducer has error_feedback=False: "
                             "build it with error_feedback=True to resume them")
        self.counters = dict(counters)
        self.residuals = dict(residuals)

    def residual_bytes(self) -> int:
        """Bytes the error-feedback residuals hold now."""
        return sum(t.numel() * t.element_size() for t in self.residuals.values())

    def _pipelined(self, buf: torch.Tensor, hops: list[tuple], topology: "Topology", op: str,
                   segments: tuple[int, ...], runs: list[tuple[int, ...]], name: str, call: int) -> torch.Tensor:
        """The hops (group, codec, tier) as a wavefront over column chunks ([Note: qgZ pipeline])."""
        width = sum(segments)
        per_group = {id(group): (codec, tier) for group, codec, tier in hops}
        groups = [group for group, _, _ in hops]
        rows = buf.numel() // width
        starts = [sum(sum(r) for r in runs[:i]) for i in range(len(runs))]
        state = [buf.view(rows, width)[:, a:a + sum(r)].contiguous().view(-1) for a, r in zip(starts, runs)]

        def issue(c: int, group: "TierGroup"):
            codec, tier = per_group[id(group)]
            seed = self._hop_seed(name, call, tier, topology.rank, c) if codec.stochastic else None
            wire = codec.encode_wire(state[c], group.size, order=C._slot_index(group, buf.device), segments=runs[c],
                                     seed=seed)
            received = torch.empty_like(wire)
            work = dist.all_to_all_single(received, wire, group=group.pg, async_op=True)
            LEDGER.record(op, "all_to_all", group.ranks, wire.numel(), topology.rank, topology)
            return work, received

        def finish(c: int, group: "TierGroup", received: torch.Tensor) -> None:
            k = group.size
            codec = per_group[id(group)][0]
            state[c] = codec.decode_wire_sum(received, k, state[c].numel() // k, segments=runs[c])

        C.wavefront(len(runs), groups, issue, finish, topology, op)
        out_rows = rows // math.prod(group.size for group in groups)
        out = torch.empty(out_rows, width, dtype=torch.float32, device=buf.device)
        for a, r, part in zip(starts, runs, state):
            out[:, a:a + sum(r)] = part.view(out_rows, sum(r))
        return out.view(-1)

    def _hop(self, buf: torch.Tensor, group: "TierGroup", codec: BlockCodec, seed: int | None, topology: "Topology",
             op: str, ef_key: str, segments: tuple[int, ...] | None) -> torch.Tensor:
        k = group.size
        n = buf.numel() // k
        order = C._slot_index(group, buf.device)          # input row i goes to member i, who owns slot slots[i]
        wire = codec.encode_wire(buf, k, order=order, segments=segments, seed=seed)
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
