"""The ledger: this rank's bytes by tier and by operation, fed by every collective the engine runs, and where its
communication time went (``seconds``: [Note: where the time goes])."""
from __future__ import annotations

import threading
from typing import Sequence, TYPE_CHECKING

from .volume import rank_bytes

if TYPE_CHECKING:
    from ..topology import Topology

# [Note: where the time goes] Beside the bytes, the ledger sums host wall-clock seconds since the last reset:
#   waited  the training (main) thread blocked on communication: on the stream (a gather it needs, a reduction's
#           slot, a drain) or inside a collective it runs itself (``failure.guard``): the communication the
#           computation did not hide, measured;
#   stream  the communication stream busy running jobs (collectives with their copies and codecs);
#   codec   inside the codecs' encode and decode, on whichever thread ran them;
#   tiers   per tier, the seconds collectives spent in flight, from issue to completion (a pipelined hierarchical
#           collective's phases overlap, so these may sum to more than ``stream``).
# The clocks are the host's: on CUDA the collectives and codecs are asynchronous, so ``waited`` counts the host
# waits only and the rest count launches; the bench, which reads them, runs on CPU ranks.
SECONDS_KEYS = ("waited", "stream", "codec")


class Ledger:
    """Counts bytes per tier and per op with the link model of ``volume``; one per process (one rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.tiers: dict[str, int] = {}
            self.ops: dict[str, int] = {}
            self.calls: dict[str, int] = {}
            self.seconds: dict[str, float] = dict.fromkeys(SECONDS_KEYS, 0.0)
            self.tier_seconds: dict[str, float] = {}

    def record(self, op: str, kind: str, ranks: Sequence[int], nbytes: int, rank: int,
               topology: "Topology") -> None:
        per_tier = rank_bytes(kind, ranks, nbytes, rank, topology)
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            self.ops.setdefault(op, 0)
            for tier, b in per_tier.items():
                self.tiers[tier] = self.tiers.get(tier, 0) + b
                self.ops[op] += b

    def add_seconds(self, key: str, seconds: float) -> None:
        """Add to one of ``SECONDS_KEYS`` ([Note: where the time goes])."""
        with self._lock:
            self.seconds[key] += seconds

    def add_tier_seconds(self, tier: str, seconds: float) -> None:
        with self._lock:
            self.tier_seconds[tier] = self.tier_seconds.get(tier, 0.0) + seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"tiers": dict(self.tiers), "ops": dict(self.ops), "calls": dict(self.calls),
                    "seconds": {**self.seconds, "tiers": dict(self.tier_seconds)}}


LEDGER = Ledger()


def comm_stats() -> dict:
    """This rank's bytes by tier and by operation, and its communication seconds, since the last reset (see
    DESIGN.md, "Bytes on a tier", and [Note: where the time goes])."""
    return LEDGER.snapshot()


def reset_comm_stats() -> None:
    LEDGER.reset()
