"""``accelerate.Accelerator`` for tiershard-sharded models, as optimum-habana and optimum-neuron extend it.

accelerate's list of distributed types is closed, and for a plain multi-process run its ``prepare`` wraps the
model in DDP, which cannot hold DTensor parameters. This subclass prepares a sharded model the way accelerate
prepares a model that owns its own parallelism (``prepare_model(..., device_placement=False,
evaluation_mode=True)``: autocast and ``torch.compile`` only, as transformers does for models sharded at load
time), and keeps everything else of accelerate: optimizers, schedulers, data loaders, ``backward``,
``accumulate`` / ``no_sync`` (``ts.no_sync`` through ``model.no_sync``), ``clip_grad_norm_`` (torch's, the
global norm over DTensor gradients), ``gather_for_metrics``. ``save_state`` / ``load_state`` carry a sharded
model and its optimizer through ``ts.save`` / ``ts.load`` (any world size, plan or topology on load) in a
``tiershard/`` folder beside accelerate's own files (schedulers, samplers, RNG, scaler, custom objects).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import accelerate
import torch
import torch.nn as nn

from .. import Plan, Topology
from ..checkpoint import load, save
from ..runtime.guards import is_refusing, mark_prepared
from .sharding import is_sharded, job_for, shard_for

CHECKPOINT_FOLDER = "tiershard"


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that shards (``plan=``, ``topology=``, ``wrap=``, as ``ts.shard``; an unsharded
    model with no ``plan=`` gets the planner's pick) or takes a model ``ts.shard`` already sharded."""

    def __init__(self, *args, plan: Plan | str | None = None, topology: Topology | None = None,
                 wrap: object = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tiershard_plan, self.tiershard_topology, self.tiershard_wrap = plan, topology, wrap

    def prepare(self, *args, device_placement: list[bool | None] | None = None):
        """accelerate's ``prepare``; a model sharded here has its parameters replaced by the masters, so the
        optimizers given beside it are pointed at the masters of the same names first (as accelerate does for
        FSDP's flattened parameters)."""
        args = list(args)
        for index, obj in enumerate(args):
            if isinstance(obj, nn.Module) and not is_sharded(obj):
                old = {id(p): name for name, p in obj.named_parameters(remove_duplicate=False)}
                args[index] = obj = self._shard(obj)
                for optimizer in args:
                    if isinstance(optimizer, torch.optim.Optimizer):
                        _point_at_masters(optimizer, obj, old)
        return super().prepare(*args, device_placement=device_placement)

    def _shard(self, model: nn.Module) -> nn.Module:
        return shard_for(model, self.tiershard_plan, self.tiershard_topology, self.tiershard_wrap, self.device,
                         job_for(model, accum=self.gradient_accumulation_steps))

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        if not is_sharded(model):
            model = self._shard(model)
        if not is_refusing(model):
            return super().prepare_model(model, device_placement, evaluation_mode)
        del model.__dict__["_is_accelerate_prepared"]
        prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)
        mark_prepared(model)
        return prepared

    def _sharded(self) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
        """Each sharded model accelerate holds, with the prepared optimizer over its parameters (if any)."""
        pairs = []
        for model in self._models:
            inner = getattr(model, "_orig_mod", model)          # torch.compile's wrapper
            if not is_sharded(inner):
                continue
            params = {id(p) for p in inner.parameters()}
            owned = [opt for opt in self._optimizers
                     if any(id(p) in params for group in opt.optimizer.param_groups for p in group["params"])]
            if len(owned) > 1:
                raise ValueError(f"{len(owned)} optimizers hold parameters of one sharded model: save_state carries "
                                 "one optimizer per sharded model; build one with parameter groups")
            pairs.append((inner, owned[0].optimizer if owned else None))
        return pairs

    @contextlib.contextmanager
    def _without_sharded(self) -> Iterator[list[tuple[nn.Module, torch.optim.Optimizer | None]]]:
        """accelerate's own save/load, blind to the sharded models and their optimizers (they are ts.save's)."""
        pairs = self._sharded()
        models, optimizers = self._models, self._optimizers
        mine_m = {id(m) for m, _ in pairs}
        mine_o = {id(o) for _, o in pairs if o is not None}
        self._models = [m for m in models if id(getattr(m, "_orig_mod", m)) not in mine_m]
        self._optimizers = [o for o in optimizers if id(o.optimizer) not in mine_o]
        try:
            yield pairs
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs) -> str:
        with self._without_sharded() as pairs:
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for index, (model, optimizer) in enumerate(pairs):
            save(Path(location) / _folder(index), model, optimizer)
        return location

    def load_state(self, input_dir: str | None = None, **kwargs) -> None:
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            folders = sorted(Path(self.project_dir, "checkpoints").glob("checkpoint_*"),
                             key=lambda f: int(f.name.rpartition("_")[2]))
            input_dir = str(folders[-1]) if folders else None
        with self._without_sharded() as pairs:
            super().load_state(input_dir, **kwargs)
        for index, (model, optimizer) in enumerate(pairs):
            load(Path(os.path.expanduser(input_dir)) / _folder(index), model, optimizer)


def _point_at_masters(optimizer: torch.optim.Optimizer, model: nn.Module, old: dict[int, str]) -> None:
    """Replace in ``optimizer`` each parameter ``ts.shard`` replaced in ``model`` by its master (same name)."""
    for group in optimizer.param_groups:
        params = group["params"]
        if any(id(p) in old for p in params) and optimizer.state:
            raise ValueError("this optimizer has already stepped the model's parameters before it was sharded: "
                             "build it fresh, or shard the model (ts.shard) before the optimizer takes a step")
        group["params"] = [model.get_parameter(old[id(p)]) if id(p) in old else p for p in params]


def _folder(index: int) -> str:
    return CHECKPOINT_FOLDER if index == 0 else f"{CHECKPOINT_FOLDER}_{index}"
