"""Tensor parallelism inside the node, priced: what one rank of a TP group holds, computes and sends.

[Note: TP in the cost model] At TP degree ``t`` (torch's ``parallelize_module`` over ``t`` adjacent ranks, the
tiers over the rest: [Note: tensor parallelism is not a tier], topology.py) a rank is priced as a data-parallel
rank of a smaller model on a smaller cluster, plus the TP collectives. The job's ``micro_batch`` stays per device,
so every TP degree trains the same global batch: a TP group takes its ``t`` devices' ``t · micro_batch``
sequences together (``evaluate``), and degrees compare at equal tokens per step.

- the model: every matrix is cut ``t`` ways (column- and row-parallel linears, the vocab-parallel embedding and
  head); the norms' weights and biases and the row-parallel biases, ``6 h`` per layer and ``2 h`` for the final
  norm, stay whole on every TP rank. So Ψ_t = (Ψ - R) / t + R with R = (6 L + 2) h. With sequence parallelism the
  activations between the TP regions are cut along the sequence and those inside along the heads or the hidden
  dim: every per-layer activation term (``s b h``, of the group's ``t`` times larger batch) is divided by ``t``,
  which is ``hidden / t``: per device what data parallelism holds. The logits stay whole on every TP rank (the
  head's output is replicated unless loss parallel is used), so their ``8 s b V`` grows ``t`` times;
- the cluster: the tiers count TP groups, so each tier's size is divided by ``t`` (the tiers' per-device
  bandwidths are unchanged: the ``t`` TP coordinates run their own data-parallel collectives side by side on
  their own links). ``t`` must divide the innermost tier's size: TP runs inside it;
- the TP collectives: per layer and micro-step, forward two all-gather / reduce-scatter pairs (sequence
  parallelism) or two all-reduces (without it), the same again in backward and once more in a recomputed forward:
  ``(4 + 2 recompute)`` all-reduce volumes of the group's ``s b h`` activations in ``param_bytes``, each ``2 (t - 1) / t`` of
  its bytes per rank on the innermost tier that holds the TP group, with ``2 (t - 1)`` latency steps. They sit on
  the critical path between a layer's matmuls (no async TP), so they are counted as exposed.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .specs import Cluster, Job, ModelSpec


def tp_degrees(cluster: Cluster) -> tuple[int, ...]:
    """The TP degrees that fit inside the innermost tier: its size's divisors."""
    inner = cluster.tiers[0].size
    return tuple(t for t in range(1, inner + 1) if inner % t == 0)


def _check(cluster: Cluster, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive whole number of ranks per tensor-parallel group")
    inner = cluster.tiers[0]
    if inner.size % tp:
        raise ValueError(f"tp={tp} does not divide the {inner.size} ranks of the innermost tier {inner.name!r}: "
                         f"tensor parallelism runs inside it, so pick one of {', '.join(map(str, tp_degrees(cluster)))}")


def replicated_params(model: ModelSpec) -> int:
    """Parameters every TP rank keeps whole: the norms and the row-parallel biases ([Note: TP in the cost model])."""
    return min(model.params, (6 * model.layers + 2) * model.hidden)


def tp_model(model: ModelSpec, tp: int) -> ModelSpec:
    """What one rank of a TP group of ``tp`` holds and computes, as a model of its own."""
    if tp == 1:
        return model
    whole = replicated_params(model)
    params = math.ceil((model.params - whole) / tp) + whole
    trainable = min(params, max(1, round(params * model.trainable_fraction)))
    name = f"{model.label}/tp{tp}"
    return replace(model, params=params, trainable=trainable, hidden=max(1, math.ceil(model.hidden / tp)),
                   name=name, units=(), param_shapes=())


def tp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster as the data-parallel ranks of one TP coordinate see it: every tier's size divided by ``tp``."""
    _check(cluster, tp)
    if tp == 1:
        return cluster
    return replace(cluster, tiers=tuple(replace(t, size=t.size // tp) for t in cluster.tiers))


def tp_collectives(model: ModelSpec, job: Job, cluster: Cluster, tp: int) -> tuple[str, int, float]:
    """(tier, bytes one rank sends, seconds) of one optimizer step's TP collectives; ``job`` is the TP group's
    (its micro-batch the group's sequences)."""
    _check(cluster, tp)
    tier = cluster.tiers[0]
    if tp == 1:
        return tier.name, 0, 0.0
    per_layer = 4 + (2 if job.recompute else 0)
    count = per_layer * model.layers * job.accum
    message = job.tokens * model.hidden * job.param_bytes
    sent = round(count * 2 * (tp - 1) / tp * message)
    seconds = sent / tier.bandwidth + count * 2 * (tp - 1) * tier.latency
    return tier.name, sent, seconds
