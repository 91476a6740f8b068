"""One flat group: a unit's parameters that share ``requires_grad``, as DTensor masters and slot-major buffers.

States and where they live (levels of the placement; layout in [Note: slot-major layout], layout.py):

    masters    fp32         level os   one nn.Parameter(DTensor) per original parameter: what users and
                                       optimizers see; ``.grad`` a DTensor at level os after the boundary
    p_shard    param_dtype  level p    flat (slots x U) band between uses; the forward's gather source
    working    param_dtype  all        one tensor per parameter, original shape: the module's attribute in
                                       forward and backward; storage freed after use when p is sharded
    hpz        param_dtype  hpz levels bands of the last gathered weights (or their int8 wire encodings under qwz)
    grad_acc   fp32         level g    flat band of the gradients accumulated between optimizer steps

[Note: no stale copies] Every derived copy (p_shard, working, hpz, the qwz encoding) is tagged with
``weights_version``, which only ``sync_params`` advances after rebuilding ``p_shard`` from the masters. The
engine calls it after every optimizer step whatever kernel ran (fused and foreach kernels bump no version
counter), and before a forward when a master shows a write: its version counter moved (in-place ops under
``torch.no_grad()``), or its ``.data`` was taken (``TierMaster``: writes through ``.data`` reach no version
counter at all, so taking it is treated as a write).

[Note: deferred rebuild] ``sync_params`` (after every optimizer step) only drops the derived copies; the
level-p copy (``p_shard``, or the working tensors when p is replicated) is rebuilt from the masters inside the
next gather's job on the stream. The boundary all-gather (os -> p) therefore runs where that gather runs: in the
next forward, for each unit while the units before it compute (prefetch), instead of all of them blocking the
optimizer step. Every rank still issues the same collectives in the same order (the forward order).

[Note: gathering without bumping versions] Autograd saves the working tensors for backward. Gathers write
through ``aliases``, tensors on the same storage with their own version counters, so refilling freed storage
before backward does not trip autograd's in-place check.

[Note: gradients between micro-steps] Under ``ts.no_sync`` the micro-steps accumulate at level g in
``grad_acc``; a master's ``.grad`` holds a ``PendingGrad``, zeros plus whatever the user adds (one element
expanded to the shard's shape until the first write gives it memory), and the boundary adds the reduced
accumulator to it. What DDP would do to the accumulated gradient the user's in-place
writes do here too: ``PendingGrad`` sees each write (``__torch_dispatch__``) and records its effect on the
micro-steps so far, applied to their columns of ``grad_acc`` before the next reduction adds to it: a
multiplication or division by a number scales them (``mul_(1.0)`` changes nothing), an addition leaves them
(``add_(0)`` changes nothing), ``zero_``/``fill_``/``copy_`` (``optimizer.zero_grad(set_to_none=False)``,
foreach or not) drops them, as does setting ``.grad`` to None or to another tensor. Any other write (``clamp_``,
a product with a tensor) would need the micro-steps themselves, which sit reduced at level g: it raises before
changing anything.

[Note: draining before .grad] A master's ``.grad`` (read, set or deleted: ``zero_grad``, ``clip_grad_norm_``,
the optimizer) first waits for the communication stream, so a reduction still in flight (a backward that
raised leaves some behind: its end callback never waits for them) lands before the user reads or clears the
gradient, never after. The engine's own accesses, some of them on the stream, go through ``_get_grad`` /
``_set_grad``.
"""
from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten

from ..comm import collectives as C
from ..comm import hierarchical as H
from ..comm.codecs import codec_from_spec, hop_codecs
from ..comm.quantized import QuantizedGather, QuantizedReduceScatter
from ..comm.weight_diff import DiffGather
from ..comm.stream import drain_all, stream_for
from .layout import ParamLayout, plan_columns

if TYPE_CHECKING:
    from ..plan import Placement


# [Note: background copies] An asynchronous save copies the masters and the optimizer's states in a background
# thread. Until the copy is taken, whatever writes them waits for it: every optimizer step (a global pre-step
# hook, engine.py), ``load_state_dict``, ``ts.load_full_state_dict``, ``ts.load``, and taking a master's ``.data``
# (through which a write reaches no version counter). A failed copy is not raised here: the save's handle
# reports it. In-place writes to a parameter or an optimizer state are caught by the save instead
# ([Note: asynchronous save], checkpoint/sharded.py).
_COPIES: list[Future] = []


def copy_in_background(done: Future) -> None:
    """Register a background copy of the masters; writers wait until ``done`` is set."""
    _COPIES.append(done)


def wait_for_copies(*_: object) -> None:
    """Wait for every background copy of the masters in progress ([Note: background copies])."""
    while _COPIES:
        futures.wait([_COPIES.pop()])


_RAW_GRAD = torch._C.TensorBase.grad
def _get_grad(master: torch.Tensor) -> torch.Tensor | None:
    """``master.grad`` without draining: the engine's own accesses ([Note: draining before .grad])."""
    return _RAW_GRAD.__get__(master)


def _set_grad(master: torch.Tensor, value: torch.Tensor | None) -> None:
    _RAW_GRAD.__set__(master, value)


class TierMaster(DTensor):
    """A master parameter: a DTensor that notices ``.data`` being taken ([Note: no stale copies]), and whose
    ``.grad`` waits for the reductions in flight ([Note: draining before .grad]).

    Assigning ``.data`` would replace the wrapper without its shard (DTensor keeps the old local tensor), so it
    raises instead of losing the value."""

    @property
    def grad(self):
        drain_all()
        return _RAW_GRAD.__get__(self)

    @grad.setter
    def grad(self, value):
        drain_all()
        _RAW_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self):
        drain_all()
        _RAW_GRAD.__delete__(self)

    @property
    def data(self):
        wait_for_copies()
        self._tiershard_touched = True
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        raise RuntimeError("assigning .data of a sharded parameter is not supported (and a sharded model cannot be "
                           "moved or cast after ts.shard): write in place instead, "
                           "`with torch.no_grad(): param.copy_(value)`")


class WatchedMaster(TierMaster):
    """A master under qWD, which sends each gather as a 4-bit difference against the last one: an in-place write
    that replaces its values (``copy_``, ``fill_``, ``zero_``, an ``nn.init`` fill) marks it written wherever it
    happens, inside an optimizer's ``step()`` too (Lookahead and SWA copy weights there), so the next gather sends
    values exactly instead of a rounded difference of a large change ([Note: weight differences])."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _OVERWRITES and args:
            for target in args[0] if isinstance(args[0], (list, tuple)) else (args[0],):
                if isinstance(target, WatchedMaster):
                    target.__dict__["_tiershard_touched"] = True
        return DTensor.__torch_dispatch__(func, types, args, kwargs)


# in-place ops that set a tensor's values rather than move them by a step
_OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_", "cauchy_",
               "log_normal_", "geometric_", "random_", "index_put_", "masked_fill_", "index_fill_", "set_",
               "_foreach_copy_", "_foreach_zero_"}

_SCALES = {"mul_": 1, "_foreach_mul_": 1, "div_": -1, "_foreach_div_": -1}
_ADDS = {"add_", "sub_", "addcmul_", "addcdiv_", "_foreach_add_", "_foreach_sub_", "_foreach_addcmul_",
         "_foreach_addcdiv_"}
_REPLACES = {"zero_", "fill_", "copy_", "_foreach_zero_", "_foreach_copy_"}


class PendingGrad(DTensor):
    """A master's gradient between ``ts.no_sync`` micro-steps: the micro-steps so far are not in it yet (they sit
    at level g), so each in-place write records what it does to them ([Note: gradients between micro-steps])."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default and isinstance(args[0], PendingGrad):
            return _detached(args[0])
        writes = [(a.name, i) for i, a in enumerate(func._schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write]
        for name, i in writes:
            value = args[i] if i < len(args) else kwargs.get(name)
            targets = value if isinstance(value, (list, tuple)) else [value]
            factors = [_write_factor(func, args, kwargs, k, t) if isinstance(t, PendingGrad) else None
                       for k, t in enumerate(targets)]
            for t, factor in zip(targets, factors):      # every write understood: only now record them
                if factor is not None:
                    owner = t.__dict__.get("_tiershard_owner", t)
                    owner.__dict__["_tiershard_scale"] = owner.__dict__.get("_tiershard_scale", 1.0) * factor
                    _materialize(owner)
        return DTensor.__torch_dispatch__(func, types, args, kwargs)


def _materialize(grad: PendingGrad) -> None:
    """Give an unwritten placeholder (one zero expanded to the shard's shape) memory of its own: zeros."""
    if grad.__dict__.pop("_tiershard_unwritten", False):
        local = grad._local_tensor
        grad._local_tensor = torch.zeros(local.shape, dtype=local.dtype, device=local.device)


def _detached(grad: PendingGrad) -> PendingGrad:
    """``grad.detach()`` and ``grad.data``: an alias whose in-place writes are recorded on ``grad`` (old scripts
    scale ``p.grad.data`` between micro-steps; a plain alias would change the values without the micro-steps
    accumulated so far, or fail on the expanded zero with torch's overlap error)."""
    _materialize(grad)
    alias = DTensor.__torch_dispatch__(torch.ops.aten.detach.default, (DTensor,), (grad,), {})
    alias.__class__ = PendingGrad
    alias.__dict__["_tiershard_owner"] = grad.__dict__.get("_tiershard_owner", grad)
    return alias


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float((value.full_tensor() if isinstance(value, DTensor) else value).item())
    return None


def _write_factor(func, args, kwargs, position: int, target: PendingGrad) -> float:
    """What an in-place write to ``target`` (the ``position``-th of a foreach list) does to the micro-steps
    accumulated so far: the factor they are multiplied by (0: dropped). Raises for a write they cannot follow."""
    name = func.overloadpacket.__name__
    others = [t for t in tree_flatten((args[1:], kwargs))[0] if isinstance(t, PendingGrad)]
    if name in _REPLACES and not others:
        return 0.0
    if name in _ADDS and not others:
        return 1.0
    if name in _SCALES and not others and kwargs.get("rounding_mode") is None and len(args) >= 2:
        other = args[1]
        if isinstance(other, (list, tuple)):
            other = other[position]
        number = _number(other)
        if number is not None and (number != 0 or _SCALES[name] > 0):
            return number if _SCALES[name] > 0 else 1.0 / number
    raise RuntimeError(
        f"{func} writes param.grad between ts.no_sync micro-steps, and tiershard cannot apply it to the micro-steps "
        "accumulated so far: they are kept reduced at level g until the boundary, where they reach .grad. Between "
        "micro-steps .grad takes a multiplication or division by a number, an addition, zero_grad() or zero_(); "
        "do anything else after the last micro-step (outside ts.no_sync)")


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on ``tensor``'s storage with a version counter of its own."""
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


class FlatGroup:
    """Storage and level-to-level moves for one group of parameters; no hooks, no schedule."""

    unit = "<unknown>"                 # the module path of its unit (set by ts.shard): named in collective errors

    def __init__(self, layouts: Sequence[ParamLayout], values: Sequence[torch.Tensor] | None, placement: "Placement",
                 trainable: bool, param_dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device):
        topo = placement.topology
        self.layouts, self.pl, self.topo, self.rank = list(layouts), placement, topo, topo.rank
        self.trainable, self.device = trainable, device
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.W = topo.world_size
        self.U = plan_columns(self.layouts)
        self.S = self.W * self.U
        self.cols = tuple(layout.cols for layout in self.layouts)   # the row layout; qgZ's blocks follow it
        # masters: fp32 at level os for trainable parameters; frozen ones are kept only as what compute needs,
        # param_dtype at level p (no fp32 copy, no gradient, no optimizer state)
        self.level = placement.os if trainable else placement.p
        self.master_dtype = torch.float32 if trainable else param_dtype
        self.mesh, self.placements = topo.mesh, topo.placements(self.level)
        # one spec per parameter, shared by its master and its gradients (both fp32 at level os when trainable)
        self.specs = [DTensorSpec(self.mesh, self.placements,
                                  TensorMeta(layout.shape, _contiguous_stride(layout.shape), self.master_dtype))
                      if layout.tp is None else layout.tp.master_spec(topo, self.level, self.master_dtype)
                      for layout in self.layouts]
        self.watch_writes = bool(placement.plan.qwd)     # masters are WatchedMasters under qWD
        self.masters = [self._make_master(i, None if values is None else values[i]) for i in range(len(layouts))]
        if trainable or placement.p > 0:
            locals_ = [torch.empty(layout.shape, dtype=param_dtype, device=device) for layout in self.layouts]
        else:                          # frozen and replicated: the masters' storage is the working copy
            locals_ = [_alias(self.master_local(i)) for i in range(len(self.layouts))]
        # what the modules show in forward and backward; a TP parameter's is a DTensor of its TP spec
        self.working = [nn.Parameter(local, requires_grad=trainable) if layout.tp is None else
                        layout.tp.working(local, trainable) for layout, local in zip(self.layouts, locals_)]
        # their storage, which gathers fill and releases free
        self.working_local = [w._local_tensor if isinstance(w, DTensor) else w for w in self.working]
        self.aliases = [_alias(w) for w in self.working_local]
        self.allocated = True          # the working tensors have storage (always, when p is replicated)
        # the level-p copy is kept only where it differs from the masters' band (p finer than os); at p = os each
        # gather casts the masters' band on the fly, as FSDP2 does ([Note: memory breakdown], engine.py)
        self.p_shard = None if placement.p in (0, placement.os) or not trainable else \
            torch.empty(self.S // self.size(placement.p), dtype=param_dtype, device=device)
        self.grad_acc: torch.Tensor | None = None   # allocated by the first micro-step, handed over at the boundary
        self.island_average = False     # an outer sync's warm-up averages the gradient over the islands too
        # the gradient each master held after the last micro-step ([Note: gradients between micro-steps])
        self._pending: list[torch.Tensor | None] = [None] * len(self.layouts)
        self.hpz: dict[int, tuple[int, torch.Tensor]] = {}   # level -> (weights version, band or its wire)
        plan = placement.plan
        self.qwz = QuantizedGather(codec_from_spec(plan.qwz)) if plan.qwz else None
        # one codec per tier; seeded from torch's seed at ts.shard, so runs seeded alike reduce alike
        self.qgz = QuantizedReduceScatter(hop_codecs(placement.qgz_spec, len(topo.sizes)), plan.error_feedback,
                                          seed=torch.initial_seed()) if plan.qgz else None
        self._encoded_p = None         # (weights version, wire): the qwz encoding of p_shard, reused until it changes
        # qwd: the outermost hpz band, kept across optimizer steps as the reference the next gather's differences
        # are taken against ([Note: weight differences], comm/weight_diff.py); None until an exact gather makes it
        self.qwd = DiffGather(codec_from_spec(plan.qwd)) if plan.qwd else None
        self.reference: torch.Tensor | None = None
        self.cc = plan.cc
        self.stream = stream_for(topo)
        self._gathering = None         # (future of the gathered matrix, exact): a gather in flight
        self._reducing = None          # future of this group's last reduction
        self._rebuild = False          # the masters changed since p_shard (or, replicated, the working copy) was made
        self.weights_version = 0
        self.gathered_version = -1     # weights version the working tensors hold
        self.gauge: MemoryGauge | None = None   # the engine's high-water marks (set by ts.shard)
        elem = torch.empty(0, dtype=param_dtype).element_size()
        self.working_bytes = sum(layout.numel for layout in self.layouts) * elem
        self.matrix_bytes = self.S * elem if placement.p > 0 else 0   # a gathered (slots x U) matrix
        self.sync_params()
        self.release()

    # ---- layout -------------------------------------------------------------------------------
    def size(self, level: int) -> int:
        return self.topo.level_size(level)

    def slots(self, level: int) -> int:
        """Rows of the slot-major matrix a level-``level`` band holds."""
        return self.W // self.size(level)

    def chunk_range(self, level: int) -> tuple[int, int]:
        length = self.S // self.size(level)
        start = self.topo.chunk_index(self.rank, level) * length
        return start, start + length

    def first_slot(self, level: int) -> int:
        return self.topo.chunk_index(self.rank, level) * self.slots(level)

    def group(self, inner: int, outer: int):
        return self.topo.group_for(self.rank, inner, outer)

    # ---- masters ------------------------------------------------------------------------------
    def _dtensor(self, index: int, local: torch.Tensor) -> DTensor:
        """This rank's shard of parameter ``index`` at the masters' level as a DTensor (no autograd, no checks:
        the spec is made once, as FSDP2 does)."""
        return DTensor(local, self.specs[index], requires_grad=False)

    def _make_master(self, index: int, full: torch.Tensor | None) -> nn.Parameter:
        """The master of parameter ``index`` from its full value (None: uninitialised, for a meta model)."""
        band = self.layouts[index].band(self.first_slot(self.level), self.slots(self.level))
        if full is None:
            local = torch.empty(band.shape, dtype=self.master_dtype, device=self.device)
        else:
            local = full.detach().narrow(0, band.start, band.length).to(self.device, self.master_dtype).clone()
        master = nn.Parameter(self._dtensor(index, local), requires_grad=self.trainable)
        master.__class__ = WatchedMaster if self.watch_writes else TierMaster
        return master

    def master_local(self, index: int) -> torch.Tensor:
        return self.masters[index]._local_tensor

    def _master_marks(self) -> list[tuple[int, int, int]]:
        return [(m._version, id(m._local_tensor), m._local_tensor._version) for m in self.masters]

    @property
    def rebuild_pending(self) -> bool:
        """The masters changed and the level-p copy is not rebuilt (nor its rebuild issued) yet."""
        return self._rebuild

    @property
    def stale(self) -> bool:
        """A master was written in place (or had its ``.data`` taken) since the working copies were made."""
        return self._master_marks() != self._synced_marks or \
            any(m.__dict__.get("_tiershard_touched", False) for m in self.masters)

    # ---- parameters: masters -> p_shard -> working ------------------------------------------------
    def _pack_masters(self, dtype: torch.dtype, band: torch.Tensor | None = None) -> torch.Tensor:
        """The masters as this rank's band at their level (slots x U), in ``dtype``: one interleaving copy
        (into ``band`` when given)."""
        n, first = self.slots(self.level), self.first_slot(self.level)
        if band is None:
            band = torch.empty(self.S // self.size(self.level), dtype=dtype, device=self.device)
        _chunk_cat([layout.band(first, n).padded_flat(self.master_local(i)) for i, layout in enumerate(self.layouts)],
                   n, band)
        return band

    def _split_full(self, full: torch.Tensor, outs: Sequence[torch.Tensor], one_by_one: bool = False) -> None:
        """Scatter a whole (slots x U) matrix into per-parameter tensors of the original shapes: one copy each.
        ``one_by_one``: each parameter straight into its tensor (on any device), with no scratch beyond one
        parameter's padded block."""
        if one_by_one:
            columns = full.view(self.W, self.U).split(self.cols, dim=1)
            for layout, out, block in zip(self.layouts, outs, columns):
                if layout.exact:
                    out.view(self.W, layout.cols).copy_(block)
                else:
                    out.copy_(layout.band(0, self.W).real(block.contiguous().view(self.W * layout.rows, layout.row)))
            return
        targets, scratch = [], []
        for layout, out in zip(self.layouts, outs):
            if layout.exact:
                targets.append(out.view(self.W, layout.cols))
            else:
                padded = torch.empty(self.W * layout.rows, layout.row, dtype=full.dtype, device=self.device)
                scratch.append((layout, out, padded))
                targets.append(padded.view(self.W, layout.cols))
        torch.split_with_sizes_copy(full.view(self.W, self.U), self.cols, dim=1, out=targets)
        for layout, out, padded in scratch:
            out.copy_(layout.band(0, self.W).real(padded))

    @torch.no_grad()
    def full_param(self, index: int) -> torch.Tensor:
        """One parameter's full value on every rank, in the masters' dtype: one all-gather of its column
        block, no copy of the whole group (what re-initialising a module one at a time needs)."""
        self.stream.drain()
        layout = self.layouts[index]
        block = layout.band(self.first_slot(self.level), self.slots(self.level)).padded_flat(self.master_local(index))
        gathered = torch.empty(self.W * layout.cols, dtype=self.master_dtype, device=self.device)
        C.all_gather(gathered, block, self.group(0, self.level), self.topo, "state_dict")
        return layout.band(0, self.W).real(gathered.view(self.W * layout.rows, layout.row))

    @torch.no_grad()
    def full_values(self, rank0_only: bool = False, scratch: torch.Tensor | None = None,
                    device: torch.device | None = None) -> list[torch.Tensor]:
        """Every parameter's full fp32 value: one all-gather of the masters for the group, or with
        ``rank0_only`` one gather to rank 0 (the other ranks get an empty list and hold nothing more).
        ``scratch``: fp32 room for the band and the gathered group (``scratch_size``), reused across groups so
        that no unit-sized buffer is allocated and freed per group (freed holes stay resident). ``device``: where
        the values are made (default: the engine's); on another device each parameter is copied there from the
        gathered group, so the engine's device never holds a second copy of the group. Under tensor parallelism
        each TP coordinate gathers its own group, and the TP parameters are then gathered across TP, one at a
        time (with ``rank0_only`` by rank 0's TP group only)."""
        self.stream.drain()
        length = self.S // self.size(self.level)
        band = self._pack_masters(torch.float32, None if scratch is None else scratch[:length])
        group = self.group(0, self.level)
        first = group.ranks[0]                   # rank 0 itself, or its TP peer in this rank's TP coordinate
        if rank0_only and first not in self.topo.tp_ranks(0):
            return []
        if group.size == 1:                      # the band is the whole group: nothing to gather
            full = band
        else:
            size = self.S if not rank0_only or self.rank == first else 0
            full = torch.empty(size, device=self.device) if scratch is None else scratch[length:length + size]
            if rank0_only:
                C.gather_to_first(full, band, group, self.topo, "state_dict")
            else:
                C.all_gather(full, band, group, self.topo, "state_dict")
        if rank0_only and self.rank != first:
            return []
        if not any(layout.tp is not None for layout in self.layouts):
            outs = [torch.empty(layout.shape, device=device or self.device) for layout in self.layouts]
            self._split_full(full, outs, one_by_one=device is not None)
            return outs
        outs = [torch.empty(layout.shape, device=self.device) for layout in self.layouts]
        self._split_full(full, outs)
        del full
        values = []
        for layout, out in zip(self.layouts, outs):
            value = out if layout.tp is None else layout.tp.full(out)
            values.append(value if device is None else value.to(device))
        return [] if rank0_only and self.rank != 0 else values

    def scratch_size(self, rank0_only: bool = False) -> int:
        """fp32 elements ``full_values`` works in on this rank."""
        band = self.S // self.size(self.level)
        group = self.group(0, self.level)
        if group.size == 1:
            return band
        return band + (self.S if not rank0_only or self.rank == group.ranks[0] else 0)

    @torch.no_grad()
    def note_writes_before_step(self) -> None:
        """(Before an optimizer step.) A master written since the last sync (user code between backward and step)
        is a write, not a step: the step's sync must not take the change for a small one under qWD."""
        if self.qwd is not None and self._master_marks() != self._synced_marks:
            for m in self.masters:
                m.__dict__["_tiershard_touched"] = True

    def sync_params(self, step: bool = False) -> None:
        """The masters changed: drop every derived copy. The level-p copy is rebuilt by the next gather, on the
        stream ([Note: deferred rebuild]). ``step``: an optimizer step made the change, a small one, so qwd's
        reference band stays; any other write (a load, ``.data``, an in-place edit) drops it and the next gather
        is exact."""
        self.stream.drain()
        if not step or any(m.__dict__.get("_tiershard_touched", False) for m in self.masters):
            self.reference = None          # a .data taken since the last sync is a write, even if a step followed
        if self._gathering is not None:        # dropped unused: the drained stream no longer holds it either
            self._gathering = None
            self._gauge_add(buffers=-self.matrix_bytes)
        self.weights_version += 1
        self.hpz.clear()
        self._encoded_p = None
        if self.trainable:
            self._rebuild = True
        elif self.pl.p == 0:           # frozen and replicated: the masters are the working copy
            self.gathered_version = self.weights_version
        self._synced_marks = self._master_marks()
        for m in self.masters:
            m.__dict__.pop("_tiershard_touched", None)

    def _rebuild_level_p(self) -> torch.Tensor | None:
        """(On the stream.) The masters brought to level p: the whole matrix when p is replicated, else written
        into ``p_shard`` (returns None)."""
        pl = self.pl
        band = self._pack_masters(self.param_dtype)
        if pl.p < pl.os:
            level_p = torch.empty(self.S // self.size(pl.p), dtype=self.param_dtype, device=self.device)
            self._all_gather(level_p, band, pl.p, pl.os, "param_sync")
        else:
            start, end = self.chunk_range(pl.p)
            base, _ = self.chunk_range(pl.os)
            level_p = band[start - base:end - base]
        if pl.p == 0:
            return level_p
        self.p_shard.copy_(level_p)
        return None

    def gather_start(self, op: str, exact: bool = False) -> None:
        """Issue the gather of the working weights on the stream (a prefetch when nobody waits for it yet):
        from the finest valid copy, an hpz band of the current weights, else the level-p band, rebuilt first
        when the masters changed. ``exact``: skip qwZ and the hpz bands (forwards under no_grad, when asked)."""
        replicated = self.pl.p == 0
        if self._gathering is not None:
            if self._gathering[1] == exact or replicated:   # a replicated rebuild is exact either way
                return
            self._gathering[0].take()              # a prefetch of the other kind: let it finish, unused
            self._gathering = None
            self._gauge_add(buffers=-self.matrix_bytes)
        rebuild = self._rebuild and (replicated or self.p_shard is not None)   # at p = os nothing to rebuild
        if not self._rebuild and (replicated or self.gathered_version == self.weights_version and not exact):
            return                         # replicated weights are always there, and exact (no qwz on them)
        self._rebuild = False
        pl = self.pl
        level, source = pl.p, self.p_shard if self.trainable else None
        for h in () if exact or rebuild else pl.hpz:   # sorted innermost first: the smallest group wins
            cached = self.hpz.get(h)
            if cached is not None and cached[0] == self.weights_version:
                level, source = h, cached[1]
                break
        # the matrix is allocated here, by the thread that frees it after the copy-out: on CPUs a buffer made by
        # the communication thread would come from (and stay in) that thread's own malloc arena
        full = None if replicated else torch.empty(self.S, dtype=self.param_dtype, device=self.device)
        if level == pl.p and source is None:
            # a plain all-gather reads this rank's band from its own slot of the matrix, as FSDP2's all-gather
            # input is a view of its output: packed there, no band beside the matrix
            in_place = (full is not None and not rebuild and not self.cc and self.group(0, level).in_rank_order
                        and self._plain_gather(exact, level))
            source = self._pack_masters(self.param_dtype, full[slice(*self.chunk_range(level))] if in_place else None)
        future = self.stream.submit(self._gather_matrix, op, exact, level, source, self.weights_version, full,
                                    rebuild, unit=self.unit)
        self._gathering = (future, exact)
        self._gauge_add(buffers=self.matrix_bytes)

    def gather_finish(self) -> None:
        """Wait for the gather in flight, if any, and copy it out into the working tensors."""
        if self._gathering is None:
            return
        (future, exact), self._gathering = self._gathering, None
        full, version = future.take()  # the matrix is ours alone now: freed after the copy-out
        if not self.allocated:
            for w in self.working_local:
                w.untyped_storage().resize_(w.numel() * w.element_size())
            self.allocated = True
            self._gauge_add(gathered=self.working_bytes)
        if full is not None:           # None: a replicated rebuild, already in the working tensors
            self._copy_out(full)
            del full
        self._gauge_add(buffers=-self.matrix_bytes)
        # an exact copy is not reused under qwz; a replicated copy is always exact and stays until the next step
        self.gathered_version = version if self.pl.p == 0 or not exact else -1

    @torch.no_grad()
    def gather(self, op: str, exact: bool = False) -> None:
        self.gather_start(op, exact)
        self.gather_finish()

    def _plain_gather(self, exact: bool, level: int) -> bool:
        """Whether a gather from ``level`` all-gathers the band as it is: no qwd differences (against the level-p
        band) and no qwz encoding."""
        return exact or (self.qwz is None and (self.qwd is None or level != self.pl.p))

    def _gather_matrix(self, op: str, exact: bool, level: int, source: torch.Tensor, version: int,
                       full: torch.Tensor | None, rebuild: bool = False):
        """(On the stream.) The whole (slots x U) matrix of the weights, and the hpz bands it leaves behind;
        with ``rebuild`` the level-p copy is made from the masters first."""
        pl = self.pl
        if rebuild:
            level_p = self._rebuild_level_p()
            if level_p is not None:        # replicated: the rebuilt copy is the whole matrix; into the working
                self._split_full(level_p, self.aliases)    # tensors here, so rebuilds issued early hold no copy
                return None, version
        encoded = None
        if self._plain_gather(exact, level):
            self._all_gather(full, source, 0, level, op)
        elif self.qwd is not None and level == pl.p:
            self._gather_differences(full, source, version, op)
        else:
            chunks, numel = self.size(pl.p), self.S // self.size(pl.p)
            if level == pl.p:
                if self._encoded_p is None or self._encoded_p[0] != version:
                    self._encoded_p = (version, self.qwz.encode(source))
                source = self._encoded_p[1]
            encoded = self.qwz.gather(source, self.group(0, level), chunks, numel, self.topo, op)
            self.qwz.decode(encoded, chunks, numel, out=full)
        for h in () if exact else pl.hpz:
            if self.hpz.get(h, (None,))[0] != version:
                self.hpz[h] = (version, self._hpz_band(h, full, encoded))
        return self.stream.hand_over(full), version

    def _gather_differences(self, full: torch.Tensor, chunk: torch.Tensor, version: int, op: str) -> None:
        """(On the stream.) qwd: the reference band moved on by every member's quantized difference over the
        tiers above it, then the whole matrix gathered exactly from the bands inside them; the first gather (no
        reference yet) sends values exactly and keeps its band as the reference."""
        h = self.pl.hpz[-1]
        if self.reference is None:
            self._all_gather(full, chunk, 0, self.pl.p, op)
            start, end = self.chunk_range(h)
            self.reference = full[start:end].clone()
        else:
            self.reference = self.qwd.gather(chunk, self.reference, self.group(h, self.pl.p), self.topo,
                                             "param_diff")
            self._all_gather(full, self.reference, 0, h, op)
        self.hpz[h] = (version, self.reference)

    def _copy_out(self, full: torch.Tensor) -> None:
        self._split_full(full, self.aliases)

    @torch.no_grad()
    def release(self) -> None:
        """Free the working tensors when p is sharded (the hpz bands of these weights stay behind)."""
        if self.pl.p == 0 or not self.allocated:
            return
        for w in self.working_local:
            w.untyped_storage().resize_(0)
        self.allocated = False
        self.gathered_version = -1
        self._gauge_add(gathered=-self.working_bytes)

    def _gauge_add(self, gathered: int = 0, buffers: int = 0) -> None:
        if self.gauge is not None and self.pl.p > 0:
            self.gauge.add(gathered, buffers)

    def held(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor this group keeps alive, by what it holds ([Note: memory breakdown], engine.py); a storage
        may appear twice (a gradient that views the accumulator, frozen replicated weights): count it once."""
        out = []
        for i, master in enumerate(self.masters):
            out.append(("master_weights" if self.trainable else "frozen_weights", self.master_local(i)))
            grad = _get_grad(master)
            if grad is not None:
                out.append(("gradients", grad._local_tensor if isinstance(grad, DTensor) else grad))
        out += [("gradients", t) for t in (self.grad_acc, *(p._local_tensor for p in self._pending if p is not None))
                if t is not None]
        if self.p_shard is not None:
            out.append(("working_weights", self.p_shard))
        out += [("working_weights" if self.pl.p == 0 else "gathered", w) for w in self.working_local]
        out += [("gradients", w.grad._local_tensor if isinstance(w.grad, DTensor) else w.grad)
                for w in self.working if w.grad is not None]
        out += [("hpz_bands", band) for _, band in self.hpz.values()]
        if self.reference is not None:
            out.append(("hpz_bands", self.reference))
        if self._encoded_p is not None:
            out.append(("codec_scratch", self._encoded_p[1]))
        if self.qgz is not None:
            out += [("ef_residuals", r) for r in self.qgz.residuals.values()]
        return out

    def _hpz_band(self, level: int, full: torch.Tensor, encoded):
        """This rank's level-``level`` band of the gathered weights: exact values, or under qwz the encodings
        exactly as received (never re-quantized from a dequantized copy)."""
        if encoded is None:
            start, end = self.chunk_range(level)
            return full[start:end].clone()
        ratio = self.size(self.pl.p) // self.size(level)
        index = self.topo.chunk_index(self.rank, level)
        return self.qwz.chunk_wires(encoded, index * ratio, ratio, self.S // self.size(self.pl.p)).clone()

    # ---- gradients: working .grad -> grad_acc (level g) -> master.grad (level os) ----------------
    @torch.no_grad()
    def reduce(self, boundary: bool) -> None:
        """Issue this micro-step's reduction: gradients to level g, accumulated (the DDP mean), and at the
        boundary on to the masters' gradients at level os. The working gradients are interleaved here; the
        collectives run on the stream while backward goes on.

        Off the boundary the masters get ``PendingGrad`` placeholders, whose writes ``apply_grad_writes`` brings
        to the micro-steps so far ([Note: gradients between micro-steps])."""
        if self._reducing is not None:
            self._reducing.result()        # the group's previous reduction reads and writes the same state
        self.stream.wait_previous("reduce")    # its matrix is freed before this one is made
        self.apply_grad_writes()
        pieces = []
        for layout, w in zip(self.layouts, self.working):
            grad, w.grad = w.grad, None
            if grad is not None and layout.tp is not None:
                grad = layout.tp.local_grad(grad)
            if grad is None:
                pieces.append(torch.zeros(self.W * layout.cols, dtype=self.param_dtype, device=self.device))
            else:
                pieces.append(layout.band(0, self.W).padded_flat(grad))
        full = torch.empty(self.S, dtype=self.reduce_dtype, device=self.device)
        _chunk_cat(pieces, self.W, full)
        del pieces
        self._reducing = self.stream.submit(self._reduce_matrix, [full], boundary, unit=self.unit, bound="reduce")

    def _reduce_matrix(self, matrix: list[torch.Tensor], boundary: bool) -> None:
        """(On the stream.) Reduce-scatter to level g, accumulate, and at the boundary finish at level os.
        ``matrix`` holds the gradient matrix; on a CPU it is dropped once reduced (the collective has returned),
        so it is not alive through the accumulation and the boundary's collectives (on CUDA the job keeps it
        until the device is past it)."""
        pl = self.pl
        full = matrix[0]
        # the DDP mean over the ranks that average (the world; an island with outer sync): divide before an fp16
        # sum can overflow, else while accumulating
        early, ranks = self.reduce_dtype == torch.float16, self.size(pl.dp_level)
        if early:
            full.div_(ranks)
        reduced = full if pl.g == 0 else self._reduce_scatter(full, 0, pl.g, "grad_reduce")
        del full
        if self.device.type == "cpu":
            matrix.clear()
        scale = 1.0 if early else 1.0 / ranks
        if self.grad_acc is None:      # a fresh buffer either way: adopt it
            self.grad_acc = reduced.to(torch.float32)
            if scale != 1.0:
                self.grad_acc.mul_(scale)
        else:
            self.grad_acc.add_(reduced, alpha=scale)
        if boundary:
            self._sync_grads()
        else:
            self._mark_grads()

    def apply_grad_writes(self) -> None:
        """What the user did to ``.grad`` since the last micro-step, applied to the micro-steps accumulated so far,
        as DDP would ([Note: gradients between micro-steps]): scaled by the in-place writes recorded, dropped when
        ``.grad`` was zeroed, set to None (``zero_grad()``) or replaced."""
        if self.grad_acc is None:      # nothing accumulated since the last boundary
            return
        band = self.grad_acc.view(self.slots(self.pl.g), self.U)
        for i, (layout, master) in enumerate(zip(self.layouts, self.masters)):
            held = self._pending[i]
            if held is None:
                continue
            grad = _get_grad(master)
            factor = held.__dict__.pop("_tiershard_scale", 1.0) if grad is held else 0.0
            if factor != 1.0:
                columns = band[:, layout.offset:layout.offset + layout.cols]
                columns.zero_() if factor == 0.0 else columns.mul_(factor)
            if grad is not held:
                self._pending[i] = None

    def _mark_grads(self) -> None:
        """(On the stream.) Give every master a ``PendingGrad`` (zeros, or the tensor the user set, in place),
        whose writes the next micro-step applies to the accumulator. New zeros are one element expanded to the
        shard's shape until something writes them: the micro-steps sit in ``grad_acc``, and a second fp32 copy
        of the gradient shard for placeholders nobody writes was the largest cost of accumulating."""
        for i, master in enumerate(self.masters):
            grad = _get_grad(master)
            if grad is None:
                like = self.master_local(i)
                zeros = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
                grad = self._dtensor(i, self.stream.hand_over(zeros))
                grad.__dict__["_tiershard_unwritten"] = True
            elif type(grad) is DTensor and grad._spec == self.specs[i]:
                grad = self._dtensor(i, grad._local_tensor)     # the tensor the user set: its writes count too
            if type(grad) is DTensor:
                grad.__class__ = PendingGrad
                _set_grad(master, grad)
            self._pending[i] = grad

    def _reduce_scatter(self, buf: torch.Tensor, inner: int, outer: int, op: str) -> torch.Tensor:
        """Sum over the (inner -> outer) group, keeping this rank's level-``outer`` chunk; qgz goes tier by tier."""
        if self.qgz is not None:
            hops = [self.group(k - 1, k) for k in range(inner + 1, outer + 1)]
            return self.qgz(buf, hops, self.topo, op, key=(inner, outer), segments=self.cols, first_tier=inner + 1)
        if self.cc:
            return H.reduce_scatter(buf, inner, outer, self._hop, self.topo, op)
        out = torch.empty(self.S // self.size(outer), dtype=buf.dtype, device=self.device)
        C.reduce_scatter(out, buf, self.group(inner, outer), self.topo, op)
        return out

    # ---- collectives between two levels: one flat ring, or one phase per tier with cc (PaRO-CC) ---------
    def _hop(self, k: int):
        return self.group(k - 1, k)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, inner: int, outer: int, op: str) -> None:
        if self.cc:
            H.all_gather(out, shard, inner, outer, self._hop, self.topo, op)
        else:
            C.all_gather(out, shard, self.group(inner, outer), self.topo, op)

    def _all_reduce(self, buf: torch.Tensor, inner: int, outer: int, op: str) -> None:
        if self.cc:
            H.all_reduce(buf, inner, outer, self._hop, self.topo, op)
        else:
            C.all_reduce(buf, self.group(inner, outer), self.topo, op)

    def _sync_grads(self) -> None:
        """At the accumulation boundary: finish the reduction over the world (the island with outer sync), at level
        os, into the masters' grads."""
        pl, top = self.pl, self.pl.dp_level
        # the masters' gradients may be views of the accumulator: hand it over, the next micro-step starts anew
        acc, self.grad_acc = self.grad_acc, None
        if pl.g == pl.os == top:       # reduced over the world already: the fp32 sum is the gradient (a round
            out = acc                  # trip through reduce_dtype would only round the accumulation)
        else:
            buf = acc.to(self.reduce_dtype)
            del acc         # not alive beside the fp32 result made below
            if pl.g < pl.os:
                out = self._reduce_scatter(buf, pl.g, pl.os, "grad_sync")
                self._all_reduce(out, pl.os, top, "grad_sync")
            else:
                self._all_reduce(buf, pl.g, top, "grad_sync")
                out = buf
                if pl.g > pl.os:
                    out = torch.empty(self.S // self.size(pl.os), dtype=self.reduce_dtype, device=self.device)
                    self._all_gather(out, buf, pl.os, pl.g, "grad_sync")
            out = out.to(torch.float32)
        if self.island_average:        # an outer sync's warm-up: the islands' mean ([Note: outer warm-up])
            cross = self.group(top, top + 1)
            C.all_reduce(out, cross, self.topo, "outer_warmup")
            out.div_(cross.size)
        self._add_to_master_grads(self.stream.hand_over(out))
        self._pending = [None] * len(self.layouts)

    def _add_to_master_grads(self, band: torch.Tensor) -> None:
        """Split a level-os (slots x U) band into the masters' gradient shards and add them in."""
        n_os = self.slots(self.pl.os)
        if n_os == 1:       # one slot: the band is the parameters' padded shards end to end, no copy needed
            blocks = list(band.split(self.cols))
        else:
            blocks = [torch.empty(n_os, c, device=self.device) for c in self.cols]
            torch.split_with_sizes_copy(band.view(n_os, self.U), self.cols, dim=1, out=blocks)
        for i, (layout, master, block) in enumerate(zip(self.layouts, self.masters, blocks)):
            b = layout.band(self.first_slot(self.pl.os), n_os)
            local = b.real(block.view(b.padded, layout.row))
            grad = _get_grad(master)
            unwritten = isinstance(grad, PendingGrad) and grad.__dict__.get("_tiershard_unwritten")
            if grad is None or unwritten:       # an unwritten placeholder is zeros: zeros + local is local
                _set_grad(master, self._dtensor(i, self.stream.hand_over(local)))
            elif isinstance(grad, PendingGrad):     # the boundary: from now on a plain gradient
                _set_grad(master, self._dtensor(i, grad._local_tensor.add_(local)))
            else:
                grad._local_tensor.add_(local)

    # ---- whole-state helpers ------------------------------------------------------------------
    @torch.no_grad()
    def load_full(self, index: int, full: torch.Tensor) -> None:
        """Write a parameter's full fp32 value: every rank has it, so each cuts its own shard."""
        layout = self.layouts[index]
        b = layout.band(self.first_slot(self.level), self.slots(self.level))
        local = full.detach() if layout.tp is None else layout.tp.local_of(full.detach())
        self.master_local(index).copy_(local.narrow(0, b.start, b.length))

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each persistent model state this rank holds for the group."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        masters = sum(nbytes(self.master_local(i)) for i in range(len(self.masters)))
        if not self.trainable:         # frozen: the masters are the working copy at level p
            params, masters = masters, 0
        elif self.pl.p > 0:
            params = nbytes(self.p_shard)
        else:
            params = sum(nbytes(w) for w in self.working_local)
        hpz = sum(nbytes(value) for _, value in self.hpz.values())
        return {
            "params": params,
            "grads": self.S // self.size(self.pl.g) * 4 if self.trainable else 0,   # the level-g accumulator
            "masters": masters,
            "hpz": hpz,
        }


class MemoryGauge:
    """High-water marks of what an engine's gathers hold ([Note: memory breakdown], engine.py): working tensors
    with storage (``gathered``) and whole matrices issued and not yet copied out (``buffers``)."""

    def __init__(self) -> None:
        self.gathered = self.buffers = 0
        self.reset()

    def reset(self) -> None:
        self.peak_gathered, self.peak_buffers = self.gathered, self.buffers

    def add(self, gathered: int, buffers: int) -> None:
        self.gathered += gathered
        self.buffers += buffers
        self.peak_gathered = max(self.peak_gathered, self.gathered)
        self.peak_buffers = max(self.peak_buffers, self.buffers)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(tuple(shape)):
        out.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(out))


def _chunk_cat(pieces: list[torch.Tensor], chunks: int, out: torch.Tensor) -> None:
    """Interleave flat per-parameter pieces (each a multiple of ``chunks``, one dtype) into a (chunks x U) matrix,
    converting to ``out``'s dtype on the way: one kernel. Zero-size pieces (a zero-size parameter) are left out,
    as torch's kernel refuses them."""
    pieces = [piece for piece in pieces if piece.numel()]
    if pieces:
        torch._chunk_cat(pieces, dim=0, num_chunks=chunks, out=out.view(chunks, -1))
