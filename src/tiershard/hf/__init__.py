"""transformers and accelerate over a tiershard-sharded model (docs/integrations.md).

``tiershard.hf.Trainer`` is ``transformers.Trainer`` with ``plan=``, ``topology=`` and ``wrap=``;
``sharded_trainer(SFTTrainer)`` makes the same of any Trainer subclass; ``tiershard.hf.Accelerator`` is
``accelerate.Accelerator`` for a custom loop. Importing this package imports transformers and accelerate.
"""
from __future__ import annotations

from .accelerator import Accelerator
from .trainer import ShardedTrainerMixin, Trainer, sharded_trainer

__all__ = ["Accelerator", "ShardedTrainerMixin", "Trainer", "sharded_trainer"]
