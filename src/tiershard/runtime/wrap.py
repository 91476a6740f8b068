"""Cutting a model into units: which modules are units, and which unit owns each parameter."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

import torch.nn as nn

WrapPolicy = Union[None, type, str, Iterable[Union[type, str]], Callable[[nn.Module], bool]]


@dataclass
class UnitSpec:
    """A unit's module, its path, and the parameters it owns (with every use of each)."""

    path: str
    module: nn.Module
    params: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = field(default_factory=list)


def _matcher(wrap: WrapPolicy) -> Callable[[nn.Module], bool]:
    """Classes match by isinstance, names (e.g. a transformers model's ``_no_split_modules``) by class name."""
    if wrap is None:
        return lambda m: False
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    items = (wrap,) if isinstance(wrap, (type, str)) else tuple(wrap)
    if not all(isinstance(c, (type, str)) for c in items):
        raise TypeError(f"wrap must be module classes, class names or a predicate, got {wrap!r}")
    classes = tuple(c for c in items if isinstance(c, type))
    names = {c for c in items if isinstance(c, str)}
    return lambda m: isinstance(m, classes) or type(m).__name__ in names


def default_wrap(model: nn.Module) -> WrapPolicy:
    """What ``wrap=None`` cuts at: a ``transformers`` model's ``_no_split_modules`` (its repeated blocks, what
    accelerate's FSDP wraps by default; through a PEFT wrapper too), else nothing (one unit)."""
    names = getattr(model, "_no_split_modules", None)
    if isinstance(names, (list, tuple, set, frozenset)) and names and all(isinstance(n, str) for n in names):
        return set(names)
    return None


def find_units(model: nn.Module, wrap: WrapPolicy) -> list[UnitSpec]:
    """Every module matching ``wrap`` is a unit, the root takes the rest; order is ``named_modules`` order.

    ``wrap=None`` is ``default_wrap(model)``; an empty collection (``wrap=()``) makes the whole model one unit.
    Both ``ts.shard`` and the cost model (``ModelSpec.from_module``) cut through here, so they count alike.
    A parameter used by several modules (tied weights) belongs to the innermost unit that contains all its uses,
    so that unit is gathered whenever any use runs.
    """
    given = wrap
    match = _matcher(default_wrap(model) if wrap is None else wrap)
    units = [UnitSpec("", model)]
    for path, module in model.named_modules():
        if path and match(module):
            units.append(UnitSpec(path, module))
    empty = isinstance(given, (list, tuple, set, frozenset)) and not given
    if given is not None and not empty and len(units) == 1:
        kinds = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise ValueError(f"wrap={wrap!r} matches no submodule of {type(model).__name__}, so the whole model would "
                         f"be one unit: name the repeated block (module classes here: {', '.join(kinds[:12])}"
                         f"{' ...' if len(kinds) > 12 else ''}), or pass wrap=() for one unit on purpose")
    unit_paths = [u.path for u in units]

    def owner(path: str) -> int:
        best = 0
        for i, upath in enumerate(unit_paths):
            if upath == "" or path == upath or path.startswith(upath + "."):
                if len(upath) >= len(unit_paths[best]):
                    best = i
        return best

    uses: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str], list[str]]] = {}
    for mpath, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None:
                continue
            full = f"{mpath}.{name}" if mpath else name
            entry = uses.setdefault(id(param), (param, [], [], []))
            entry[1].append((module, name))
            entry[2].append(full)
            entry[3].append(mpath)
    for param, mods, names, mpaths in uses.values():
        owners = {owner(p) for p in mpaths}
        if len(owners) == 1:
            index = owners.pop()
        else:
            common = _common_prefix([unit_paths[i] for i in owners])
            index = owner(common) if common else 0
        # keep (module, name) pairs unique: a module reached by two paths holds the attribute once
        seen, pairs = set(), []
        for m, n in mods:
            if (id(m), n) not in seen:
                seen.add((id(m), n))
                pairs.append((m, n))
        units[index].params.append((param, pairs, names))
    _narrow_root(model, units[0], uses)
    return units


def _narrow_root(model: nn.Module, root: UnitSpec, uses: dict) -> None:
    """Hook the root unit on the innermost module that holds all of its parameters' uses, not on the model.

    Wrappers call into their inner model directly (``PeftModel.generate`` runs the base model's forward), so the
    unit that owns the embeddings and the head must gather when that inner model runs, however it is entered.
    """
    mine = {id(param) for param, _, _ in root.params}
    paths = [mpath for key, (_, _, _, mpaths) in uses.items() if key in mine for mpath in mpaths]
    if not paths:
        return
    common = _common_prefix(paths)
    if common:
        root.path, root.module = common, model.get_submodule(common)


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for tokens in zip(*parts):
        if len(set(tokens)) != 1:
            break
        out.append(tokens[0])
    return ".".join(out)
