"""torch FSDP2 (``fully_shard``) as a peer: ZeRO-3, HSDP and its hpZ-like ``reshard_after_forward=int``.

Wrapped the way torchtitan wraps a decoder: one ``fully_shard`` per ``Block`` (one all-gather and one
reduce-scatter per block), then the root, which takes the embeddings, the final norm and the tied head.
Mixed precision goes through ``MixedPrecisionPolicy`` (fp32 sharded masters, ``param_dtype`` gathers and
compute, ``reduce_dtype`` reductions), so it matches ``ts.shard(..., param_dtype=, reduce_dtype=)``.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .setup import Runner, Setup

VARIANTS = ("fsdp2", "fsdp2-rs", "fsdp2-hpz", "fsdp2-hsdp", "fsdp2-hsdp-ar")


class FSDP2Runner(Runner):
    """Non-final micro-steps skip the reduce-scatter, or with ``all_reduce_only`` just HSDP's all-reduce; with
    ``sync_every_micro_step`` none is skipped (gradients reduce-scattered every micro-step, as torchtitan does)."""

    def __init__(self, model, optimizer, setup: Setup, all_reduce_only: bool, sync_every_micro_step: bool):
        super().__init__(model, optimizer, setup)
        self.all_reduce_only = all_reduce_only
        self.sync_every_micro_step = sync_every_micro_step

    def micro_step(self, last: bool) -> ContextManager:
        # set on every micro-step: the boundary turns sync back on
        if self.setup.micro_steps > 1 and not self.sync_every_micro_step:
            if self.all_reduce_only:
                self.model.set_requires_all_reduce(last)
            else:
                self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


def build(setup: Setup) -> Runner:
    """``setup.system`` is one of ``VARIANTS``; the mesh is (nodes, ranks_per_node) for HSDP, else 1-D."""
    if setup.system not in VARIANTS:
        raise ValueError(f"unknown FSDP2 variant {setup.system!r}: choose one of {', '.join(VARIANTS)}")
    hsdp = setup.system.startswith("fsdp2-hsdp")
    if hsdp:
        mesh = init_device_mesh("cpu", (setup.world // setup.ranks_per_node, setup.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (setup.world,), mesh_dim_names=("shard",))
    # an int keeps a post-forward copy sharded over that many ranks; FSDP2 maps 1 to False, world to True
    reshard = setup.ranks_per_node if setup.system == "fsdp2-hpz" else True
    mp = MixedPrecisionPolicy(param_dtype=setup.param_dtype, reduce_dtype=setup.reduce_dtype)
    model = setup.model()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)   # root: kept gathered after forward, as FSDP2 defaults
    return FSDP2Runner(model, setup.optimizer(model.parameters()), setup,
                       all_reduce_only=setup.system == "fsdp2-hsdp-ar",
                       sync_every_micro_step=setup.system == "fsdp2-rs")
