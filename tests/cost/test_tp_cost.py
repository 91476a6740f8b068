"""The cost model's tensor parallelism ([Note: TP in the cost model]): the per-rank model, the tiers it leaves, the
TP collectives, the ranking of TP degrees beside placements, and ``tiershard plan --tp``."""
from __future__ import annotations

import dataclasses

import pytest

from tiershard import cost
from tiershard.cli import main
from tiershard.cost import Job, ModelSpec, presets

MODEL = ModelSpec.named("70b")
CLUSTER = presets.preset("dgx-a100", 64)
JOB = Job(seq=4096, accum=2)


def test_tp_one_is_no_tp_and_tp_two_cuts_the_states_of_a_replicated_placement():
    assert cost.evaluate("IIG", MODEL, CLUSTER, JOB, tp=1) == cost.evaluate("IIG", MODEL, CLUSTER, JOB)
    ddp1, ddp2 = (cost.evaluate("NNN", MODEL, CLUSTER, JOB, tp=t) for t in (1, 2))
    whole = cost.tensor_parallel.replicated_params(MODEL)
    assert whole == (6 * 80 + 2) * 8192
    assert ddp2.memory.optimizer == pytest.approx(JOB.optimizer_bytes * ((MODEL.params - whole) / 2 + whole), rel=1e-9)
    # fully sharded states are cut over every device either way
    assert cost.evaluate("GGG", MODEL, CLUSTER, JOB, tp=2).memory.optimizer == pytest.approx(
        cost.evaluate("GGG", MODEL, CLUSTER, JOB).memory.optimizer, rel=1e-3)


def test_tp_collectives_are_priced_on_the_node_and_added_exposed():
    e1, e2 = (cost.evaluate("IGG", MODEL, CLUSTER, JOB, tp=t) for t in (1, 2))
    group_job = dataclasses.replace(JOB, micro_batch=2 * JOB.micro_batch)
    tier, sent, seconds = cost.tp_collectives(MODEL, group_job, CLUSTER, 2)
    count = (4 + 2) * MODEL.layers * JOB.accum                    # recompute is on
    assert (tier, sent) == ("node", round(count * group_job.tokens * MODEL.hidden * JOB.param_bytes))
    assert e2.comm_tp == seconds > 0 and e1.comm_tp == 0
    assert e2.tier_bytes["node"] >= sent * CLUSTER.world_size
    assert e2.label == "IGG tp=2" and e1.label == "IGG" and e2.tp == 2


def test_ranking_weighs_degrees_and_placements_together():
    ranked = cost.rank_plans(MODEL, CLUSTER, JOB, tp=(1, 2, 4, 8))
    assert {e.tp for e in ranked} == {1, 2, 4, 8}
    assert len({e.label for e in ranked}) == len(ranked)          # the tie rule needs unique labels
    assert len(ranked) == 4 * len(cost.rank_plans(MODEL, CLUSTER, JOB))
    with pytest.raises(ValueError, match="tp=3 does not divide the 8 ranks"):
        cost.rank_plans(MODEL, CLUSTER, JOB, tp=(3,))


def test_auto_weighs_tp_only_when_asked_or_when_nothing_fits_without_it():
    assert cost.auto_estimate(MODEL, CLUSTER, JOB).tp == 1
    tight = dataclasses.replace(CLUSTER, gpu_memory=80e9)
    only_ddp = ["NNN"]                       # 70B's replicated states fit only when TP cuts them
    best = cost.auto_estimate("7b", tight, Job(seq=1024), candidates=only_ddp)
    assert best.tp > 1 and best.fits and best.reason.startswith("no plan fits without tensor parallelism")
    with pytest.raises(cost.NoPlanFits, match=f"NNN tp={best.tp} fits"):
        cost.auto_plan("7b", tight, Job(seq=1024), candidates=only_ddp)
    assert cost.auto_plan("7b", tight, Job(seq=1024), candidates=only_ddp, tp=(best.tp,)) == best.plan


def test_cli_plan_ranks_tp_degrees(capsys):
    assert main(["plan", "--model", "70b", "--gpus", "64", "--seq", "4096", "--inter-bw", "100Gbps/node",
                 "--tp", "1,2,4,8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best    IGG+cc tp=2" in out and "tp=4" in out
    assert main(["plan", "--model", "70b", "--tp", "two"]) != 0
    assert "--tp 'two' is not a list of TP degrees" in capsys.readouterr().err
