"""Units and their hooks: when each flat group is gathered, released and reduced.

[Note: unit lifecycle]
    forward pre-hook    gather every group of the unit (refreshing weights written in place first), point
                        the module's parameter attributes at the working tensors; inputs that need a gradient
                        pass through ``_PostBackward`` so the unit learns when its backward is over
    forward post-hook   point the attributes back at the masters and release (not inside backward: that is
                        activation-checkpoint recompute), and hook the outputs so the unit is gathered again
                        when their gradient arrives
    output grad hook    gather for backward and use the working tensors; the first one queues the end of
                        backward
    working .grad ready (post-accumulate hook of each trainable working tensor) when every one of the group's
                        tensors has its gradient: reduce to level g, at the boundary on to level os; when that
                        completes every group of a unit with no frozen group, release first ([Note: weights
                        free before the gradient matrix])
    _PostBackward       the gradient of the unit's inputs is computed, so its weights are no longer needed:
                        release, masters back in place (a unit whose inputs need no gradient is released once
                        its trainable groups are reduced: frozen layers below the first adapter)
    end of backward     reduce the trainable groups not reduced yet (zeros for unused ones, so every rank runs
                        the same collectives), release everything, reset the per-backward state
    optimizer.step()    a global post-step hook marks the working copies of every group it stepped stale; the
                        unit's next gather rebuilds them ([Note: deferred rebuild], flat.py)

[Note: unused parameters] A trainable parameter with no gradient at the end of a backward (a unit skipped this
step, a branch not taken) is reduced as a zero gradient, so every rank issues the same collectives whatever its
own forward visited, and it gets a gradient where another rank's is not zero. Single-process training leaves
such a ``grad`` None after ``zero_grad()``, and optimizers skip it; tiershard's zeros are what
``zero_grad(set_to_none=False)`` would leave, which plain SGD and Adam without weight decay apply as no change
until momentum builds, but momentum or weight decay still move. Telling globally unused parameters apart would
cost a collective per step; the unit warns once instead.

[Note: collective order] Every rank must issue the engine's collectives in the same order, so that order may
depend only on the model and on the passes every rank runs, never on what one rank did alone: a forward under
``torch.no_grad()`` on rank 0 only (sample logging) is legal when the weights are replicated (p = N), and it may
visit other units in another order. So:
    a unit's own gather     issued when it runs (the FSDP contract: every rank runs the same units in the same
                            order in every pass that communicates);
    prefetch                the next ``prefetch`` units in registration order (``Engine.units``, the same list on
                            every rank), in backward the previous ones; no order is learned from a past forward;
    replicated rebuilds     after the masters changed (an optimizer step, a write), the first unit that needs
                            its level-p copy rebuilt (os -> p all-gather, [Note: deferred rebuild]) issues the
                            rebuilds of every group that needs one, in registration order, whichever unit that
                            is and whichever units the forward goes on to visit; each is copied into the working
                            tensors on the stream, so they hold no extra memory while they wait.
A rank-local forward therefore issues no collective, or (right after a step) the same rebuilds in the same order
as the next forward of every other rank; in both cases the others' collectives pair with the right ones.

[Note: memory breakdown] ``ts.memory_stats`` walks what the engine really holds (``Engine.held``: each group's
masters, gradients, level-p copy, working tensors, hpz bands, qwz encoding, qgz residuals, and the results the
stream's jobs still hold) and counts every storage once, under the first thing that holds it. Transient weights
are seen through ``MemoryGauge`` (flat.py): the high-water marks of gathered working tensors (a unit from its
gather to its release; the root stays gathered through forward and backward, as FSDP2 keeps it) and of whole
gathered matrices in flight (issued, not yet copied out: up to ``prefetch`` units ahead). The cost model
(``cost.memory.breakdown``) predicts the same numbers from the layout alone; a unit's weights are released before
the next unit's are copied out, so the gathered peak is the root plus the largest other unit, whatever the
prefetch depth. What FSDP2 does not keep, the engine does not keep either: at ``p = os`` there is no separate
level-p copy (each gather casts the masters' band), and a gathered matrix is freed right after its copy-out (the
stream's finished job does not hold it); it is allocated by the thread that frees it, since on CPUs memory the
communication thread allocates comes from, and stays in, that thread's own malloc arena.

[Note: hooks outside the graphs] The unit hooks (forward pre/post, the output-gradient hook) are wrapped in
``torch._dynamo.disable``, as FSDP2's are: gathers, releases, reductions and the stream's threads and locks stay
eager, and a compiled block traces only its own math, with its parameters (the working tensors, plain tensors
of fixed shapes) as graph inputs. So every plan, ZeRO++ options included, compiles to the same graphs and a
plan, a step, an accumulation micro-step, ``no_sync`` or a checkpoint load changes no guard. Tracing the
collectives instead (SimpleFSDP) would need compiled autograd and functional collectives for every comm
strategy (qwZ's codecs, hpZ caches, qgZ's two hops); it is left for later (docs/compile.md).

[Note: what the module shows] Between forward/backward the module's parameters are the masters (DTensors);
inside a unit's forward and backward they are its working tensors (plain tensors of the original shapes).
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm.stream import stream_for
from .outer import OuterSync
from .flat import FlatGroup, MemoryGauge, wait_for_copies
from .optim_state import watch

if TYPE_CHECKING:
    from ..plan import Placement

# Engines in creation order: the post-step sync must run its collectives in the same order on every rank.
_ENGINES: "list[weakref.ref[Engine]]" = []
_STEP_HOOK = None
_PRE_STEP_HOOK = None
_WATCH_HOOK = None


def _outside_graphs(hook):
    """``hook``, run eagerly even when a compiled module calls it ([Note: hooks outside the graphs]).

    Dynamo is imported here, at ``ts.shard``, not with the package: DTensor imports it there anyway."""
    import torch._dynamo

    return torch._dynamo.disable(hook, recursive=True,
                                 reason="tiershard's gathers, releases and reductions run outside compiled graphs")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: containers, mappings, dataclasses (model outputs come in all of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 16 or isinstance(obj, (str, bytes)):
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from tensors_in(value, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None), depth + 1)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's own backward is done."""

    @staticmethod
    def forward(ctx, unit: "Unit", *inputs: torch.Tensor):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.post_backward()
        return (None, *grads)


class Unit:
    """One wrapped module and its flat groups (trainable and frozen)."""

    def __init__(self, path: str, module: nn.Module, groups: list[FlatGroup], engine: "Engine"):
        self.path, self.module, self.groups = path or "<root>", module, groups
        self.engine = engine
        self.fired = [0] * len(groups)
        self.reduced = [False] * len(groups)
        self.awaits_post_backward = False     # its inputs carry _PostBackward: that releases it
        self.warned_unused = False
        for group in groups:
            group.gauge = engine.gauge
        self._pre_backward = _outside_graphs(self._pre_backward)
        self.handles = [module.register_forward_pre_hook(_outside_graphs(self._pre_forward), with_kwargs=True),
                        module.register_forward_hook(_outside_graphs(self._post_forward))]
        for index, group in enumerate(groups):
            if group.trainable:
                for working in group.working:
                    self.handles.append(working.register_post_accumulate_grad_hook(self._grad_hook(index)))

    # ---- what the module shows ([Note: what the module shows]) -----------------------------------
    def _show(self, working: bool) -> None:
        for group in self.groups:
            tensors = group.working if working else group.masters
            for layout, tensor in zip(group.layouts, tensors):
                for module, name in layout.uses:
                    module._parameters[name] = tensor

    def prefetch(self, op: str, exact: bool = False) -> None:
        """Issue this unit's gather now; the unit waits for it when it runs."""
        for group in self.groups:
            group.gather_start(op, exact)

    def gather(self, op: str, exact: bool = False) -> None:
        self.prefetch(op, exact)
        for group in self.groups:
            group.gather_finish()
        self._show(working=True)

    def release(self) -> None:
        self._show(working=False)
        for group in self.groups:
            group.release()

    # ---- forward --------------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        in_backward = _in_backward()
        if not in_backward:
            self.engine.before_forward(self)
        exact = not self.engine.qwz_eval and not torch.is_grad_enabled()
        with torch.profiler.record_function(f"tiershard::gather[{self.path}]"):
            self.gather("param_gather", exact)
        if not in_backward:
            self.engine.prefetch_forward(self, exact)
        if self is self.engine.root and self.engine.cast_dtype is not None:
            cast = self.engine.cast_dtype
            args, kwargs = _map_tensors(lambda t: t.to(cast) if t.is_floating_point() else t, (args, kwargs))
        if torch.is_grad_enabled() and not in_backward:
            flat, spec = tree_flatten((args, kwargs))
            needs = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs:
                self.awaits_post_backward = True
                outs = _PostBackward.apply(self, *(flat[i] for i in needs))
                for i, t in zip(needs, outs):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    def _post_forward(self, module, args, output):
        if _in_backward():
            return None
        hooked = False
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
                    hooked = True
        if hooked and self is self.engine.root:
            self._show(working=False)   # its backward comes first: keep the weights gathered, as FSDP2 does
        else:
            self.release()
        return None

    # ---- backward -------------------------------------------------------------------------------
    def _pre_backward(self, grad):
        self.engine.backward_started()
        with torch.profiler.record_function(f"tiershard::gather_backward[{self.path}]"):
            self.gather("param_gather_backward")
        self.engine.prefetch_backward(self)
        return None

    def _grad_hook(self, index: int):
        group = self.groups[index]

        def hook(tensor: torch.Tensor) -> None:
            self.fired[index] += 1
            if self.fired[index] == len(group.working) and not self.reduced[index]:
                self.reduce(index)
        return hook

    def reduce(self, index: int) -> None:
        group = self.groups[index]
        if all(g.trainable and (r or i == index) for i, (r, g) in enumerate(zip(self.reduced, self.groups))):
            # [Note: weights free before the gradient matrix] every parameter's gradient is complete (autograd
            # accumulates a leaf's gradient once all its uses are done), so no backward step left uses the unit's
            # weights: free them before the matrix is made, as FSDP2 reshards before its reduce-scatter. A frozen
            # group's weights may still serve an input gradient: such a unit waits for _PostBackward.
            self.release()
        with torch.profiler.record_function(f"tiershard::reduce[{self.path}]"):
            group.reduce(boundary=self.engine.sync_grads)
            if not self.engine.overlap:
                self.engine.stream.drain()
        self.reduced[index] = True
        # without a gradient to its inputs, the unit's backward is over once its parameters have theirs
        if not self.awaits_post_backward and all(r or not g.trainable for r, g in zip(self.reduced, self.groups)):
            self.release()

    def post_backward(self) -> None:
        self.release()

    def end_backward(self) -> None:
        for index, group in enumerate(self.groups):
            if group.trainable and not self.reduced[index]:
                self._warn_unused(group)
                self.reduce(index)
        self.reset()

    def _warn_unused(self, group: FlatGroup) -> None:
        """Once per unit: trainable parameters with no gradient in a backward are reduced as zeros ([Note: unused
        parameters]), which an optimizer with momentum or weight decay does not skip as it skips ``grad=None``."""
        missing = [layout.names[0] for layout, w in zip(group.layouts, group.working) if w.grad is None]
        if self.warned_unused or not missing:
            return
        self.warned_unused = True
        warnings.warn(f"unit {self.path}: {len(missing)} trainable parameter(s) got no gradient in this backward on "
                      f"this rank (e.g. {missing[0]}); tiershard reduces them as zero gradients so every rank runs "
                      "the same collectives, as zero_grad(set_to_none=False) would leave them, so an optimizer "
                      "with momentum or weight decay still moves them; freeze what never trains "
                      "(requires_grad_(False)). Said once per unit.", stacklevel=2)

    def reset(self) -> None:
        """Back to the state between steps: masters shown, weights released, per-backward counters cleared."""
        self.release()
        self.fired = [0] * len(self.groups)
        self.reduced = [False] * len(self.groups)
        self.awaits_post_backward = False


class Engine:
    """The sharding state of one model: its units, placement, precision and the backward in flight."""

    def __init__(self, model: nn.Module, placement: "Placement", param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device: torch.device, qwz_eval: bool = False, prefetch: int = 1):
        self.model_ref = weakref.ref(model)
        self.qwz_eval = qwz_eval
        self.prefetch = prefetch            # units gathered ahead; 0: nothing overlaps (the synchronous schedule)
        self.overlap = prefetch > 0
        self._positions: dict[int, int] = {}   # id(unit) -> its place in self.units ([Note: collective order])
        self.placement, self.topology = placement, placement.topology
        self.param_dtype, self.reduce_dtype, self.device = param_dtype, reduce_dtype, device
        self.cast_dtype = param_dtype if param_dtype != torch.float32 else None
        self.units: list[Unit] = []
        self.stream = stream_for(placement.topology)
        self.sync_grads = True
        self._backward_queued = False
        self.gauge = MemoryGauge()          # high-water marks of gathered weights ([Note: memory breakdown])
        self.outer: OuterSync | None = None     # +outer=H: the islands' outer sync ([Note: outer step], outer.py)
        _ENGINES.append(weakref.ref(self))
        _install_step_hook()

    @property
    def root(self) -> Unit:
        return self.units[0]

    def groups(self) -> Iterator[FlatGroup]:
        for unit in self.units:
            yield from unit.groups

    def held(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor the engine keeps alive, by what it holds ([Note: memory breakdown])."""
        out = [item for group in self.groups() for item in group.held()]
        out += [("comm_buffers", t) for result in self.stream.held_results() for t in tensors_in(result)]
        return out

    def settle(self) -> None:
        """Outside backward, undo what a backward that raised left behind: working tensors shown in the module,
        gathered weights, half-counted gradients (the end-of-backward callback never ran). Called at every
        forward, by state_dict hooks and by the ts functions, so the module shows its masters again."""
        if not self._backward_queued or _in_backward():
            return
        self.stream.drain()
        for u in self.units:
            u.reset()
            for group in u.groups:
                for w in group.working:
                    w.grad = None
        self._backward_queued = False

    def before_forward(self, unit: Unit) -> None:
        """Checks at a forward outside backward: recover from a backward that raised, refresh written weights."""
        self.settle()
        for group in unit.groups:
            for layout, master in zip(group.layouts, group.masters):
                if master.requires_grad != group.trainable:
                    raise RuntimeError(
                        f"{layout.name}: requires_grad changed to {master.requires_grad} after ts.shard. "
                        "Trainable and frozen parameters are sharded as separate groups, so set requires_grad "
                        "before calling ts.shard")
            if group.stale:
                group.sync_params()
        if any(g.rebuild_pending and g.pl.p == 0 for g in unit.groups):
            for group in self.groups():        # every replicated rebuild, in registration order
                if group.rebuild_pending and group.pl.p == 0:
                    group.gather_start("param_gather")

    def _position(self, unit: Unit) -> int:
        if len(self._positions) != len(self.units):
            self._positions = {id(u): i for i, u in enumerate(self.units)}
        return self._positions[id(unit)]

    def prefetch_forward(self, unit: Unit, exact: bool) -> None:
        """Issue the gathers of the next units in registration order ([Note: collective order])."""
        if self.prefetch:
            i = self._position(unit)
            for later in self.units[i + 1:i + 1 + self.prefetch]:
                later.prefetch("param_gather", exact)

    def prefetch_backward(self, unit: Unit) -> None:
        """Issue the gathers of the units whose backward comes next: the previous ones in registration order."""
        if self.prefetch:
            i = self._position(unit)
            for earlier in reversed(self.units[max(0, i - self.prefetch):i]):
                earlier.prefetch("param_gather_backward")

    def backward_started(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        for unit in self.units:
            unit.end_backward()
        self.stream.drain()          # every reduction has landed in the masters' gradients
        self._backward_queued = False

    def sync_stepped(self, stepped: set[int]) -> None:
        """Mark stale the working copies of every group whose masters an optimizer just stepped; with outer sync,
        count the step first, and drop every derived copy of the groups its outer step moved."""
        self.settle()
        moved = set()
        if self.outer is not None and any(id(m) in stepped for g in self.outer.groups for m in g.masters):
            moved = self.outer.after_step()
        for group in self.groups():
            if id(group) in moved:
                group.sync_params()
            elif any(id(m) in stepped for m in group.masters):
                group.sync_params(step=True)


def _map_tensors(fn, tree):
    flat, spec = tree_flatten(tree)
    return tree_unflatten([fn(t) if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    _ENGINES[:] = [ref for ref in _ENGINES if ref() is not None]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ref in list(_ENGINES):
        engine = ref()
        if engine is not None:
            engine.sync_stepped(stepped)


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    wait_for_copies()                          # [Note: background copies]
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for ref in list(_ENGINES):
        engine = ref()
        if engine is not None:
            for group in engine.groups():
                if any(id(m) in stepped for m in group.masters):
                    group.note_writes_before_step()


def _watch_optimizer(optimizer, args, kwargs) -> None:
    """[Note: a sharded optimizer's own state_dict] (optim_state.py), once per optimizer."""
    if not optimizer.__dict__.get("_tiershard_watched"):
        engines = [ref() for ref in _ENGINES]
        watch(optimizer, {id(m) for e in engines if e is not None for g in e.groups() for m in g.masters})


def _install_step_hook() -> None:
    global _STEP_HOOK, _PRE_STEP_HOOK, _WATCH_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
        _PRE_STEP_HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
        _WATCH_HOOK = register_optimizer_step_pre_hook(_watch_optimizer)
