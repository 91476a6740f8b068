"""The ledger: this rank's bytes by tier and by operation, fed by every collective the engine runs."""
from __future__ import annotations

import threading
from typing import Sequence, TYPE_CHECKING

from .volume import rank_bytes

if TYPE_CHECKING:
    from ..topology import Topology


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

    def record(self, op: str, kind: str, ranks: Sequence[int], nbytes: int, rank: int,
               topology: "Topology") -> None:
        per_tier = rank_bytes(kind, ranks, nbytes, rank, topology)
        with self._lock:
            self.calls[op] = self.calls.get(op, 0) + 1
            self.ops.setdefault(op, 0)
            for tier, b in per_tier.items():
                self.tiers[tier] = self.tiers.get(tier, 0) + b
                self.ops[op] += b

    def snapshot(self) -> dict:
        with self._lock:
            return {"tiers": dict(self.tiers), "ops": dict(self.ops), "calls": dict(self.calls)}


LEDGER = Ledger()


def comm_stats() -> dict:
    """This rank's bytes by tier and by operation since the last reset (see DESIGN.md, "Bytes on a tier")."""
    return LEDGER.snapshot()


def reset_comm_stats() -> None:
    LEDGER.reset()
