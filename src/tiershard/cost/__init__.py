"""Cost model and planner: memory per device and time per optimizer step of every plan, and the best one.

``auto_plan(model, cluster, job)`` (behind ``ts.Plan.auto``) returns the fastest exact plan that fits (with
``allow_lossy=True``, the fastest of all, quantized ones included); ``rank_plans``
returns every estimate, best first. The formulas and assumptions are in docs/cost-model.md and in the notes of
``cost.memory`` (memory), ``cost.comm`` (bytes and time of collectives) and ``cost.planner`` (overlap).
"""
from __future__ import annotations

from .comm import plan_collectives, price, price_plan
from .memory import Memory, memory
from .planner import (REL_TIE, Estimate, NoPlanFits, auto_estimate, auto_plan, candidate_plans, coerce_model,
                      compute_seconds, evaluate, no_plan_fits, rank_estimates, rank_plans)
from .specs import MODELS, Cluster, Job, ModelSpec, Tier
from .tensor_parallel import tp_cluster, tp_collectives, tp_degrees, tp_model

__all__ = [
    "MODELS", "Cluster", "Estimate", "Job", "Memory", "ModelSpec", "NoPlanFits", "Tier", "auto_estimate", "auto_plan",
    "candidate_plans", "coerce_model", "compute_seconds", "evaluate", "memory", "no_plan_fits", "plan_collectives", "price",
    "price_plan", "REL_TIE", "rank_estimates", "rank_plans", "tp_cluster", "tp_collectives", "tp_degrees", "tp_model",
]
