"""Plans: where each model state lives (PaRO's p / g / os levels) and the options on top (ZeRO++, PaRO-CC).

A plan is policy only. It names levels by letter (``N`` replicated, ``I`` the tier below world, ``G`` world) or by
tier name; ``resolve`` turns it into level indices for one topology and rejects what cannot fit it.

Text forms, all round-tripping through ``str``::

    "IIG"  "zero3"  "GGG+hpz+qwz+qgz"  "p=pair,g=node,os=world+hpz=pair/node"  "NIG+qgz=int4+ef"
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

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
    "zero++": "GGG+hpz+qwz+qgz",
}
QWZ_CODECS = ("int8",)
QGZ_CODECS = ("int4", "int8")


class PlanError(ValueError):
    """A plan that is malformed, or cannot fit the topology; the message names the fix."""


@dataclass(frozen=True)
class Plan:
    """Levels for parameters, gradients and optimizer states, plus options.

    ``hpz``: levels (finer groups than ``p``) that keep a cached weight shard after a gather, innermost last used.
    ``qwz``: codec for parameter all-gathers, ``"int8"`` or ``"int8:BLOCK"``.
    ``qgz``: codec for gradient reduction, ``"int4"``, ``"int4:BLOCK"``, with ``"+ef"`` for error feedback.
    ``cc``: run global collectives hierarchically (intra then inter phases).
    """

    p: str = "G"
    g: str = "G"
    os: str = "G"
    hpz: tuple[str, ...] = ()
    qwz: str | None = None
    qgz: str | None = None
    cc: bool = False

    def __post_init__(self) -> None:
        for name in ("p", "g", "os"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or any(c in value for c in "+,=/ "):
                raise PlanError(f"{name}={value!r} is not a level: use N, I, G or a tier name")
        if isinstance(self.hpz, str):
            object.__setattr__(self, "hpz", tuple(self.hpz.split("/")))
        if self.qwz is not None:
            _check_codec("qwz", self.qwz, QWZ_CODECS, allow_ef=False)
        if self.qgz is not None:
            _check_codec("qgz", self.qgz, QGZ_CODECS, allow_ef=True)

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
                options["qgz"] += "+ef"
                continue
            if key in options:
                raise PlanError(f"option {key} given twice in {text!r}")
            if key == "hpz":
                options["hpz"] = tuple(value.split("/")) if value else ("I",)
            elif key == "qwz":
                options["qwz"] = value or "int8"
            elif key == "qgz":
                options["qgz"] = value or "int4"
            elif key == "cc":
                if value:
                    raise PlanError(f"cc takes no value in {text!r}")
                options["cc"] = True
            else:
                raise PlanError(f"unknown plan option {key!r} in {text!r}: known options are hpz, qwz, qgz, cc")
        return cls(**fields, **options)

    def __str__(self) -> str:
        levels = (self.p, self.g, self.os)
        base = "".join(levels) if all(level in LETTERS for level in levels) else \
            f"p={self.p},g={self.g},os={self.os}"
        return "+".join([base, *_option_tokens(self)])

    def with_options(self, **changes) -> "Plan":
        return replace(self, **changes)

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
        if self.qgz and g == 0 and os_ == 0:
            raise PlanError("qgz quantizes gradient reduction, but g and os are both N (plain all-reduce): "
                            "use a plan that reduce-scatters, e.g. NIG+qgz")
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
    def code(self) -> str:
        names = self.topology.level_name
        return f"p={names(self.p)},g={names(self.g)},os={names(self.os)}"


def _option_tokens(plan: Plan) -> list[str]:
    tokens = []
    if plan.hpz:
        tokens.append("hpz" if plan.hpz == ("I",) else "hpz=" + "/".join(plan.hpz))
    if plan.qwz:
        tokens.append("qwz" if plan.qwz == "int8" else f"qwz={plan.qwz}")
    if plan.qgz:
        tokens.append("qgz" if plan.qgz == "int4" else f"qgz={plan.qgz}")
    if plan.cc:
        tokens.append("cc")
    return tokens


def _check_codec(name: str, spec: str, codecs: tuple[str, ...], allow_ef: bool) -> None:
    body, ef = (spec[:-3], True) if spec.endswith("+ef") else (spec, False)
    if ef and not allow_ef:
        raise PlanError(f"{name} does not take error feedback (+ef); only qgz does")
    codec, _, block = body.partition(":")
    if codec not in codecs:
        raise PlanError(f"unknown {name} codec {codec!r}: use one of {', '.join(codecs)}")
    if block and (not block.isdigit() or int(block) < 1):
        raise PlanError(f"{name} block size {block!r} must be a positive integer, e.g. {codecs[0]}:2048")


def all_placements() -> list[str]:
    """The 27 PaRO codes, NNN .. GGG."""
    return [a + b + c for a in LETTERS for b in LETTERS for c in LETTERS]
