"""Import paths of modules that moved, kept working until a named release: ``tiershard.local`` is
``tiershard.cluster.local``, and so on (docs/changelog.md lists them).

[Note: moved names] One policy for every module that moves: its old path gets an entry in ``MOVED`` and a row in
docs/changelog.md, and keeps importing until the release ``REMOVED_IN`` names. An old path imports the module
at its new path and binds the same module object under the old name, so ``tiershard.models.GPT is
tiershard.train.models.GPT`` and patches through either name reach the same code. A ``DeprecationWarning`` names
the new path and the release that removes the old one. tests/test_layout.py checks each entry and the changelog.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

MOVED = {
    "tiershard.local": "tiershard.cluster.local",
    "tiershard.clusters": "tiershard.cost.presets",
    "tiershard.traffic": "tiershard.cost.traffic",
    "tiershard.convert": "tiershard.checkpoint.convert",
    "tiershard.models": "tiershard.train.models",
    "tiershard.models.gpt": "tiershard.train.models.gpt",
    "tiershard.data": "tiershard.train.data",
    "tiershard.trainer": "tiershard.train.trainer",
    "tiershard.train_config": "tiershard.train.config",
    "tiershard.progress": "tiershard.train.progress",
    "tiershard.peers": "tiershard.bench.peers",
    "tiershard.peers.fsdp2": "tiershard.bench.peers.fsdp2",
    "tiershard.peers.deepspeed": "tiershard.bench.peers.deepspeed",
    "tiershard.measure": "tiershard.bench.measure",
    "tiershard.comm.codec_kernels": "tiershard.comm.codecs.native",
    "tiershard.comm.codec_triton": "tiershard.comm.codecs.triton_kernels",
    "tiershard.cost.clusters": "tiershard.cost.presets",
}
REMOVED_IN = "0.3.0"    # the release that drops every old path above


def message(old: str) -> str:
    """The warning an old path gives."""
    return f"{old} moved to {MOVED[old]}: import it from there ({old} is removed in tiershard {REMOVED_IN})"


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at the new one."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec):
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has just stamped the old name's spec on the module: give it back its own.
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """First on the meta path: otherwise ``tiershard.models.gpt`` would be found again, as a second copy of the
    module, in the folder of ``tiershard.models`` (which is ``tiershard.train.models``)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
