"""tiershard: sharded data parallelism that knows the network's tiers.

Public contract (DESIGN.md section 3)::

    topo = ts.Topology((2, 4)); plan = ts.Plan.parse("IIG")
    model = ts.shard(model, plan, topo, wrap={Block})

The package root holds the core concepts (``topology``, ``plan``) and this facade; each part has its folder
(docs/layout.md): ``comm/``, ``runtime/``, ``cost/``, ``checkpoint/``, and the tools ``train/``, ``bench/``,
``cluster/``, ``cli/``.
"""
from __future__ import annotations

from . import _moved
from . import cost as _cost          # the planner behind ts.Plan.auto ([Note: the planner behind Plan.auto])
from .comm.failure import CollectiveError
from .comm.ledger import comm_stats, reset_comm_stats
from .plan import Plan, PlanError
from .topology import Topology, TopologyError

__all__ = [
    "Plan", "PlanError", "Topology", "TopologyError", "comm_stats", "reset_comm_stats", "save", "load",
    "CheckpointError", "CollectiveError",
    "shard", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict", "memory_stats",
]

_moved.install()


def __getattr__(name: str):
    # The runtime imports lazily so that planning and the cost model need no process group.
    if name in ("shard", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict", "memory_stats"):
        from .runtime import api

        return getattr(api, name)
    if name in ("save", "load", "CheckpointError"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'tiershard' has no attribute {name!r}")
