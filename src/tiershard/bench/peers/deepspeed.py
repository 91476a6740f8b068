"""DeepSpeed ZeRO-3 and ZeRO-3 + hpZ as peers, on CPU ranks over gloo.

DeepSpeed is the optional extra ``bench`` (``pip install -e '.[bench]'``, pinned; it installs without
touching the CPU torch). On CPU its accelerator picks gloo when oneCCL is absent, and
``deepspeed.init_distributed`` adopts the process group that ``run_local`` or ``torchrun`` already made.

Settings that differ from DeepSpeed's defaults, and why:

- ``stage3_param_persistence_threshold: 0``: every parameter is partitioned, as in ZeRO-3, FSDP2 and
  tiershard (the default keeps parameters under 100k elements replicated on every rank).
- the optimizer is torch's AdamW (``zero_allow_untested_optimizer``), the same one every peer uses, so losses
  compare; DeepSpeed's own Adam kernels would be C++ extensions built at first use.
- ``communication_data_type`` follows ``reduce_dtype``; ``bf16.enabled`` follows ``param_dtype``.

Gradient accumulation is DeepSpeed's own: ``gradient_accumulation_steps`` = micro-steps, ``engine.backward``
divides the loss by it, and ``engine.step()`` after every micro-step steps the optimizer at the boundary.
"""
from __future__ import annotations

import logging
import os

import torch

from .setup import Runner, Setup

VARIANTS = ("deepspeed-zero3", "deepspeed-hpz")
DEEPSPEED_VERSION = "0.19.8"     # the version pinned in the ``bench`` extra and tested here


def unavailable() -> str | None:
    """Why DeepSpeed cannot run here (a sentence), or None when it imports."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:   # ImportError, or DeepSpeed's own checks failing at import
        return f"deepspeed does not import ({type(exc).__name__}: {exc}); install the extra: pip install -e '.[bench]'"
    return None


def ds_config(setup: Setup) -> dict:
    """The DeepSpeed config of ``setup``'s variant (see the module docstring for the non-defaults)."""
    dtypes = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if setup.param_dtype not in dtypes or setup.reduce_dtype not in dtypes:
        raise ValueError(f"DeepSpeed peers run fp32 or bf16, got param_dtype={setup.param_dtype}, "
                         f"reduce_dtype={setup.reduce_dtype}")
    hpz = setup.ranks_per_node if setup.system == "deepspeed-hpz" else 1
    return {
        "train_micro_batch_size_per_gpu": setup.batch_per_rank,
        "gradient_accumulation_steps": setup.micro_steps,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": setup.param_dtype == torch.bfloat16},
        "communication_data_type": dtypes[setup.reduce_dtype],
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedRunner(Runner):
    """The engine is the model; it scales the loss and steps the optimizer at the accumulation boundary."""

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)
        self.model.step()

    def optimizer_step(self) -> None:
        pass


def _prepare(setup: Setup) -> None:
    """Environment and global state DeepSpeed reads, set before the engine is built."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(setup.rank % setup.ranks_per_node))   # asserted by the engine
    os.environ.setdefault("LOCAL_SIZE", str(setup.ranks_per_node))   # the CPU accelerator's devices per node
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import groups

    deepspeed.utils.logger.setLevel(logging.ERROR)
    # ZeRO training on gloo uses no DeepSpeed C++ op. Marking none compatible skips the compiler probe and the
    # shared-memory all-reduce op (used only by inference) that the comm backend would otherwise JIT-build
    # at start, about 20 s with a C++ compiler on first use.
    if "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_backend="gloo")
    # The hpZ group is a process-wide global that ZeRO-3 reuses when present: drop one of another size (or
    # any, for plain ZeRO-3) so several engines, one after another in a process, each get their own variant.
    hpz = setup.ranks_per_node if setup.system == "deepspeed-hpz" else 1
    current = groups._get_zero_param_intra_parallel_group()
    if current is not None and (hpz == 1 or torch.distributed.get_world_size(current) != hpz):
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None


def build(setup: Setup) -> Runner:
    """``setup.system`` is one of ``VARIANTS``."""
    if setup.system not in VARIANTS:
        raise ValueError(f"unknown DeepSpeed variant {setup.system!r}: choose one of {', '.join(VARIANTS)}")
    reason = unavailable()
    if reason:
        raise RuntimeError(reason)
    _prepare(setup)
    import deepspeed

    model = setup.model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=setup.optimizer(model.parameters()),
                                                   config=ds_config(setup))
    return DeepSpeedRunner(engine, optimizer, setup)
