"""The peer systems (FSDP2, DeepSpeed) against single-process training on the concatenated batch.

Oracle: 4 gloo ranks as 2 nodes of 2, fp32, 3 optimizer steps of 2 micro-steps, SGD with momentum (linear in
the gradient, so a wrong averaging factor or a micro-step whose gradient is lost shows); the per-step global
mean losses equal the single process's within 1e-5 relative. The same bound holds for DeepSpeed, whose
reductions are bucketed differently (measured: about 5e-8). bf16 runs are held to 5e-4 of the fp32 oracle.
"""
from __future__ import annotations

import pytest
import torch

from tiershard.train.models.gpt import gpt_config
from tiershard.bench.peers import step_batch, train_steps

from _dist import run_ranks

WORLD, PER_RANK = 4, 2
CFG = gpt_config("tiny")
KW = dict(steps=3, micro_steps=2, seq=16, optimizer="sgd", lr=1.0)
FSDP2 = ["fsdp2", "fsdp2-rs", "fsdp2-hpz", "fsdp2-hsdp", "fsdp2-hsdp-ar"]
DEEPSPEED = ["deepspeed-zero3", "deepspeed-hpz"]


def _train(rank, world, runs):
    return {name: train_steps(system, CFG, batch_per_rank=PER_RANK, ranks_per_node=2, **kw)
            for name, system, kw in runs}


def _rel(losses, ref):
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


@pytest.fixture(scope="module")
def oracle():
    losses = train_steps("single", CFG, batch_per_rank=WORLD * PER_RANK, **KW)["losses"]
    assert abs(losses[-1] - losses[0]) > 1e-3, "the oracle must move, or equal losses prove nothing"
    return losses


def test_step_batch_is_the_global_batch_sliced_by_rank():
    full = step_batch(3, 5, 2, WORLD * PER_RANK, 16, 256)
    assert full.shape == (2, WORLD * PER_RANK, 17)
    assert torch.equal(full, step_batch(3, 5, 2, WORLD * PER_RANK, 16, 256))
    assert not torch.equal(full, step_batch(3, 6, 2, WORLD * PER_RANK, 16, 256))


def test_fsdp2_variants_equal_single_process(oracle):
    runs = [(s, s, KW) for s in FSDP2] + [("fsdp2-bf16", "fsdp2", dict(KW, param_dtype=torch.bfloat16))]
    results = run_ranks(_train, WORLD, runs)
    assert all(r == results[0] for r in results[1:]), "every rank returns the same reduced results"
    out = results[0]
    for system in FSDP2:
        assert _rel(out[system]["losses"], oracle) < 1e-5, (system, out[system]["losses"], oracle)
        assert len(out[system]["step_times"]) == KW["steps"] and out[system]["peak_rss_bytes"] > 0
    assert 0 < _rel(out["fsdp2-bf16"]["losses"], oracle) < 5e-4   # bf16 applied, and close


def test_deepspeed_equals_single_process(oracle):
    from tiershard.bench.peers.deepspeed import unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    runs = [(s, s, KW) for s in DEEPSPEED] + [("deepspeed-hpz-bf16", "deepspeed-hpz",
                                               dict(KW, param_dtype=torch.bfloat16))]
    out = run_ranks(_train, WORLD, runs)[0]
    for system in DEEPSPEED:
        assert _rel(out[system]["losses"], oracle) < 1e-5, (system, out[system]["losses"], oracle)
    assert _rel(out["deepspeed-hpz-bf16"]["losses"], oracle) < 5e-4


def test_unknown_system_and_bad_node_size_raise():
    with pytest.raises(ValueError, match="unknown system"):
        train_steps("zero3", CFG, steps=1)
    with pytest.raises(ValueError, match="trains in fp32 only"):
        train_steps("single", CFG, steps=1, param_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        train_steps("fsdp2", CFG, steps=1)
