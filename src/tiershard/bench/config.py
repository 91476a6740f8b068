"""The bench's settings: what one run measures (:class:`BenchConfig`), the systems it compares, and the checks
that turn a setting which cannot run into one :class:`BenchError` before anything is launched.

Also the constants the per-rank job, the driver and the report share (the pseudo-system ``compute``, the wire
widths, the reference peers of the ratio columns), so that each of those imports them from here and none of
them from another.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..topology import Topology
    from ..train.models.gpt import GPTConfig

# GPT shapes (tiershard.train.models.gpt.GPTConfig fields); 3.7M and 26M are benchmarks/step_time.py's sizes.
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
# --slow-world: two islands behind a slow link (docs/outer-sync.md): the best step-synchronous plans against outer
# sync, every timed round one whole outer period (steps per round = H), so each round holds each fragment's sync
# and the planner's pick among exact, quantized and outer-sync plans (auto with allow_lossy and allow_outer)
SLOW_WORLD = dict(systems=("zero3", "zero++", "IIG", "IIG+outer=10", "IIG+outer=10:f5:int4:128:h", "auto"),
                  rates=("25mbit", "250mbit", "none"), accums=(1,), steps_per_round=10)
COMPUTE = "compute"                           # the compute-only pseudo-system
CHECK_TOLERANCE = 0.05
PARAM_BYTES = REDUCE_BYTES = 2                # bf16 gathers, compute and reductions; fp32 masters everywhere
RESULT_PREFIX = "rank"


class BenchError(ValueError):
    """A user error in the bench's settings or environment; the message names the fix."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One bench run. ``model`` overrides fields of the ``size`` preset (tests use tiny custom shapes).

    Two tiers: ``rates`` are the inter-node caps to run at, one after the other. ``tiers`` (innermost first, e.g.
    ``(2, 4, 8)``: 2 nodes of 2 groups of 2 ranks) runs on a three-tier cluster; then every entry of ``rates`` is
    one setting of all tiers, a comma list innermost first, e.g. ``"none,2gbit,250mbit"``.
    """

    size: str = "3.7M"
    model: dict = field(default_factory=dict)
    nodes: int = 2
    ranks_per_node: int = 2
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    accums: tuple[int, ...] = (1, 4)
    rates: tuple[str, ...] = ("250mbit", "1gbit", "none")
    tiers: tuple[int, ...] | None = None   # (group, node, world) for three tiers; None: (ranks_per_node, world)
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
    allow_lossy: bool = False         # what auto may pick: the quantized plans too ([Note: quality rule])
    allow_outer: bool = False         # and, with allow_lossy, the outer-sync plans

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
    from ..train.models.gpt import GPTConfig

    if cfg.size not in SIZES:
        raise BenchError(f"unknown size {cfg.size!r}: choose one of {', '.join(SIZES)}")
    try:
        return GPTConfig(**{**SIZES[cfg.size], **cfg.model})
    except TypeError as err:
        raise BenchError(f"model override {sorted(cfg.model)}: {err}") from None


def topology(cfg: BenchConfig) -> Topology:
    """The bench's tiers: ``cfg.tiers`` (three: pair, node, world), else (ranks_per_node, world), node and world."""
    from ..topology import Topology

    return Topology(tier_sizes(cfg))


def tier_sizes(cfg: BenchConfig) -> tuple[int, ...]:
    return tuple(cfg.tiers) if cfg.tiers else (cfg.ranks_per_node, cfg.world)


def rate_settings(cfg: BenchConfig) -> list[tuple[str, tuple[int | None, ...]]]:
    """Each setting of the links as (label, bits/s per tier innermost first, None uncapped): two tiers
    ``("250mbit", (None, 250e6))``; three ``("none/2gbit/250mbit", (None, 2e9, 250e6))``."""
    from ..cluster.netns import ClusterError, check_tiers, format_rate, parse_rate

    settings = []
    for rate in cfg.rates:
        try:
            if not cfg.tiers:
                settings.append((format_rate(parse_rate(rate)), (None, parse_rate(rate))))
                continue
            per_tier = [r.strip() for r in str(rate).split(",")]
            check_tiers(cfg.tiers, per_tier)
            bits = tuple(parse_rate(r) for r in per_tier)
        except ClusterError as err:
            raise BenchError(f"rates {rate!r}: {err}") from None
        settings.append(("/".join(format_rate(b) for b in bits), bits))
    return settings


def parse_systems(cfg: BenchConfig) -> list[System]:
    """The systems to run, validated: our plans (any plan text, or ``auto``) and the peers by name."""
    from ..plan import Plan, PlanError

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


def sync_interval(plan: str | None) -> int | None:
    """Steps between two fragment syncs of an outer-sync plan (H / F; H when F does not divide H), None without
    one. [Note: outer step time] A blocking sync lands in one step of H, so the median step hides it: an
    outer-sync row's step time is the mean over its timed steps, and each round must hold whole intervals for that
    mean to be the plan's."""
    from ..plan import Plan

    outer = Plan.parse(plan).outer if plan and plan != "auto" else None
    if outer is None:
        return None
    return outer.every // outer.fragments if outer.every % outer.fragments == 0 else outer.every


def check_config(cfg: BenchConfig) -> None:
    """Raise BenchError for settings that cannot run, before anything is launched."""
    ints = dict(nodes=cfg.nodes, ranks_per_node=cfg.ranks_per_node, rounds=cfg.rounds,
                steps_per_round=cfg.steps_per_round, warmup=cfg.warmup, batch_per_rank=cfg.batch_per_rank)
    for name, value in ints.items():
        if not isinstance(value, int) or value < 1:
            raise BenchError(f"{name.replace('_', '-')}={value!r} must be a positive integer (warm-up included: "
                             "peak memory is measured over the warm-up steps)")
    if cfg.nodes < 2:
        raise BenchError(f"nodes={cfg.nodes}: the bench compares node-crossing traffic, give at least 2 nodes")
    if cfg.tiers:
        from ..cluster.netns import ClusterError, check_tiers

        try:
            check_tiers(tuple(cfg.tiers), ("none",) * len(cfg.tiers))
        except ClusterError as err:
            raise BenchError(str(err)) from None
        if tuple(cfg.tiers[-2:]) != (cfg.ranks_per_node, cfg.world):
            raise BenchError(f"tiers {tuple(cfg.tiers)} do not match nodes={cfg.nodes} x ranks_per_node="
                             f"{cfg.ranks_per_node}: the last two tiers are (ranks_per_node, nodes x ranks_per_node)")
    if not cfg.accums or any(not isinstance(a, int) or a < 1 for a in cfg.accums):
        raise BenchError(f"accum {cfg.accums!r} must be positive integers, e.g. 1,4")
    if not cfg.local:
        if not cfg.rates:
            raise BenchError("no inter-node rates: give e.g. --rates 250mbit,1gbit,none")
        rate_settings(cfg)
    mc = model_config(cfg)
    if cfg.seq is not None and not 1 <= cfg.seq <= mc.block_size:
        raise BenchError(f"seq={cfg.seq} must be in 1..{mc.block_size} (the model's block size)")
    if cfg.allow_outer and not cfg.allow_lossy:
        raise BenchError("allow-outer lets auto pick outer-sync plans, which are lossy: add --allow-lossy")
    for system in parse_systems(cfg):
        interval = sync_interval(system.plan)
        if interval and cfg.steps_per_round % interval:
            raise BenchError(f"{system.label} syncs every {interval} steps, which {cfg.steps_per_round} steps per "
                             f"round do not hold whole ([Note: outer step time]): give --steps-per-round "
                             f"{interval * max(1, round(cfg.steps_per_round / interval))}")
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
