"""The public entry points: ``shard`` and the functions that act on a sharded model (DESIGN.md section 3)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
from collections import Counter
from typing import Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..comm import collectives as C
from ..comm import liveness
from ..comm.failure import unit_scope
from ..plan import Plan
from ..topology import Topology, TopologyError
from .arguments import as_dtype, as_plan, as_topology, refuse_keywords, refuse_wrapped
from .engine import Engine, Unit
from .flat import FlatGroup, wait_for_copies
from .guards import guard_wrappers
from .layout import ParamLayout, finest_chunks
from .outer import OuterSync
from .materialize import InitFn, Unloaded, materialize, tie_empty_weights
from .tensor_parallel import TPSpec
from .wrap import WrapPolicy, find_units

__all__ = ["shard", "no_sync", "clip_grad_norm_", "full_state_dict", "load_full_state_dict", "memory_stats"]


class _NestedShardNotice(logging.Filter):
    """DTensor notes that nested Shard(0) placements reduce one mesh dim after another (a norm over the masters:
    one small all-reduce per tier). That nesting is the ownership map itself (``Topology.placements``), so the
    note tells users nothing they can act on; every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in record.getMessage()


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_NestedShardNotice())


def shard(model: nn.Module, plan: Plan | str | None = None, topology: Topology | Sequence[int] | None = None,
          wrap: WrapPolicy = None, param_dtype: torch.dtype | str | None = None,
          reduce_dtype: torch.dtype | str | None = None, qwz_eval: bool = False, init: InitFn | None = None,
          device: torch.device | str | None = None, prefetch: int = 1, **unknown: object) -> nn.Module:
    """Shard ``model`` in place by ``plan`` over ``topology`` and return it.

    ``wrap``: module classes, class names or a predicate; each matching module is a unit (gathered and released
    as one), the root takes the rest; None: a ``transformers`` model's ``_no_split_modules``, else one unit
    (``wrap=()``: one unit on purpose). ``param_dtype``: compute and gather precision (default: the parameters'
    own dtype); ``reduce_dtype``: gradient reduction precision (default ``param_dtype``). Masters and optimizer
    states are fp32 DTensors with the parameters' names and shapes; frozen parameters (``requires_grad=False``)
    are kept only in ``param_dtype`` at level p. Every rank starts from rank 0's weights and buffers. The
    model's device decides where every buffer lives. ``qwz_eval``: with qwZ or qWD, forwards under ``torch.no_grad()``
    (evaluation, ``generate()``) gather exact weights unless this is True. ``prefetch``: units whose gathers are
    issued ahead (forward order, reversed for backward) while the current one computes; reductions run behind
    backward on the communication stream; 0 runs every collective in place (the synchronous schedule). Dtypes
    may be named (``"bf16"``, ``"float32"``) and ``topology`` given by its sizes (``(2, 4)``); FSDP's keywords
    (``mesh=``, ``mp_policy=``, ``reshard_after_forward=``, ...) raise a TypeError naming the equivalent.

    A model built under ``torch.device("meta")`` is materialised shard by shard on ``device`` (default: the
    current CUDA device under NCCL, else the CPU): each module's ``reset_parameters()`` and then ``init(module)``
    (children first, as ``model.apply``) replay eager initialisation one module at a time ([Note: meta init
    replay]); load pretrained weights afterwards with ``ts.load_full_state_dict`` or ``ts.load``. So is one built
    under accelerate's ``init_empty_weights()`` (parameters on meta, buffers real: they keep their values). A
    parameter that nothing initialises must be loaded before the first forward ([Note: parameters waiting for a
    load]).
    """
    if unknown:
        refuse_keywords(unknown, [name for name in inspect.signature(shard).parameters if name not in
                                  ("model", "unknown")])
    plan, topology = as_plan(plan), as_topology(topology)
    param_dtype, reduce_dtype = as_dtype(param_dtype, "param_dtype"), as_dtype(reduce_dtype, "reduce_dtype")
    refuse_wrapped(model)
    if not dist.is_initialized():
        raise TopologyError("torch.distributed is not initialised: call torch.distributed.init_process_group() "
                            "(or launch with torchrun) before ts.shard")
    if getattr(model, "_tiershard", None) is not None:
        raise ValueError("this model is already sharded; ts.shard it once")
    placement = plan.resolve(topology)
    tie_empty_weights(model)
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
    liveness.HEART.start(topology)        # beating from the model's creation ([Note: slow is not dead])
    _check_same_everywhere(params)
    tp = _tp_specs(params, topology, meta)
    if not meta:
        _broadcast_buffers(model)
    del params

    dtypes = {}
    engine = Engine(model, placement, param_dtype, reduce_dtype, device, qwz_eval, prefetch)
    for spec in specs:
        groups = []
        for trainable in (True, False):
            owned = [entry for entry in spec.params if entry[0].requires_grad == trainable]
            if owned:
                # cut as the masters' DTensors are: at os when trainable, at p (kept in param_dtype) when frozen
                chunking = topology.chunking(placement.os if trainable else placement.p)
                layouts = [ParamLayout(uses, names, _stored_shape(p), finest_chunks(_stored_shape(p)[0], chunking),
                                       tp=tp.get(id(p))) for p, uses, names in owned]
                values = None if meta else _RankZeroValues([p for p, _, _ in owned], device, topology)
                group = FlatGroup(layouts, values, placement, trainable, param_dtype, reduce_dtype, device)
                dtypes.update((id(m), p.dtype) for m, (p, _, _) in zip(group.masters, owned))
                groups.append(group)
        unit = Unit(spec.path, spec.module, groups, engine)
        for group in groups:
            group.unit = unit.path
        unit.release()          # the module shows the masters from now on
        engine.units.append(unit)
        _mark_replaced(spec.params)
        spec.params.clear()     # the unit's full tensors go now, not when the whole model is cut
        owned = values = None
    if meta:
        unloaded = materialize(model, engine, device, dtypes, init)
        if unloaded:
            model._tiershard_unloaded = Unloaded(engine, unloaded)
        _broadcast_buffers(model)
        for group in engine.groups():
            group.sync_params()
    if plan.outer is not None:
        engine.outer = OuterSync(plan.outer, placement, [g for g in engine.groups() if g.trainable],
                                 seed=torch.initial_seed())
    model._tiershard = engine
    _guard_save_pretrained(model)
    _guard_load_state_dict(model)
    guard_wrappers(model, no_sync)
    for module in model.modules():           # .to / .half / .float / .cuda / ... of the model or any submodule
        module._apply = types.MethodType(_sharded_apply, module)
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: engine.settle())
    model.register_load_state_dict_pre_hook(lambda module, *args, **kwargs: engine.settle())
    return model


_SAVE_PRETRAINED_RECIPE = ("on every rank `state = ts.full_state_dict(model, rank0_only=True)`, then on rank 0 "
                           "`model.save_pretrained(path, state_dict=state)`")


def _guard_load_state_dict(model: nn.Module) -> None:
    """``model.load_state_dict`` of full plain tensors (an unsharded model's ``state_dict()``, a checkpoint file)
    loads them into this rank's shards as ``ts.load_full_state_dict`` does, with torch's strict / missing /
    unexpected key rules and messages (torch would fail copying a plain tensor into a DTensor); only, unlike
    torch, a mismatch raises before anything is written. A state dict of DTensors (``model.state_dict()``,
    ``torch.distributed.checkpoint``) takes torch's own path, as before."""
    load = model.load_state_dict

    @functools.wraps(load)
    def load_state_dict(state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        engine = _engine(model)
        wait_for_copies()                  # [Note: background copies]
        layouts = list(_units_layouts(engine))
        names = {name for _, _, layout in layouts for name in layout.names}
        kinds = {isinstance(v, DTensor) for k, v in state_dict.items() if k in names}
        if False not in kinds:           # DTensors, or no parameter at all: torch's own path
            result = load(state_dict, strict=strict, assign=assign)
            _loaded(model, names=state_dict.keys())
            return result
        if True in kinds:
            raise ValueError("this state dict mixes DTensor shards and full tensors for the parameters: load one "
                             "kind (model.state_dict() gives DTensors, ts.full_state_dict(model) full tensors)")
        if assign:
            raise ValueError("load_state_dict(..., assign=True) would replace the sharded parameters by full "
                             "tensors: drop assign=True; full tensors are copied into this rank's shards")
        missing, unexpected = _key_mismatch(model, layouts, state_dict)
        errors = [f"size mismatch for {name}: copying a param with shape {torch.Size(theirs)} from checkpoint, "
                  f"the shape in current model is {torch.Size(ours)}."
                  for name, theirs, ours in _shape_mismatch(model, layouts, state_dict)]
        quoted = lambda keys: ", ".join(f'"{k}"' for k in keys)    # noqa: E731 - torch's message, verbatim
        if strict and unexpected:
            errors.insert(0, f"Unexpected key(s) in state_dict: {quoted(unexpected)}. ")
        if strict and missing:
            errors.insert(0, f"Missing key(s) in state_dict: {quoted(missing)}. ")
            tied = set(missing) - set(_key_mismatch(model, layouts, state_dict, tied=True)[0])
            if tied:       # [Note: tied weights in a full state dict]
                errors.append(f"{', '.join(sorted(tied))}: tied to a parameter the state dict holds under another "
                              "name; load it with strict=False, or with ts.load_full_state_dict(model, state), "
                              "which takes any one name of a tied parameter")
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__} (nothing was loaded):"
                               "\n\t" + "\n\t".join(errors))
        _write_full(model, engine, layouts, state_dict.keys(), _local_value(state_dict))
        return _IncompatibleKeys(missing, unexpected)

    model.load_state_dict = load_state_dict


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


_DTYPE_FIX = ("the masters stay fp32; compute precision is ts.shard(..., param_dtype=torch.bfloat16) (and "
              "reduce_dtype= for the gradient reduction)")
_DEVICE_FIX = ("shard it on the target device: move the model there before ts.shard, or build it under "
               "torch.device('meta') and pass ts.shard(..., device=...)")


def _sharded_apply(self: nn.Module, fn, recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` of a sharded model (behind ``to``, ``half``, ``float``, ``double``, ``bfloat16``,
    ``type``, ``cuda``, ``cpu``, ``to_empty``): torch would swap the DTensor masters for tensors the engine does
    not hold (a cast dies in the next backward, a move in a later gather, ``to_empty`` trains on garbage).

    ``fn`` is tried on a one-element tensor of each (dtype, device) the module holds; if it returns that very
    tensor, or a copy of it on the same device with the same dtype and value, everywhere, the call changes nothing
    and returns the module (``.to("cpu")`` or ``.to("cpu:0")`` on a CPU model, as ``transformers.Trainer`` and
    Lightning do, ``.float()`` on fp32 masters); anything else raises, naming the fix, before a tensor has
    changed."""
    qualname = getattr(fn, "__qualname__", "").split(".")
    call = f"{type(self).__name__}.{qualname[1] if len(qualname) > 2 and qualname[0] == 'Module' else '_apply'}()"
    moves, casts, replaced = set(), set(), False
    kinds = {(t.dtype, t.device) for t in self.parameters(recurse=recurse)}
    kinds |= {(t.dtype, t.device) for t in self.buffers(recurse=recurse)}
    for dtype, device in kinds:
        probe = torch.zeros(1, dtype=dtype, device=device)
        try:
            out = fn(probe)
        except Exception as err:  # noqa: BLE001 - e.g. .cuda() without CUDA: a move all the same
            raise RuntimeError(f"{call} on a sharded model failed ({type(err).__name__}: {err}); a sharded model "
                               f"stays on the device ts.shard put it on ({device}): {_DEVICE_FIX}. Nothing was "
                               "changed") from err
        if out is probe:
            continue
        if out.device != device:
            moves.add(f"{device} to {out.device}")
        elif out.dtype != dtype:
            casts.add(f"{dtype} to {out.dtype}")
        elif "to_empty" in qualname or not torch.equal(out, probe):
            replaced = True             # a copy of equal value (``.to("cpu:0")`` on the CPU) changes nothing
    if moves:
        raise RuntimeError(f"{call} would move a sharded model ({', '.join(sorted(moves))}); its shards and process "
                           f"groups stay where ts.shard put them: {_DEVICE_FIX}. Nothing was changed")
    if casts:
        raise RuntimeError(f"{call} would cast a sharded model's tensors ({', '.join(sorted(casts))}): {_DTYPE_FIX}. "
                           "Nothing was changed")
    if replaced:
        raise RuntimeError(f"{call} would replace a sharded model's tensors: ts.shard already materialised its "
                           "shards (a meta-built model through init=); load weights with model.load_state_dict "
                           "or ts.load_full_state_dict. Nothing was changed")
    return self


# [Note: optimizers of replaced parameters] ts.shard replaces every parameter of the model by its master; an
# optimizer built before holds the old ones, gets no gradients and steps nothing, silently. ts.shard marks the old
# parameters and a global step pre-hook refuses such an optimizer at its first step, before anything is stepped.
# Optimizers of anything else hold no marked parameter and are never refused. The check runs again only when the
# optimizer's parameter count or the number of ts.shard calls changes (a few list lengths per step otherwise).
_SHARDS = 0
_PRE_HOOK = None


def _mark_replaced(params) -> None:
    global _SHARDS, _PRE_HOOK
    for p, _, names in params:
        p.__dict__["_tiershard_replaced"] = names[0]
    _SHARDS += 1
    if _PRE_HOOK is None:
        _PRE_HOOK = register_optimizer_step_pre_hook(_refuse_replaced_params)


def _refuse_replaced_params(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    key = (_SHARDS, sum(len(group["params"]) for group in optimizer.param_groups))
    if optimizer.__dict__.get("_tiershard_checked") == key:
        return
    stale = [p.__dict__.get("_tiershard_replaced") for group in optimizer.param_groups for p in group["params"]]
    stale = [name for name in stale if name is not None]
    if stale:
        raise RuntimeError(f"this {type(optimizer).__name__} holds {len(stale)} parameters that ts.shard replaced "
                           f"(e.g. {stale[0]!r}): stepping them would train nothing. Build the optimizer after "
                           "ts.shard(model, ...), from model.parameters() (and any LR scheduler on it). Nothing was "
                           "stepped")
    optimizer.__dict__["_tiershard_checked"] = key


def _target_device(model: nn.Module, device: torch.device | str | None) -> tuple[torch.device, bool]:
    """Where the shards go, and whether the model is on the meta device (to be materialised there)."""
    params = {p.device for p in model.parameters()}
    if "meta" in {d.type for d in params} and len(params) > 1:
        raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, params))}), some on the "
                         "meta device: build every parameter under torch.device('meta') or accelerate's "
                         "init_empty_weights() (ts.shard materialises them), or none (move the model to one device)")
    devices = params | {b.device for b in model.buffers()}
    if {d.type for d in params or devices} != {"meta"}:
        if len(devices) != 1:
            raise ValueError(f"the model's tensors are on several devices ({sorted(map(str, devices))}): move it to "
                             "one device (model.to('cuda') or model.to('cpu')), or build its parameters under "
                             "torch.device('meta') or accelerate's init_empty_weights(), before ts.shard")
        own = devices.pop()
        if device is not None and torch.device(device) != own:
            raise ValueError(f"the model is on {own} but device={device}: move the model, or build it on the "
                             "meta device to have it materialised there")
        return own, False
    # parameters on meta; buffers may be real (init_empty_weights): they keep their values, moved to the device
    if device is None:
        cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return torch.device(device), True


def _common_dtype(params) -> torch.dtype:
    dtypes = Counter(p.dtype for p, _, _ in params)
    if len(dtypes) > 1:
        first = {}
        for p, _, names in params:
            first.setdefault(p.dtype, names[0])
        seen = ", ".join(f"{dtype} ({first[dtype]}, {count} in all)" for dtype, count in dtypes.items())
        raise ValueError(f"parameters have several dtypes: {seen}; pass param_dtype= to ts.shard to choose the "
                         "working precision (the masters keep float32), or cast the model to one dtype first")
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


def _tp_specs(params, topology: Topology, meta: bool) -> dict:
    """id(parameter) -> its ``TPSpec`` for the tensor-parallel (DTensor) parameters, checked against the topology."""
    out = {}
    for p, _, names in params:
        if isinstance(p, DTensor):
            if meta:
                raise ValueError(f"parameter {names[0]} is a tensor-parallel DTensor on the meta device: ts.shard "
                                 "does not materialise tensor-parallel models yet; build the model on its device, "
                                 "parallelise it, then ts.shard it (docs/parallelism.md)")
            out[id(p)] = TPSpec.of(names[0], p, topology)
    return out


def _stored_shape(p: torch.Tensor) -> torch.Size:
    """The shape the engine stores: a tensor-parallel parameter's local shard's, else the parameter's."""
    return p._local_tensor.shape if isinstance(p, DTensor) else p.shape


class _RankZeroValues(Sequence):
    """Rank 0's value of each of ``params`` as fp32 on ``device``, broadcast when it is read: ``FlatGroup`` reads
    each once, in order, and keeps only its band, so sharding holds one full parameter at a time beyond the
    masters (one broadcast of the whole group held a copy of the group, the whole model for a model of one unit).
    A tensor-parallel parameter's local shard comes from the first rank of this rank's TP coordinate (rank 0's TP
    group holds the whole parameter), over the tiers' world group of that coordinate."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, topology: Topology):
        self.params, self.device, self.topology = params, device, topology

    def __len__(self) -> int:
        return len(self.params)

    @torch.no_grad()
    def __getitem__(self, index: int) -> torch.Tensor:
        param = self.params[index]
        local = param._local_tensor if isinstance(param, DTensor) else param
        value = local.detach().to(device=self.device, dtype=torch.float32, copy=True,
                                  memory_format=torch.contiguous_format)
        if isinstance(param, DTensor):
            topo = self.topology
            world = topo.group_for(topo.rank, 0, topo.num_levels - 1)
            C.broadcast(value, world.ranks[0], world, topo, "state_dict")
        else:
            dist.broadcast(value, src=0)
        return value


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
    _check_loaded(model, "ts.full_state_dict")
    out: dict[str, torch.Tensor] = {}
    keep = not rank0_only or dist.get_rank() == 0
    groups = list(engine.groups())
    # one buffer for every group's band and gathered values, made once: a unit-sized buffer allocated and freed
    # per group would leave freed holes resident between the kept tensors
    scratch = torch.empty(max((g.scratch_size(rank0_only) for g in groups), default=0), device=engine.device)
    for group in groups:
        with unit_scope(group.unit):           # named if a rank does not take part ([Note: bounded collectives])
            values = group.full_values(rank0_only, scratch, torch.device("cpu") if cpu_offload else None)
        for layout, tensor in zip(group.layouts, values):
            for name in layout.names:
                out[name] = tensor
    if keep:
        for name, buf in _persistent_buffers(model):
            out[name] = buf.detach().to("cpu" if cpu_offload else buf.device, copy=True)
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True,
                         broadcast_from_rank0: bool = False) -> None:
    """Load full tensors (as ``full_state_dict`` gives them) on every rank; shards are cut locally.

    ``broadcast_from_rank0=True`` (torch's ``StateDictOptions`` name): only rank 0 reads ``state`` (the other
    ranks pass ``{}`` and never hold the model); rank 0 checks it, then sends one tensor at a time and each rank
    keeps its shard of it, so a rank holds at most one full tensor beyond its shards. Without it every rank
    passes the whole state dict (every rank holds the model)."""
    engine = _engine(model)
    wait_for_copies()                            # [Note: background copies]
    layouts = list(_units_layouts(engine))
    problem = None
    if not broadcast_from_rank0 or dist.get_rank() == 0:
        problem = _full_state_problem(model, layouts, state, strict)
    if broadcast_from_rank0:
        box = [problem]
        dist.broadcast_object_list(box, src=0, group=engine.topology.control_group.pg)
        problem = box[0]
    if problem is not None:                      # checked everything before writing anything
        kind, message = problem
        raise (KeyError if kind == "keys" else ValueError)(message)
    if broadcast_from_rank0:
        _broadcast_full(model, engine, layouts, state)
    else:
        _write_full(model, engine, layouts, state.keys(), _local_value(state))


def _full_state_problem(model: nn.Module, layouts: list, state: Mapping[str, torch.Tensor],
                        strict: bool) -> tuple[str, str] | None:
    """("keys" or "shape", message) for a full state dict that does not fit the model, or None.

    [Note: tied weights in a full state dict] A parameter reachable under several names (an LM head tied to the
    embedding, as ``from_pretrained`` ties them) is one tensor: any one of its names loads it, as
    ``from_pretrained`` accepts a GPT-2 checkpoint without ``lm_head.weight``. Two of its names with different
    values cannot both be loaded: refused."""
    missing, unexpected = _key_mismatch(model, layouts, state, tied=True)
    if strict and (missing or unexpected):
        ties = [f"{' and '.join(layout.names)} are one tied parameter (any one of its names loads it)"
                for _, _, layout in layouts if len(layout.names) > 1 and layout.names[0] in missing]
        return "keys", (f"state dict does not match the model: missing {missing[:5]}, unexpected "
                        f"{unexpected[:5]}{' ...' if len(missing) > 5 or len(unexpected) > 5 else ''}"
                        + "".join(f"; {tie}" for tie in ties[:3]))
    for name, theirs, ours in _shape_mismatch(model, layouts, state):
        return "shape", f"{name}: shape {theirs} in the state dict, {ours} in the model; nothing was loaded"
    for _, _, layout in layouts:
        given = [n for n in layout.names if n in state]
        first = state[given[0]] if given else None
        if len(given) > 1 and not all(torch.equal(first, state[n].to(first.device, first.dtype)) for n in given[1:]):
            return "shape", (f"{' and '.join(given)} are one tied parameter in the model (the same Parameter under "
                             "each name) but the state dict holds different values for them: keep one name, or "
                             "untie the model's weights (tie_word_embeddings=False) before ts.shard; nothing was "
                             "loaded")
    return None


def _broadcast_full(model: nn.Module, engine: Engine, layouts: list, state: Mapping[str, torch.Tensor]) -> None:
    """``_write_full`` from rank 0's ``state``: one broadcast per tensor on the control group, each rank cutting
    its shard before the next arrives."""
    topology, rank0 = engine.topology, dist.get_rank() == 0
    control = topology.control_group
    box = [sorted(state.keys()) if rank0 else None]     # which names rank 0 has (all of them when strict)
    dist.broadcast_object_list(box, src=0, group=control.pg)

    def value(name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        full = state[name].to(device=device, dtype=dtype) if rank0 else torch.empty(shape, dtype=dtype, device=device)
        C.broadcast(full, 0, control, topology, "state_dict")
        return full

    _write_full(model, engine, layouts, set(box[0]), value)


def _key_mismatch(model: nn.Module, layouts: list, state: Mapping[str, torch.Tensor],
                  tied: bool = False) -> tuple[list, list]:
    """(missing, unexpected) keys of a full state dict: every name of a parameter, the persistent buffers. With
    ``tied``, a name of a tied parameter is not missing when another of its names is given ([Note: tied weights
    in a full state dict]); torch's ``load_state_dict`` counts every name."""
    expected = {name for _, _, layout in layouts for name in layout.names}
    expected |= {name for name, _ in _persistent_buffers(model)}
    missing = expected - state.keys()
    if tied:
        missing -= {name for _, _, layout in layouts if not state.keys().isdisjoint(layout.names)
                    for name in layout.names}
    return sorted(missing), sorted(state.keys() - expected)


def _shape_mismatch(model: nn.Module, layouts: list, state: Mapping[str, torch.Tensor]):
    """(name, shape given, shape in the model) for each entry of ``state`` that does not fit."""
    shapes = {name: tuple(layout.global_shape) for _, _, layout in layouts for name in layout.names}
    shapes.update((name, tuple(buf.shape)) for name, buf in _persistent_buffers(model))
    for name, value in state.items():
        if name in shapes and tuple(value.shape) != shapes[name]:
            yield name, tuple(value.shape), shapes[name]


@torch.no_grad()
def _write_full(model: nn.Module, engine: Engine, layouts: list, names: Collection[str],
                value: Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]) -> None:
    """Write the entries ``names`` of a full state dict into the model, parameter by parameter (each cut into its
    shard before the next is fetched), then the persistent buffers; ``value(name, shape, dtype, device)`` fetches
    one entry in that dtype and on that device."""
    touched: list[FlatGroup] = []
    for group, index, layout in layouts:
        name = next((n for n in layout.names if n in names), None)
        if name is not None:
            group.load_full(index, value(name, layout.global_shape, torch.float32, engine.device))
            _loaded(model, group=group, index=index)
            if group not in touched:
                touched.append(group)
    for group in touched:
        group.sync_params()
    for name, buf in _persistent_buffers(model):
        if name in names:
            buf.copy_(value(name, buf.shape, buf.dtype, buf.device))


def _local_value(state: Mapping[str, torch.Tensor]):
    """``_write_full``'s fetch from a state dict this rank holds."""
    return lambda name, shape, dtype, device: state[name].to(device=device, dtype=dtype)


def _loaded(model: nn.Module, group: FlatGroup | None = None, index: int = 0, names=()) -> None:
    """A load reached these parameters: they no longer wait for one ([Note: parameters waiting for a load])."""
    unloaded = getattr(model, "_tiershard_unloaded", None)
    if unloaded is not None:
        if group is not None:
            unloaded.loaded(group, index)
        unloaded.loaded_names(names)


def _check_loaded(model: nn.Module, what: str) -> None:
    unloaded = getattr(model, "_tiershard_unloaded", None)
    if unloaded is not None:
        unloaded.check(what)


def _persistent_buffers(model: nn.Module):
    for mpath, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{mpath}.{name}" if mpath else name), buf


BREAKDOWN = ("master_weights", "optimizer_states", "gradients", "frozen_weights", "working_weights", "hpz_bands",
             "gathered", "comm_buffers", "codec_scratch", "ef_residuals")


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 reset_peaks: bool = False) -> dict[str, int]:
    """Bytes this rank holds for the sharded model ([Note: memory breakdown], runtime/engine.py).

    Model-state formula (as before): ``params``, ``grads``, ``masters``, ``optimizer``, ``hpz``. Measured from
    the live tensors, each storage counted once: ``master_weights`` (fp32), ``optimizer_states``, ``gradients``
    (the masters' ``.grad``, the level-g accumulator, working gradients in backward), ``frozen_weights``,
    ``working_weights`` (the level-p copy: a band when p is finer than os, the whole weights when p = N),
    ``hpz_bands``, ``gathered`` (working tensors with storage now), ``comm_buffers`` (results the stream's jobs
    hold), ``codec_scratch`` (the qwz encoding of the level-p band), ``ef_residuals`` (qgz error feedback), their
    sum ``engine_total`` and ``model_states`` (the first six); the high-water marks ``peak_gathered`` and
    ``peak_gather_buffers`` since ``ts.shard`` or the last ``reset_peaks=True`` (which restarts them after
    reading); on Linux ``resident`` (the process's RSS) and ``other`` = resident - engine_total (activations,
    the allocator's free memory, everything else in the process)."""
    engine = _engine(model)
    total = {"params": 0, "grads": 0, "masters": 0, "optimizer": 0, "hpz": 0}
    masters = set()
    for group in engine.groups():
        masters.update(id(m) for m in group.masters)
        for key, value in group.state_bytes().items():
            total[key] += value
    held = engine.held()
    if optimizer is not None:
        for param, state in optimizer.state.items():
            if id(param) in masters:
                for t in state.values():
                    if isinstance(t, DTensor):
                        t = t._local_tensor
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        total["optimizer"] += t.numel() * t.element_size()
                        held.append(("optimizer_states", t))
    breakdown = dict.fromkeys(BREAKDOWN, 0)
    seen: set[int] = set()
    for what, tensor in held:
        storage = tensor.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            breakdown[what] += storage.nbytes()
    total.update(breakdown)
    total["model_states"] = sum(breakdown[k] for k in BREAKDOWN[:6])
    total["engine_total"] = sum(breakdown.values())
    total["peak_gathered"], total["peak_gather_buffers"] = engine.gauge.peak_gathered, engine.gauge.peak_buffers
    if reset_peaks:
        engine.gauge.reset()
    resident = _resident_bytes()
    if resident is not None:
        total["resident"], total["other"] = resident, resident - total["engine_total"]
    return total


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
