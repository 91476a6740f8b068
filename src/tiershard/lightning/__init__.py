"""PyTorch Lightning over a tiershard-sharded model: ``pl.Trainer(strategy=tiershard.lightning.TieredStrategy())``.

Lightning's ``ModelParallelStrategy`` already does most of what a sharded model needs (the user shards in
``configure_model()``, no DDP, autocast precision, clipping by torch over DTensor gradients, a folder per
checkpoint), so this strategy is that one with what it lacks for tiershard ([Note: Lightning seams]):

- its sampler splits the data over its ``data_parallel`` mesh dimension (the nodes: it expects tensor
  parallelism inside them); here every rank is a data-parallel rank;
- it has no ``no_sync`` for ``accumulate_grad_batches``: here the micro-steps run under ``ts.no_sync``, so the
  slow reductions run at the accumulation boundary only;
- its checkpoints are the model's and optimizer's DCP state dicts; here they are ``ts.save`` / ``ts.load``
  (sharded, atomic, any world size, plan or topology on load, the engine's own state included) in
  ``PATH/tiershard`` beside Lightning's ``PATH/meta.pt`` (loops, callbacks, schedulers, hyper-parameters);
- a trainable parameter outside every sharded module would train unreduced on each rank: refused in ``setup``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import pytorch_lightning as pl
import torch
import torch.nn as nn
from pytorch_lightning.strategies import ModelParallelStrategy

from ..checkpoint import load, save
from ..runtime.api import no_sync
from ..runtime.guards import refuse_tensor_parallel

__all__ = ["TieredStrategy"]

CHECKPOINT_FOLDER = "tiershard"
METADATA_FILE = "meta.pt"           # Lightning's own name for a folder checkpoint's metadata


def _sharded_modules(root: nn.Module) -> list[nn.Module]:
    return [m for m in root.modules() if getattr(m, "_tiershard", None) is not None]


class TieredStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` for a model ``ts.shard`` sharded in ``configure_model()``."""

    def __init__(self, **kwargs: Any) -> None:
        if "tensor_parallel_size" in kwargs or "data_parallel_size" in kwargs:
            raise ValueError("TieredStrategy takes its tiers from ts.shard's topology: drop data_parallel_size= / "
                             "tensor_parallel_size= (tensor parallelism is ts.Topology(..., tp=k))")
        super().__init__(save_distributed_checkpoint=True, **kwargs)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        sharded = _sharded_modules(self.lightning_module)
        if not sharded:
            raise ValueError("TieredStrategy found no module sharded by ts.shard in the LightningModule: call "
                             "ts.shard(self.model, plan, ts.Topology.from_env()) in configure_model()")
        for module in sharded:
            refuse_tensor_parallel(module, "TieredStrategy")
        inside = {id(p) for m in sharded for p in m.parameters()}
        outside = [n for n, p in self.lightning_module.named_parameters() if p.requires_grad and id(p) not in inside]
        if outside:
            raise ValueError(f"{len(outside)} trainable parameters of the LightningModule are outside every module "
                             f"ts.shard sharded (e.g. {outside[0]!r}); nothing would reduce their gradients: shard "
                             "the module that holds them too (or the whole model in one ts.shard)")

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for module in _sharded_modules(self.lightning_module):
                stack.enter_context(no_sync(module))
            yield None

    # -- checkpoints: ts.save / ts.load ---------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}                     # the weights go through ts.save in save_checkpoint

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}                     # so do the optimizer states

    def _model_and_optimizer(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        sharded = _sharded_modules(self.lightning_module)
        if len(sharded) != 1:
            raise ValueError(f"TieredStrategy checkpoints one sharded module; this LightningModule has "
                             f"{len(sharded)}: shard them as one (one ts.shard over the module holding them)")
        model = sharded[0]
        params = {id(p) for p in model.parameters()}
        owned = [opt for opt in self.optimizers
                 if any(id(p) in params for group in opt.param_groups for p in group["params"])]
        if len(owned) > 1:
            raise ValueError(f"{len(owned)} optimizers hold the sharded model's parameters; a checkpoint carries one: "
                             "use one optimizer with parameter groups")
        optimizer = owned[0] if owned else None
        return model, getattr(optimizer, "_optimizer", optimizer)       # LightningOptimizer wraps it

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TieredStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                            "checkpoints are written by ts.save")
        path = Path(self.broadcast(str(filepath)))
        if self.global_rank == 0 and path.is_file():
            path.unlink()
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        model, optimizer = self._model_and_optimizer()
        save(path / CHECKPOINT_FOLDER, model, optimizer)
        if self.global_rank == 0:
            tmp = path / f".{METADATA_FILE}.tmp"
            torch.save(checkpoint, tmp)
            tmp.replace(path / METADATA_FILE)
        self.barrier("tiershard.lightning.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / CHECKPOINT_FOLDER).is_dir() or not (path / METADATA_FILE).is_file():
            raise ValueError(f"{path} is not a TieredStrategy checkpoint (it needs {CHECKPOINT_FOLDER}/ and "
                             f"{METADATA_FILE}): give ckpt_path= a folder that ModelCheckpoint or "
                             "trainer.save_checkpoint wrote under TieredStrategy")
        model, optimizer = self._model_and_optimizer()
        load(path / CHECKPOINT_FOLDER, model, optimizer)
        return torch.load(path / METADATA_FILE, weights_only=weights_only)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.global_rank == 0:
            shutil.rmtree(filepath, ignore_errors=True)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass                          # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass                          # loaded by load_checkpoint
