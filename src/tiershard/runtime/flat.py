"""One flat group: the parameters of a unit that share ``requires_grad``, as padded flat buffers per state.

States and where they live (levels of the placement, see [Note: ownership map] in topology.py):

    p_shard   param_dtype  level p    between uses; the forward's gather source
    full      param_dtype  all        gathered for compute; storage freed when p is sharded and not in use
    hpz       param_dtype  hpz levels cached shards of the last gathered weights, tagged with their version
    grad_acc  fp32         level g    gradient accumulated between optimizer steps (trainable groups only)
    master    fp32         level os   the nn.Parameter the optimizer sees; its ``_version`` is the weights' version

[Note: no stale copies] Every derived copy (p_shard, full, hpz) records the ``master._version`` it was made from.
Any in-place write to a master (``optimizer.step()``, a write under ``torch.no_grad()``, ``load_full_state_dict``)
bumps that counter, and the next use rebuilds the copies first.

[Note: gathering without bumping versions] Autograd saves views of ``full`` for backward. The gathers write
through ``full_alias``, a tensor on the same storage with its own version counter, so refilling freed storage
before backward does not trip autograd's in-place check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..comm import collectives as C
from ..comm import hierarchical as H
from ..comm.codecs import codec_from_spec
from ..comm.quantized import QuantizedGather, QuantizedReduceScatter

if TYPE_CHECKING:
    from ..plan import Placement


@dataclass
class ParamSlot:
    """One original parameter: where it sits in the flat buffer and every (module, name) that uses it."""

    uses: list[tuple[nn.Module, str]]
    names: list[str]
    shape: torch.Size
    offset: int
    numel: int


def padded_numel(numel: int, world: int) -> int:
    return -(-numel // world) * world


class FlatGroup:
    """Storage and level-to-level moves for one group of parameters; no hooks, no schedule."""

    def __init__(self, slots: list[ParamSlot], values: torch.Tensor, placement: "Placement", trainable: bool,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        topo = placement.topology
        self.slots, self.pl, self.topo, self.rank = slots, placement, topo, topo.rank
        self.trainable = trainable
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.numel = values.numel()
        self.S = padded_numel(self.numel, topo.world_size)
        flat = torch.zeros(self.S, dtype=torch.float32)
        flat[: self.numel] = values
        self.master = nn.Parameter(self._chunk(flat, placement.os).clone(), requires_grad=trainable)
        self.p_shard = self._chunk(flat, placement.p).to(param_dtype).clone()
        if placement.p == 0:
            self.full = self.p_shard.requires_grad_(trainable)
        else:
            self.full = torch.empty(self.S, dtype=param_dtype, requires_grad=trainable)
        self.full_alias = torch.empty(0, dtype=param_dtype).set_(self.full.untyped_storage(), 0, (self.S,))
        self.grad_acc = torch.zeros(self.S // self.size(placement.g)) if trainable else None
        # hpz level -> (weights version, exact values) or, under qwz, (version, (payload, scales)) as received
        self.hpz: dict[int, tuple[int, object]] = {}
        plan = placement.plan
        self.qwz = QuantizedGather(codec_from_spec(plan.qwz)) if plan.qwz else None
        self.qgz = QuantizedReduceScatter(codec_from_spec(plan.qgz.removesuffix("+ef")),
                                          plan.qgz.endswith("+ef")) if plan.qgz else None
        self._encoded = None   # the last qwz gather's encodings, kept until release builds the hpz shards
        self.cc = plan.cc
        self.synced_version = self.master._version
        self.gathered = placement.p == 0
        self.gathered_version = self.synced_version
        if placement.p > 0:
            self.release()

    # ---- layout -------------------------------------------------------------------------------
    def size(self, level: int) -> int:
        return self.topo.level_size(level)

    def chunk_range(self, level: int) -> tuple[int, int]:
        length = self.S // self.size(level)
        start = self.topo.chunk_index(self.rank, level) * length
        return start, start + length

    def _chunk(self, flat: torch.Tensor, level: int) -> torch.Tensor:
        start, end = self.chunk_range(level)
        return flat[start:end]

    def group(self, inner: int, outer: int):
        return self.topo.group_for(self.rank, inner, outer)

    # ---- parameters: master -> p_shard -> full ------------------------------------------------
    @property
    def stale(self) -> bool:
        return self.master._version != self.synced_version

    @torch.no_grad()
    def sync_params(self) -> None:
        """Bring the updated master (level os) back to the parameter level p; drop cached copies."""
        pl = self.pl
        src = self.master.detach().to(self.param_dtype)
        if pl.p < pl.os:
            self._all_gather(self.p_shard, src, pl.p, pl.os, "param_sync")
        else:
            start, end = self.chunk_range(pl.p)
            base, _ = self.chunk_range(pl.os)
            self.p_shard.copy_(src[start - base:end - base])
        self.hpz.clear()
        self.synced_version = self.master._version

    @torch.no_grad()
    def gather(self, op: str) -> None:
        """Fill ``full`` from the finest valid copy: an hpz shard of the current weights, else p_shard."""
        if self.stale:
            self.sync_params()
        if self.gathered and self.gathered_version == self.synced_version:
            return
        pl = self.pl
        if pl.p > 0:
            if not self.gathered:
                self.full.untyped_storage().resize_(self.S * self.full.element_size())
            level, source = pl.p, self.p_shard
            for h in pl.hpz:   # sorted innermost first: the smallest group wins
                cached = self.hpz.get(h)
                if cached is not None and cached[0] == self.synced_version:
                    level, source = h, cached[1]
                    break
            if self.qwz is None:
                self._all_gather(self.full_alias, source, 0, level, op)
            else:
                chunks, numel = self.size(pl.p), self.S // self.size(pl.p)
                payload, scales = self.qwz.encode(source) if level == pl.p else source
                self._encoded = self.qwz.gather(payload, scales, self.group(0, level), chunks, numel, self.topo, op)
                self.qwz.decode(*self._encoded, chunks, numel, out=self.full_alias)
        self.gathered = True
        self.gathered_version = self.synced_version

    @torch.no_grad()
    def release(self) -> None:
        """Free ``full`` when p is sharded, leaving the hpz shards of these exact weights behind."""
        if self.pl.p == 0:
            return
        if self.gathered:
            for h in self.pl.hpz:
                if self.hpz.get(h, (None,))[0] != self.gathered_version:
                    self.hpz[h] = (self.gathered_version, self._hpz_shard(h))
        self._encoded = None
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def _hpz_shard(self, level: int):
        """This rank's level-``level`` shard of the gathered weights: exact values, or under qwz the encodings
        exactly as received (never re-quantized from a dequantized copy)."""
        if self.qwz is None:
            return self._chunk(self.full_alias, level).clone()
        payload_all, scales_all = self._encoded
        ratio = self.size(self.pl.p) // self.size(level)
        index = self.topo.chunk_index(self.rank, level)
        P, s = (len(t) // self.size(self.pl.p) for t in (payload_all, scales_all))
        return (payload_all[index * ratio * P:(index + 1) * ratio * P].clone(),
                scales_all[index * ratio * s:(index + 1) * ratio * s].clone())

    def views(self) -> list[torch.Tensor]:
        """One tensor per original parameter, on ``full``; autograd carries their gradients into ``full.grad``."""
        return [self.full[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    # ---- gradients: full.grad -> grad_acc (level g) -> master.grad (level os) -----------------
    @torch.no_grad()
    def reduce_micro_step(self, grad: torch.Tensor | None) -> None:
        """Reduce this micro-step's full gradient to level g and accumulate it (pre-divided: the DDP mean)."""
        pl = self.pl
        if grad is None:
            grad = torch.zeros(self.S, dtype=self.reduce_dtype)
        local = grad.to(self.reduce_dtype) / self.topo.world_size
        if pl.g == 0:
            self.grad_acc += local
            return
        self.grad_acc += self._reduce_scatter(local, 0, pl.g, "grad_reduce")

    def _reduce_scatter(self, buf: torch.Tensor, inner: int, outer: int, op: str) -> torch.Tensor:
        """Sum over the (inner -> outer) group, keeping this rank's level-``outer`` chunk; qgz goes tier by tier."""
        if self.qgz is not None:
            hops = [self.group(k - 1, k) for k in range(inner + 1, outer + 1)]
            return self.qgz(buf, hops, self.topo, op, key=(inner, outer))
        if self.cc:
            return H.reduce_scatter(buf, inner, outer, self._hop, self.topo, op)
        out = torch.empty(self.S // self.size(outer), dtype=buf.dtype)
        C.reduce_scatter(out, buf, self.group(inner, outer), self.topo, op)
        return out

    # ---- collectives between two levels: one flat ring, or one phase per tier with cc (PaRO-CC) ---------
    def _hop(self, k: int):
        return self.group(k - 1, k)

    def _all_gather(self, out: torch.Tensor, shard: torch.Tensor, inner: int, outer: int, op: str) -> None:
        if self.cc:
            H.all_gather(out, shard, inner, outer, self._hop, self.topo, op)
        else:
            C.all_gather(out, shard, self.group(inner, outer), self.topo, op)

    def _all_reduce(self, buf: torch.Tensor, inner: int, outer: int, op: str) -> None:
        if self.cc:
            H.all_reduce(buf, inner, outer, self._hop, self.topo, op)
        else:
            C.all_reduce(buf, self.group(inner, outer), self.topo, op)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """At the accumulation boundary: finish the reduction over the world, at level os, into master.grad."""
        pl, top = self.pl, self.topo.num_levels - 1
        buf = self.grad_acc.to(self.reduce_dtype)
        if pl.g < pl.os:
            out = self._reduce_scatter(buf, pl.g, pl.os, "grad_sync")
            self._all_reduce(out, pl.os, top, "grad_sync")
        else:
            self._all_reduce(buf, pl.g, top, "grad_sync")
            out = buf
            if pl.g > pl.os:
                out = torch.empty(self.S // self.size(pl.os), dtype=self.reduce_dtype)
                self._all_gather(out, buf, pl.os, pl.g, "grad_sync")
        out = out.to(torch.float32)
        if out.data_ptr() == self.grad_acc.data_ptr():
            out = out.clone()
        if self.master.grad is None:
            self.master.grad = out
        else:
            self.master.grad += out
        self.grad_acc.zero_()

    # ---- whole-state helpers ------------------------------------------------------------------
    @torch.no_grad()
    def full_master(self) -> torch.Tensor:
        """The unpadded fp32 master values of the whole group, on every rank."""
        out = torch.empty(self.S, dtype=torch.float32)
        C.all_gather(out, self.master.detach(), self.group(0, self.pl.os), self.topo, "state_dict")
        return out[: self.numel]

    @torch.no_grad()
    def load_full(self, values: torch.Tensor) -> None:
        """Write new full fp32 values: every rank has them, so each cuts its own shards without communication."""
        flat = torch.zeros(self.S, dtype=torch.float32)
        flat[: self.numel] = values
        self.master.copy_(self._chunk(flat, self.pl.os))
        self.p_shard.copy_(self._chunk(flat, self.pl.p))
        self.hpz.clear()
        self.synced_version = self.master._version
        if self.pl.p > 0 and self.gathered:
            self.release()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each persistent model state this rank holds for the group."""
        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()
        return {
            "params": nbytes(self.p_shard),
            "grads": nbytes(self.grad_acc),
            "masters": nbytes(self.master),
            "hpz": sum(nbytes(t) for _, t in self.hpz.values()),
        }
