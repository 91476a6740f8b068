"""Plans: where each model state lives (PaRO's p / g / os levels) and the options on top (ZeRO++, PaRO-CC).

A plan is policy only. It names levels by letter (``N`` replicated, ``I`` the tier below world, ``G`` world) or by
tier name; ``resolve`` turns it into level indices for one topology and rejects what cannot fit it.

Text forms, all round-tripping through ``str``::

    "IIG"  "zero3"  "GGG+hpz+qwz+qgz"  "p=pair,g=node,os=world+hpz=pair/node"  "NIG+qgz=int4+ef"  "IIG+qgz=8/4"

[Note: qgz specs] ``qgz`` names one codec per tier, innermost first, joined by ``/``: ``int8`` or ``int4`` (or
``8``, ``4``), an optional ``:BLOCK``, then the flags (each at most once) ``:h`` (Walsh-Hadamard rotation) and
``:sr`` (stochastic rounding). One entry serves every tier; with k entries the last is the outermost tier and
the first repeats for the inner tiers not named (``8/4`` on pair, node, world is 8, 8, 4). Bare ``qgz`` is
``QGZ_DEFAULT``: int8 where links are fast, int4 only on the outermost tier, both rotated, the int4 hop rounded
stochastically (on a one-tier topology, its outermost entry). Round to nearest on that hop cost 1.6% of
validation loss at 600 steps; stochastic rounding, which sends the same bytes, did not (docs/zeropp.md).
This module checks the grammar with one regex (plans sit below ``comm``); the codec layer's ``hop_codecs`` is
the parser at run time, and a test keeps the two in agreement.

[Note: outer sync] ``+outer=H`` makes the outermost tier's groups *islands* (DiLoCo): inside an island training
runs the plan's placement with every level capped at the tier below world (``I``), so nothing crosses the slowest
tier at an optimizer step; every ``H`` steps the islands average their parameter change since the last sync and
take an outer Nesterov SGD step on it (runtime/outer.py). Its options follow ``H``, joined by ``:``, any order,
each at most once: ``fF`` streams the sync in ``F`` fragments of consecutive units, each at its own offset within
the ``H`` steps (``1 <= F <= H``); ``lrX`` the outer learning rate (default 0.7), ``mX`` its Nesterov momentum
(default 0.9, ``m0`` plain SGD); ``wN`` a warm-up of ``N`` step-synchronous steps first (the islands' gradients
averaged every step, as without the option; the periods count from its end); a codec (``int8`` or ``int4``, then
``:BLOCK``, ``:h``, ``:sr`` as in qgz) for the outer gradient, last. ``IIG+outer=100:f4:int4:128:h``. It is lossy:
islands drift apart between syncs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .topology import Topology

LETTERS = ("N", "I", "G")
PRESETS = {
    "ddp": "NNN",
    "zero1": "NNG",
    "zero2": "NGG",
    "zero3": "GGG",
    "fsdp": "GGG",
    "hsdp": "III",
    "zero++": "GGG+hpz+qwd+qgz",
}
QWZ_CODECS = ("int8",)
QGZ_CODECS = ("int4", "int8")
QGZ_DEFAULT = "int8:128:h/int4:128:h:sr"   # bare ``qgz`` ([Note: qgz specs])
QWD_CODECS = ("int4", "int8")
QWD_DEFAULT = "int4:2048"                  # bare ``qwd``: SDP4Bit's weight differences
_HOP = r"(?:int)?(?:8|4)(?::[1-9][0-9]*)?(?::h(?::sr)?|:sr(?::h)?)?"
_QGZ_SPEC = re.compile(rf"{_HOP}(?:/{_HOP})*")
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9        # DiLoCo's outer Nesterov SGD


class PlanError(ValueError):
    """A plan that is malformed, or cannot fit the topology; the message names the fix."""


# [Note: the planner behind Plan.auto] Choosing a plan is the cost model's job (cost/planner.py), and the cost model
# sits above plans: it imports them, so this module cannot import it (docs/layout.md). ``Plan.auto`` is declared
# here, with the class, and calls the one planner that ``tiershard.cost.planner`` hands over when it is imported
# (``use_planner(auto_plan)``); the package's facade imports the cost model, so any ``import tiershard...`` has
# done so before a caller can reach ``Plan.auto``.
_PLANNER: "Callable[..., Plan] | None" = None


def use_planner(planner: "Callable[..., Plan]") -> None:
    """Make ``planner`` (``tiershard.cost.auto_plan``) the function behind ``Plan.auto``."""
    global _PLANNER
    _PLANNER = planner


def _planner() -> "Callable[..., Plan]":
    if _PLANNER is None:        # only reachable by loading this file outside the package
        raise RuntimeError("Plan.auto needs the cost model: import tiershard.cost (the package import does)")
    return _PLANNER


@dataclass(frozen=True)
class OuterSpec:
    """The outer sync of ``+outer=H`` ([Note: outer sync]): period, fragments, outer optimizer, outer-gradient codec."""

    every: int
    fragments: int = 1
    lr: float = OUTER_LR
    momentum: float = OUTER_MOMENTUM
    codec: str | None = None
    warmup: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise PlanError(f"outer={self.every!r}: the period must be a positive whole number of steps, e.g. outer=100")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or \
                not 1 <= self.fragments <= self.every:
            raise PlanError(f"outer={self.every}:f{self.fragments}: the fragments must number 1 to the period "
                            f"{self.every} (each syncs at its own step of the period), e.g. outer={self.every}:f1")
        if not self.lr > 0:
            raise PlanError(f"outer lr {self.lr} must be positive, e.g. outer={self.every}:lr0.7")
        if not 0 <= self.momentum < 1:
            raise PlanError(f"outer momentum {self.momentum} must be in [0, 1), e.g. outer={self.every}:m0.9")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise PlanError(f"outer={self.every}:w{self.warmup}: the warm-up is a whole number of steps, 0 or more, "
                            f"e.g. outer={self.every}:w500")
        if self.codec is not None and not re.fullmatch(_HOP, self.codec):
            raise PlanError(f"unknown outer codec {self.codec!r}: int8 or int4, then an optional :BLOCK, :h and :sr "
                            f"as in qgz, e.g. outer={self.every}:int4:128:h")

    @classmethod
    def parse(cls, text: str) -> "OuterSpec":
        """``H[:fF][:lrX][:mX][:wN][:CODEC]`` ([Note: outer sync])."""
        head, *tokens = text.split(":")
        if not head.isdigit():
            raise PlanError(f"outer={text!r}: give the period in steps first, e.g. outer=100 or outer=100:f4:int4")
        fields: dict = {}
        for i, token in enumerate(tokens):
            if re.fullmatch(r"(?:int)?[48]", token):
                fields["codec"] = ":".join(tokens[i:])
                break
            match = re.fullmatch(r"(f|lr|m|w)([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)", token)
            if match is None:
                raise PlanError(f"unknown outer option {token!r} in outer={text}: use fF (fragments), lrX, mX, "
                                "wN (warm-up steps), then a codec such as int4:128:h, "
                                "e.g. outer=100:f4:lr0.7:m0.9:w500:int4")
            key = {"f": "fragments", "lr": "lr", "m": "momentum", "w": "warmup"}[match.group(1)]
            if key in fields:
                raise PlanError(f"outer option {match.group(1)} given twice in outer={text}")
            fields[key] = int(match.group(2)) if key in ("fragments", "warmup") and match.group(2).isdigit() else \
                float(match.group(2))
        if isinstance(fields.get("fragments"), float):
            raise PlanError(f"outer={text}: fragments must be a whole number, e.g. f4")
        if isinstance(fields.get("warmup"), float):
            raise PlanError(f"outer={text}: the warm-up must be a whole number of steps, e.g. w500")
        return cls(int(head), **fields)

    def __str__(self) -> str:
        parts = [str(self.every)] + ([f"f{self.fragments}"] if self.fragments != 1 else []) + \
            ([f"lr{self.lr:g}"] if self.lr != OUTER_LR else []) + \
            ([f"m{self.momentum:g}"] if self.momentum != OUTER_MOMENTUM else []) + \
            ([f"w{self.warmup}"] if self.warmup else []) + ([self.codec] if self.codec else [])
        return ":".join(parts)

    def offset(self, fragment: int) -> int:
        """The step of the period (0 .. H-1, counted after the optimizer step) at which ``fragment`` syncs: fragment
        ``F-1`` at the period's end, the others evenly before it."""
        return (fragment + 1) * self.every // self.fragments % self.every


@dataclass(frozen=True)
class Plan:
    """Levels for parameters, gradients and optimizer states, plus options.

    ``hpz``: levels (finer groups than ``p``) that keep a cached weight shard after a gather, innermost last used.
    ``qwz``: codec for parameter all-gathers, ``"int8"`` or ``"int8:BLOCK"``.
    ``qwd``: codec for parameter all-gathers that send differences against the outermost hpz band
    (``"int4:2048"``; [Note: weight differences] in comm/weight_diff.py); needs hpz, excludes qwz.
    ``qgz``: codecs for gradient reduction, one per tier ([Note: qgz specs]), e.g. ``"int4"``, ``"8/4"``,
    ``"int8:128:h/int4:128:h"``, with ``"+ef"`` for error feedback.
    ``cc``: run global collectives hierarchically (intra then inter phases).
    ``outer``: DiLoCo's outer sync over the outermost tier ([Note: outer sync]), an ``OuterSpec`` or its text.
    """

    p: str = "G"
    g: str = "G"
    os: str = "G"
    hpz: tuple[str, ...] = ()
    qwz: str | None = None
    qgz: str | None = None
    cc: bool = False
    qwd: str | None = None
    outer: OuterSpec | None = None

    def __post_init__(self) -> None:
        for name in ("p", "g", "os"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or any(c in value for c in "+,=/ "):
                raise PlanError(f"{name}={value!r} is not a level: use N, I, G or a tier name")
        if isinstance(self.hpz, str):
            object.__setattr__(self, "hpz", tuple(self.hpz.split("/")))
        if self.qwz is not None:
            _check_codec("qwz", self.qwz, QWZ_CODECS, allow_ef=False)
        if self.qwd is not None:
            _check_codec("qwd", self.qwd, QWD_CODECS, allow_ef=False)
        if self.qgz is not None:
            _check_codec("qgz", self.qgz, QGZ_CODECS, allow_ef=True)
        if isinstance(self.outer, (str, int)) and not isinstance(self.outer, bool):
            object.__setattr__(self, "outer", OuterSpec.parse(str(self.outer)))
        elif self.outer is not None and not isinstance(self.outer, OuterSpec):
            raise PlanError(f"outer={self.outer!r}: give a period like outer=100 ([Note: outer sync])")

    # ---- the cost model's pick -----------------------------------------------------------------
    @staticmethod
    def auto(model: object, cluster: object, job: object = None, **options: object) -> "Plan":
        """The fastest exact plan that fits ``model`` on ``cluster`` (lossy ones too with ``allow_lossy=True``), as the
        cost model predicts: ``tiershard.cost.auto_plan(model, cluster, job, **options)``, which documents the
        arguments ([Note: the planner behind Plan.auto]). Raises ``tiershard.cost.NoPlanFits``."""
        return _planner()(model, cluster, job, **options)

    # ---- text ---------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Plan":
        """Parse a preset, a PaRO code with ``+`` options, or the ``p=..,g=..,os=..`` form."""
        if not isinstance(text, str) or not text.strip():
            raise PlanError("empty plan: give a preset (ddp, zero1, zero2, zero3, hsdp, zero++) or a code like IIG")
        text = text.strip()
        if text.lower() in PRESETS:
            return cls.parse(PRESETS[text.lower()])
        base, *mods = text.split("+")
        if base.lower() in PRESETS:
            expanded = cls.parse(PRESETS[base.lower()])
            base = f"{expanded.p}{expanded.g}{expanded.os}"
            mods = [m for m in _option_tokens(expanded)] + mods
        fields: dict = {}
        if "=" in base or "," in base:
            for item in base.split(","):
                key, _, value = item.partition("=")
                key, value = key.strip(), value.strip()
                if key not in ("p", "g", "os") or not value:
                    raise PlanError(f"bad plan field {item!r} in {text!r}: expected p=LEVEL,g=LEVEL,os=LEVEL")
                if key in fields:
                    raise PlanError(f"{key} given twice in {text!r}")
                fields[key] = value
            missing = {"p", "g", "os"} - fields.keys()
            if missing:
                raise PlanError(f"plan {text!r} lacks {', '.join(sorted(missing))}: give all of p=, g=, os=")
        elif len(base) == 3 and all(c in LETTERS for c in base.upper()):
            fields = dict(zip(("p", "g", "os"), base.upper()))
        else:
            raise PlanError(
                f"unknown plan {base!r}: use a preset ({', '.join(PRESETS)}), a three-letter PaRO code of "
                "N/I/G such as IIG, or p=LEVEL,g=LEVEL,os=LEVEL")
        options: dict = {}
        for token in mods:
            key, _, value = token.partition("=")
            key = key.strip()
            if key == "ef":
                if "qgz" not in options:
                    raise PlanError(f"'+ef' in {text!r} must follow qgz, as in GGG+qgz=int4+ef")
                if options["qgz"].endswith("+ef"):
                    raise PlanError(f"'+ef' given twice in {text!r}: give it once, as in GGG+qgz=int4+ef")
                options["qgz"] += "+ef"
                continue
            if key in options:
                raise PlanError(f"option {key} given twice in {text!r}")
            if key == "hpz":
                options["hpz"] = tuple(value.split("/")) if value else ("I",)
            elif key == "qwz":
                options["qwz"] = value or "int8"
            elif key == "qwd":
                options["qwd"] = value or QWD_DEFAULT
            elif key == "qgz":
                options["qgz"] = value or QGZ_DEFAULT
            elif key == "outer":
                if not value:
                    raise PlanError(f"outer needs its period in {text!r}: e.g. IIG+outer=100")
                options["outer"] = OuterSpec.parse(value)
            elif key == "cc":
                if value:
                    raise PlanError(f"cc takes no value in {text!r}")
                options["cc"] = True
            else:
                raise PlanError(f"unknown plan option {key!r} in {text!r}: known options are hpz, qwz, qwd, qgz, cc, outer")
        return cls(**fields, **options)

    def __str__(self) -> str:
        levels = (self.p, self.g, self.os)
        base = "".join(levels) if all(level in LETTERS for level in levels) else \
            f"p={self.p},g={self.g},os={self.os}"
        return "+".join([base, *_option_tokens(self)])

    def with_options(self, **changes) -> "Plan":
        return replace(self, **changes)

    # ---- quality ------------------------------------------------------------------------------
    @property
    def lossy(self) -> bool:
        """Whether the plan quantizes anything (qwz / qwd weights or qgz gradients) or syncs islands only every H
        steps (outer): its training differs from exact."""
        return bool(self.qwz or self.qwd or self.qgz or self.outer)

    @property
    def error_feedback(self) -> bool:
        return bool(self.qgz and self.qgz.endswith("+ef"))

    def qgz_hops(self, tiers: int) -> tuple[str, ...]:
        """The qgz codec spec of each of ``tiers`` tiers, innermost first ([Note: qgz specs]); () without qgz."""
        if not self.qgz:
            return ()
        body = self.qgz.removesuffix("+ef")
        entries = body.split("/")
        if body == QGZ_DEFAULT and len(entries) > tiers:
            entries = entries[-tiers:]
        if len(entries) > tiers:
            raise PlanError(f"qgz={body} names {len(entries)} codecs but the topology has {tiers} tier(s): "
                            f"give at most {tiers}, innermost first, the last for the outermost tier")
        return tuple([entries[0]] * (tiers - len(entries)) + entries)

    def quality(self, topology: "Topology | None" = None) -> str:
        """``'exact'``, or ``'lossy: '`` and the bits of what is quantized, per tier when ``topology`` is given:
        e.g. ``'lossy: weights int8, gradients int8 (node) / int4 (world)'``."""
        return self.resolve(topology).quality if topology is not None else \
            _quality(self.qwz, self.qgz and self.qgz.removesuffix("+ef"), qwd=self.qwd, outer=self.outer)

    # ---- topology -----------------------------------------------------------------------------
    def resolve(self, topology: "Topology") -> "Placement":
        """Level indices for ``topology``; raises PlanError when the plan cannot fit it."""
        from .topology import TopologyError

        def level(name: str, what: str) -> int:
            try:
                return topology.level_of(name)
            except TopologyError as err:
                raise PlanError(f"{what}: {err}") from None

        p, g, os_ = level(self.p, "p"), level(self.g, "g"), level(self.os, "os")
        if self.outer is not None:         # islands: every level stays inside the tier below world
            if len(topology.sizes) < 2:
                raise PlanError(f"outer syncs islands, the groups of the tier below world, but {topology} has one "
                                "tier: declare two, e.g. Topology((ranks_per_island, world))")
            top = len(topology.sizes) - 1
            p, g, os_ = min(p, top), min(g, top), min(os_, top)
        hpz = tuple(level(h, "hpz") for h in self.hpz)
        for name, lvl in zip(self.hpz, hpz):
            if not 0 < lvl < p:
                raise PlanError(
                    f"hpz level {name!r} must be a tier strictly inside p={self.p!r} "
                    f"(a smaller group than {topology.level_name(p)!r}); e.g. GGG+hpz=I")
        if len(set(hpz)) != len(hpz):
            raise PlanError(f"hpz names a level twice: {self.hpz}")
        if self.qwz and p == 0:
            raise PlanError(f"qwz quantizes parameter gathers, but p={self.p} is replicated and never gathered: "
                            "shard p (e.g. GGG+qwz) or drop qwz")
        if self.qwd and self.qwz:
            raise PlanError("qwd and qwz both quantize the parameter gathers: keep one (qwd sends 4-bit differences "
                            "against the hpz band, qwz int8 values), e.g. GGG+hpz+qwd")
        if self.qwd and (p == 0 or not hpz):
            raise PlanError(f"qwd sends weight differences against the hpz band every rank of a node holds, but "
                            f"{'p is replicated' if p == 0 else 'the plan has no hpz'}: use e.g. GGG+hpz+qwd")
        if self.qgz and g == 0 and os_ == 0:
            raise PlanError("qgz quantizes gradient reduction, but g and os are both N (plain all-reduce): "
                            "use a plan that reduce-scatters, e.g. NIG+qgz")
        self.qgz_hops(len(topology.sizes))
        return Placement(self, topology, p, g, os_, tuple(sorted(hpz)))


@dataclass(frozen=True)
class Placement:
    """A plan resolved against one topology: level indices (0 = N .. len(sizes) = world)."""

    plan: Plan
    topology: "Topology" = field(repr=False)
    p: int
    g: int
    os: int
    hpz: tuple[int, ...] = ()

    def size(self, level: int) -> int:
        return self.topology.level_size(level)

    @property
    def dp_level(self) -> int:
        """The level whose group averages gradients at each step: the world, or the island with outer sync."""
        return len(self.topology.sizes) - (1 if self.plan.outer is not None else 0)

    @property
    def code(self) -> str:
        names = self.topology.level_name
        return f"p={names(self.p)},g={names(self.g)},os={names(self.os)}"

    @property
    def qgz_spec(self) -> str | None:
        """One qgz codec per tier joined by ``/`` (what ``comm.codecs.hop_codecs`` maps one to one), or None."""
        return "/".join(self.plan.qgz_hops(len(self.topology.sizes))) or None

    def gradient_bits(self) -> tuple[tuple[str, str], ...]:
        """(tier name, codec) of each tier the quantized gradient reductions cross (levels 1 .. max(g, os))."""
        hops = self.plan.qgz_hops(len(self.topology.sizes))
        return tuple((self.topology.level_name(k), hops[k - 1]) for k in range(1, max(self.g, self.os) + 1)
                     if hops and self.size(k) > self.size(k - 1))

    @property
    def quality(self) -> str:
        """``Plan.quality`` on this topology: the codec's bits on each tier the gradients cross."""
        runs: list[tuple[str, list[str]]] = []          # consecutive tiers with the same bits
        for tier, spec in self.gradient_bits():
            if runs and runs[-1][0] == _bits(spec):
                runs[-1][1].append(tier)
            else:
                runs.append((_bits(spec), [tier]))
        text = runs[0][0] if len(runs) == 1 else " / ".join(f"{b} ({', '.join(tiers)})" for b, tiers in runs)
        if runs and self.plan.error_feedback:
            text += " +ef"
        gathered = self.size(self.p) > 1
        return _quality(self.plan.qwz if gathered else None, text if runs else None, bits=False,
                        qwd=self.plan.qwd if gathered else None, outer=self.plan.outer)


def _option_tokens(plan: Plan) -> list[str]:
    tokens = []
    if plan.hpz:
        tokens.append("hpz" if plan.hpz == ("I",) else "hpz=" + "/".join(plan.hpz))
    if plan.qwz:
        tokens.append("qwz" if plan.qwz == "int8" else f"qwz={plan.qwz}")
    if plan.qwd:
        tokens.append("qwd" if plan.qwd == QWD_DEFAULT else f"qwd={plan.qwd}")
    if plan.qgz:
        body = plan.qgz.removesuffix("+ef")
        tokens.append(("qgz" if body == QGZ_DEFAULT else f"qgz={body}") + ("+ef" if plan.error_feedback else ""))
    if plan.cc:
        tokens.append("cc")
    if plan.outer:
        tokens.append(f"outer={plan.outer}")
    return tokens


def _bits(spec: str) -> str:
    """``'int8'`` or ``'int4'`` for one hop's codec spec."""
    return "int" + spec.removeprefix("int")[0]


def _quality(qwz: str | None, qgz: str | None, bits: bool = True, qwd: str | None = None,
             outer: OuterSpec | None = None) -> str:
    parts = ([f"weights {_bits(qwz)}"] if qwz else []) + ([f"weights {_bits(qwd)} differences"] if qwd else []) + \
        ([f"gradients {'/'.join(_bits(s) for s in qgz.split('/')) if bits else qgz}"] if qgz else []) + \
        ([f"outer sync every {outer.every} steps" + (f" in {outer.fragments} fragments" if outer.fragments > 1 else "")
          + (f", outer gradients {_bits(outer.codec)}" if outer.codec else "")
          + (f", after {outer.warmup} step-synchronous steps" if outer.warmup else "")] if outer else [])
    return "lossy: " + ", ".join(parts) if parts else "exact"


def _check_codec(name: str, spec: str, codecs: tuple[str, ...], allow_ef: bool) -> None:
    body, ef = (spec[:-3], True) if spec.endswith("+ef") else (spec, False)
    if ef and not allow_ef:
        raise PlanError(f"{name} does not take error feedback (+ef); only qgz does")
    if allow_ef:
        if not _QGZ_SPEC.fullmatch(body):
            raise PlanError(
                f"unknown qgz codec {body!r}: give one codec per tier, innermost first, joined by '/', each int8 or "
                "int4 (or 8, 4), an optional :BLOCK (a positive integer), then the flags :h (rotate) and :sr "
                "(stochastic rounding), each at most once; e.g. qgz=8/4, qgz=int8:128:h/int4:128:h, qgz=int4+ef")
        return
    codec, _, block = body.partition(":")
    if codec not in codecs:
        raise PlanError(f"unknown {name} codec {codec!r}: use one of {', '.join(codecs)}")
    if block and (not block.isdigit() or int(block) < 1):
        raise PlanError(f"{name} block size {block!r} must be a positive integer, e.g. {codecs[0]}:2048")


def all_placements() -> list[str]:
    """The 27 PaRO codes, NNN .. GGG."""
    return [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]
