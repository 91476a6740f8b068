"""Cluster presets and the text forms of cluster numbers ("25GB/s", "100Gbps/node", "5us", "80GiB").

A preset is a function of the GPU count, so ``preset("dgx-a100", gpus=64)`` is 8 DGX nodes. Numbers with
their sources are in docs/cost-model.md. ``cluster_from_dict`` reads the ``[cluster]`` table that
``tiershard probe`` writes and that ``tiershard plan --cluster-file`` reads.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping

from ..topology import Topology
from .specs import Cluster, Tier

_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
# Case matters for rates: B is bytes, b is bits ("25GB/s" = 25e9 bytes/s, "200Gb/s" = "200Gbps" = 25e9 bytes/s).
_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_RATE = {f"{p}{u}": f * s for p, f in _PREFIX.items() for u, s in (("B/s", 1), ("b/s", 1 / 8), ("bps", 1 / 8))}
_TIME = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_FLOPS = {"": 1, "flops": 1, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ/]*)\s*$")


def _parse(text: object, units: Mapping[str, float], what: str, example: str, fold: bool = True) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    m = _NUMBER.match(str(text))
    unit = (m.group(2).lower() if fold else m.group(2)) if m else None
    if not m or unit not in units:
        raise ValueError(f"cannot read {what} {text!r}: write a number with a unit, e.g. {example}")
    return float(m.group(1)) * units[unit]


def parse_bytes(text: object) -> float:
    return _parse(text, _BYTES, "a size", "80GB or 64GiB")


def parse_seconds(text: object) -> float:
    return _parse(text, _TIME, "a latency", "5us or 0.01ms")


def parse_flops(text: object) -> float:
    return _parse(text, _FLOPS, "a flop rate", "312TFLOPS")


def parse_bandwidth(text: object, group: int = 1) -> float:
    """Bytes/s per rank. ``"100Gbps/node"`` is the total of a group of ``group`` ranks (a node's NICs), divided."""
    body, per_group = str(text), False
    if isinstance(text, str) and text.strip().lower().endswith(("/node", "/group")):
        body, per_group = text.strip().rsplit("/", 1)[0], True
    value = _parse(body if isinstance(text, str) else text, _RATE, "a bandwidth",
                   "25GB/s, 200Gbps, or 100Gbps/node for a node's total", fold=False)
    if value <= 0:
        raise ValueError(f"bandwidth {text!r} must be positive")
    return value / group if per_group else value


def _dgx_a100(gpus: int) -> Cluster:
    # 8 A100-80GB per node, NVLink 3 (300 GB/s per GPU per direction), 8 x 200 Gb/s HDR (one NIC per GPU).
    return Cluster.two_tier(gpus=gpus, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9, gpu_memory=80 * 2 ** 30,
                            peak_flops=312e12, intra_latency=3e-6, inter_latency=10e-6, name="dgx-a100")


def _v100_100g(gpus: int) -> Cluster:
    # ZeRO++'s cluster: 16 V100-32GB per node on NVSwitch (150 GB/s per GPU per direction), 100 Gb/s per node.
    return Cluster.two_tier(gpus=gpus, gpus_per_node=16, intra_bw=150e9, inter_bw=100e9 / 8 / 16,
                            gpu_memory=32 * 2 ** 30, peak_flops=125e12, intra_latency=3e-6,
                            inter_latency=10e-6, name="v100-100g")


def _frontier(gpus: int) -> Cluster:
    # 4 MI250X per node = 8 GCDs of 64 GB; GCD pair 200 GB/s, across MI250X 50 GB/s, 4 x 25 GB/s NICs per node.
    return Cluster(tiers=(Tier(name="pair", size=2, bandwidth=200e9, latency=3e-6),
                          Tier(name="node", size=8, bandwidth=50e9, latency=5e-6),
                          Tier(name="world", size=gpus, bandwidth=4 * 25e9 / 8, latency=10e-6)),
                   gpu_memory=64 * 2 ** 30, peak_flops=191.5e12, name="frontier")


PRESETS: dict[str, tuple[Callable[[int], Cluster], int]] = {
    "dgx-a100": (_dgx_a100, 64),
    "v100-100g": (_v100_100g, 384),
    "frontier": (_frontier, 384),
}


def preset(name: str, gpus: int | None = None) -> Cluster:
    """A named cluster with ``gpus`` devices (default: the size the papers used)."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster {name!r}: use one of {', '.join(PRESETS)}, or give --tiers / a file")
    make, default = PRESETS[name]
    return make(default if gpus is None else gpus)


def this_machine(topology: Topology) -> Cluster:
    """The cluster ``--plan auto`` assumes when nothing was probed: ``topology``'s tiers, 10 GB/s inside a node and
    1 GB/s between nodes, this device's memory (a GPU's, else an even share of RAM) and a round peak rate.

    The bandwidths are an assumption (emulated nodes share one machine): ``tiershard probe`` measures them."""
    import os

    import torch

    if torch.cuda.is_available():
        memory, flops = torch.cuda.get_device_properties(0).total_memory, 1e14
    else:
        memory, flops = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / topology.world_size, 5e10
    bandwidths = [10e9] * (len(topology.sizes) - 1) + [1e9]
    return Cluster(tiers=tuple(Tier(name=n, size=s, bandwidth=b)
                               for n, s, b in zip(topology.names, topology.sizes, bandwidths)),
                   gpu_memory=memory, peak_flops=flops, name="this machine")


def parse_tiers(text: str) -> tuple[Tier, ...]:
    """``"pair:2:200GB/s:3us,node:8:50GB/s,world:384:100GB/s/node"``: name:size:bandwidth[:latency], innermost first."""
    tiers, inner = [], 1
    for item in text.split(","):
        parts = [p.strip() for p in item.split(":")]
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError(f"tier {item!r} must be name:size:bandwidth[:latency], e.g. node:8:300GB/s:3us")
        try:
            size = int(parts[1])
        except ValueError:
            raise ValueError(f"tier {item!r}: size {parts[1]!r} is not an integer") from None
        tiers.append(Tier(name=parts[0], size=size, bandwidth=parse_bandwidth(parts[2], inner),
                          latency=parse_seconds(parts[3]) if len(parts) == 4 else 5e-6))
        inner = size
    return tuple(tiers)


# Keys of one [[cluster.tiers]] table; the all_to_all_* ones are what the probe measured, kept for reading.
TIER_KEYS = {"name", "size", "bandwidth", "latency", "all_to_all_bandwidth", "all_to_all_latency",
             "reduce_scatter_bandwidth", "reduce_scatter_latency", "all_reduce_bandwidth", "all_reduce_latency",
             "broadcast_bandwidth", "broadcast_latency"}


def cluster_from_dict(table: Mapping[str, object], base: Cluster | None = None) -> Cluster:
    """A cluster from a ``[cluster]`` TOML table: ``preset``, ``tiers`` (list of tables), ``gpu_memory``,
    ``peak_flops``, and what ``tiershard probe`` measures: ``codec_rate`` (bytes/s), ``codecs`` (per codec spec a
    table with ``rate``, bytes/s, and the ``encode`` / ``decode`` rates it came from), ``overlap`` (0..1); values
    may be numbers (SI) or strings with units."""
    table = dict(table)
    if "preset" in table:
        base = preset(str(table.pop("preset")), table.get("gpus"))
    tiers = base.tiers if base else None
    if "tiers" in table:
        raw = table.pop("tiers")
        if not isinstance(raw, list) or not raw:
            raise ValueError("cluster.tiers must be a list of tables with name, size, bandwidth, latency")
        tiers, inner = [], 1
        for t in raw:
            if not isinstance(t, Mapping) or not {"name", "size", "bandwidth"} <= t.keys():
                raise ValueError(f"cluster tier {t!r} needs name, size and bandwidth")
            extra = set(t) - TIER_KEYS
            if extra:
                raise ValueError(f"cluster tier {t['name']!r}: unknown keys {', '.join(sorted(extra))} "
                                 f"(known: {', '.join(sorted(TIER_KEYS))}; cluster-wide keys go before the tiers)")
            tiers.append(Tier(name=str(t["name"]), size=int(t["size"]), bandwidth=parse_bandwidth(t["bandwidth"], inner),
                              latency=parse_seconds(t.get("latency", 5e-6))))
            inner = int(t["size"])
    if not tiers:
        raise ValueError("the cluster needs tiers: give preset = '...' or [[cluster.tiers]] tables")
    memory = table.pop("gpu_memory", None)
    flops = table.pop("peak_flops", None)
    codec_rate = table.pop("codec_rate", base.codec_rate if base else None)
    codecs = table.pop("codecs", None)
    codec_rates = base.codec_rates if base else ()
    if codecs is not None:
        if not isinstance(codecs, Mapping) or not all(isinstance(v, Mapping) and "rate" in v for v in codecs.values()):
            raise ValueError("cluster.codecs must be tables [cluster.codecs.\"SPEC\"] with rate (bytes/s of values "
                             "encoded and decoded), as tiershard probe writes them")
        codec_rates = tuple((str(spec), parse_bandwidth(v["rate"])) for spec, v in codecs.items())
    overlap = table.pop("overlap", base.overlap if base else None)
    name = str(table.pop("name", base.name if base and tiers is base.tiers else "custom"))
    for ignored in ("gpus", "measured", "probe"):
        table.pop(ignored, None)
    if table:
        raise ValueError(f"unknown cluster keys: {', '.join(sorted(table))}")
    if memory is None and base is None:
        raise ValueError("the cluster needs gpu_memory (e.g. '80GB')")
    if flops is None and base is None:
        raise ValueError("the cluster needs peak_flops (e.g. '312TFLOPS')")
    return Cluster(tiers=tuple(tiers), name=name,
                   gpu_memory=parse_bytes(memory) if memory is not None else base.gpu_memory,
                   peak_flops=parse_flops(flops) if flops is not None else base.peak_flops,
                   codec_rate=parse_bandwidth(codec_rate) if codec_rate is not None else None,
                   overlap=float(overlap) if overlap is not None else None, codec_rates=codec_rates)
