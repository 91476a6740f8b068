"""A sharded optimizer's own ``state_dict()`` handed to DCP: said where tiershard can see it.

[Note: a sharded optimizer's own state_dict] ``optimizer.state_dict()`` keys each parameter's states by its
position, and holds this rank's shards. ``dcp.save({"optim": opt.state_dict()})`` writes them, but the usual
resume, ``dcp.load({"optim": fresh.state_dict()})`` into a new optimizer, finds no state to fill (a fresh
optimizer has none yet), so ``fresh.load_state_dict`` restores the hyperparameters only and Adam starts again:
the resumed losses drift from the uninterrupted run's, silently (FSDP2 behaves the same). torch's
``get_state_dict``/``set_state_dict`` (which ``ts.save``/``ts.load`` run) key states by name and create a fresh
optimizer's states before loading. So once an optimizer over a sharded model's parameters has stepped, its
``state_dict()`` returns a ``dict`` that DCP treats as ``Stateful``: when DCP asks it for its state (a value at
the top of ``dcp.save``'s or ``dcp.load``'s state dict) and its states are keyed by position, it warns, naming
the route that works. ``get_state_dict`` re-keys the states by name into a plain dict, so it never warns.

The resume side is seen at the optimizer's first step: ``load_state_dict`` rebuilds each parameter group from
the saved one, whose ``"params"`` comes last (``state_dict()`` packs it last), where a constructed group has it
first. An optimizer whose groups were so loaded, that held no state before its first step and holds some after
it (Adam's moments made afresh; SGD without momentum keeps none and is left alone), warns once, naming the
same routes. ``ts.load`` and ``set_state_dict`` create the states before they load, so they never warn.
"""
from __future__ import annotations

import collections
import warnings
from typing import Any

import torch

__all__ = ["OptimizerStateDict", "watch", "HABIT", "RESTARTED"]

RESTARTED = ("this optimizer was loaded with load_state_dict but held no per-parameter state, so its first step "
             "started its states afresh (Adam's moments and step from zero): a state_dict() of a fresh optimizer, "
             "filled by dcp.load, gets no states. Load with ts.load, or torch's get_state_dict(model, opt) / "
             "set_state_dict (torch.distributed.checkpoint.state_dict), which create the states before loading")
HABIT = ("DCP was given a sharded optimizer's own state_dict() (states keyed by position, this rank's shards): it "
         "restores only into an optimizer that already holds states, so a fresh optimizer (the usual resume) keeps "
         "none and Adam starts again. Save and load with ts.save/ts.load, or torch's get_state_dict(model, opt) / "
         "set_state_dict (torch.distributed.checkpoint.state_dict), which key states by name")


class OptimizerStateDict(dict):
    """What ``state_dict()`` of an optimizer over sharded parameters returns: a plain dict to every reader, which
    DCP also sees as ``Stateful`` ([Note: a sharded optimizer's own state_dict])."""

    def state_dict(self) -> dict:
        if any(isinstance(key, int) for key in self.get("state", {})) or any(
                isinstance(p, int) for group in self.get("param_groups", []) for p in group.get("params", [])):
            warnings.warn(HABIT, UserWarning, stacklevel=3)
        return dict(self)

    def load_state_dict(self, state: dict) -> None:
        self.clear()
        self.update(state)

    def __reduce_ex__(self, protocol: Any):
        # pickled as an OrderedDict, which torch.load(weights_only=True) reads without naming this class
        return (collections.OrderedDict, (), None, None, iter(self.items()))


def _hand_out(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    return OptimizerStateDict(state)


def watch(optimizer: torch.optim.Optimizer, masters: set[int]) -> None:
    """At an optimizer's first step: if it steps any of ``masters`` (ids), its ``state_dict()`` from now on is an
    ``OptimizerStateDict``, and if ``load_state_dict`` left it without states, this step warns once it makes them
    ([Note: a sharded optimizer's own state_dict]). Checked once per optimizer."""
    if optimizer.__dict__.get("_tiershard_watched"):
        return
    optimizer.__dict__["_tiershard_watched"] = True
    if any(id(p) in masters for group in optimizer.param_groups for p in group["params"]):
        optimizer.register_state_dict_post_hook(_hand_out)
        if not optimizer.state and all(_loaded(group) for group in optimizer.param_groups):
            handle = None

            def after_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                handle.remove()
                if optimizer.state:
                    warnings.warn(RESTARTED, UserWarning, stacklevel=4)

            handle = optimizer.register_step_post_hook(after_first_step)


def _loaded(group: dict) -> bool:
    """Whether a parameter group was rebuilt by ``load_state_dict`` (its ``"params"`` last, as ``state_dict()``
    packs it) rather than constructed (``"params"`` first)."""
    keys = [k for k in group if k != "param_names"]
    return len(keys) > 1 and keys[-1] == "params"
