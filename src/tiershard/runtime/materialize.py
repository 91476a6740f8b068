"""Materialising a model built on the meta device, one module at a time, into this rank's shards.

[Note: meta init replay] A 7B model does not fit in one rank before sharding, so it is built under
``torch.device("meta")`` and ``ts.shard`` makes its masters directly. Their values come from replaying, one
module at a time with that module's parameters materialised in full on the target device, what eager
construction does:

1. every module in construction order (``named_modules``, parents before children) runs its
   ``reset_parameters()``: what torch's layer constructors do;
2. with ``init=fn``, ``fn(module)`` for every module children first, as ``model.apply(fn)`` does: a model's own
   initialisation (``transformers``' ``_init_weights``, nanoGPT's ``_init_weights``).

With the same seed this consumes the random stream exactly as eager construction does, so the weights are
the same. A parameter tied to an earlier module's (an LM head to the embedding) is a scratch tensor in step 1:
its draws happen and are discarded, as eager construction discards the head's own weight when it is tied.
The last step's values are taken from rank 0 (one broadcast per module), as the eager path does, so ranks
seeded differently still agree. Only one module's parameters exist in full at a time: peak memory is this
rank's shards plus one module. A buffer on the meta device must be written by one of the steps, or ``ts.shard``
raises naming it; a real buffer (accelerate's ``init_empty_weights()`` leaves buffers real: Llama's rotary
``inv_freq``) keeps its values and moves to the target device. A parameter no step writes waits for a load
([Note: parameters waiting for a load]). A write counts however it is made: in place
(``nn.init.normal_(m.weight)``), through ``.data`` (``m.weight.data.normal_()``, which no version counter of the
parameter sees: ``_Watched``), by assigning ``.data`` or by replacing the parameter with one of its shape.

[Note: parameters waiting for a load] Without ``init=`` the replay still runs every ``reset_parameters()``: that
is what eager torch construction does, so a torch-style model gets its eager weights from the seed, as it would
unsharded, and a model whose weights are loaded next gets them from the load, which overwrites them. What no step
writes (a ``transformers`` RMSNorm's or Conv1D's weight without ``init=``, a bare ``nn.Parameter``) is not
initialised: it waits for a load (``ts.load_full_state_dict``, ``model.load_state_dict`` of full tensors or of
DTensors, ``ts.load``), and the first forward (or ``ts.full_state_dict``) while one still waits raises, naming it
and the fix, rather than computing with the uninitialised memory of its shard.
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .engine import Engine
from .flat import FlatGroup

InitFn = Callable[[nn.Module], None]


def tie_empty_weights(model: nn.Module) -> None:
    """Tie a meta-built ``transformers`` model's weights as its config says, as ``from_pretrained`` does.

    Under accelerate's ``init_empty_weights()`` every parameter assignment makes a new meta parameter, so the
    tying of ``post_init`` does not hold (accelerate issue 3668): an LM head meant to be the embedding would be
    loaded with the same values but then trained as a separate weight, unlike the model built on the CPU."""
    if "transformers" not in sys.modules or not any(True for _ in model.parameters()):
        return
    if any(p.device.type != "meta" for p in model.parameters()):
        return
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is not None:
        inner.tie_weights()


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def materialize(model: nn.Module, engine: Engine, device: torch.device, dtypes: dict[int, torch.dtype],
                init: InitFn | None) -> list[tuple[FlatGroup, int]]:
    """Replay the model's initialisation ([Note: meta init replay]) into the masters and real buffers; returns
    the parameters no step wrote, as (group, index): they wait for a load ([Note: parameters waiting for a load])."""
    where = {}     # id(master) -> (group, index): where a parameter's shard lives
    for group in engine.groups():
        for index, master in enumerate(group.masters):
            where[id(master)] = (group, index)
    written: dict[int, bool] = {key: False for key in where}
    last = "init" if init is not None else "reset"
    owners: set[int] = set()
    with torch.no_grad():
        for path, module in model.named_modules():
            _materialize_buffers(module, device)
            if not module._parameters and not module._buffers:
                continue
            full = _open(module, where, device, dtypes, from_masters=False)
            scratch = {name for name, (key, _) in full.items() if key in owners}
            owners.update(key for key, _ in full.values())
            versions = {name: t._version for name, (_, t) in full.items()}
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            _close(module, full, where, written, versions, keep=lambda name: name not in scratch,
                   broadcast=last == "reset")
        if init is not None:
            for path, module in _post_order(model):
                if not module._parameters:
                    init(module)          # buffers only (rotary tables, ...): already real
                    _note_buffer_writes(module)
                    continue
                full = _open(module, where, device, dtypes, from_masters=True)
                versions = {name: t._version for name, (_, t) in full.items()}
                init(module)
                _close(module, full, where, written, versions, keep=lambda name: True, broadcast=True)
    unset = [f"{path}.{name}" if path else name for path, module in model.named_modules()
             for name, buf in module._buffers.items() if buf is not None and getattr(buf, "_ts_unset", False)]
    if unset:
        raise ValueError(f"buffers {unset[:5]} were not initialised on the meta device: give their modules a "
                         "reset_parameters() or pass ts.shard(..., init=fn) that sets them (e.g. "
                         "init=model._init_weights for a transformers model), or build the model under accelerate's "
                         "init_empty_weights(), which keeps buffers real")
    return [(group, index) for key, (group, index) in where.items() if not written[key]]


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    for name, buf in module._buffers.items():
        if buf is not None and buf.device.type != "meta" and buf.device != device:
            module._buffers[name] = buf.to(device)      # a real buffer (init_empty_weights): its values kept
        elif buf is not None and buf.device.type == "meta":
            real = torch.empty_like(buf, device=device)
            real._ts_unset = True           # cleared by the first write (see _close)
            real._ts_version = real._version
            module._buffers[name] = real


def _open(module: nn.Module, where: dict, device: torch.device, dtypes: dict[int, torch.dtype],
          from_masters: bool) -> dict[str, tuple[int, torch.Tensor]]:
    """Swap the module's own masters for full tensors (current values, or empty); returns name -> (id, tensor)."""
    full = {}
    for name, master in module._parameters.items():
        if master is None or id(master) not in where:
            continue
        group, index = where[id(master)]
        dtype = dtypes.get(id(master), master.dtype)
        if from_masters:
            tensor = group.full_param(index).to(dtype)
        else:
            tensor = torch.empty(master.shape, dtype=dtype, device=device)
        full[name] = (id(master), tensor)
        param = nn.Parameter(tensor, requires_grad=master.requires_grad)
        param.__class__ = _Watched
        module._parameters[name] = param
    return full


def _close(module: nn.Module, full: dict, where: dict, written: dict, versions: dict, keep, broadcast: bool) -> None:
    """Cut the written full tensors into the masters' shards (rank 0's values) and put the masters back."""
    for name, (key, tensor) in full.items():
        group, index = where[key]
        changed = _take_writes(module, name, tensor) or tensor._version != versions[name]
        if keep(name) and changed:
            if broadcast and dist.is_initialized():
                dist.broadcast(tensor, src=0)
            group.load_full(index, tensor)
            written[key] = True
        module._parameters[name] = group.masters[index]
    _note_buffer_writes(module)


class _Watched(nn.Parameter):
    """A parameter opened for ``reset_parameters()`` / ``init``: notices writes through ``.data``.

    ``param.data`` is an alias with a version counter of its own, so ``module.weight.data.normal_()`` (older
    ``transformers`` ``_init_weights``, many model repos) moves no counter of ``param``; each alias handed out
    is kept and its counter read at close. Assigning ``.data`` (or replacing the parameter) is a write too."""

    @property
    def data(self):
        alias = torch._C.TensorBase.data.__get__(self)
        self.__dict__.setdefault("_ts_aliases", []).append(alias)
        return alias

    @data.setter
    def data(self, value):
        torch._C.TensorBase.data.__set__(self, value)      # seen at close: the storage is no longer ours


def _take_writes(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether ``init``/``reset_parameters()`` wrote ``module.<name>`` in a way ``tensor``'s own version
    counter misses (through ``.data``, by assigning ``.data``, by replacing the parameter); a new value is
    copied into ``tensor``, which the caller cuts into the shards."""
    current = module._parameters.get(name)
    aliases = current.__dict__.get("_ts_aliases", ()) if current is not None else ()
    through_data = any(alias._version for alias in aliases)
    if current is not None and current.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        return through_data
    if current is None or tuple(current.shape) != tuple(tensor.shape):
        what = "None" if current is None else f"a tensor of shape {tuple(current.shape)}"
        raise ValueError(f"{type(module).__name__}.{name}: the initialisation set it to {what}, but the model's "
                         f"parameter has shape {tuple(tensor.shape)}: write it in place (e.g. "
                         f"`module.{name}.data.normal_()` or `nn.init.normal_(module.{name})`) instead")
    tensor.copy_(current.detach())
    return True


def _note_buffer_writes(module: nn.Module) -> None:
    for buf in module._buffers.values():
        if buf is not None and getattr(buf, "_ts_unset", False) and buf._version != buf._ts_version:
            buf._ts_unset = False


class Unloaded:
    """The parameters of a meta-built model that no initialisation wrote and no load has reached yet ([Note:
    parameters waiting for a load]): every unit's forward refuses to run while one is left."""

    def __init__(self, engine: Engine, pending: list[tuple[FlatGroup, int]]):
        self.pending = {(id(group), index): group.layouts[index] for group, index in pending}
        self.handles = [unit.module.register_forward_pre_hook(self._before_forward, prepend=True)
                        for unit in engine.units]

    def loaded(self, group: FlatGroup, index: int) -> None:
        self.pending.pop((id(group), index), None)
        self._done_if_empty()

    def loaded_names(self, names) -> None:
        """Every waiting parameter one of whose names is in ``names`` (the keys a state dict loaded)."""
        names = set(names)
        for key, layout in list(self.pending.items()):
            if names.intersection(layout.names):
                del self.pending[key]
        self._done_if_empty()

    def _done_if_empty(self) -> None:
        if not self.pending:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def check(self, what: str) -> None:
        if self.pending:
            names = [layout.name for layout in self.pending.values()]
            more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
            raise RuntimeError(f"{what} refused: parameters {names[:5]}{more} of this meta-built model were neither "
                               "initialised (no reset_parameters() of their modules, no init= that writes them) "
                               "nor loaded, so their shards hold uninitialised memory: load them "
                               "(ts.load_full_state_dict(model, state), model.load_state_dict(state) or "
                               "ts.load(path, model)), or pass ts.shard(..., init=fn) with the model's own "
                               "initialisation (e.g. init=model._init_weights for a transformers model)")

    def _before_forward(self, module: nn.Module, args) -> None:
        self.check("forward")
