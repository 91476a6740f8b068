"""What ``ts.shard`` is given, checked before anything is touched: the obvious spellings of its arguments (a dtype
by name, a topology by its sizes) are taken, and the habits of other sharders (a model ``fully_shard`` already
wrapped, FSDP's keywords) are refused with tiershard's equivalent named."""
from __future__ import annotations

import difflib
from typing import Sequence

import torch
import torch.nn as nn

from ..plan import Plan
from ..topology import Topology

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
          "fp64": torch.float64, "float64": torch.float64, "double": torch.float64}

_PLANS_TABLE = "README's 'Plans' section has the table of FSDP2 settings and their tiershard plans"

# keyword of FSDP2's fully_shard (or of FSDP1's wrapper) -> what ts.shard takes instead
FSDP2_KEYWORDS = {
    "mesh": "use topology= (ts.Topology((ranks_per_node, world_size)), or ts.Topology.from_env() under torchrun)",
    "mp_policy": "use param_dtype= and reduce_dtype=",
    "reshard_after_forward": ("use the plan: True is 'zero3' (GGG), an int (ranks per node) 'GGG+hpz', and False "
                              "is closest to 'NGG' (gathered parameters kept between uses)"),
    "shard_placement_fn": "no equivalent: ts.shard cuts every parameter on dim 0",
    "offload_policy": "no equivalent: the states stay on the model's device",
    "ignored_params": "no equivalent: every parameter is sharded (frozen ones only as the working copy at level p)",
}
FSDP1_KEYWORDS = {
    "auto_wrap_policy": "use wrap= (module classes, class names, or a predicate)",
    "sharding_strategy": "use the plan ('zero3', 'zero2', 'hsdp', 'IIG', ...)",
    "mixed_precision": "use param_dtype= and reduce_dtype=",
    "device_id": "use device= (where a meta-device model is materialised; otherwise the model's own device)",
}


def refuse_keywords(given: dict, accepted: Sequence[str]) -> None:
    """A TypeError for keywords ``ts.shard`` does not take: FSDP's named with their equivalent, others with the
    closest accepted name."""
    for key, value in given.items():
        if key in FSDP2_KEYWORDS or key in FSDP1_KEYWORDS:
            origin = "FSDP2's fully_shard" if key in FSDP2_KEYWORDS else "FullyShardedDataParallel's"
            use = FSDP2_KEYWORDS.get(key) or FSDP1_KEYWORDS[key]
            if key in ("mp_policy", "mixed_precision") and hasattr(value, "param_dtype"):
                use = f"use param_dtype={value.param_dtype}, reduce_dtype={getattr(value, 'reduce_dtype', None)}"
            raise TypeError(f"ts.shard has no {key}= ({origin} keyword): {use}; {_PLANS_TABLE}")
        close = difflib.get_close_matches(key, list(accepted), n=1)
        hint = f"did you mean {close[0]}=? " if close else ""
        raise TypeError(f"ts.shard() got an unexpected keyword argument {key!r}: {hint}it takes "
                        f"{', '.join(f'{name}=' for name in accepted)}")


def as_dtype(value: object, what: str) -> torch.dtype | None:
    """A torch dtype, or its name ('bf16', 'bfloat16', 'fp16', 'float32', 'torch.float16', ...)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
        raise ValueError(f"{what}={value!r} is not a dtype name tiershard knows: pass a torch dtype such as "
                         f"torch.bfloat16, or one of {', '.join(repr(k) for k in DTYPES)}")
    raise TypeError(f"{what}= must be a torch dtype or its name (e.g. torch.bfloat16 or 'bf16'), got "
                    f"{type(value).__name__} {value!r}")


def as_topology(value: object) -> Topology:
    """A ``Topology``, or its tier sizes innermost first (``(2, 4)``)."""
    if isinstance(value, Topology):
        return value
    if value is None:
        raise TypeError("ts.shard needs a topology: ts.Topology.from_env() under torchrun, or the tier sizes "
                        "innermost first, e.g. (2, 4) for 2 nodes of 2 ranks")
    if (isinstance(value, (tuple, list)) and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return Topology(tuple(value))
    if type(value).__name__ == "DeviceMesh":
        raise TypeError("topology= takes a ts.Topology, not a DeviceMesh (FSDP2's mesh=): pass "
                        f"ts.Topology((ranks_per_node, world_size)) or ts.Topology.from_env(); {_PLANS_TABLE}")
    raise TypeError(f"topology={value!r} must be a ts.Topology or its tier sizes innermost first, e.g. (2, 4) for "
                    "2 nodes of 2 ranks")


def as_plan(value: object) -> Plan:
    """A ``Plan``, or its text."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, str):
        return Plan.parse(value)
    if value is None:
        raise TypeError("ts.shard needs a plan: its text ('zero3', 'IIG', 'zero++', ...) or a ts.Plan")
    raise TypeError(f"plan={value!r} must be a ts.Plan or its text ('zero3', 'IIG', 'zero++', ...)")


def refuse_wrapped(model: nn.Module) -> None:
    """A model another sharder or DDP already wrapped would die inside torch's collectives (DTensor parameters
    that are not tensor-parallel, flat parameters): name what it is and what to pass instead."""
    fsdp2 = _fsdp2_module_class()
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for path, module in model.named_modules():
        where = f" ({path or 'the root'} is {type(module).__name__})"
        if fsdp2 is not None and isinstance(module, fsdp2):
            raise ValueError(f"this is an FSDP2 model: torch.distributed.fsdp.fully_shard already sharded it{where}; "
                             "ts.shard does the sharding itself, so pass the unwrapped model (built without "
                             f"fully_shard) with the plan of your FSDP2 setup; {_PLANS_TABLE}")
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(f"this is an FSDP model: FullyShardedDataParallel already wraps it{where}; pass the "
                             f"unwrapped model (built without FSDP) to ts.shard; {_PLANS_TABLE}")
        if isinstance(module, DistributedDataParallel):
            raise ValueError(f"this model is wrapped in DistributedDataParallel{where}: pass the module inside it "
                             "(ddp.module) to ts.shard, which reduces the gradients itself")


def _fsdp2_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:                      # torch < 2.6
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule
