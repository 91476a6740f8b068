"""The public entry points: ``shard`` and the functions that act on a sharded model (DESIGN.md section 3)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections import Counter
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..plan import Plan
from ..topology import Topology, TopologyError
from .engine import Engine, Unit
from .flat import FlatGroup
from .layout import ParamLayout, finest_chunks
from .materialize import InitFn, materialize
from .wrap import WrapPolicy, find_units

__all__ = ["shard", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict", "memory_stats"]


class _NestedShardNotice(logging.Filter):
    """DTensor notes that nested Shard(0) placements reduce one mesh dim after another (a norm over the masters:
    one small all-reduce per tier). That nesting is the ownership map itself (``Topology.placements``), so the
    note tells users nothing they can act on; every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in record.getMessage()


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NestedShardNotice())


def shard(model: nn.Module, plan: Plan | str, topology: Topology, wrap: WrapPolicy = None,
          param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
          qwz_eval: bool = False, init: InitFn | None = None,
          device: torch.device | str | None = None, prefetch: int = 1) -> nn.Module:
    """Shard ``model`` in place by ``plan`` over ``topology`` and return it.

    ``wrap``: module classes, class names or a predicate; each matching module is a unit (gathered and released
    as one), the root takes the rest. ``param_dtype``: compute and gather precision (default: the parameters'
    own dtype); ``reduce_dtype``: gradient reduction precision (default ``param_dtype``). Masters and optimizer
    states are fp32 DTensors with the parameters' names and shapes; frozen parameters (``requires_grad=False``)
    are kept only in ``param_dtype`` at level p. Every rank starts from rank 0's weights and buffers. The
    model's device decides where every buffer lives. ``qwz_eval``: with qwZ, forwards under ``torch.no_grad()``
    (evaluation, ``generate()``) gather exact weights unless this is True. ``prefetch``: units whose gathers are
    issued ahead (forward order, reversed for backward) while the current one computes; reductions run behind
    backward on the communication stream; 0 runs every collective in place (the synchronous schedule).

    A model built under ``torch.device("meta")`` is materialised shard by shard on ``device`` (default: the
    current CUDA device under NCCL, else the CPU): each module's ``reset_parameters()`` and then ``init(module)``
    (children first, as ``model.apply``) replay eager initialisation one module at a time ([Note: meta init
    replay]); load pretrained weights afterwards with ``ts.load_full_state_dict`` or ``ts.load``.
    """
    if not dist.is_initialized():
        raise TopologyError("torch.distributed is not initialised: call torch.distributed.init_process_group() "
                            "(or launch with torchrun) before ts.shard")
    if getattr(model, "_tiershard", None) is not None:
        raise ValueError("this model is already sharded; ts.shard it once")
    if isinstance(plan, str):
        plan = Plan.parse(plan)
    placement = plan.resolve(topology)
    specs = find_units(model, wrap)
    params = [entry for spec in specs for entry in spec.params]
    device, meta = _target_device(model, device)
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be a non-negative integer (units gathered ahead; 0 = none)")
    if init is not None and not meta:
        raise ValueError("init= replays initialisation for a model built on the meta device; this model already "
                         "has its weights: drop init=, or build it under torch.device('meta')")
    param_dtype = param_dtype or _common_dtype(params)
    reduce_dtype = reduce_dtype or param_dtype
    for dtype, what in ((param_dtype, "param_dtype"), (reduce_dtype, "reduce_dtype")):
        if not dtype.is_floating_point:
            raise ValueError(f"{what}={dtype} must be a floating dtype such as torch.bfloat16")
    topology.init_process_groups(device.type)
    _check_same_everywhere(params)
    if not meta:
        _broadcast_buffers(model)

    dtypes = {}
    engine = Engine(model, placement, param_dtype, reduce_dtype, device, qwz_eval, prefetch)
    for spec in specs:
        groups = []
        for trainable in (True, False):
            owned = [entry for entry in spec.params if entry[0].requires_grad == trainable]
            if owned:
                # cut as the masters' DTensors are: at os when trainable, at p (kept in param_dtype) when frozen
                chunking = topology.chunking(placement.os if trainable else placement.p)
                layouts = [ParamLayout(uses, names, p.shape, finest_chunks(p.shape[0], chunking))
                           for p, uses, names in owned]
                values = None if meta else _broadcast_values([p for p, _, _ in owned], device)
                group = FlatGroup(layouts, values, placement, trainable, param_dtype, reduce_dtype, device)
                dtypes.update((id(m), p.dtype) for m, (p, _, _) in zip(group.masters, owned))
                groups.append(group)
        unit = Unit(spec.path, spec.module, groups, engine)
        unit.release()          # the module shows the masters from now on
        engine.units.append(unit)
    if meta:
        materialize(model, engine, device, dtypes, init)
        _broadcast_buffers(model)
        for group in engine.groups():
            group.sync_params()
    model._tiershard = engine
    _guard_save_pretrained(model)
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: engine.settle())
    model.register_load_state_dict_pre_hook(lambda module, *args, **kwargs: engine.settle())
    return model


_SAVE_PRETRAINED_RECIPE = ("on every rank `state = ts.full_state_dict(model, rank0_only=True)`, then on rank 0 "
                           "`model.save_pretrained(path, state_dict=state)`")


def _guard_save_pretrained(model: nn.Module) -> None:
    """``save_pretrained`` (transformers, peft) without ``state_dict=`` writes ``model.state_dict()``, whose values
    are DTensor shards here; safetensors then fails on their storage with a message that names neither the cause
    nor the fix. Refuse first, naming the recipe (a collective gather inside it would hang the common
    ``if rank == 0: model.save_pretrained(...)``)."""
    save = getattr(model, "save_pretrained", None)
    if not callable(save):
        return

    @functools.wraps(save)
    def save_pretrained(*args, **kwargs):
        given = kwargs.get("state_dict")
        if given is None:
            try:
                given = inspect.signature(save).bind_partial(*args, **kwargs).arguments.get("state_dict")
            except TypeError:
                given = True               # let save_pretrained report its own argument error
        if given is None:
            raise ValueError("save_pretrained on a tiershard-sharded model needs the full weights, as with FSDP2: "
                             + _SAVE_PRETRAINED_RECIPE)
        return save(*args, **kwargs)

    model.save_pretrained = save_pretrained


def _target_device(model: nn.Module, device: torch.device | str | None) -> tuple[torch.device, bool]:
    """Where the shards go, and whether the model is on the meta device (to be materialised there)."""
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) != 1:
        raise ValueError(f"the model's tensors are on several devices ({sorted(map(str, devices))}): move it to "
                         "one device (model.to('cuda') or model.to('cpu')), or build it all under "
                         "torch.device('meta'), before ts.shard")
    own = devices.pop()
    if own.type != "meta":
        if device is not None and torch.device(device) != own:
            raise ValueError(f"the model is on {own} but device={device}: move the model, or build it on the "
                             "meta device to have it materialised there")
        return own, False
    if device is None:
        cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return torch.device(device), True


def _common_dtype(params) -> torch.dtype:
    dtypes = Counter(p.dtype for p, _, _ in params)
    if len(dtypes) > 1:
        raise ValueError(f"parameters have several dtypes ({', '.join(str(d) for d in dtypes)}): pass "
                         "param_dtype= to ts.shard to choose the working precision")
    return next(iter(dtypes)) if dtypes else torch.float32


def _check_same_everywhere(params) -> None:
    """Every rank must hold the same parameters; a mismatch would otherwise surface as a hang or garbage."""
    for p, _, names in params:
        if not p.is_floating_point():
            raise ValueError(f"parameter {names[0]} has dtype {p.dtype}; only floating parameters can be sharded")
        if p.dim() == 0:
            raise ValueError(f"parameter {names[0]} is a scalar (0-d); parameters are sharded on dim 0: give it "
                             "shape (1,) (e.g. nn.Parameter(torch.tensor([v])))")
    mine = [(names[0], tuple(p.shape)) for p, _, names in params]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):     # the same message on every rank: each compares with rank 0
        if theirs == first:
            continue
        for (name_a, shape_a), (name_b, shape_b) in zip(first, theirs):
            if (name_a, shape_a) != (name_b, shape_b):
                raise ValueError(f"parameter {name_a} has shape {shape_a} on rank 0 but rank {rank} has {name_b} "
                                 f"of shape {shape_b}: every rank must build the same model")
        raise ValueError(f"rank 0 has {len(first)} parameters, rank {rank} has {len(theirs)}: every rank must "
                         "build the same model")


@torch.no_grad()
def _broadcast_buffers(model: nn.Module) -> None:
    for buf in model.buffers():
        dist.broadcast(buf, src=0)


@torch.no_grad()
def _broadcast_values(params: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Rank 0's values of ``params`` (as fp32), one broadcast for the group."""
    flat = torch.cat([p.detach().reshape(-1).to(device=device, dtype=torch.float32) for p in params])
    dist.broadcast(flat, src=0)
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in params]), params)]


def _engine(model: nn.Module) -> Engine:
    engine = getattr(model, "_tiershard", None)
    if engine is None:
        raise ValueError("this model is not sharded: call ts.shard(model, plan, topology) first")
    engine.settle()
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


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the model's parameters, returned as a plain tensor (the global
    norm, identical on every rank)."""
    _engine(model)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return total.full_tensor() if isinstance(total, DTensor) else total


def _units_layouts(engine: Engine):
    for group in engine.groups():
        for index, layout in enumerate(group.layouts):
            yield group, index, layout


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (under each of its original names) as a full fp32 tensor, and the persistent buffers.

    Built unit by unit: a rank holds one unit's gathered values at a time besides what it returns. With
    ``rank0_only`` only rank 0 receives and returns the model (the others return ``{}``), so the whole model
    never exists on more than one rank; ``cpu_offload`` moves each tensor to the CPU as soon as it is made.
    What ``model.save_pretrained(out, state_dict=...)`` takes (on rank 0).
    """
    engine = _engine(model)
    out: dict[str, torch.Tensor] = {}
    keep = not rank0_only or dist.get_rank() == 0
    for group in engine.groups():
        for layout, tensor in zip(group.layouts, group.full_values(rank0_only)):
            if cpu_offload:
                tensor = tensor.cpu()
            for name in layout.names:
                out[name] = tensor
    if keep:
        for name, buf in _persistent_buffers(model):
            out[name] = buf.detach().to("cpu" if cpu_offload else buf.device, copy=True)
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load full tensors (as ``full_state_dict`` gives them) on every rank; shards are cut locally."""
    engine = _engine(model)
    layouts = list(_units_layouts(engine))
    expected = {name for _, _, layout in layouts for name in layout.names}
    expected |= {name for name, _ in _persistent_buffers(model)}
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
                       f"{' ...' if len(missing) > 5 or len(unexpected) > 5 else ''}")
    for _, _, layout in layouts:      # check everything before writing anything
        for name in layout.names:
            if name in state and tuple(state[name].shape) != tuple(layout.shape):
                raise ValueError(f"{name}: shape {tuple(state[name].shape)} in the state dict, "
                                 f"{tuple(layout.shape)} in the model; nothing was loaded")
    touched: list[FlatGroup] = []
    for group, index, layout in layouts:
        name = next((n for n in layout.names if n in state), None)
        if name is not None:
            group.load_full(index, state[name].to(device=engine.device, dtype=torch.float32))
            if group not in touched:
                touched.append(group)
    for group in touched:
        group.sync_params()
    for name, buf in _persistent_buffers(model):
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
        masters.update(id(m) for m in group.masters)
        for key, value in group.state_bytes().items():
            total[key] += value
    if optimizer is not None:
        for param, state in optimizer.state.items():
            if id(param) in masters:
                for t in state.values():
                    if isinstance(t, DTensor):
                        t = t._local_tensor
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        total["optimizer"] += t.numel() * t.element_size()
    return total
