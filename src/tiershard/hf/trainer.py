"""``transformers.Trainer`` (and any subclass of it, such as trl's ``SFTTrainer``) training a tiershard-sharded model.

Trainer's seams, and what each does here ([Note: Trainer seams]):

- ``__init__``: the model is sharded before Trainer sees it, on ``args.device``; Trainer's ``model.to(device)``
  is then a no-op and its accelerator is ``tiershard.hf.Accelerator`` (no DDP: the model reduces its own
  gradients); ``gradient_accumulation_steps`` goes through ``accelerator.no_sync`` = ``ts.no_sync``,
  ``max_grad_norm`` through torch's clipping over DTensor gradients (the global norm); ``bf16``/``fp16`` are
  accelerate's autocast (fp32 masters, as under DDP), fp16's GradScaler skipping a step on every rank when any
  rank's shard overflowed.
- checkpoints (``save_steps``): the model and optimizer through ``ts.save`` into ``checkpoint-N/tiershard`` on
  every rank (sharded, atomic), beside Trainer's own ``trainer_state.json``, scheduler, scaler and RNG files;
  ``resume_from_checkpoint`` loads them with ``ts.load`` (any world size, plan or topology), and
  ``load_best_model_at_end`` the best one's model. ``save_total_limit`` removes whole ``checkpoint-N`` folders.
- ``save_model(dir)``: every rank gathers the full weights, rank 0 writes a ``from_pretrained`` folder.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import transformers

from .. import Plan, Topology, full_state_dict
from ..checkpoint import load, save
from .accelerator import CHECKPOINT_FOLDER, Accelerator
from .sharding import job_for, shard_for

SCHEDULER_NAME = "scheduler.pt"


class ShardedTrainerMixin:
    """Put before a ``transformers.Trainer`` subclass: ``class MyTrainer(ShardedTrainerMixin, SFTTrainer)``, or
    ``sharded_trainer(SFTTrainer)``. Adds ``plan=``, ``topology=``, ``wrap=`` (as ``ts.shard``; a model that
    ``ts.shard`` already sharded is taken as it is)."""

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *rest: Any, plan: Plan | str | None = None, topology: Topology | None = None, wrap: object = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"{type(self).__name__} needs the model itself (model=an nn.Module, built or on the "
                             f"meta device), not {type(model).__name__}: model_init= and model names are not "
                             "sharded")
        if args is None:
            raise ValueError(f"{type(self).__name__} needs args= (TrainingArguments or its subclass): the plan is "
                             "cut for its device, batch size and accumulation")
        if args.fsdp or args.deepspeed:
            raise ValueError(f"{type(self).__name__} shards the model itself: drop TrainingArguments' "
                             f"{'fsdp' if args.fsdp else 'deepspeed'}= (plan= chooses the placement)")
        device = args.device          # initialises the process group from the launcher's environment
        job = job_for(model, args.per_device_train_batch_size, args.gradient_accumulation_steps,
                      args.gradient_checkpointing)
        model = shard_for(model, plan, topology, wrap, device, job)
        self._tiershard_saving = False
        super().__init__(model, args, *rest, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise ValueError(f"{type(self).__name__} shards the model itself: launch without accelerate's FSDP or "
                             "DeepSpeed configuration (plan= chooses the placement)")
        accelerator = self.accelerator                  # built by Trainer from its arguments, then made ours
        accelerator.__class__ = Accelerator
        accelerator.tiershard_plan = accelerator.tiershard_topology = accelerator.tiershard_wrap = None

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return model                                    # no DataParallel / DDP: the model reduces its gradients

    # -- checkpoints --------------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._tiershard_saving = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._tiershard_saving = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        if self._tiershard_saving:      # checkpoint-N: sharded, with the optimizer (Trainer saves it next) unless
            optimizer = None if self.args.save_only_model else self.optimizer       # asked to save the model only
            save(Path(output_dir) / CHECKPOINT_FOLDER, self.model, optimizer)
            return
        state = full_state_dict(self.model, rank0_only=True)    # a collective: every rank, rank 0 keeps it
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer went into checkpoint-N/tiershard with the model (save_model above)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        folder = Path(resume_from_checkpoint) / CHECKPOINT_FOLDER
        if not folder.is_dir():
            raise ValueError(f"{resume_from_checkpoint} holds no {CHECKPOINT_FOLDER}/ folder, so it was not written "
                             f"by {type(self).__name__}: resume from one of its checkpoint-N folders (a model "
                             "folder from save_pretrained loads with ts.load_full_state_dict)")
        # the weights load with the optimizer, once it exists (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load(Path(checkpoint) / CHECKPOINT_FOLDER, self.model, None if self.args.save_only_model else self.optimizer)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if self.lr_scheduler is not None and scheduler.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        load(Path(self.state.best_model_checkpoint) / CHECKPOINT_FOLDER, self.model)


def sharded_trainer(trainer_class: type) -> type:
    """``trainer_class`` (``transformers.Trainer`` or a subclass) training a tiershard-sharded model:
    ``SFTTrainer = tiershard.hf.sharded_trainer(trl.SFTTrainer)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"sharded_trainer takes transformers.Trainer or a subclass of it, not {trainer_class!r}")
    return type(f"Sharded{trainer_class.__name__}", (ShardedTrainerMixin, trainer_class),
                {"__module__": __name__, "__doc__": f"{trainer_class.__name__} over a tiershard-sharded model."})


class Trainer(ShardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training a tiershard-sharded model; ``plan=``, ``topology=``, ``wrap=`` as
    ``ts.shard`` (defaults: the planner's fastest exact plan, ``Topology.from_env()``, the model's
    ``_no_split_modules``)."""
