"""Units and their hooks: when each flat group is gathered, released and reduced.

[Note: unit lifecycle]
    forward pre-hook    gather every group of the unit (syncing stale weights first), point the module's
                        parameter attributes at views of ``full``
    forward post-hook   release (unless inside backward: activation-checkpoint recompute), and hook the
                        outputs so the unit is gathered again when their gradient arrives
    output grad hook    gather for backward; the first one in a backward queues the end-of-backward callback
    full.grad ready     (post-accumulate hook of ``full``) reduce to level g, at the boundary on to level os,
                        release the group
    end of backward     reduce zeros for trainable groups that got no gradient (so every rank runs the same
                        collectives), release whatever is still gathered
    optimizer.step()    a global post-step hook syncs every group whose master changed back to level p
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_flatten, tree_map

from .flat import FlatGroup

if TYPE_CHECKING:
    from ..plan import Placement

# Engines in creation order: the post-step sync must run its collectives in the same order on every rank.
_ENGINES: "list[weakref.ref[Engine]]" = []
_STEP_HOOK = None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One wrapped module and its flat groups (trainable and frozen)."""

    def __init__(self, path: str, module: nn.Module, groups: list[FlatGroup], engine: "Engine"):
        self.path, self.module, self.groups = path or "<root>", module, groups
        self.engine = engine
        self.reduced: set[int] = set()
        self.handles = [module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                        module.register_forward_hook(self._post_forward)]
        for group in groups:
            if group.trainable:
                self.handles.append(group.full.register_post_accumulate_grad_hook(self._make_grad_hook(group)))

    # ---- forward --------------------------------------------------------------------------------
    def gather(self, op: str) -> None:
        for group in self.groups:
            group.gather(op)
        for group in self.groups:
            for slot, view in zip(group.slots, group.views()):
                for module, name in slot.uses:
                    setattr(module, name, view)

    def _pre_forward(self, module, args, kwargs):
        with torch.profiler.record_function(f"tiershard::gather[{self.path}]"):
            self.gather("param_gather")
        if self is self.engine.root and self.engine.cast_dtype is not None:
            cast = self.engine.cast_dtype
            args, kwargs = tree_map(
                lambda t: t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                (args, kwargs))
        return args, kwargs

    def _post_forward(self, module, args, output):
        if _in_backward():
            return None
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward)
        self.release()
        return None

    def release(self) -> None:
        for group in self.groups:
            group.release()

    # ---- backward -------------------------------------------------------------------------------
    def _pre_backward(self, grad):
        self.engine.backward_started()
        with torch.profiler.record_function(f"tiershard::gather_backward[{self.path}]"):
            self.gather("param_gather_backward")
        return None

    def _make_grad_hook(self, group: FlatGroup):
        def hook(full: torch.Tensor) -> None:
            grad, full.grad = full.grad, None
            self.reduce(group, grad)
            group.release()
        return hook

    def reduce(self, group: FlatGroup, grad: torch.Tensor | None) -> None:
        with torch.profiler.record_function(f"tiershard::reduce[{self.path}]"):
            group.reduce_micro_step(grad)
            if self.engine.sync_grads:
                group.sync_grads()
        self.reduced.add(id(group))


class Engine:
    """The sharding state of one model: its units, placement, precision and the backward in flight."""

    def __init__(self, model: nn.Module, placement: "Placement", param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype):
        self.model_ref = weakref.ref(model)
        self.placement, self.topology = placement, placement.topology
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.cast_dtype = param_dtype if param_dtype != torch.float32 else None
        self.units: list[Unit] = []
        self.sync_grads = True
        self._backward_queued = False
        _ENGINES.append(weakref.ref(self))
        _install_step_hook()

    @property
    def root(self) -> Unit:
        return self.units[0]

    def groups(self):
        for unit in self.units:
            yield from unit.groups

    def backward_started(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        for unit in self.units:
            for group in unit.groups:
                if group.trainable and id(group) not in unit.reduced:
                    unit.reduce(group, None)
            unit.reduced.clear()
            unit.release()
        self._backward_queued = False

    def sync_stale(self) -> None:
        for group in self.groups():
            if group.stale:
                group.sync_params()


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None]
    for ref in list(_ENGINES):
        engine = ref()
        if engine is not None:
            engine.sync_stale()


def _install_step_hook() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
