"""The inputs of the cost model: a model, a cluster of tiers, and a training job.

Each is a frozen, keyword-only dataclass validated on construction, so a bad number fails where it is
written (``Tier(bandwidth=-1)``), with a message that says what to change, and never deep inside a formula.
Units are SI throughout: bytes, bytes per second, seconds, flop per second.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..topology import Topology, TopologyError

if TYPE_CHECKING:
    import torch


# name -> (params, layers, hidden, vocab); LLaMA shapes for 7b/13b/65b, GPT-NeoX for 20b, ZeRO++'s 18B GPT-2.
MODELS: dict[str, tuple[float, int, int, int]] = {
    "1.3b": (1.32e9, 24, 2048, 50257),
    "7b": (6.74e9, 32, 4096, 32000),
    "13b": (13.0e9, 40, 5120, 32000),
    "18b": (18.4e9, 40, 6144, 50257),
    "20b": (20.6e9, 44, 6144, 50432),
    "30b": (32.5e9, 60, 6656, 32000),
    "65b": (65.2e9, 80, 8192, 32000),
    "70b": (70.0e9, 80, 8192, 32000),
}

# config.json model_type values ModelSpec.from_hf_config counts (the LLaMA shape or the GPT-2 shape).
HF_MODEL_TYPES = ("gpt2", "llama", "mistral")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a model's training cost depends on.

    ``params``: all parameters (Ψ); ``trainable``: those with gradients (Ψ', default all); ``layers`` and
    ``hidden`` size the repeated blocks (one sharded unit each) and the activations; ``vocab`` sizes the
    embedding/head unit and the logits. ``units``, when known (``from_module``), lists each sharded unit's
    (trainable, frozen) parameter counts exactly as ``ts.shard`` would cut them; otherwise the units are
    ``layers`` equal blocks plus an embedding/head unit, trainable in proportion.
    """

    params: int
    layers: int
    hidden: int
    trainable: int | None = None
    vocab: int = 32000
    name: str = ""
    units: tuple[tuple[int, int], ...] = ()
    param_shapes: tuple = ()   # per unit: (trainable shapes, frozen shapes, is the root), when known (``from_module``)

    def __post_init__(self) -> None:
        _positive_int(self, "params", "layers", "hidden", "vocab")
        trainable = self.params if self.trainable is None else self.trainable
        if not isinstance(trainable, int) or isinstance(trainable, bool) or not 0 < trainable <= self.params:
            raise ValueError(f"trainable={self.trainable!r} must be an integer in 1..params ({self.params}): "
                             "the number of parameters that get gradients")
        object.__setattr__(self, "trainable", trainable)
        units = tuple((int(t), int(f)) for t, f in self.units)
        if units and (sum(t for t, _ in units) != trainable or sum(t + f for t, f in units) != self.params):
            raise ValueError(f"units {units} do not add up to params={self.params}, trainable={trainable}")
        object.__setattr__(self, "units", units)

    @property
    def trainable_fraction(self) -> float:
        return self.trainable / self.params

    @property
    def label(self) -> str:
        return self.name or f"{self.params / 1e9:.3g}B"

    def root_params(self) -> int:
        """Parameters outside the repeated blocks (embedding and head): their own unit."""
        return min(2 * self.vocab * self.hidden, self.params // 2)

    def layer_params(self) -> int:
        return (self.params - self.root_params()) // self.layers

    def unit_sizes(self) -> list[tuple[int, int, int]]:
        """(trainable, frozen, how many units) per distinct unit shape."""
        if self.units:
            counts: dict[tuple[int, int], int] = {}
            for unit in self.units:
                counts[unit] = counts.get(unit, 0) + 1
            return [(t, f, n) for (t, f), n in counts.items()]
        out = []
        for numel, n in ((self.layer_params(), self.layers), (self.root_params(), 1)):
            trainable = round(numel * self.trainable_fraction)
            if numel:
                out.append((trainable, numel - trainable, n))
        return out

    def unit_param_shapes(self) -> list[tuple[tuple, tuple, int, bool]]:
        """(trainable parameter shapes, frozen parameter shapes, how many units, is the root) per distinct
        unit; without exact shapes each group counts as one flat parameter and the embedding/head unit is the
        root."""
        counts: dict[tuple, int] = {}
        if self.param_shapes:
            for key in self.param_shapes:
                counts[key] = counts.get(key, 0) + 1
        else:
            sizes = self.unit_sizes()
            for i, (trainable, frozen, n) in enumerate(sizes):
                key = (((trainable,),) if trainable else (), ((frozen,),) if frozen else (), i == len(sizes) - 1)
                counts[key] = counts.get(key, 0) + n
        return [(t, f, n, root) for (t, f, root), n in counts.items()]

    def with_trainable(self, fraction: float) -> "ModelSpec":
        if not 0 < fraction <= 1:
            raise ValueError(f"trainable fraction {fraction!r} must be in (0, 1], e.g. 1 for full training, 0.003 for LoRA")
        return replace(self, trainable=max(1, round(self.params * fraction)), units=(), param_shapes=())

    @classmethod
    def named(cls, name: str) -> "ModelSpec":
        key = name.strip().lower()
        if key not in MODELS:
            raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)} or a parameter count like 1.3e9")
        params, layers, hidden, vocab = MODELS[key]
        return cls(params=int(params), layers=layers, hidden=hidden, vocab=vocab, name=key.upper())

    @classmethod
    def from_params(cls, params: float, *, layers: int | None = None, hidden: int | None = None,
                    vocab: int = 32000) -> "ModelSpec":
        """A GPT-shaped model of ``params`` parameters: Ψ ≈ 12·L·h² with h ≈ 128·L unless given."""
        if not params > 0 or not math.isfinite(params):
            raise ValueError(f"model size {params!r} must be a positive number of parameters, e.g. 1.3e9")
        if layers is None and hidden is None:
            layers = max(1, round((params / (12 * 128 ** 2)) ** (1 / 3)))
        if hidden is None:
            hidden = max(64, 64 * round(math.sqrt(params / (12 * layers)) / 64))
        if layers is None:
            layers = max(1, round(params / (12 * hidden ** 2)))
        return cls(params=int(params), layers=int(layers), hidden=int(hidden), vocab=vocab)

    @classmethod
    def from_hf_config(cls, config: "dict | str | os.PathLike") -> "ModelSpec":
        """A model from a Hugging Face ``config.json`` (a path or its dict), counted without transformers.

        Parameters, units and shapes are those ``AutoModelForCausalLM.from_config`` builds and ``ts.shard`` cuts
        (one unit per decoder block, the root holding embeddings, final norm and an untied head), so planning a
        70B model needs neither its weights nor its memory. Supported: ``HF_MODEL_TYPES``."""
        source = "config"
        if not isinstance(config, dict):
            source = str(config)
            try:
                config = json.loads(Path(config).read_text())
            except OSError as err:
                raise ValueError(f"cannot read {source}: {err.strerror}") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"{source} is not valid JSON: {err}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{source} holds a {type(config).__name__}, not a config object")
        kind = config.get("model_type")
        supported = ", ".join(sorted(HF_MODEL_TYPES))
        if kind not in HF_MODEL_TYPES:
            what = f"unknown model_type {kind!r}" if kind else "no model_type"
            raise ValueError(f"{source}: {what}; supported: {supported} (or give --model / a ModelSpec)")

        def need(key: str) -> int:
            if key not in config:
                raise ValueError(f"{source}: missing {key!r}, which a {kind} config needs to count its parameters")
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
            return value

        vocab = need("vocab_size")
        if kind == "gpt2":
            h, layers, heads, positions = need("n_embd"), need("n_layer"), need("n_head"), need("n_positions")
            if h % heads:
                raise ValueError(f"{source}: n_embd={h} is not divisible by n_head={heads}")
            inner = config.get("n_inner") or 4 * h
            tied = config.get("tie_word_embeddings", True)
            root = [(vocab, h), (positions, h), (h,), (h,)] + ([] if tied else [(vocab, h)])
            block = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, inner), (inner,), (inner, h), (h,)]
        else:   # llama-shaped: llama, mistral
            h, inter, layers, heads = (need(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads"))
            kv = config.get("num_key_value_heads") or heads
            head_dim = config.get("head_dim") or h // heads
            if not config.get("head_dim") and h % heads:
                raise ValueError(f"{source}: hidden_size={h} is not divisible by num_attention_heads={heads}")
            if not isinstance(kv, int) or kv < 1 or heads % kv:
                raise ValueError(f"{source}: num_key_value_heads={kv!r} must divide num_attention_heads={heads}")
            tied = config.get("tie_word_embeddings", False)
            qkv_bias = bool(config.get("attention_bias", False))
            mlp_bias = bool(config.get("mlp_bias", False))
            q, k = heads * head_dim, kv * head_dim
            attn = [(q, h)] + [(q,)] * qkv_bias + [(k, h)] + [(k,)] * qkv_bias + [(k, h)] + [(k,)] * qkv_bias + \
                [(h, q)] + [(h,)] * qkv_bias
            mlp = [(inter, h)] + [(inter,)] * mlp_bias + [(inter, h)] + [(inter,)] * mlp_bias + [(h, inter)] + \
                [(h,)] * mlp_bias
            block = attn + mlp + [(h,), (h,)]
            root = [(vocab, h), (h,)] + ([] if tied else [(vocab, h)])
        units = [tuple(root)] + [tuple(block)] * layers
        counts = tuple((sum(math.prod(s) for s in shapes), 0) for shapes in units)
        names = config.get("architectures") or [kind]
        return cls(params=sum(t for t, _ in counts), layers=layers, hidden=h, vocab=vocab, name=str(names[0]),
                   units=counts, param_shapes=tuple((shapes, (), i == 0) for i, shapes in enumerate(units)))

    @classmethod
    def from_module(cls, module: "torch.nn.Module", *, wrap=None, layers: int | None = None,
                    hidden: int | None = None, vocab: int | None = None) -> "ModelSpec":
        """Count a module's parameters, cut into units as ``ts.shard(module, ..., wrap=wrap)`` cuts them
        (``wrap=None``: ts.shard's default, a ``transformers`` model's ``_no_split_modules``).

        Layers default to the longest ModuleList (for activations), hidden to the widest embedding.
        """
        import torch.nn as nn

        from ..runtime.wrap import find_units

        units, shapes = [], []
        for index, unit in enumerate(find_units(module, wrap)):
            sizes = {True: 0, False: 0}
            groups: dict[bool, list] = {True: [], False: []}
            for param, _, _ in unit.params:
                sizes[param.requires_grad] += param.numel()
                groups[param.requires_grad].append(tuple(param.shape))
            if sizes[True] or sizes[False]:
                units.append((sizes[True], sizes[False]))
                shapes.append((tuple(groups[True]), tuple(groups[False]), index == 0))
        params = sum(t + f for t, f in units)
        trainable = sum(t for t, _ in units)
        if params == 0 or trainable == 0:
            raise ValueError("the module has no (trainable) parameters to plan for")
        lists = [len(m) for m in module.modules() if isinstance(m, nn.ModuleList)]
        embeds = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        if hidden is None:
            hidden = max((e.embedding_dim for e in embeds), default=0) or \
                max((lin.in_features for lin in linears), default=1)
        if vocab is None:
            vocab = max((e.num_embeddings for e in embeds), default=1)
        return cls(params=params, trainable=trainable, layers=layers or max(lists, default=1),
                   hidden=hidden, vocab=vocab, name=type(module).__name__, units=tuple(units),
                   param_shapes=tuple(shapes))


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One tier of the network: ``size`` ranks per group (cumulative, like ``Topology.sizes``).

    ``bandwidth`` is what one rank can send over this tier's links while all ranks do (bytes/s per rank: a node's
    NIC bandwidth divided by its GPUs for the inter-node tier); ``latency`` is the cost of one collective step
    over the tier, in seconds.
    """

    name: str
    size: int
    bandwidth: float
    latency: float = 5e-6

    def __post_init__(self) -> None:
        _positive_int(self, "size")
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"tier {self.name!r}: bandwidth {self.bandwidth!r} must be a positive number of "
                             "bytes/s, e.g. 25e9 (25 GB/s)")
        if not (isinstance(self.latency, (int, float)) and self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"tier {self.name!r}: latency {self.latency!r} must be a non-negative number of "
                             "seconds, e.g. 5e-6")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Tiers (innermost first, the last one the world), device memory and peak flops per device.

    Measured by ``tiershard probe`` when known: ``codec_rate``, bytes of values per second one rank quantizes
    and dequantizes (qwZ/qgZ compute; None leaves it out); ``codec_rates``, the same per codec, as
    ``((spec, bytes/s), ...)`` (``BlockCodec.spec``: ``"int8:128:h"``), each measured at the plan's message sizes
    and used for its codec before ``codec_rate``; ``overlap``, the fraction of compute that the engine's
    communication stream actually hides communication behind (None: the job's assumption).
    """

    tiers: tuple[Tier, ...]
    gpu_memory: float
    peak_flops: float
    name: str = ""
    codec_rate: float | None = None
    overlap: float | None = None
    codec_rates: tuple[tuple[str, float], ...] = ()
    topology: Topology = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tiers = tuple(self.tiers)
        object.__setattr__(self, "tiers", tiers)
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ValueError("a cluster needs at least one Tier, innermost first, the last one spanning all GPUs")
        try:
            topology = Topology([t.size for t in tiers], [t.name for t in tiers])
        except TopologyError as err:
            raise ValueError(f"cluster tiers: {err}") from None
        object.__setattr__(self, "topology", topology)
        for name in ("gpu_memory", "peak_flops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be a positive number ({'bytes' if name == 'gpu_memory' else 'flop/s'})")
        if self.codec_rate is not None and not (isinstance(self.codec_rate, (int, float)) and self.codec_rate > 0):
            raise ValueError(f"codec_rate={self.codec_rate!r} must be a positive number of bytes/s, or None")
        if self.overlap is not None and not (isinstance(self.overlap, (int, float)) and 0 <= self.overlap <= 1):
            raise ValueError(f"overlap={self.overlap!r} must be in [0, 1], or None")
        rates = tuple(sorted(dict(self.codec_rates).items()))
        for spec, rate in rates:
            if not (isinstance(spec, str) and isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
                raise ValueError(f"codec_rates entry {spec!r}: {rate!r} must be a codec spec and a positive number of "
                                 "bytes/s, e.g. ('int8:128:h', 2.5e9)")
        object.__setattr__(self, "codec_rates", rates)

    def codec_seconds(self, spec: str, nbytes: float) -> float:
        """Seconds one rank spends encoding and decoding ``nbytes`` bytes of values in codec ``spec``: its measured
        rate (``codec_rates``), else the one ``codec_rate``, else 0 (codecs free, as in the papers' accounting)."""
        if not nbytes:
            return 0.0
        rate = dict(self.codec_rates).get(spec) or self.codec_rate
        return nbytes / rate if rate else 0.0

    @classmethod
    def two_tier(cls, *, gpus: int, gpus_per_node: int, intra_bw: float, inter_bw: float,
                 gpu_memory: float, peak_flops: float, intra_latency: float = 3e-6,
                 inter_latency: float = 10e-6, name: str = "") -> "Cluster":
        """Nodes of ``gpus_per_node`` GPUs; ``inter_bw`` per GPU (a node's NICs divided by its GPUs)."""
        _check_gpus(gpus, gpus_per_node)
        return cls(tiers=(Tier(name="node", size=gpus_per_node, bandwidth=intra_bw, latency=intra_latency),
                          Tier(name="world", size=gpus, bandwidth=inter_bw, latency=inter_latency)),
                   gpu_memory=gpu_memory, peak_flops=peak_flops, name=name)

    @property
    def world_size(self) -> int:
        return self.tiers[-1].size

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    def resized(self, gpus: int | None = None, gpus_per_node: int | None = None) -> "Cluster":
        """The same tiers with a new world size and/or node size (the tier just below world)."""
        sizes = [t.size for t in self.tiers]
        if gpus_per_node is not None:
            if len(sizes) < 2:
                raise ValueError("gpus-per-node needs a cluster with a node tier below world")
            sizes[-2] = gpus_per_node
        if gpus is not None:
            sizes[-1] = gpus
        if len(sizes) >= 2:
            _check_gpus(sizes[-1], sizes[-2])
        return replace(self, tiers=tuple(replace(t, size=s) for t, s in zip(self.tiers, sizes)))


@dataclass(frozen=True, kw_only=True)
class Job:
    """How the model is trained on each device, per optimizer step.

    ``accum``: micro-steps per optimizer step; ``param_bytes``/``reduce_bytes``: working precision of weights and
    of gradient reduction on the wire (2 = bf16); ``grad_bytes``: per accumulated gradient element (2 in the papers'
    accounting; tiershard's engine accumulates in fp32, 4); ``optimizer_bytes``: fp32 master + Adam m, v per trainable
    parameter; ``efficiency``: achieved fraction of peak flops in compute; ``overlap``: fraction of compute time
    that per-micro-step communication can hide behind; ``recompute``: activation checkpointing (one more forward,
    only layer inputs kept); ``memory_reserve``: fraction of device memory kept for the framework and fragmentation.
    """

    micro_batch: int = 1
    seq: int = 2048
    accum: int = 1
    param_bytes: int = 2
    reduce_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    efficiency: float = 0.5
    overlap: float = 0.8
    recompute: bool = True
    memory_reserve: float = 0.1

    def __post_init__(self) -> None:
        _positive_int(self, "micro_batch", "seq", "accum", "param_bytes", "reduce_bytes", "grad_bytes",
                      "optimizer_bytes")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency={self.efficiency!r} must be in (0, 1]: the achieved fraction of peak flops")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r} must be in [0, 1]: the fraction of compute that hides "
                             "per-micro-step communication")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory_reserve={self.memory_reserve!r} must be in [0, 1)")

    @property
    def tokens(self) -> int:
        """Tokens per device per micro-step."""
        return self.micro_batch * self.seq


def _positive_int(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(obj).__name__}.{name}={value!r} must be a positive integer")


def _check_gpus(gpus: int, per_node: int) -> None:
    if not isinstance(gpus, int) or not isinstance(per_node, int) or gpus < 1 or per_node < 1:
        raise ValueError(f"gpus={gpus!r} and gpus-per-node={per_node!r} must be positive integers")
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs are not divisible by {per_node} GPUs per node: "
                         f"use a multiple, e.g. {per_node * max(1, gpus // per_node)}")


