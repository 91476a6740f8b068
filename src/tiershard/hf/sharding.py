"""Sharding a model for a framework that expected to wrap it itself: the plan, topology and wrap policy the user
gave (or the defaults a user of FSDP2 expects), on the device the framework trains on."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .. import Plan, Topology, shard
from ..cost import Job, auto_estimate
from ..cost.presets import this_machine
from ..runtime.arguments import as_topology
from ..runtime.guards import refuse_tensor_parallel

log = logging.getLogger("tiershard")


def is_sharded(model: nn.Module) -> bool:
    return getattr(model, "_tiershard", None) is not None


def job_for(model: nn.Module, micro_batch: int = 1, accum: int = 1, recompute: bool = False) -> Job:
    """What the planner needs to know of the training: sequence length from the model's config (capped at
    2,048), fp32 masters gathered and reduced at 4 bytes (mixed precision is autocast here)."""
    config = getattr(model, "config", None)
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
    return Job(micro_batch=micro_batch, seq=min(int(seq), 2048), accum=accum, param_bytes=4, reduce_bytes=4,
               grad_bytes=4, recompute=recompute)


def shard_for(model: nn.Module, plan: Plan | str | None, topology: Topology | tuple | None, wrap: object,
              device: torch.device | None, job: Job | None = None) -> nn.Module:
    """``model`` sharded by ``plan`` (None or ``"auto"``: the planner's fastest exact plan that fits) over
    ``topology`` (None: ``Topology.from_env()``) on ``device``; a model ``ts.shard`` already sharded as it is."""
    if is_sharded(model):
        given = [name for name, value in (("plan", plan), ("topology", topology), ("wrap", wrap)) if value is not None]
        if given:
            raise ValueError(f"this model is already sharded by ts.shard, so {'/'.join(given)}= would not apply: "
                             "drop them, or pass the unsharded model")
        refuse_tensor_parallel(model, "this route")
        return model
    topology = Topology.from_env() if topology is None else as_topology(topology)
    meta = any(p.is_meta for p in model.parameters())
    if not meta and device is not None and {p.device for p in model.parameters()} != {torch.device(device)}:
        model.to(device)                  # where the framework would have moved it, before the shards are cut
    if plan is None or plan == "auto":
        choice = auto_estimate(model, this_machine(topology), job or job_for(model), wrap=wrap)
        plan = choice.plan
        log.info("tiershard: plan %s over %s (%s); pass plan= to choose", plan, topology, choice.reason)
    model = shard(model, plan, topology, wrap=wrap, device=device if meta else None)
    refuse_tensor_parallel(model, "this route")
    return model
