"""The public entry points: ``shard`` and the functions that act on a sharded model (DESIGN.md section 3)."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives as C
from ..plan import Plan, PlanError
from ..topology import Topology, TopologyError
from .engine import Engine, Unit
from .flat import FlatGroup, ParamSlot
from .wrap import WrapPolicy, find_units

__all__ = ["shard", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict", "memory_stats"]


def shard(model: nn.Module, plan: Plan | str, topology: Topology, wrap: WrapPolicy = None,
          param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` in place by ``plan`` over ``topology`` and return it.

    ``wrap``: module classes or a predicate; each matching module is a unit (gathered and released as one),
    the root takes the rest. ``param_dtype``: compute and gather precision; ``reduce_dtype``: gradient
    reduction precision (defaults to ``param_dtype``). Masters and optimizer states are always fp32.
    Every rank starts from rank 0's weights.
    """
    if not dist.is_initialized():
        raise TopologyError("torch.distributed is not initialised: call torch.distributed.init_process_group() "
                            "(or launch with torchrun) before ts.shard")
    if getattr(model, "_tiershard", None) is not None:
        raise ValueError("this model is already sharded; ts.shard it once")
    if isinstance(plan, str):
        plan = Plan.parse(plan)
    placement = plan.resolve(topology)
    topology.init_process_groups()
    param_dtype = param_dtype or torch.float32
    reduce_dtype = reduce_dtype or param_dtype
    for dtype, what in ((param_dtype, "param_dtype"), (reduce_dtype, "reduce_dtype")):
        if not dtype.is_floating_point:
            raise ValueError(f"{what}={dtype} must be a floating dtype such as torch.bfloat16")

    engine = Engine(model, placement, param_dtype, reduce_dtype)
    for spec in find_units(model, wrap):
        groups = []
        for trainable in (True, False):
            owned = [entry for entry in spec.params if entry[0].requires_grad == trainable]
            if owned:
                groups.append(_build_group(owned, placement, trainable, param_dtype, reduce_dtype))
        for i, group in enumerate(groups):
            spec.module.register_parameter(f"_tiershard_flat{i}", group.master)
        engine.units.append(Unit(spec.path, spec.module, groups, engine))
    model._tiershard = engine
    return model


def _build_group(owned, placement, trainable, param_dtype, reduce_dtype) -> FlatGroup:
    slots, values, offset = [], [], 0
    for param, uses, names in owned:
        if not param.is_floating_point():
            raise ValueError(f"parameter {names[0]} has dtype {param.dtype}; only floating parameters can be sharded")
        slots.append(ParamSlot(uses, names, param.shape, offset, param.numel()))
        values.append(param.detach().reshape(-1).to(torch.float32))
        offset += param.numel()
        for module, name in uses:
            del module._parameters[name]
    flat = torch.cat(values)
    world = placement.topology.group_for(placement.topology.rank, 0, placement.topology.num_levels - 1)
    C.broadcast(flat, 0, world, placement.topology, "setup")
    group = FlatGroup(slots, flat, placement, trainable, param_dtype, reduce_dtype)
    if placement.p == 0:   # replicated weights stay readable between steps; sharded ones exist only in use
        for slot, view in zip(group.slots, group.views()):
            for module, name in slot.uses:
                setattr(module, name, view)
    return group


def _engine(model: nn.Module) -> Engine:
    engine = getattr(model, "_tiershard", None)
    if engine is None:
        raise ValueError("this model is not sharded: call ts.shard(model, plan, topology) first")
    return engine


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes inside are not accumulation boundaries: gradients stay at level g, no boundary traffic."""
    engine = _engine(model)
    previous, engine.sync_grads = engine.sync_grads, False
    try:
        yield
    finally:
        engine.sync_grads = previous


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the masters' gradients by their global norm; returns that norm, identical on every rank."""
    engine = _engine(model)
    grads = [g.master.grad for g in engine.groups() if g.master.grad is not None]
    pl, topo = engine.placement, engine.topology
    group = topo.group_for(topo.rank, 0, pl.os)
    if norm_type == math.inf:
        local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
        local = local.reshape(1).clone()
        if group.size > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group.pg)
            C._record("grad_norm", "all_reduce", group, local, topo)
        total = local[0]
    else:
        local = sum((g.float().pow(norm_type).sum() for g in grads), torch.zeros(())).reshape(1)
        C.all_reduce(local, group, topo, "grad_norm")
        total = local[0].pow(1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return total


def _slots(engine: Engine) -> list[ParamSlot]:
    return [slot for group in engine.groups() for slot in group.slots]


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (under each of its original names) as fp32 master values, and the persistent buffers."""
    engine = _engine(model)
    out: dict[str, torch.Tensor] = {}
    for group in engine.groups():
        values = group.full_master()
        for slot in group.slots:
            tensor = values[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            for name in slot.names:
                out[name] = tensor
    for name, buf in _persistent_buffers(model):
        out[name] = buf.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors (as ``full_state_dict`` gives them) on every rank; shards are cut locally."""
    engine = _engine(model)
    expected = {name for slot in _slots(engine) for name in slot.names}
    expected |= {name for name, _ in _persistent_buffers(model)}
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                       f"{' ...' if len(missing) > 5 or len(unexpected) > 5 else ''}")
    for slot in _slots(engine):      # check everything before writing anything
        for name in slot.names:
            if name in state and tuple(state[name].shape) != tuple(slot.shape):
                raise ValueError(f"{name}: shape {tuple(state[name].shape)} in the state dict, "
                                 f"{tuple(slot.shape)} in the model; nothing was loaded")
    for group in engine.groups():
        complete = all(any(n in state for n in slot.names) for slot in group.slots)
        # only a partial load needs the current values of the slots it leaves alone
        values = torch.zeros(group.numel) if complete else group.full_master().clone()
        for slot in group.slots:
            name = next((n for n in slot.names if n in state), None)
            if name is None:
                continue
            tensor = state[name]
            values[slot.offset:slot.offset + slot.numel] = tensor.detach().reshape(-1).to(torch.float32)
        group.load_full(values)
    buffers = dict(_persistent_buffers(model))
    with torch.no_grad():
        for name, buf in buffers.items():
            if name in state:
                buf.copy_(state[name])


def _persistent_buffers(model: nn.Module):
    for mpath, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mpath}.{name}" if mpath else name), buf


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of model state this rank holds: params, grads, masters, optimizer states (and hpz caches)."""
    engine = _engine(model)
    total = {"params": 0, "grads": 0, "masters": 0, "optimizer": 0, "hpz": 0}
    masters = set()
    for group in engine.groups():
        masters.add(id(group.master))
        for key, value in group.state_bytes().items():
            total[key] += value
    if optimizer is not None:
        for param, state in optimizer.state.items():
            if id(param) in masters:
                total["optimizer"] += sum(t.numel() * t.element_size() for t in state.values()
                                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total
