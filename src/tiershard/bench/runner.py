"""``tiershard bench``: tiershard's plans against FSDP2 and DeepSpeed on an emulated cluster, side by side.

A step-time number means little without the bytes that explain it, and a comparison means little unless every
system trains the same model, on the same batches, under the same network. So one bench run:

- brings up an :class:`~tiershard.cluster.EmulatedCluster` (network namespaces as nodes, ``tbf``-capped links)
  and, at each inter-node rate, launches the ranks inside the nodes; ``local=True`` runs the same per-rank code
  on loopback gloo ranks instead (no caps, no NIC counters: for tests and machines without root);
- builds every system on every rank through :mod:`tiershard.bench.peers` (one training loop for all: tiershard plans
  as ``tiershard:PLAN``, FSDP2 ``fully_shard`` variants, DeepSpeed ZeRO-3 and ZeRO-3 + hpZ), measuring each
  one's peak memory while it builds and trains its warm-up steps;
- alternates the systems round by round (and a compute-only pseudo-system: forward and backward of the
  unsharded bf16 model, no communication), reading the nodes' NIC byte counters and ``ts.comm_stats()`` around
  every system's steps;
- compares the measurement with the cost model (``cost.evaluate`` on a :class:`~tiershard.cost.Cluster` that
  describes the emulated one) and with the floor max(compute, node-crossing bytes / link rate).

This module is the driver: the cluster, the launches, the link probe and the calibration, the cost model's
view of the bench (:func:`model_spec`, :func:`cost_job`, :func:`cost_cluster`), and the rows of the results
(:func:`summarize`, :func:`bench_check`, :func:`add_uncapped_floor`). The settings are in
:mod:`~tiershard.bench.config`, the per-rank job that :func:`run_bench` launches on the cluster (``python -m
tiershard.bench SPEC.json``) in :mod:`~tiershard.bench.rank`, the tables and plots in
:mod:`~tiershard.bench.report`.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .config import (CHECK_TOLERANCE, COMPUTE, PARAM_BYTES, PEERS, REDUCE_BYTES, REFERENCES, RESULT_PREFIX,
                     BenchConfig, BenchError, System, check_config, deepspeed_note, model_config, parse_systems,
                     rate_settings, sync_interval, tier_sizes)
from .rank import rank_job

if TYPE_CHECKING:
    from ..cost import Cluster, Job, ModelSpec


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _spec(cfg: BenchConfig, systems: Sequence[tuple[str, str]], accum: int, nic: bool, **over) -> dict:
    mc = model_config(cfg)
    spec = dict(model=mc.to_dict(), systems=[list(s) for s in systems], accum=accum, rounds=cfg.rounds,
                steps_per_round=cfg.steps_per_round, warmup=cfg.warmup, batch_per_rank=cfg.batch_per_rank,
                seq=cfg.seq or mc.block_size, seed=cfg.seed, ranks_per_node=cfg.ranks_per_node, nic=nic)
    if cfg.tiers:
        spec["tiers"] = list(cfg.tiers)
        if len(cfg.tiers) == 3:
            spec["ranks_per_group"] = cfg.tiers[0]
    spec.update(over)
    return spec


def _launch(cfg: BenchConfig, cluster, spec: dict) -> list[dict]:
    """Run ``rank_job`` on every rank: inside the cluster's nodes, or on local loopback ranks."""
    if cluster is None:
        from ..cluster.local import run_local

        return run_local(rank_job, cfg.world, spec, timeout=cfg.timeout)
    with tempfile.TemporaryDirectory(prefix="tiershard-bench-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        cluster.launch([sys.executable, "-m", "tiershard.bench", str(path)], timeout=cfg.timeout)
        return [json.loads((Path(tmp) / f"{RESULT_PREFIX}{r}.json").read_text()) for r in range(cfg.world)]


def measure_links(cfg: BenchConfig, cluster, log: Callable[[str], None]) -> dict:
    """Bandwidth and latency per rank of the node tier and of the uncapped inter-node tier (three tiers: of the
    innermost tier as ``intra``, and of the uncapped node tier as ``mid``).

    Measured by ``tiershard probe`` (inside the emulated nodes with the links uncapped, or on local ranks) unless
    ``cfg.intra_bw`` is given; without a probe the uncapped outer tiers are assumed as fast as the innermost.
    """
    three = len(tier_sizes(cfg)) == 3
    if cfg.intra_bw is not None:
        links = {"source": "assumed (--intra-bw)", "intra_bw": cfg.intra_bw, "intra_latency": 5e-5,
                 "inter_bw": cfg.intra_bw, "inter_latency": 1e-4}
        return {**links, "mid_bw": cfg.intra_bw, "mid_latency": 1e-4} if three else links
    import tomllib

    with tempfile.TemporaryDirectory(prefix="tiershard-probe-") as tmp:
        out = Path(tmp) / "probe.toml"
        probe = [sys.executable, "-m", "tiershard.cli", "probe", "--out", str(out)]
        try:
            if cluster is None:
                proc = subprocess.run([*probe, "--nproc", str(cfg.world), "--ranks-per-node",
                                       str(cfg.ranks_per_node), "--tiers", ",".join(map(str, tier_sizes(cfg)))],
                                      capture_output=True, text=True, timeout=900)
                if proc.returncode:
                    raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1:])
            else:
                cluster.set_tier_rates((None,) * len(cluster.tiers))
                cluster.launch(probe, timeout=900)
            table = tomllib.loads(out.read_text())["cluster"]
        except Exception as err:   # the bench still runs: the planner columns then rest on a stated assumption
            log(f"tiershard bench: probe failed ({type(err).__name__}: {err}); assuming 1 GB/s per rank inside a "
                "node and uncapped between nodes")
            links = {"source": "assumed (probe failed)", "intra_bw": 1e9, "intra_latency": 5e-5,
                     "inter_bw": 1e9, "inter_latency": 1e-4}
            return {**links, "mid_bw": 1e9, "mid_latency": 1e-4} if three else links
    tiers = {t["name"]: t for t in table["tiers"]}
    inner = "pair" if three else "node"
    links = {"source": "tiershard probe" + (" (inside the emulated nodes, links uncapped)" if cluster else
                                            " (local loopback ranks)"),
             "intra_bw": float(tiers[inner]["bandwidth"]), "intra_latency": float(tiers[inner]["latency"]),
             "inter_bw": float(tiers["world"]["bandwidth"]), "inter_latency": float(tiers["world"]["latency"])}
    if three:
        links.update(mid_bw=float(tiers["node"]["bandwidth"]), mid_latency=float(tiers["node"]["latency"]))
    for key in ("overlap", "codec_rate"):
        if key in table:
            links[key] = float(table[key])
    if "codecs" in table:           # each codec's own measured rate (Cluster.codec_rates)
        links["codec_rates"] = {spec: float(v["rate"]) for spec, v in table["codecs"].items()}
    return links


def model_spec(cfg: BenchConfig) -> ModelSpec:
    """The cost model's view of the GPT, cut into units as ``ts.shard(..., wrap={Block})`` cuts it."""
    from ..cost import ModelSpec
    from ..train.models.gpt import GPT, Block

    import torch

    with torch.device("meta"):
        model = GPT(model_config(cfg))
    return ModelSpec.from_module(model, wrap={Block})


def cost_job(cfg: BenchConfig, accum: int) -> Job:
    """The job every system runs, for the cost model: bf16 on the wire, fp32 accumulation, no recompute."""
    from ..cost import Job

    return Job(micro_batch=cfg.batch_per_rank, seq=cfg.seq or model_config(cfg).block_size, accum=accum,
               param_bytes=PARAM_BYTES, reduce_bytes=REDUCE_BYTES, grad_bytes=4, recompute=False, efficiency=1.0)


def cost_cluster(cfg: BenchConfig, links: dict, rate_bits: int | None, micro_seconds: float,
                 node_bits: int | None = None) -> Cluster:
    """The emulated cluster as the cost model sees it: tiers (ranks_per_node, world), the inter-node tier at
    the cap (a node's link shared by its ranks) or, uncapped, at the probe's rate; with three tiers (pair, node,
    world) also the node tier at ``node_bits`` (a group's link shared by its ranks) or the probe's rate; peak
    flops calibrated so one micro-step's compute takes ``micro_seconds`` (the measured compute-only step); the
    probe's overlap and codec rate when it measured them."""
    import dataclasses

    from ..cost import Cluster, Tier, compute_seconds

    inter = rate_bits / 8 / cfg.ranks_per_node if rate_bits else links["inter_bw"]
    sizes = tier_sizes(cfg)
    if len(sizes) == 3:
        mid = node_bits / 8 / sizes[0] if node_bits else links["mid_bw"]
        tiers = (Tier(name="pair", size=sizes[0], bandwidth=links["intra_bw"], latency=links["intra_latency"]),
                 Tier(name="node", size=sizes[1], bandwidth=mid, latency=links["mid_latency"]),
                 Tier(name="world", size=cfg.world, bandwidth=inter, latency=links["inter_latency"]))
    else:
        tiers = (Tier(name="node", size=cfg.ranks_per_node, bandwidth=links["intra_bw"],
                      latency=links["intra_latency"]),
                 Tier(name="world", size=cfg.world, bandwidth=inter, latency=links["inter_latency"]))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cfg.world
    extra = {k: links[k] for k in ("overlap", "codec_rate")
             if k in links and k in {f.name for f in dataclasses.fields(Cluster)}}
    if links.get("codec_rates"):
        extra["codec_rates"] = tuple(links["codec_rates"].items())
    unit = Cluster(tiers=tiers, gpu_memory=memory, peak_flops=1.0, name="emulated", **extra)
    flops = compute_seconds(model_spec(cfg), cost_job(cfg, 1), unit)     # at 1 flop/s: the flop count
    return replace(unit, peak_flops=flops / max(micro_seconds, 1e-9))


def calibrate(cfg: BenchConfig, cluster, log: Callable[[str], None]) -> float:
    """Seconds of one micro-step's forward and backward per rank, all ranks at once (the planner's compute)."""
    spec = _spec(cfg, [(COMPUTE, COMPUTE)], 1, False, rounds=3, steps_per_round=2)
    results = _launch(cfg, cluster, spec)
    seconds = statistics.median(results[0]["systems"][COMPUTE]["step_times"])
    log(f"tiershard bench: compute-only micro-step {seconds * 1e3:.1f} ms (calibrates the planner)")
    return seconds


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _nic_tiers(ranks: list[dict], key: str, timed: int, three: bool) -> tuple[dict, list[dict]]:
    """Per capped tier and node, NIC bytes sent and received per step (``{"world": {node: {"tx", "rx"}}}``, with
    three tiers also ``"node"``: the node's group links minus its uplink), and the group links' own bytes."""
    eth0: dict[str, dict[str, float]] = {}
    uplink: dict[str, dict[str, float]] = {}
    groups = []
    for r in ranks:
        rounds = r["systems"][key]["rounds"]
        if not rounds or rounds[0]["nic"] is None:
            continue
        mine = {d: sum(x["nic"][d] for x in rounds) / timed for d in ("tx", "rx")}
        groups.append(mine)
        node = eth0.setdefault(str(r["node"]), {"tx": 0.0, "rx": 0.0})
        for d in ("tx", "rx"):
            node[d] += mine[d]
        if rounds[0].get("uplink") is not None:
            uplink[str(r["node"])] = {d: sum(x["uplink"][d] for x in rounds) / timed for d in ("tx", "rx")}
    if not three:
        return ({"world": eth0} if eth0 else {}), []
    middle = {n: {d: eth0[n][d] - uplink.get(n, {}).get(d, 0.0) for d in ("tx", "rx")} for n in eth0}
    return ({"node": middle, "world": uplink} if eth0 else {}), groups


def summarize(cfg: BenchConfig, systems: list[System], ranks: list[dict], accum: int, rate: str,
              rate_bits: int | None, links: dict, plans: dict[str, str], node_bits: int | None = None) -> dict:
    """One (rate, accum) run: a row per system with times, bytes per step and per node and tier, memory,
    prediction. ``rate_bits`` caps the node uplinks; with three tiers ``node_bits`` caps the group links."""
    from .. import cost

    nodes, rpn = cfg.nodes, cfg.ranks_per_node
    mc = model_config(cfg)
    seq = cfg.seq or mc.block_size
    tokens = cfg.world * cfg.batch_per_rank * accum * seq
    first = ranks[0]["systems"]
    compute = _median(first[COMPUTE]["step_times"])
    spec, job = model_spec(cfg), cost_job(cfg, accum)
    ccluster = cost_cluster(cfg, links, rate_bits, compute / accum, node_bits)
    link_rate = rate_bits / 8 if rate_bits else (links["inter_bw"] * rpn if not cfg.local else None)
    names = tuple(t.name for t in ccluster.tiers)
    three = len(names) == 3
    rows = []
    for s in systems:
        key = s.same_as or s.label
        mine = first[key]
        timed = sum(r["steps"] for r in mine["rounds"])
        interval = sync_interval(plans.get(s.label)) if s.ours else None
        # an outer sync lands in one step of its interval: the mean holds it, the median would not
        step = statistics.mean(mine["step_times"]) if interval else _median(mine["step_times"])
        row = {"system": s.label, "runner": s.runner if not s.same_as else f"tiershard:{plans[s.label]}",
               "plan": plans.get(s.label) if s.ours else None, "peer": None if s.ours else PEERS[s.label],
               "same_as": s.same_as, "step_s": step, "step_stat": "mean" if interval else "median",
               "whole_intervals": None if not interval else cfg.steps_per_round % interval == 0, "step_times": mine["step_times"],
               "tokens_per_s": tokens / step, "final_loss": mine["losses"][-1] if mine["losses"] else None,
               "losses": mine["losses"], "timed_steps": timed,
               "peak_bytes": max((r["systems"][key]["peak_bytes"] or 0) for r in ranks) or None,
               "build_peak_bytes": max((r["systems"][key].get("build_peak_bytes") or 0) for r in ranks) or None}
        tier_nic, group_nic = _nic_tiers(ranks, key, timed, three)
        nic = tier_nic.get("world", {})
        row["nic_per_node"] = nic or None
        row["nic_tiers_per_node"] = tier_nic or None
        row["nic_tx_per_node"] = sum(v["tx"] for v in nic.values()) / len(nic) if nic else None
        crossing = max(max(v["tx"], v["rx"]) for v in nic.values()) if nic else None
        if s.ours:
            comm_node: dict[str, dict[str, float]] = {}
            for r in ranks:
                for x in r["systems"][key]["rounds"]:
                    tiers = comm_node.setdefault(str(r["node"]), {})
                    for tier, b in x["tiers"].items():
                        tiers[tier] = tiers.get(tier, 0) + b / timed
            row["comm_per_node"] = comm_node
            row["comm_tiers_per_node"] = {t: sum(c.get(t, 0) for c in comm_node.values()) / nodes
                                          for t in names}
            closed = first[key]["closed_form"]
            row["closed_form_per_node"] = {t: closed.get(t, 0) / nodes for t in names}
            est = cost.evaluate(plans[s.label], spec, ccluster, job)
            row["predicted_s"] = est.step_time
            row["time_split"] = time_split(ranks, key, timed, step, compute, est)
            row.update(_memory_columns([r["systems"][key].get("memory") for r in ranks], spec, job))
            row["predicted_tier_bytes_per_node"] = {t: b / nodes for t, b in est.tier_bytes.items()}
            if crossing is None:
                crossing = row["comm_tiers_per_node"]["world"]
        row["crossing_bytes"] = crossing
        row["link_s"] = crossing / link_rate if crossing is not None and link_rate else 0.0
        if node_bits and group_nic:             # three tiers: a group's link may be the slower one
            row["link_s"] = max(row["link_s"], max(max(g["tx"], g["rx"]) for g in group_nic) / (node_bits / 8))
        row["floor_s"] = max(compute, row["link_s"])
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for row in rows:
        for ref in REFERENCES:
            row[f"vs_{ref}"] = row["step_s"] / by[ref]["step_s"] if ref in by else None
        row["vs_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
    return {"rate": rate, "rate_bits": rate_bits, "node_bits": node_bits, "accum": accum, "tokens_per_step": tokens,
            "compute_s": compute, "link_rate_bytes": link_rate, "rows": rows, "plans": plans,
            "cost_cluster": {"tiers": [asdict(t) for t in ccluster.tiers], "peak_flops": ccluster.peak_flops}}


def time_split(ranks: list[dict], key: str, timed: int, step: float, compute: float, est) -> dict:
    """Where one plan's step went, per step and rank (the mean over ranks), measured beside predicted ([Note: where
    the time goes], comm/ledger.py): the compute-only step, the communication the step waited for, the rest (the
    engine's host work, the optimizer step, compute slowed by the communication thread beside it), the stream's busy
    time, the codecs' time and each tier's time in flight; predicted: compute, exposed communication, each tier's
    bytes / bandwidth."""
    sums: dict[str, float] = {"waited": 0.0, "stream": 0.0, "codec": 0.0}
    tiers: dict[str, float] = {}
    for r in ranks:
        for x in r["systems"][key]["rounds"]:
            seconds = x.get("seconds") or {}
            for k in sums:
                sums[k] += seconds.get(k, 0.0)
            for tier, s in seconds.get("tiers", {}).items():
                tiers[tier] = tiers.get(tier, 0.0) + s
    per = len(ranks) * timed
    out = {k: v / per for k, v in sums.items()}
    out.update(tiers={t: s / per for t, s in tiers.items()}, step=step, compute=compute,
               rest=step - compute - out["waited"],
               predicted={"step": est.step_time, "compute": est.compute, "exposed": est.exposed,
                          "tiers": dict(est.tier_seconds)})
    return out


def _memory_columns(per_rank: list[dict | None], spec, job) -> dict:
    """Our plans' memory beside the peak RSS, each the largest over ranks: the measured breakdown
    (``ts.memory_stats`` before the last warm-up step's optimizer step), the model states of that step at their
    fullest (with the optimizer states after it, and the level-g accumulators between micro-steps where they
    outgrow the gradients), and the same predicted: the cost model's exact ``breakdown`` and
    ``accumulator_bytes``, plus its activations (``cost.memory.activations``). The predicted states and
    activations *at the step's peak* follow its last backward (``cost.memory.backward_peak``): the masters'
    gradients are made unit by unit as the activations are freed (the previous step freed them), from the level-g
    accumulators of the micro-steps before."""
    from ..cost.memory import activations, backward_peak
    from ..runtime.api import BREAKDOWN

    seen = [m for m in per_rank if m and "measured" in m]
    if not seen:
        return {}
    measured = {k: max(m["measured"][k] for m in seen) for k in seen[0]["measured"]}
    predicted = {k: max(m["predicted"][k] for m in seen) for k in seen[0]["predicted"]}
    # the step at its fullest: gradients (before the step), or the accumulators between micro-steps where
    # larger, and optimizer states (after it) together
    held = max(m["measured"]["model_states"] - m["measured"]["optimizer_states"] + m["optimizer_after_step"]
               - m["measured"]["gradients"] + max(m["measured"]["gradients"], m["accumulators"]) for m in seen)
    def steady(m: dict) -> int:        # the predicted model states without the masters' gradients
        return sum(m["states"][k] for k in BREAKDOWN[:6]) - m["states"]["gradients"]

    states = max(steady(m) + max(m["states"]["gradients"], m["predicted_accumulators"]) for m in seen)
    at_peak = max(backward_peak(steady(m), m["units"], spec, job) for m in seen)
    return {"memory": measured, "predicted_memory": predicted, "states_bytes": held,
            "predicted_states_bytes": states, "predicted_peak_bytes": at_peak,
            "predicted_activation_bytes": activations(spec, job),
            "accumulator_bytes": max(m["accumulators"] for m in seen),
            "predicted_accumulator_bytes": max(m["predicted_accumulators"] for m in seen)}


def bench_check(results: dict) -> list[dict]:
    """For every one of our plans at every (rate, accum), every capped tier and every node: the NIC bytes sent on
    that tier's links per step against the ``comm_stats`` bytes of that tier summed over the node's ranks (the
    node-crossing "world" tier; with three tiers also the "node" tier, between the node's groups); within 5 %
    passes. A tier without comm_stats bytes passes when its NIC sent under 64 KiB per step (barriers)."""
    checks = []
    for run in results["runs"]:
        for row in run["rows"]:
            tiers = row.get("nic_tiers_per_node") or ({"world": row["nic_per_node"]} if row["nic_per_node"] else {})
            if not row["plan"] or row["same_as"] or not tiers:
                continue
            for tier, per_node in tiers.items():
                for node, nic in sorted(per_node.items(), key=lambda kv: int(kv[0])):
                    comm = row["comm_per_node"].get(node, {}).get(tier, 0)
                    dev = (nic["tx"] - comm) / comm if comm else (0.0 if nic["tx"] < 64 * 1024 else float("inf"))
                    checks.append({"rate": run["rate"], "accum": run["accum"], "system": row["system"],
                                   "plan": row["plan"], "tier": tier, "node": int(node), "nic_tx": nic["tx"],
                                   "comm": comm, "deviation": dev, "ok": abs(dev) <= CHECK_TOLERANCE})
    return checks


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the whole bench (every rate and accumulation); returns the results :func:`render_markdown` shows."""
    from .. import cost
    from ..cluster.emulated import ClusterError, EmulatedCluster, LaunchError

    check_config(cfg)
    if not cfg.local and os.geteuid() != 0:
        raise BenchError("the emulated cluster needs root to create network namespaces: run as root (e.g. sudo "
                         ".venv/bin/tiershard bench ...), or add --local for loopback ranks without caps or NIC "
                         "counters")
    systems, note = deepspeed_note(parse_systems(cfg))
    if note:
        log(f"tiershard bench: {note}")
    if not systems:
        raise BenchError("every system asked for was skipped: add systems that can run here")
    mc = model_config(cfg)
    settings = [("local", (None, None))] if cfg.local else rate_settings(cfg)
    results: dict = {"config": {**asdict(cfg), "model": mc.to_dict(), "systems": [s.label for s in systems]},
                     "notes": [note] if note else [], "runs": [], "loadavg": {"start": _loadavg()}}
    spec_model = model_spec(cfg)
    results["params"] = spec_model.params
    started = time.perf_counter()
    try:
        sizes = tier_sizes(cfg)
        context = nullcontext(None) if cfg.local else EmulatedCluster.from_tiers(sizes, (None,) * len(sizes),
                                                                                 name=cfg.cluster_name)
        with context as cluster:
            links = measure_links(cfg, cluster, log)
            results["links"] = links
            log(f"tiershard bench: links per rank: node {links['intra_bw'] / 1e9:.3g} GB/s, uncapped inter-node "
                f"{links['inter_bw'] / 1e9:.3g} GB/s ({links['source']})")
            calibration = calibrate(cfg, cluster, log) if any(s.plan == "auto" for s in systems) else None
            results["calibration_micro_s"] = calibration
            for rate, per_tier in settings:
                bits, node_bits = per_tier[-1], (per_tier[1] if len(per_tier) == 3 else None)
                if cluster is not None:
                    cluster.set_tier_rates(per_tier)
                for accum in cfg.accums:
                    plans = {s.label: s.plan for s in systems if s.ours and s.plan != "auto"}
                    run_systems = []
                    for s in systems:
                        if s.plan == "auto":
                            pick = cost.auto_plan(spec_model, cost_cluster(cfg, links, bits, calibration, node_bits),
                                                  cost_job(cfg, accum), allow_lossy=cfg.allow_lossy,
                                                  outer=cfg.allow_outer)
                            plans[s.label] = str(pick)
                            twin = next((o.label for o in systems if o.ours and o.plan == str(pick)), None)
                            s = replace(s, runner=f"tiershard:{pick}", same_as=twin)
                        run_systems.append(s)
                    launched = [(s.label, s.runner) for s in run_systems if not s.same_as]
                    load = _loadavg()
                    t0 = time.perf_counter()
                    before = cluster.tier_nic_bytes() if cluster is not None else None
                    ranks = _launch(cfg, cluster, _spec(cfg, [(COMPUTE, COMPUTE), *launched], accum,
                                                        cluster is not None))
                    after = cluster.tier_nic_bytes() if cluster is not None else None
                    run = summarize(cfg, run_systems, ranks, accum, rate, bits, links, plans, node_bits)
                    run["seconds"] = time.perf_counter() - t0
                    run["loadavg"] = {"before": load, "after": _loadavg()}
                    if before is not None:
                        run["nic_launch_total"] = {n: {d: after["world"][n][d] - before["world"][n][d]
                                                       for d in ("tx", "rx")} for n in before["world"]}
                        run["nic_launch_tiers"] = {t: {n: {d: after[t][n][d] - before[t][n][d] for d in ("tx", "rx")}
                                                       for n in before[t]} for t in before}
                    results["runs"].append(run)
                    auto = next((r for r in run["rows"] if r["system"] == "auto"), None)
                    log(f"tiershard bench: rate {rate}, accum {accum}: {len(launched)} systems in "
                        f"{run['seconds']:.0f} s" + (f", auto = {auto['plan']}" if auto else ""))
    except (ClusterError, LaunchError) as err:
        raise BenchError(str(err)) from None
    results["loadavg"]["end"] = _loadavg()
    results["seconds"] = time.perf_counter() - started
    results["check"] = bench_check(results)
    add_uncapped_floor(results)
    return results


def add_uncapped_floor(results: dict) -> None:
    """Each capped row's second floor: max(the same system's step time uncapped at the same accumulation, its
    link time). On machines where moving bytes costs the cores that compute (gloo over the kernel's TCP), the
    uncapped step is what the system costs without waiting for the link; a step near this floor hides the link
    behind that work. Rows without an uncapped twin (or uncapped themselves) get None."""
    uncapped = {run["accum"]: {r["plan"] or r["system"]: r["step_s"] for r in run["rows"]}
                for run in results["runs"]
                if run["rate_bits"] is None and not run.get("node_bits") and run["rate"] != "local"}
    for run in results["runs"]:
        twins = uncapped.get(run["accum"], {}) if run["rate_bits"] or run.get("node_bits") else {}
        for row in run["rows"]:
            own = twins.get(row["plan"] or row["system"])
            row["uncapped_floor_s"] = None if own is None else max(own, row["link_s"])
            row["vs_uncapped_floor"] = None if own is None else row["step_s"] / row["uncapped_floor_s"]
