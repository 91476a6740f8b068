"""State on disk: sharded checkpoints through ``torch.distributed.checkpoint`` (``sharded``) and their conversion
to single-file formats (``convert``), which reads them in one process without a process group."""
from __future__ import annotations

from .sharded import CheckpointError, LoadResult, SaveFuture, latest, load, resolve, save, verify

__all__ = ["CheckpointError", "LoadResult", "SaveFuture", "save", "load", "latest", "resolve", "verify"]
