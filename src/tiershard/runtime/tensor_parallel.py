"""The tensor-parallel side of a parameter: what ``parallelize_module`` made of it, and the moves across TP.

[Note: TP parameters under the tiers] A parameter that ``parallelize_module`` turned into a DTensor over a 1-D TP
mesh is sharded by the engine as its *local* TP shard: the layouts, flat buffers and every collective of the tiers
see the local shape and run within one TP coordinate ([Note: tensor parallelism is not a tier], topology.py).
Only three things know about TP, all here:

- the masters (and their gradients and optimizer states) are DTensors over ``Topology.mesh``, whose first dim is
  ``"tp"``: placements ``(tp placement, Shard(0) on the tiers below the level, Replicate() above)``. The tp dim
  comes first, so DTensor cuts TP before the tiers, which is how the engine cuts (the tiers chunk the local TP
  shard's dim 0): plain nested ``Shard`` placements, no ``_StridedShard``, and ``full_tensor()``, DCP and
  ``clip_grad_norm_`` read them as they are (docs/parallelism.md);
- the working tensors shown to the modules in forward and backward are DTensors with the parameter's own TP
  spec (its mesh and placements), as FSDP2 shows them, so the TP layers' hooks and DTensor's ops run unchanged;
- their gradients are brought to the parameter's TP placements before the reduction (a replicated weight under
  sequence parallelism gets a ``Partial`` gradient: one all-reduce over TP, as FSDP2 does), and full values move
  across TP by DTensor's own redistribution (``full_state_dict``) or by slicing (a full tensor loaded).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..topology import Topology


@dataclass(frozen=True)
class TPSpec:
    """How ``parallelize_module`` placed one parameter: its TP mesh and placement, and its global shape."""

    mesh: object                      # the 1-D DeviceMesh the model was parallelised over
    placement: Shard | Replicate      # dim normalised to be non-negative
    shape: torch.Size                 # the global shape
    stride: tuple[int, ...]

    @classmethod
    def of(cls, name: str, param: DTensor, topology: Topology) -> "TPSpec":
        """The TP spec of a DTensor parameter, checked against the topology's TP groups."""
        spec = param._spec
        mesh, placements = spec.mesh, spec.placements
        if topology.tp == 1:
            raise ValueError(f"parameter {name} is a DTensor over a mesh of {mesh.size()} ranks (tensor parallelism), "
                             f"but {topology} has none: declare it, e.g. ts.Topology(sizes, tp={mesh.size()}), where "
                             "the tiers count TP groups (docs/parallelism.md); if FSDP2's fully_shard made it, pass "
                             "the model built without fully_shard instead")
        if mesh.ndim != 1 or len(placements) != 1:
            raise ValueError(f"parameter {name} is a DTensor over a {mesh.ndim}-D mesh {placements}: ts.shard takes "
                             "parameters tensor-parallel over one mesh dim (parallelize_module(model, tp_mesh, plan) "
                             "with a 1-D tp_mesh)")
        ranks = tuple(mesh.mesh.flatten().tolist())
        mine = topology.tp_ranks(topology.rank)
        if ranks != mine:
            raise ValueError(f"parameter {name} is tensor-parallel over ranks {list(ranks)}, but {topology} puts this "
                             f"rank's TP group on ranks {list(mine)} (tp adjacent ranks): parallelise over "
                             "topology.tp_mesh, or a mesh whose last dim is tp (init_device_mesh(..., (dp, tp)))")
        placement = placements[0]
        if isinstance(placement, Shard) and type(placement) is Shard:
            placement = Shard(placement.dim % param.dim())
        elif not isinstance(placement, Replicate):
            raise ValueError(f"parameter {name} has TP placement {placement}, which ts.shard does not take: "
                             "parallelise it with a style that leaves Shard(dim) or Replicate() parameters "
                             "(ColwiseParallel, RowwiseParallel, SequenceParallel), or leave it out of the TP plan")
        return cls(mesh, placement, param.shape, tuple(param.stride()))

    def master_spec(self, topology: Topology, level: int, dtype: torch.dtype) -> DTensorSpec:
        """The spec of a master at ``level`` ([Note: TP parameters under the tiers])."""
        return DTensorSpec(topology.mesh, topology.placements(level, self.placement),
                           TensorMeta(self.shape, self.stride, dtype))

    def working(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The module's attribute in forward and backward: ``local`` as a DTensor of the parameter's TP spec."""
        spec = DTensorSpec(self.mesh, (self.placement,), TensorMeta(self.shape, self.stride, local.dtype))
        return nn.Parameter(DTensor(local, spec, requires_grad=requires_grad), requires_grad=requires_grad)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of a working gradient, at the parameter's TP placement (a ``Partial`` sum is
        reduced over TP first)."""
        if not isinstance(grad, DTensor):
            return grad
        if grad.placements != (self.placement,):
            grad = grad.redistribute(grad.device_mesh, (self.placement,))
        local = grad._local_tensor
        wait = getattr(local, "wait", None)        # an AsyncCollectiveTensor from a functional collective
        return wait() if callable(wait) else local

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The global value from every TP rank's ``local`` (a collective of the TP group)."""
        if isinstance(self.placement, Replicate):
            return local
        dt = DTensor.from_local(local, self.mesh, (self.placement,), run_check=False, shape=self.shape,
                                stride=self.stride)
        return dt.full_tensor()

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of a global value (no communication)."""
        if isinstance(self.placement, Replicate):
            return full
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, (self.placement,))
        dim = self.placement.dim
        return full.narrow(dim, offset[dim], shape[dim])
