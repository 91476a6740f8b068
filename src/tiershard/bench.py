"""``tiershard bench``: tiershard's plans against FSDP2 and DeepSpeed on an emulated cluster, side by side.

A step-time number means little without the bytes that explain it, and a comparison means little unless every
system trains the same model, on the same batches, under the same network. So one bench run:

- brings up an :class:`~tiershard.cluster.EmulatedCluster` (network namespaces as nodes, ``tbf``-capped links)
  and, at each inter-node rate, launches the ranks inside the nodes; ``local=True`` runs the same per-rank code
  on loopback gloo ranks instead (no caps, no NIC counters: for tests and machines without root);
- builds every system on every rank through :mod:`tiershard.peers` (one training loop for all: tiershard plans
  as ``tiershard:PLAN``, FSDP2 ``fully_shard`` variants, DeepSpeed ZeRO-3 and ZeRO-3 + hpZ), measuring each
  one's peak memory while it builds and trains its warm-up steps;
- alternates the systems round by round (and a compute-only pseudo-system: forward and backward of the
  unsharded bf16 model, no communication), reading the nodes' NIC byte counters and ``ts.comm_stats()`` around
  every system's steps;
- compares the measurement with the cost model (``cost.evaluate`` on a :class:`~tiershard.cost.Cluster` that
  describes the emulated one) and with the floor max(compute, node-crossing bytes / link rate).

``python -m tiershard.bench SPEC.json`` is the per-rank job that :func:`run_bench` launches on the cluster.
"""
from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .cost import Cluster, Job, ModelSpec
    from .models.gpt import GPTConfig
    from .topology import Topology

# GPT shapes (tiershard.models.gpt.GPTConfig fields); 3.7M and 26M are benchmarks/step_time.py's sizes.
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32),
    "3.7M": dict(vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "26M": dict(vocab_size=2048, block_size=128, n_layer=8, n_head=8, n_embd=512),
}

PEERS: dict[str, str] = {
    "fsdp2": "FSDP2 fully_shard",
    "fsdp2-rs": "FSDP2 fully_shard, reduce-scatter every micro-step",
    "fsdp2-hsdp": "FSDP2 HSDP (no_sync skips all)",
    "fsdp2-hsdp-ar": "FSDP2 HSDP (no_sync skips the all-reduce)",
    "fsdp2-hpz": "FSDP2 reshard_after_forward=ranks/node",
    "deepspeed-zero3": "DeepSpeed ZeRO-3",
    "deepspeed-hpz": "DeepSpeed ZeRO-3 + hpZ",
}
OURS = ("zero3", "zero++", "hsdp", "IIG", "NIG", "GNG", "auto")
DEFAULT_SYSTEMS: tuple[str, ...] = (*OURS, *PEERS)
REFERENCES = ("fsdp2", "deepspeed-hpz")      # the ratio columns
COMPUTE = "compute"                           # the compute-only pseudo-system
CHECK_TOLERANCE = 0.05
PARAM_BYTES = REDUCE_BYTES = 2                # bf16 gathers, compute and reductions; fp32 masters everywhere
RESULT_PREFIX = "rank"


class BenchError(ValueError):
    """A user error in the bench's settings or environment; the message names the fix."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One bench run. ``model`` overrides fields of the ``size`` preset (tests use tiny custom shapes)."""

    size: str = "3.7M"
    model: dict = field(default_factory=dict)
    nodes: int = 2
    ranks_per_node: int = 2
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    accums: tuple[int, ...] = (1, 4)
    rates: tuple[str, ...] = ("250mbit", "1gbit", "none")
    rounds: int = 3
    steps_per_round: int = 2
    warmup: int = 1
    batch_per_rank: int = 2
    seq: int | None = None
    seed: int = 0
    local: bool = False
    intra_bw: float | None = None     # bytes/s per rank inside a node; None: measure with `tiershard probe`
    cluster_name: str = "bench"
    timeout: float = 3600.0           # seconds per launch of the ranks

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class System:
    """One row of the tables: ``label`` as the user named it, what runs (``runner``), and our plan's text."""

    label: str
    runner: str
    plan: str | None = None          # canonical plan text for tiershard systems, None for peers
    same_as: str | None = None       # auto only: the label of a listed plan it equals (measured once)

    @property
    def ours(self) -> bool:
        return self.plan is not None


# ---------------------------------------------------------------------------------------------------------------
# Settings


def model_config(cfg: BenchConfig) -> GPTConfig:
    """The GPTConfig of ``cfg``: the ``size`` preset with ``cfg.model``'s fields replaced."""
    from .models.gpt import GPTConfig

    if cfg.size not in SIZES:
        raise BenchError(f"unknown size {cfg.size!r}: choose one of {', '.join(SIZES)}")
    try:
        return GPTConfig(**{**SIZES[cfg.size], **cfg.model})
    except TypeError as err:
        raise BenchError(f"model override {sorted(cfg.model)}: {err}") from None


def topology(cfg: BenchConfig) -> Topology:
    """The bench's tiers: (ranks_per_node, world), named node and world."""
    from .topology import Topology

    return Topology((cfg.ranks_per_node, cfg.world))


def parse_systems(cfg: BenchConfig) -> list[System]:
    """The systems to run, validated: our plans (any plan text, or ``auto``) and the peers by name."""
    from .plan import Plan, PlanError

    topo = topology(cfg)
    systems: list[System] = []
    for raw in cfg.systems:
        name = raw.strip()
        if not name or name in [s.label for s in systems]:
            continue
        if name in PEERS:
            systems.append(System(name, name))
            continue
        if name == "auto":
            systems.append(System("auto", "tiershard:auto", "auto"))
            continue
        text = name.removeprefix("tiershard:")
        try:
            plan = Plan.parse(text)
            plan.resolve(topo)
        except (PlanError, ValueError) as err:
            raise BenchError(f"unknown system {name!r} ({err}): give a plan such as zero3, zero++, hsdp, IIG or "
                             f"auto, or a peer: {', '.join(PEERS)}") from None
        systems.append(System(name, f"tiershard:{text}", str(plan)))
    if not systems:
        raise BenchError("no systems to run: give --systems, e.g. zero3,IIG,fsdp2")
    return systems


def check_config(cfg: BenchConfig) -> None:
    """Raise BenchError for settings that cannot run, before anything is launched."""
    from .cluster import ClusterError, parse_rate

    ints = dict(nodes=cfg.nodes, ranks_per_node=cfg.ranks_per_node, rounds=cfg.rounds,
                steps_per_round=cfg.steps_per_round, warmup=cfg.warmup, batch_per_rank=cfg.batch_per_rank)
    for name, value in ints.items():
        if not isinstance(value, int) or value < 1:
            raise BenchError(f"{name.replace('_', '-')}={value!r} must be a positive integer (warm-up included: "
                             "peak memory is measured over the warm-up steps)")
    if cfg.nodes < 2:
        raise BenchError(f"nodes={cfg.nodes}: the bench compares node-crossing traffic, give at least 2 nodes")
    if not cfg.accums or any(not isinstance(a, int) or a < 1 for a in cfg.accums):
        raise BenchError(f"accum {cfg.accums!r} must be positive integers, e.g. 1,4")
    if not cfg.local:
        if not cfg.rates:
            raise BenchError("no inter-node rates: give e.g. --rates 250mbit,1gbit,none")
        for rate in cfg.rates:
            try:
                parse_rate(rate)
            except ClusterError as err:
                raise BenchError(str(err)) from None
    mc = model_config(cfg)
    if cfg.seq is not None and not 1 <= cfg.seq <= mc.block_size:
        raise BenchError(f"seq={cfg.seq} must be in 1..{mc.block_size} (the model's block size)")
    if cfg.intra_bw is not None and not cfg.intra_bw > 0:
        raise BenchError(f"intra-bw {cfg.intra_bw!r} must be a positive number of bytes/s, e.g. 2GB/s")
    parse_systems(cfg)


def deepspeed_note(systems: list[System]) -> tuple[list[System], str | None]:
    """Drop the DeepSpeed peers when DeepSpeed does not import here; the note says why (None: kept)."""
    wanted = [s for s in systems if s.runner.startswith("deepspeed")]
    if not wanted:
        return systems, None
    from .peers.deepspeed import unavailable

    reason = unavailable()
    if reason is None:
        return systems, None
    return ([s for s in systems if s not in wanted],
            f"skipped {', '.join(s.label for s in wanted)}: {reason}")


# ---------------------------------------------------------------------------------------------------------------
# The per-rank job


def _read_nic() -> dict[str, int]:
    """This node's NIC counters (the rank runs inside the node's namespace, which shows that node's /sys)."""
    from .cluster import IFNAME

    stats = Path(f"/sys/class/net/{IFNAME}/statistics")
    return {"tx": int((stats / "tx_bytes").read_text()), "rx": int((stats / "rx_bytes").read_text())}


def _status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _settle_memory() -> int | None:
    """Free what can be freed, return it to the OS, restart the peak-RSS mark; the resident bytes after that.

    Peak memory per system is then the peak RSS while it builds and trains minus this, so systems built
    earlier in the same process (still resident, their freed pages trimmed) do not count.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")     # Linux: reset VmHWM to the current RSS
    except OSError:
        return None
    return _status_bytes("VmRSS")


class ComputeOnly:
    """Forward and backward of the unsharded bf16 model on this rank's rows: no communication, no optimizer.

    The compute part of the floor and the cost model's compute rate, measured in the same rounds (so under the
    same load) as the systems.
    """

    def __init__(self, model_cfg: GPTConfig, micro_steps: int, batch_per_rank: int, seq: int, seed: int, rank: int,
                 world: int):
        import torch

        from .models.gpt import GPT

        torch.manual_seed(seed)
        self.model = GPT(model_cfg).to(torch.bfloat16)
        self.cfg, self.micro_steps, self.rows, self.seq, self.seed = model_cfg, micro_steps, batch_per_rank, seq, seed
        self.rank, self.world, self.step = rank, world, 0

    def train(self, steps: int) -> dict:
        import torch
        import torch.distributed as dist

        from .models.gpt import lm_loss
        from .peers import step_batch

        lo, hi = self.rank * self.rows, (self.rank + 1) * self.rows
        times = torch.zeros(steps, dtype=torch.float64)
        for i in range(steps):
            tokens = step_batch(self.seed, self.step, self.micro_steps, self.world * self.rows, self.seq,
                                self.cfg.vocab_size)[:, lo:hi]
            dist.barrier()
            start = time.perf_counter()
            for m in range(self.micro_steps):
                loss = lm_loss(self.model(tokens[m, :, :-1]), tokens[m, :, 1:])
                (loss / self.micro_steps).backward()
            times[i] = time.perf_counter() - start
            self.model.zero_grad(set_to_none=True)
            self.step += 1
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return {"step_times": times.tolist(), "losses": []}


def _warm_paths(runners: Sequence[str], ranks_per_node: int) -> None:
    """Build and step a tiny model once per family of systems (tiershard, FSDP2, DeepSpeed) and drop it, so the
    first system measured does not carry the memory of lazy imports and first-use caches."""
    import torch

    from .models.gpt import gpt_config
    from .peers import make_trainer

    families = {"tiershard": "tiershard:GGG", "fsdp2": "fsdp2", "deepspeed": "deepspeed-zero3"}
    for family, example in families.items():
        if any(r.startswith(family) for r in runners):
            trainer = make_trainer(example, gpt_config("tiny"), batch_per_rank=1, seq=8,
                                   ranks_per_node=ranks_per_node, param_dtype=torch.bfloat16)
            trainer.train(1)
            del trainer


def rank_job(rank: int, world: int, spec: dict) -> dict:
    """Every rank: build the systems one by one (peak memory over build and warm-up), then alternate them round
    by round, reading NIC counters (one rank per node) and ``ts.comm_stats()`` around each system's steps.

    For ``run_local(rank_job, world, spec)`` or under a launcher (``python -m tiershard.bench SPEC``). Returns this
    rank's measurements; step times and losses are already reduced over ranks (equal on every rank).
    """
    import torch
    import torch.distributed as dist

    import tiershard as ts

    from . import traffic
    from .models.gpt import GPTConfig
    from .peers import make_trainer

    torch.set_num_threads(1)
    model_cfg = GPTConfig(**spec["model"])
    rpn, accum, steps = spec["ranks_per_node"], spec["accum"], spec["steps_per_round"]
    reads_nic = bool(spec["nic"]) and rank % rpn == 0
    options = dict(micro_steps=accum, batch_per_rank=spec["batch_per_rank"], seq=spec["seq"], seed=spec["seed"],
                   ranks_per_node=rpn, param_dtype=torch.bfloat16)
    trainers: dict[str, object] = {}
    out: dict[str, dict] = {}
    _warm_paths([runner for _, runner in spec["systems"]], rpn)
    for label, runner in spec["systems"]:
        base = _settle_memory()
        if runner == COMPUTE:
            trainer = ComputeOnly(model_cfg, accum, spec["batch_per_rank"], spec["seq"], spec["seed"], rank, world)
        else:
            trainer = make_trainer(runner, model_cfg, **options)
        warm = trainer.train(spec["warmup"])
        peak = _status_bytes("VmHWM")
        trainers[label] = trainer
        out[label] = {"runner": runner, "losses": list(warm["losses"]), "step_times": [], "rounds": [],
                      "peak_bytes": None if base is None or peak is None else peak - base,
                      "params": getattr(trainer, "num_params", None)}
    labels = [label for label, _ in spec["systems"]]
    for r in range(spec["rounds"]):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            dist.barrier()
            before = _read_nic() if reads_nic else None
            ts.reset_comm_stats()
            result = trainers[label].train(steps)
            stats = ts.comm_stats()
            dist.barrier()
            after = _read_nic() if reads_nic else None
            nic = None if before is None else {k: after[k] - before[k] for k in before}
            out[label]["step_times"] += result["step_times"]
            out[label]["losses"] += result["losses"]
            out[label]["rounds"].append({"steps": steps, "tiers": stats["tiers"], "ops": stats["ops"], "nic": nic})
    for label, runner in spec["systems"]:
        if runner.startswith("tiershard:"):
            engine = trainers[label].runner.model._tiershard
            colls = traffic.step_collectives(engine.placement, engine.flat_shapes(), PARAM_BYTES, REDUCE_BYTES, accum)
            out[label]["closed_form"] = traffic.total_traffic(colls, engine.topology)
            out[label]["plan"] = str(engine.placement.plan)
    trainers.clear()
    return {"rank": rank, "node": rank // rpn, "systems": out}


def _main(argv: Sequence[str] | None = None) -> int:
    """The per-rank entry under a launcher: ``python -m tiershard.bench SPEC.json``; writes rank<r>.json beside it."""
    import torch.distributed as dist

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tiershard.bench SPEC.json (the per-rank job of `tiershard bench`)", file=sys.stderr)
        return 2
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        result = rank_job(rank, world, spec)
        tmp = spec_path.parent / f".{RESULT_PREFIX}{rank}.json"
        tmp.write_text(json.dumps(result))
        tmp.rename(spec_path.parent / f"{RESULT_PREFIX}{rank}.json")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The driver


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
    spec.update(over)
    return spec


def _launch(cfg: BenchConfig, cluster, spec: dict) -> list[dict]:
    """Run ``rank_job`` on every rank: inside the cluster's nodes, or on local loopback ranks."""
    if cluster is None:
        from .local import run_local

        return run_local(rank_job, cfg.world, spec, timeout=cfg.timeout)
    with tempfile.TemporaryDirectory(prefix="tiershard-bench-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        cluster.launch([sys.executable, "-m", "tiershard.bench", str(path)], timeout=cfg.timeout)
        return [json.loads((Path(tmp) / f"{RESULT_PREFIX}{r}.json").read_text()) for r in range(cfg.world)]


def measure_links(cfg: BenchConfig, cluster, log: Callable[[str], None]) -> dict:
    """Bandwidth and latency per rank of the node tier and of the uncapped inter-node tier.

    Measured by ``tiershard probe`` (inside the emulated nodes with the links uncapped, or on local ranks) unless
    ``cfg.intra_bw`` is given; without a probe the uncapped inter-node tier is assumed as fast as the node tier.
    """
    if cfg.intra_bw is not None:
        return {"source": "assumed (--intra-bw)", "intra_bw": cfg.intra_bw, "intra_latency": 5e-5,
                "inter_bw": cfg.intra_bw, "inter_latency": 1e-4}
    import tomllib

    with tempfile.TemporaryDirectory(prefix="tiershard-probe-") as tmp:
        out = Path(tmp) / "probe.toml"
        probe = [sys.executable, "-m", "tiershard.cli", "probe", "--out", str(out)]
        try:
            if cluster is None:
                proc = subprocess.run([*probe, "--nproc", str(cfg.world), "--ranks-per-node",
                                       str(cfg.ranks_per_node)], capture_output=True, text=True, timeout=900)
                if proc.returncode:
                    raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1:])
            else:
                cluster.set_bandwidth(None)
                cluster.launch(probe, timeout=900)
            table = tomllib.loads(out.read_text())["cluster"]
        except Exception as err:   # the bench still runs: the planner columns then rest on a stated assumption
            log(f"tiershard bench: probe failed ({type(err).__name__}: {err}); assuming 1 GB/s per rank inside a "
                "node and uncapped between nodes")
            return {"source": "assumed (probe failed)", "intra_bw": 1e9, "intra_latency": 5e-5,
                    "inter_bw": 1e9, "inter_latency": 1e-4}
    tiers = {t["name"]: t for t in table["tiers"]}
    links = {"source": "tiershard probe" + (" (inside the emulated nodes, links uncapped)" if cluster else
                                            " (local loopback ranks)"),
             "intra_bw": float(tiers["node"]["bandwidth"]), "intra_latency": float(tiers["node"]["latency"]),
             "inter_bw": float(tiers["world"]["bandwidth"]), "inter_latency": float(tiers["world"]["latency"])}
    for key in ("overlap", "codec_rate"):
        if key in table:
            links[key] = float(table[key])
    return links


def model_spec(cfg: BenchConfig) -> ModelSpec:
    """The cost model's view of the GPT, cut into units as ``ts.shard(..., wrap={Block})`` cuts it."""
    from .cost import ModelSpec
    from .models.gpt import GPT, Block

    import torch

    with torch.device("meta"):
        model = GPT(model_config(cfg))
    return ModelSpec.from_module(model, wrap={Block})


def cost_job(cfg: BenchConfig, accum: int) -> Job:
    """The job every system runs, for the cost model: bf16 on the wire, fp32 accumulation, no recompute."""
    from .cost import Job

    return Job(micro_batch=cfg.batch_per_rank, seq=cfg.seq or model_config(cfg).block_size, accum=accum,
               param_bytes=PARAM_BYTES, reduce_bytes=REDUCE_BYTES, grad_bytes=4, recompute=False, efficiency=1.0)


def cost_cluster(cfg: BenchConfig, links: dict, rate_bits: int | None, micro_seconds: float) -> Cluster:
    """The emulated cluster as the cost model sees it: tiers (ranks_per_node, world), the inter-node tier at
    the cap (a node's link shared by its ranks) or, uncapped, at the probe's rate; peak flops calibrated so
    one micro-step's compute takes ``micro_seconds`` (the measured compute-only step); the probe's overlap and
    codec rate when it measured them."""
    import dataclasses

    from .cost import Cluster, Tier, compute_seconds

    inter = rate_bits / 8 / cfg.ranks_per_node if rate_bits else links["inter_bw"]
    tiers = (Tier(name="node", size=cfg.ranks_per_node, bandwidth=links["intra_bw"], latency=links["intra_latency"]),
             Tier(name="world", size=cfg.world, bandwidth=inter, latency=links["inter_latency"]))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / cfg.world
    extra = {k: links[k] for k in ("overlap", "codec_rate")
             if k in links and k in {f.name for f in dataclasses.fields(Cluster)}}
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


def summarize(cfg: BenchConfig, systems: list[System], ranks: list[dict], accum: int, rate: str,
              rate_bits: int | None, links: dict, plans: dict[str, str]) -> dict:
    """One (rate, accum) run: a row per system with times, bytes per step and per node, memory, prediction."""
    from . import cost

    nodes, rpn = cfg.nodes, cfg.ranks_per_node
    mc = model_config(cfg)
    seq = cfg.seq or mc.block_size
    tokens = cfg.world * cfg.batch_per_rank * accum * seq
    first = ranks[0]["systems"]
    compute = _median(first[COMPUTE]["step_times"])
    spec, job = model_spec(cfg), cost_job(cfg, accum)
    ccluster = cost_cluster(cfg, links, rate_bits, compute / accum)
    link_rate = rate_bits / 8 if rate_bits else (links["inter_bw"] * rpn if not cfg.local else None)
    rows = []
    for s in systems:
        key = s.same_as or s.label
        mine = first[key]
        timed = sum(r["steps"] for r in mine["rounds"])
        step = _median(mine["step_times"])
        row = {"system": s.label, "runner": s.runner if not s.same_as else f"tiershard:{plans[s.label]}",
               "plan": plans.get(s.label) if s.ours else None, "peer": None if s.ours else PEERS[s.label],
               "same_as": s.same_as, "step_s": step, "step_times": mine["step_times"],
               "tokens_per_s": tokens / step, "final_loss": mine["losses"][-1] if mine["losses"] else None,
               "losses": mine["losses"], "timed_steps": timed,
               "peak_bytes": max((r["systems"][key]["peak_bytes"] or 0) for r in ranks) or None}
        nic = {}
        for r in ranks:
            rounds = r["systems"][key]["rounds"]
            if rounds and rounds[0]["nic"] is not None:
                nic[str(r["node"])] = {d: sum(x["nic"][d] for x in rounds) / timed for d in ("tx", "rx")}
        row["nic_per_node"] = nic or None
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
                                          for t in ("node", "world")}
            closed = first[key]["closed_form"]
            row["closed_form_per_node"] = {t: closed.get(t, 0) / nodes for t in ("node", "world")}
            est = cost.evaluate(plans[s.label], spec, ccluster, job)
            row["predicted_s"] = est.step_time
            row["predicted_tier_bytes_per_node"] = {t: b / nodes for t, b in est.tier_bytes.items()}
            if crossing is None:
                crossing = row["comm_tiers_per_node"]["world"]
        row["crossing_bytes"] = crossing
        row["link_s"] = crossing / link_rate if crossing is not None and link_rate else 0.0
        row["floor_s"] = max(compute, row["link_s"])
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for row in rows:
        for ref in REFERENCES:
            row[f"vs_{ref}"] = row["step_s"] / by[ref]["step_s"] if ref in by else None
        row["vs_floor"] = row["step_s"] / row["floor_s"] if row["floor_s"] else None
    return {"rate": rate, "rate_bits": rate_bits, "accum": accum, "tokens_per_step": tokens, "compute_s": compute,
            "link_rate_bytes": link_rate, "rows": rows, "plans": plans,
            "cost_cluster": {"tiers": [asdict(t) for t in ccluster.tiers], "peak_flops": ccluster.peak_flops}}


def bench_check(results: dict) -> list[dict]:
    """For every one of our plans at every (rate, accum): NIC bytes sent per node and step against the
    ``comm_stats`` node-crossing ("world") bytes of that node's ranks; within 5 % passes."""
    checks = []
    for run in results["runs"]:
        for row in run["rows"]:
            if not row["plan"] or row["same_as"] or not row["nic_per_node"]:
                continue
            for node, nic in sorted(row["nic_per_node"].items(), key=lambda kv: int(kv[0])):
                comm = row["comm_per_node"].get(node, {}).get("world", 0)
                dev = (nic["tx"] - comm) / comm if comm else float("inf")
                checks.append({"rate": run["rate"], "accum": run["accum"], "system": row["system"],
                               "plan": row["plan"], "node": int(node), "nic_tx": nic["tx"], "comm_world": comm,
                               "deviation": dev, "ok": abs(dev) <= CHECK_TOLERANCE})
    return checks


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run the whole bench (every rate and accumulation); returns the results :func:`render_markdown` shows."""
    from . import cost
    from .cluster import ClusterError, EmulatedCluster, LaunchError, format_rate, parse_rate

    check_config(cfg)
    if not cfg.local and os.geteuid() != 0:
        raise BenchError("the emulated cluster needs root to create network namespaces: run as root (e.g. sudo "
                         ".venv/bin/tiershard bench ...), or add --local for loopback ranks without caps or NIC counters")
    systems, note = deepspeed_note(parse_systems(cfg))
    if note:
        log(f"tiershard bench: {note}")
    if not systems:
        raise BenchError("every system asked for was skipped: add systems that can run here")
    mc = model_config(cfg)
    rates = ["local"] if cfg.local else [format_rate(parse_rate(r)) for r in cfg.rates]
    results: dict = {"config": {**asdict(cfg), "model": mc.to_dict(), "systems": [s.label for s in systems]},
                     "notes": [note] if note else [], "runs": [], "loadavg": {"start": _loadavg()}}
    spec_model = model_spec(cfg)
    results["params"] = spec_model.params
    started = time.perf_counter()
    try:
        context = nullcontext(None) if cfg.local else EmulatedCluster(cfg.nodes, cfg.ranks_per_node, None,
                                                                      name=cfg.cluster_name)
        with context as cluster:
            links = measure_links(cfg, cluster, log)
            results["links"] = links
            log(f"tiershard bench: links per rank: node {links['intra_bw'] / 1e9:.3g} GB/s, uncapped inter-node "
                f"{links['inter_bw'] / 1e9:.3g} GB/s ({links['source']})")
            calibration = calibrate(cfg, cluster, log) if any(s.plan == "auto" for s in systems) else None
            results["calibration_micro_s"] = calibration
            for rate in rates:
                bits = None if cfg.local else parse_rate(rate)
                if cluster is not None:
                    cluster.set_bandwidth(bits)
                for accum in cfg.accums:
                    plans = {s.label: s.plan for s in systems if s.ours and s.plan != "auto"}
                    run_systems = []
                    for s in systems:
                        if s.plan == "auto":
                            pick = cost.auto_plan(spec_model, cost_cluster(cfg, links, bits, calibration),
                                                  cost_job(cfg, accum))
                            plans[s.label] = str(pick)
                            twin = next((o.label for o in systems if o.ours and o.plan == str(pick)), None)
                            s = replace(s, runner=f"tiershard:{pick}", same_as=twin)
                        run_systems.append(s)
                    launched = [(s.label, s.runner) for s in run_systems if not s.same_as]
                    load = _loadavg()
                    t0 = time.perf_counter()
                    before = cluster.nic_bytes() if cluster is not None else None
                    ranks = _launch(cfg, cluster, _spec(cfg, [(COMPUTE, COMPUTE), *launched], accum,
                                                        cluster is not None))
                    after = cluster.nic_bytes() if cluster is not None else None
                    run = summarize(cfg, run_systems, ranks, accum, rate, bits, links, plans)
                    run["seconds"] = time.perf_counter() - t0
                    run["loadavg"] = {"before": load, "after": _loadavg()}
                    if before is not None:
                        run["nic_launch_total"] = {n: {d: after[n][d] - before[n][d] for d in ("tx", "rx")}
                                                   for n in before}
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
                for run in results["runs"] if run["rate_bits"] is None and run["rate"] != "local"}
    for run in results["runs"]:
        twins = uncapped.get(run["accum"], {}) if run["rate_bits"] else {}
        for row in run["rows"]:
            own = twins.get(row["plan"] or row["system"])
            row["uncapped_floor_s"] = None if own is None else max(own, row["link_s"])
            row["vs_uncapped_floor"] = None if own is None else row["step_s"] / row["uncapped_floor_s"]


# ---------------------------------------------------------------------------------------------------------------
# Reports


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value * scale, spec)


def best_plan(run: dict) -> dict | None:
    """The fastest of our plans in one run (auto counts when it ran a plan of its own)."""
    ours = [r for r in run["rows"] if r["plan"] and not r["same_as"]]
    return min(ours, key=lambda r: r["step_s"]) if ours else None


def run_summary(run: dict) -> list[str]:
    """Lines under a table: the best plan against the references and the floor, the planner's pick."""
    lines = []
    best = best_plan(run)
    by = {r["system"]: r for r in run["rows"]}
    if best:
        parts = [f"best tiershard plan **{best['system']}** ({best['plan']}) {best['step_s'] * 1e3:.0f} ms"]
        for ref in REFERENCES:
            if ref in by:
                parts.append(f"{best['step_s'] / by[ref]['step_s']:.2f}x the step time of {ref} "
                             f"({by[ref]['step_s'] / best['step_s']:.2f}x faster)")
        parts.append(f"{best['vs_floor']:.2f}x its floor")
        if best.get("vs_uncapped_floor") is not None:
            parts.append(f"{best['vs_uncapped_floor']:.2f}x max(its uncapped step, its link time)")
        lines.append("- " + "; ".join(parts))
    auto = by.get("auto")
    if auto and best:
        gap = auto["step_s"] / best["step_s"] - 1
        verdict = "the measured best" if gap <= 0 else \
            f"{gap * 100:.1f}% slower than the best ({'within' if gap <= 0.05 else 'outside'} 5%)"
        same = f", the same run as {auto['same_as']}" if auto["same_as"] else ""
        lines.append(f"- planner's pick (auto): {auto['plan']}{same}: {verdict}")
    return lines


def render_table(run: dict) -> str:
    head = ("| system | plan / peer | step ms | tokens/s | NIC MB/step/node | comm_stats MB/step/node "
            "| predicted ms | vs fsdp2 | vs deepspeed-hpz | floor ms | vs floor | vs uncapped floor | peak MiB/rank "
            "| final loss |")
    lines = [head, "| --- | --- |" + " ---: |" * 12]
    for r in run["rows"]:
        what = r["plan"] if r["plan"] else r["peer"]
        if r["same_as"]:
            what += f" (= {r['same_as']})"
        comm = r.get("comm_tiers_per_node", {}).get("world") if r["plan"] else None
        lines.append(
            f"| {r['system']} | {what} | {_fmt(r['step_s'], '.0f', 1e3)} | {_fmt(r['tokens_per_s'], ',.0f')} "
            f"| {_fmt(r['nic_tx_per_node'], '.2f', 1e-6)} | {_fmt(comm, '.2f', 1e-6)} "
            f"| {_fmt(r.get('predicted_s'), '.0f', 1e3)} | {_fmt(r['vs_fsdp2'], '.2f')} "
            f"| {_fmt(r['vs_deepspeed-hpz'], '.2f')} | {_fmt(r['floor_s'], '.0f', 1e3)} | {_fmt(r['vs_floor'], '.2f')} "
            f"| {_fmt(r.get('vs_uncapped_floor'), '.2f')} | {_fmt(r['peak_bytes'], '.0f', 1 / 2**20)} "
            f"| {_fmt(r['final_loss'], '.4f')} |")
    return "\n".join(lines)


def render_check(results: dict) -> str:
    """The bench check: a headline, then per plan and (rate, accum) the worse node's NIC/comm_stats deviation."""
    checks = results.get("check") or []
    if not checks:
        return "bench check: not available (no NIC counters: --local, or none of our plans ran)"
    bad = [c for c in checks if not c["ok"]]
    devs = [c["deviation"] for c in checks]
    lines = [f"bench check: NIC bytes sent vs comm_stats node-crossing bytes, per node and step, within "
             f"{CHECK_TOLERANCE:.0%}: {'PASS' if not bad else 'FAIL'} ({len(checks) - len(bad)}/{len(checks)} "
             f"node checks; deviation {min(devs) * 100:+.2f}% to {max(devs) * 100:+.2f}%)", ""]
    runs = list(dict.fromkeys((c["rate"], c["accum"]) for c in checks))
    systems = list(dict.fromkeys(c["system"] for c in checks))
    lines += ["| system | " + " | ".join(f"{rate} A={accum}" for rate, accum in runs) + " |",
              "| --- |" + " ---: |" * len(runs)]
    for system in systems:
        cells = []
        for rate, accum in runs:
            mine = [c for c in checks if (c["rate"], c["accum"], c["system"]) == (rate, accum, system)]
            if not mine:
                cells.append("-")
                continue
            worst = max(mine, key=lambda c: abs(c["deviation"]))
            cell = f"{worst['deviation'] * 100:+.2f}%" + ("" if worst["ok"] else " FAIL")
            if system == "auto":
                cell += f" ({worst['plan']})"
            cells.append(cell)
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(results: dict, command: str | None = None) -> str:
    """The report: settings, one table per (rate, accum), the bench check."""
    cfg, links = results["config"], results.get("links", {})
    mc = cfg["model"]
    lines = ["# tiershard bench", ""]
    if command:
        lines += ["```sh", command, "```", ""]
    mode = "local loopback gloo ranks (no caps, no NIC counters)" if cfg["local"] else \
        f"emulated cluster '{cfg['cluster_name']}' (network namespaces, tbf caps)"
    seq = cfg["seq"] or mc["block_size"]
    lines += [
        f"- GPT {results['params'] / 1e6:.2f}M parameters ({mc['n_layer']} blocks x {mc['n_embd']}, vocab "
        f"{mc['vocab_size']}), {cfg['batch_per_rank']} rows x {seq} tokens per rank and micro-step, seed "
        f"{cfg['seed']}, bf16 gathers, compute and reductions, fp32 masters, AdamW",
        f"- {cfg['nodes']} nodes x {cfg['ranks_per_node']} ranks, {mode}",
        f"- {cfg['rounds']} interleaved rounds x {cfg['steps_per_round']} steps per system after {cfg['warmup']} "
        "warm-up step(s); step time = median over timed steps of the slowest rank",
        f"- the planner's cluster: node tier {links.get('intra_bw', 0) / 1e9:.3g} GB/s and "
        f"{links.get('intra_latency', 0) * 1e6:.0f} us per rank, uncapped inter-node "
        f"{links.get('inter_bw', 0) / 1e9:.3g} GB/s and {links.get('inter_latency', 0) * 1e6:.0f} us per rank"
        + (f", overlap {links['overlap']:.2f}" if "overlap" in links else "")
        + (f", codec rate {links['codec_rate'] / 1e9:.3g} GB/s" if "codec_rate" in links else "")
        + f" ({links.get('source', '-')}); a capped inter-node tier is the cap shared by a node's ranks; peak flops "
        "calibrated to the compute-only step"
        + (f" ({results['calibration_micro_s'] * 1e3:.0f} ms per micro-step for the planner's pick, each "
           "table's own for its predictions)" if results.get("calibration_micro_s") else " of each table"),
        f"- load average (1, 5, 15 min): {results['loadavg'].get('start')} at the start, "
        f"{results['loadavg'].get('end')} at the end; {results.get('seconds', 0):.0f} s in all",
    ]
    lines += [f"- note: {n}" for n in results.get("notes", [])]
    lines += ["", "Ratios are step time / the peer's step time (below 1: faster). NIC MB: bytes the node's NIC "
              "sent per step (mean over nodes); comm_stats MB: the world tier of `ts.comm_stats()` summed over the "
              "node's ranks (our plans only). Floor: max(compute-only step, the node's larger NIC direction per "
              "step / link rate); uncapped floor: max(the same system's step uncapped at the same accumulation, "
              "its link time), the CPU-bound step that a hidden link would leave. Peak MiB: the largest rise of a "
              "rank's resident memory while the system built and trained its warm-up steps.", ""]
    for run in results["runs"]:
        lines += [f"## {run['rate']}, accum {run['accum']}", "",
                  f"compute-only step {run['compute_s'] * 1e3:.0f} ms; {run['tokens_per_step']:,} tokens per step; "
                  f"load average {run['loadavg']['before']} -> {run['loadavg']['after']}", "",
                  render_table(run), ""]
        lines += run_summary(run)
        lines.append("")
    lines += ["## Bench check", "", render_check(results), ""]
    return "\n".join(lines)


def plot(results: dict, out: Path, prefix: str = "") -> list[Path]:
    """Step time against the inter-node rate per system, and bytes per tier per plan; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    accums = list(dict.fromkeys(run["accum"] for run in results["runs"]))
    rates = list(dict.fromkeys(run["rate"] for run in results["runs"]))
    systems = results["config"]["systems"]
    size = f"GPT {results['params'] / 1e6:.1f}M"
    paths = []

    fig, axes = plt.subplots(1, len(accums), figsize=(6 * len(accums), 4.5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        for i, system in enumerate(systems):
            xs, ys = [], []
            for x, rate in enumerate(rates):
                run = next((r for r in results["runs"] if r["rate"] == rate and r["accum"] == accum), None)
                row = next((r for r in run["rows"] if r["system"] == system), None) if run else None
                if row:
                    xs.append(x)
                    ys.append(row["step_s"] * 1e3)
            ours = system not in PEERS
            ax.plot(xs, ys, marker="o" if ours else "s", linestyle="-" if ours else "--", label=system,
                    color=plt.cm.tab20(i % 20))
        ax.set_xticks(range(len(rates)), [r if r != "none" else "none (uncapped)" for r in rates])
        ax.set_yscale("log")
        ax.set_xlabel("inter-node rate (per link and direction)")
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{size}, accum {accum}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    paths.append(out / f"{prefix}step_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(accums), figsize=(6 * len(accums), 4.5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        run = next(r for r in results["runs"] if r["accum"] == accum)
        rows = [r for r in run["rows"] if not r["same_as"]]
        names = [r["system"] + (f"\n{r['plan']}" if r["plan"] and r["plan"] != r["system"] else "") for r in rows]
        node = [r["comm_tiers_per_node"]["node"] / 1e6 if r["plan"] else 0 for r in rows]
        world = [(r["comm_tiers_per_node"]["world"] if r["plan"] else (r["nic_tx_per_node"] or 0)) / 1e6 for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], node, width=0.4, color="tab:blue")
        ax.bar([x + 0.2 for x in xs], world, width=0.4, color=["tab:orange" if r["plan"] else "tab:gray" for r in rows])
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("MB per step per node")
        ax.set_title(f"{size}, accum {accum}: bytes per tier ({run['rate']})")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(handles=[Patch(color="tab:blue", label="inside the node (comm_stats)"),
                           Patch(color="tab:orange", label="node-crossing (comm_stats)"),
                           Patch(color="tab:gray", label="node-crossing, peers (NIC sent)")], fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{prefix}bytes_per_tier.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(results: dict, out: Path, command: str | None = None, prefix: str = "") -> list[Path]:
    """``bench.md``, ``bench.json`` and the plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{prefix}bench.md"
    md.write_text(render_markdown(results, command))
    js = out / f"{prefix}bench.json"
    js.write_text(json.dumps(results, indent=1, default=str))
    return [md, js, *plot(results, out, prefix)]


if __name__ == "__main__":
    sys.exit(_main())
