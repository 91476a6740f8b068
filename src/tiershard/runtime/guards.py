"""What a sharded model tells the wrappers built for unsharded ones: DDP, accelerate, Trainer, Lightning.

A sharded model already reduces its gradients across ranks; a second data-parallel wrapper around it dies inside
torch (``aten.cat.default got mixed torch.Tensor and DTensor`` while DDP broadcasts the module's states) or, worse,
would train it twice reduced. [Note: foreign wrappers]: each wrapper reads one attribute of the module before it
does anything, and this module answers it:

- ``torch.nn.parallel.DistributedDataParallel`` (yours, Lightning's ``ddp``) takes
  ``set(module._ddp_params_and_buffers_to_ignore)`` first: iterating it raises tiershard's error;
- ``accelerate.Accelerator.prepare_model`` (plain accelerate, ``transformers.Trainer``) first asks
  ``getattr(model, "_is_accelerate_prepared", False)``: its truth value raises tiershard's error, unless
  ``tiershard.hf.Accelerator`` prepared the model (it sets a plain True);
- accelerate's ``no_sync`` and Lightning's use ``model.no_sync()`` where the model has one: it is ``ts.no_sync``.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Iterator

import torch.nn as nn

_ROUTES = ("tiershard.hf.Trainer for transformers.Trainer (or tiershard.hf.sharded_trainer(YourTrainer) for a "
           "subclass such as trl's SFTTrainer), tiershard.hf.Accelerator for accelerate, "
           "tiershard.lightning.TieredStrategy for Lightning (docs/integrations.md)")


class WrapperRefused(RuntimeError):
    """A data-parallel wrapper was given a model that ts.shard already sharded."""


class _RefuseDDP:
    """``module._ddp_params_and_buffers_to_ignore`` of a sharded model: DDP's first read of it raises."""

    def __iter__(self) -> Iterator[str]:
        raise WrapperRefused("DistributedDataParallel around a tiershard-sharded model: ts.shard already reduces "
                             "its gradients across ranks, so train the model as it is (ts.no_sync(model) for "
                             f"accumulation), without DDP; for a framework's loop use {_ROUTES}")


class _RefuseAccelerate:
    """``model._is_accelerate_prepared`` of a sharded model: accelerate's first test of it raises."""

    def __bool__(self) -> bool:
        raise WrapperRefused("accelerate would wrap a tiershard-sharded model in DistributedDataParallel (plain "
                             "Accelerator.prepare, transformers.Trainer): use " + _ROUTES)


def guard_wrappers(model: nn.Module, no_sync: Callable[[nn.Module], ContextManager[None]]) -> None:
    """Mark ``model`` for the wrappers of unsharded models ([Note: foreign wrappers]); ``model.no_sync()`` is
    ``no_sync(model)``."""
    model._ddp_params_and_buffers_to_ignore = _RefuseDDP()
    model._is_accelerate_prepared = _RefuseAccelerate()
    model.no_sync = lambda: no_sync(model)


def mark_prepared(model: nn.Module) -> None:
    """tiershard's own accelerate route prepared ``model``: accelerate may now take it as it is."""
    model._is_accelerate_prepared = True


def is_refusing(model: nn.Module) -> bool:
    """Whether ``model`` still refuses accelerate (sharded, not yet prepared by tiershard's route)."""
    return isinstance(model.__dict__.get("_is_accelerate_prepared"), _RefuseAccelerate)


def refuse_tensor_parallel(model: nn.Module, route: str) -> None:
    """The frameworks give every rank its own rows; ranks of one tensor-parallel group need the same rows."""
    tp = getattr(model._tiershard.topology, "tp", 1)
    if tp > 1:
        raise ValueError(f"{route} splits the data over every rank, but this model is sharded with tensor "
                         f"parallelism (tp={tp}), whose groups need the same rows: train it with the hand-written "
                         "loop of docs/parallelism.md, or shard it without tp=")
