"""The ``train`` job's configuration: one small frozen dataclass per component, filled from TOML and flags.

The dataclass defaults *are* the default job (``make train``); ``configs/default.toml`` spells the same values
out for reading and editing, and a test keeps the two equal. Every section rejects keys it does not know, so a
typo fails loudly instead of being ignored.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .data import DataConfig
from .models.gpt import PRESETS, GPTConfig, gpt_config

PRECISIONS = ("fp32", "bf16")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation loop.

    ``batch`` is sequences per rank per micro-step, so a step sees ``batch * accum * world`` sequences.
    The learning rate warms up linearly for ``warmup`` steps, then follows a cosine down to ``min_lr``
    (a run shorter than its warmup only warms up).
    ``clip`` is the max global gradient norm (0 turns clipping off). ``weight_decay`` applies to every
    parameter: after sharding, the flat parameters no longer say which were matrices.
    ``save_every`` writes a checkpoint (``ts.save``, with the optimizer) to ``out/checkpoints/step_<N>`` every
    that many steps and at the last step (0: none). ``resume`` is ``""`` (start fresh), ``"auto"`` (the
    checkpoint ``out/checkpoints/latest`` names, if there is one, else start fresh) or a checkpoint path.
    ``compile`` compiles each transformer block (``block.compile(fullgraph=True)``, inductor) before sharding,
    torchtitan's order; tiershard's gathers and reductions stay outside the graphs (docs/compile.md).
    """

    steps: int = 300
    batch: int = 4
    accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.0
    clip: float = 1.0
    precision: str = "fp32"
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_batches: int = 4
    out: str = "runs/default"
    save: bool = True
    save_every: int = 0
    resume: str = ""
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "accum", "log_interval", "eval_interval", "eval_batches"):
            _positive_int(f"train.{name}", getattr(self, name))
        if not isinstance(self.warmup, int) or isinstance(self.warmup, bool) or self.warmup < 0:
            raise ValueError(f"train.warmup must be a non-negative integer, got {self.warmup!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"train.seed must be a non-negative integer, got {self.seed!r}")
        for name in ("lr", "min_lr", "weight_decay", "clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"train.{name} must be a non-negative number, got {value!r}")
        if not self.lr > 0 or self.min_lr > self.lr:
            raise ValueError(f"train.lr must be positive and at least train.min_lr, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"train.out must be a folder path, got {self.out!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile must be true or false, got {self.compile!r}")
        if not isinstance(self.save, bool):
            raise ValueError(f"train.save must be true or false, got {self.save!r}")
        if not isinstance(self.save_every, int) or isinstance(self.save_every, bool) or self.save_every < 0:
            raise ValueError(f"train.save_every must be a non-negative integer (0: no checkpoints), "
                             f"got {self.save_every!r}")
        if not isinstance(self.resume, str):
            raise ValueError(f"train.resume must be \"\" (start fresh), \"auto\" or a checkpoint path, "
                             f"got {self.resume!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the job is laid out: ``nproc`` ranks on this machine, ``ranks_per_node`` to a (possibly emulated)
    node, and the sharding plan (a preset, a PaRO code such as ``IIG``, or ``auto`` for the planner).
    ``allow_lossy``: let ``auto`` pick a quantized plan (qwz, qgz; they change the training numerics); without it
    the planner picks the fastest exact plan.
    Under an outside ``torchrun`` the launcher's world is used and ``nproc``/``ranks_per_node`` are ignored.
    ``max_restarts``: how often the launcher restarts every rank after one fails; each restart resumes from the
    last checkpoint, so it needs ``train.save_every`` and ``train.resume = "auto"`` (under an outside
    ``torchrun``, its own ``--max-restarts`` applies instead).
    """

    plan: str = "IIG"
    nproc: int = 4
    ranks_per_node: int = 2
    backend: str = "auto"
    max_restarts: int = 0
    allow_lossy: bool = False

    def __post_init__(self) -> None:
        _positive_int("parallel.nproc", self.nproc)
        if not isinstance(self.allow_lossy, bool):
            raise ValueError(f"parallel.allow_lossy must be true or false, got {self.allow_lossy!r}")
        _positive_int("parallel.ranks_per_node", self.ranks_per_node)
        if self.nproc % self.ranks_per_node:
            raise ValueError(f"--nproc {self.nproc} is not divisible by --ranks-per-node {self.ranks_per_node}: "
                             "each emulated node needs the same number of ranks")
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.plan, str) or not self.plan:
            raise ValueError(f"parallel.plan must be a plan such as IIG, zero3 or auto, got {self.plan!r}")
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ValueError(f"parallel.max_restarts must be a non-negative integer, got {self.max_restarts!r}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything one ``tiershard train`` run needs; ``preset`` names the model the sizes started from."""

    preset: str = "small"
    model: GPTConfig = field(default_factory=lambda: PRESETS["small"])
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        # a restart that does not resume would start the job over (or reload one fixed checkpoint) every time
        if self.parallel.max_restarts and (self.train.resume != "auto" or not self.train.save_every):
            raise ValueError(f"--max-restarts {self.parallel.max_restarts} restarts the job from its last checkpoint: "
                             "it needs --save-every N and --resume auto (train.save_every, train.resume)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> "JobConfig":
        """Build from nested sections (TOML shape); unknown sections or keys raise ValueError naming them."""
        sections = {"model": GPTConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig}
        unknown = sorted(set(raw) - set(sections))
        if unknown:
            raise ValueError(f"unknown section [{unknown[0]}] in {where}: known sections are "
                             f"{', '.join(f'[{s}]' for s in sections)}")
        built: dict[str, Any] = {}
        for name, kind in sections.items():
            values = raw.get(name, {})
            if not isinstance(values, dict):
                raise ValueError(f"{name} in {where} must be a [{name}] table")
            known = {f.name for f in fields(kind)} | ({"preset"} if name == "model" else set())
            bad = sorted(set(values) - known)
            if bad:
                raise ValueError(f"unknown key {bad[0]!r} in [{name}] of {where}: known keys are "
                                 f"{', '.join(sorted(known))}")
            if name == "model":
                values = dict(values)
                built["preset"] = values.pop("preset", "small")
                built["model"] = gpt_config(built["preset"], **values)
            else:
                built[name] = kind(**values)
        return cls(**built)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested sections that ``from_dict`` reads back to an equal config."""
        return {"model": {"preset": self.preset, **asdict(self.model)}, "data": asdict(self.data),
                "train": asdict(self.train), "parallel": asdict(self.parallel)}


def merge(base: dict[str, dict[str, Any]], overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Sections of ``overrides`` laid over ``base`` key by key (flags over a TOML file)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in overrides.items():
        out.setdefault(section, {})
        if isinstance(out[section], dict):
            out[section].update(values)
    return out


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """A TOML document for flat sections of scalars (the only shape a job config has)."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
