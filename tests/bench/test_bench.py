"""`tiershard bench`: a smoke run on loopback ranks checked on bytes (never on times), and its errors.

Oracle for bytes: `tiershard.cost.traffic`'s closed form of each plan, built here from the model alone
(`traffic.module_shapes` of the same GPT, cut as `ts.shard` cuts it) and summed over ranks with
`traffic.total_traffic`. The bench's `ts.comm_stats()` node-crossing bytes per step must equal it exactly.
With root and network namespaces, one more run on the emulated cluster checks the NIC counters against
comm_stats within 5 % (the bench check).
"""
from __future__ import annotations

import os

import pytest

from tiershard.bench import BenchConfig, render_markdown, run_bench, write_outputs
from tiershard.bench.config import PARAM_BYTES, REDUCE_BYTES, model_config, topology
from tiershard.cost import traffic
from tiershard.cli import main

SMOKE = BenchConfig(size="tiny", systems=("zero++", "IIG", "fsdp2"), accums=(2,), rounds=1,
                    steps_per_round=1, warmup=1, local=True, intra_bw=1e9)


def closed_form_world(cfg: BenchConfig, plan: str, accum: int) -> int:
    """Node-crossing bytes of one optimizer step over all ranks, from the plan and the model alone."""
    import torch

    from tiershard import Plan
    from tiershard.train.models.gpt import GPT, Block

    topo = topology(cfg)
    pl = Plan.parse(plan).resolve(topo)
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    shapes = traffic.module_shapes(model, {Block}, topo.chunking(pl.os), topo.chunking(pl.p))
    colls = traffic.step_collectives(pl, shapes, PARAM_BYTES, REDUCE_BYTES, accum)
    return traffic.total_traffic(colls, topo)["world"]


@pytest.fixture(scope="module")
def smoke():
    return run_bench(SMOKE, log=lambda line: None)


def test_comm_stats_bytes_per_step_equal_the_closed_form(smoke):
    (run,) = smoke["runs"]
    plans = [row for row in run["rows"] if row["plan"]]
    assert [row["system"] for row in plans] == ["zero++", "IIG"]
    for row in plans:
        expected = closed_form_world(SMOKE, row["plan"], run["accum"])
        assert expected > 0
        measured = row["comm_tiers_per_node"]["world"] * SMOKE.nodes      # per step, summed over all ranks
        assert measured == expected, (row["system"], measured, expected)
        assert row["closed_form_per_node"]["world"] * SMOKE.nodes == expected   # what the engine itself says
        assert row["predicted_tier_bytes_per_node"]["world"] * SMOKE.nodes == expected   # the cost model's
    peer = next(row for row in run["rows"] if row["system"] == "fsdp2")
    assert peer["nic_tx_per_node"] is None and "comm_tiers_per_node" not in peer     # loopback: no counters
    losses = {row["system"]: row["final_loss"] for row in run["rows"]}
    assert all(abs(v - losses["fsdp2"]) < 0.05 for v in losses.values()), losses   # same model, batches, seed


def test_memory_columns_are_the_measured_breakdown_and_equal_the_cost_model(smoke):
    from tiershard.bench.report import memory_cells
    from tiershard.runtime.api import BREAKDOWN

    (run,) = smoke["runs"]
    for row in run["rows"]:
        cells = memory_cells(row)
        if not row["plan"]:
            assert set(cells.values()) == {None}, row["system"]     # the peers: peak RSS only
            continue
        measured, predicted = row["memory"], row["predicted_memory"]
        keys = (*BREAKDOWN, "peak_gathered", "peak_gather_buffers")
        assert {k: measured[k] for k in keys} == {k: predicted[k] for k in keys}, row["system"]
        assert cells["states"] == row["predicted_states_bytes"] > 0      # gradients and optimizer states
        # between the two micro-steps: the fp32 accumulators at level g, as the cost model counts them
        assert row["accumulator_bytes"] == row["predicted_accumulator_bytes"] > 0, row["system"]
        assert row["states_bytes"] >= measured["master_weights"] + row["accumulator_bytes"]
        gathered = predicted["peak_gathered"] + predicted["peak_gather_buffers"]
        # at the step's peak over backward: never above every state at its fullest with every activation, never
        # below the states without gradients with every activation (the start of backward)
        grads, acc = predicted["gradients"], row["predicted_accumulator_bytes"]
        fullest = row["predicted_states_bytes"] + row["predicted_activation_bytes"]
        assert fullest - max(grads, acc) + acc <= row["predicted_peak_bytes"] <= fullest
        assert cells["predicted"] == row["predicted_peak_bytes"] + gathered


def test_report_has_every_system_and_the_outputs(smoke, tmp_path):
    text = render_markdown(smoke, "tiershard bench --local ...")
    for system in SMOKE.systems:
        assert f"| {system} |" in text, system
    assert "| system | plan / peer | step ms |" in text and "vs fsdp2" in text and "vs floor" in text
    assert "bench check: not available" in text
    paths = write_outputs(smoke, tmp_path)
    assert {p.name for p in paths} == {"bench.md", "bench.json", "step_time.png", "bytes_per_tier.png"}
    assert all(p.stat().st_size > 0 for p in paths)


def test_package_reexports_the_modules_names():
    import tiershard.bench as pkg
    from tiershard.bench import config, report, runner

    for name in pkg.__all__:
        home = next(m for m in (config, runner, report) if hasattr(m, name))
        assert getattr(pkg, name) is getattr(home, name), name
    assert not hasattr(runner, "render_markdown") and not hasattr(config, "run_bench")   # running never renders


def test_cli_errors_are_one_line_with_exit_2(monkeypatch, capsys):
    assert main(["bench", "--local", "--size", "9M"]) == 2
    assert "unknown size '9M'" in capsys.readouterr().err
    assert main(["bench", "--local", "--systems", "zero3,fsdp3"]) == 2
    err = capsys.readouterr().err
    assert "unknown system 'fsdp3'" in err and len(err.strip().splitlines()) == 1
    assert main(["bench", "--local", "--check"]) == 2
    assert "--check compares NIC counters" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "--systems", "zero3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiershard bench: error: the emulated cluster needs root") and "--local" in err
    assert len(err.strip().splitlines()) == 1


def _netns_reason() -> str | None:
    """None if this process may create network namespaces, else why not."""
    from tiershard.cluster.emulated import namespaces_unavailable

    return namespaces_unavailable("bprobe")


def test_emulated_cluster_nic_bytes_agree_with_comm_stats():
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    from tiershard.cluster.emulated import list_namespaces

    name = f"bt{os.getpid() % 100000}"
    cfg = BenchConfig(size="tiny", model=dict(vocab_size=512, block_size=64, n_embd=128, n_head=4),
                      systems=("zero3", "IIG"), accums=(1,), rates=("none",), rounds=1, steps_per_round=2,
                      intra_bw=1e9, cluster_name=name)
    results = run_bench(cfg, log=lambda line: None)
    checks = results["check"]
    assert len(checks) == 2 * cfg.nodes and all(c["ok"] for c in checks), checks
    (run,) = results["runs"]
    for row in run["rows"]:
        assert row["comm_tiers_per_node"]["world"] * cfg.nodes == closed_form_world(cfg, row["plan"], 1)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"ts-{name}-")]


def test_three_tier_bench_checks_every_tier():
    """2 nodes x 2 groups x 1 rank, links capped between groups (middle tier) and nodes: the NIC bytes of each tier
    agree with comm_stats' bytes of that tier within 5 %, and comm_stats equal the closed form on three tiers."""
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    from tiershard.cluster.emulated import list_namespaces

    name = f"b3{os.getpid() % 100000}"
    cfg = BenchConfig(size="tiny", model=dict(vocab_size=512, block_size=64, n_embd=128, n_head=4), nodes=2,
                      ranks_per_node=2, tiers=(1, 2, 4), systems=("zero3", "IIG"), accums=(1,),
                      rates=("none,4gbit,2gbit",), rounds=1, steps_per_round=2, intra_bw=1e9, cluster_name=name)
    results = run_bench(cfg, log=lambda line: None)
    checks = results["check"]
    assert {(c["system"], c["tier"]) for c in checks} == {(s, t) for s in cfg.systems for t in ("node", "world")}
    assert len(checks) == 2 * 2 * cfg.nodes and all(c["ok"] for c in checks), checks
    (run,) = results["runs"]
    assert run["rate"] == "none/4gbit/2gbit" and (run["node_bits"], run["rate_bits"]) == (4 * 10**9, 2 * 10**9)
    for row in run["rows"]:
        closed = closed_form_tiers(cfg, row["plan"], 1)
        assert closed["node"] > 0 and closed["world"] > 0
        for tier in ("node", "world"):
            assert row["comm_tiers_per_node"][tier] * cfg.nodes == closed[tier], (row["system"], tier)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"ts-{name}-")]


def closed_form_tiers(cfg: BenchConfig, plan: str, accum: int) -> dict[str, int]:
    """Bytes per tier of one optimizer step over all ranks, from the plan and the model alone."""
    import torch

    from tiershard import Plan
    from tiershard.train.models.gpt import GPT, Block

    topo = topology(cfg)
    pl = Plan.parse(plan).resolve(topo)
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    shapes = traffic.module_shapes(model, {Block}, topo.chunking(pl.os), topo.chunking(pl.p))
    return traffic.total_traffic(traffic.step_collectives(pl, shapes, PARAM_BYTES, REDUCE_BYTES, accum), topo)


def test_tier_settings_from_the_command_line(capsys):
    from tiershard.bench.config import rate_settings
    from tiershard.cli.bench import add_parser, config
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--tiers", "2,4,8", "--rates", "none,2gbit,250mbit;none,none,none"])
    cfg = config(args)
    assert (cfg.nodes, cfg.ranks_per_node, cfg.tiers) == (2, 4, (2, 4, 8))
    assert rate_settings(cfg) == [("none/2gbit/250mbit", (None, 2 * 10**9, 250 * 10**6)),
                                  ("none/none/none", (None, None, None))]
    assert topology(cfg).names == ("pair", "node", "world")
    assert main(["bench", "--tiers", "2,4,8", "--rates", "2gbit,2gbit,250mbit", "--systems", "IIG"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert main(["bench", "--rates", "none,2gbit;none,none", "--systems", "IIG"]) == 2
    assert "need --tiers" in capsys.readouterr().err
    from tiershard.cli.bench import split_systems
    assert split_systems("IIG,p=pair,g=node,os=world+hpz=pair, p=node, g=node, os=world,fsdp2") == (
        "IIG", "p=pair,g=node,os=world+hpz=pair", "p=node, g=node, os=world", "fsdp2")


def test_slow_world_lets_auto_pick_outer_sync_and_times_whole_sync_intervals(capsys):
    import argparse

    from tiershard.bench.config import check_config, sync_interval
    from tiershard.cli.bench import add_parser, config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    cfg = config(parser.parse_args(["bench", "--slow-world"]))
    assert "auto" in cfg.systems and cfg.allow_lossy and cfg.allow_outer and cfg.rates[0] == "25mbit"
    check_config(cfg)                      # 10 steps per round hold IIG+outer=10's sync and f5's two fragments
    assert (sync_interval("IIG+outer=10"), sync_interval("IIG+outer=10:f5:int4:128:h"), sync_interval("IIG")) == \
        (10, 2, None)
    # a round shorter than the sync interval would time steps without the sync: refused, naming the fix
    assert main(["bench", "--slow-world", "--steps-per-round", "4"]) == 2
    assert "give --steps-per-round 10" in capsys.readouterr().err
    assert main(["bench", "--local", "--allow-outer", "--systems", "auto"]) == 2
    assert "add --allow-lossy" in capsys.readouterr().err
