"""The outer sync of ``+outer=H`` (DiLoCo, Streaming DiLoCo): islands train apart and meet every H steps.

[Note: outer step] Each island (a group of the outermost tier) trains with the plan's placement inside itself
([Note: outer sync] in plan.py). Every rank keeps, beside its masters and in their layout, the *anchor* (the
global parameters of the last sync, the same on every island) and the outer momentum. When a fragment's turn
comes, after the optimizer step, every rank takes its outer gradient ``d = anchor - master`` over the fragment's
parameters, the islands average it ([Note: island mean] in comm/island_mean.py), and each rank takes the outer
Nesterov SGD step ``m = mu m + d; global = anchor - lr (d + mu m)``; the global value becomes both the anchor and
the masters. Every island computes the same bits, so the islands agree again after each sync. With ``H = 1``,
``lr = 1`` and ``mu = 0`` the step is ``global = mean of the islands' masters``: one inner SGD step from the same
point on each island averages to the step of the plan without the option (up to the rounding of the mean).

[Note: fragment schedule] With ``F`` fragments the units (their trainable flat groups, in registration order)
are cut into ``F`` runs of consecutive units of about equal size; fragment ``f`` syncs when the step count modulo
``H`` is ``OuterSpec.offset(f)``, so over any ``H`` consecutive steps every parameter syncs exactly once, and the
slow link carries ``1/F`` of the model at a time. A streamed fragment's mean runs behind the next inner step: it
is started after step ``t`` and applied after step ``t + 1``, where the masters become the new global value plus
the progress the island made during that one step (``correction = d - lr (d + mu m)`` is added, Streaming
DiLoCo's overlap with the island's own step kept). With ``F = 1`` (plain DiLoCo) the sync completes in the step.

[Note: outer warm-up] With ``wN`` the first ``N`` optimizer steps are step-synchronous: each trainable group
averages its level-os gradient over the cross group at the boundary (``FlatGroup.island_average``, an fp32
all-reduce, op ``outer_warmup``), so every island's optimizer sees the global gradient and the islands stay one
model (equal bits: the same inputs to the same steps). After step ``N`` the anchors become the masters and the
periods begin: the step count that places fragments is ``steps - N``. No outer step is taken during the warm-up.

[Note: outer state in checkpoints] ``state_dict`` holds the anchors and momenta as DTensors with the masters'
specs (replicated across islands, so they reshard with the masters), the step count, and, for a fragment in
flight, each rank's correction (finished at the save: waiting changes no value). The corrections, like the
masters and inner optimizer states, differ per island: ``ts.save`` keeps them under the island's key.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from ..comm.codecs import codec_from_spec
from ..comm.island_mean import IslandMean, PendingMean

if TYPE_CHECKING:
    from ..plan import OuterSpec, Placement
    from .flat import FlatGroup


def fragment_schedule(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Cut items of ``sizes`` (in order) into ``fragments`` runs of consecutive items of about equal total size
    ([Note: fragment schedule]); each run holds at least one item."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"{fragments} outer-sync fragments but the model has {len(sizes)} trainable units: ask for "
                         f"at most {len(sizes)} (outer=H:f{max(len(sizes), 1)}), or wrap the model finer")
    total, runs, start = sum(sizes), [], 0
    for f in range(fragments):
        if f == fragments - 1:
            end = len(sizes)
        else:
            target, end, acc = total * (f + 1) / fragments, start + 1, sum(sizes[:start + 1])
            while end < len(sizes) - (fragments - f - 1) and acc + sizes[end] / 2 <= target:
                acc += sizes[end]
                end += 1
        runs.append(list(range(start, end)))
        start = end
    return runs


class OuterSync:
    """The anchors, momenta and schedule of one sharded model's outer sync ([Note: outer step])."""

    def __init__(self, spec: "OuterSpec", placement: "Placement", groups: list["FlatGroup"], seed: int = 0):
        self.spec, self.topology = spec, placement.topology
        top = len(self.topology.sizes)
        self.cross = self.topology.group_for(self.topology.rank, top - 1, top)   # this rank's peers in the islands
        self.island = self.topology.rank // self.topology.level_size(top - 1)
        self.islands = self.topology.fanouts()[-1]
        self.mean = IslandMean(codec_from_spec(spec.codec) if spec.codec else None, seed)
        self.groups = groups
        self.fragments = [[groups[i] for i in run] for run in
                          fragment_schedule([sum(layout.numel for layout in g.layouts) for g in groups], spec.fragments)]
        self.steps = 0
        with torch.no_grad():
            self.anchors = {id(g): [g.master_local(i).clone() for i in range(len(g.layouts))] for g in groups}
            self.momenta = {id(g): [torch.zeros_like(a) for a in self.anchors[id(g)]] for g in groups} \
                if spec.momentum else {}
        self.inflight: tuple[int, PendingMean] | None = None       # (fragment, its mean)
        self.corrections: dict[int, list[torch.Tensor]] | None = None  # per group id, once the mean has landed
        self._issued: dict[int, list[torch.Tensor]] = {}
        self._changed: set[int] = set()
        self._warm()

    @property
    def streamed(self) -> bool:
        return self.spec.fragments > 1

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def after_step(self) -> set[int]:
        """Called after each optimizer step; returns the ids of the groups whose masters it changed."""
        self.steps += 1
        local = self.steps - self.spec.warmup         # steps since the warm-up ended ([Note: outer warm-up])
        if local <= 0:
            if local == 0:
                for g in self.groups:
                    for i, anchor in enumerate(self.anchors[id(g)]):
                        anchor.copy_(g.master_local(i))
                self._warm()
            return set()
        changed: set[int] = set()
        if self.inflight is not None or self.corrections is not None:
            changed |= self._land()
        phase = local % self.spec.every
        for f in range(len(self.fragments)):
            if self.spec.offset(f) == phase:
                self._issue(f)
                if not self.streamed:
                    changed |= self._land()
        return changed

    def _warm(self) -> None:
        """Average the groups' gradients over the islands while the warm-up lasts ([Note: outer warm-up])."""
        for g in self.groups:
            g.island_average = self.steps < self.spec.warmup

    def _issue(self, fragment: int) -> None:
        groups = self.fragments[fragment]
        if self.streamed:        # the masters at the issue: the land adds the new global value minus these
            self._issued = {id(g): [g.master_local(i).clone() for i in range(len(g.layouts))] for g in groups}
        deltas = [(a - g.master_local(i)).reshape(-1) for g in groups for i, a in enumerate(self.anchors[id(g)])]
        # padded to the groups' level-os bands, as every engine collective is (and the cost model counts)
        bands, parts, at = [g.S // g.size(g.level) for g in groups], [], 0
        for g, band in zip(groups, bands):
            mine = deltas[at:at + len(g.layouts)]
            at += len(g.layouts)
            parts += mine + [mine[0].new_zeros(band - sum(d.numel() for d in mine))]
        buf = torch.cat(parts)
        seed = self.mean.key(self.steps, fragment, self.topology.rank) if self.mean.codec is not None else None
        self.inflight = (fragment, self.mean.start(buf, self.cross, self.topology, "outer_sync", seed=seed,
                                                   pieces=bands))

    def finish(self) -> None:
        """Wait for the mean in flight and take the outer step: new anchors and momenta; the masters become the
        new global value at once (one fragment), or get a correction to add after the next step (streamed)."""
        if self.inflight is None:
            return
        fragment, pending = self.inflight
        self.inflight = None
        mean, start = pending.finish(), 0
        lr, mu = self.spec.lr, self.spec.momentum
        corrections = {}
        for g in self.fragments[fragment]:
            fixes = corrections[id(g)] = []
            offset, start = start, start + g.S // g.size(g.level)
            for i, anchor in enumerate(self.anchors[id(g)]):
                n = anchor.numel()
                d = mean[offset:offset + n].view_as(anchor)
                offset += n
                if mu:
                    m = self.momenta[id(g)][i]
                    m.mul_(mu).add_(d)
                    d = d.add(m, alpha=mu)
                anchor.sub_(d, alpha=lr)
                if self.streamed:
                    fixes.append(anchor - self._issued[id(g)][i])
                else:
                    g.master_local(i).copy_(anchor)
        self._issued = {}
        self.corrections = corrections if self.streamed else None
        self._changed = set(corrections)

    def _land(self) -> set[int]:
        """Finish the mean in flight; add the corrections waiting (streamed); the groups changed."""
        self._changed = set()
        self.finish()
        changed = self._changed
        if self.corrections is not None:
            for group in self.groups:
                for i, fix in enumerate(self.corrections.get(id(group), ())):
                    group.master_local(i).add_(fix)
            changed |= set(self.corrections)
            self.corrections = None
        return changed

    # ---- checkpoints ([Note: outer state in checkpoints]) ---------------------------------------
    def _named(self):
        for g in self.groups:
            for i, layout in enumerate(g.layouts):
                yield layout.name, g, i

    def state_dict(self, corrections: Sequence[str] | None = None) -> tuple[dict, dict]:
        """(shared, island): the state every island holds alike, and this island's own. ``corrections``: the
        names whose correction to hold (to load a checkpoint that has them); None: those waiting now."""
        self.finish()                     # a mean in flight lands in the state (its values do not depend on when)
        shared: dict = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        island: dict = {}
        if corrections is not None:       # a load: the corrections become the checkpoint's (zeros to fill)
            want = set(corrections)
            self.corrections = {id(g): [torch.zeros_like(a) for a in self.anchors[id(g)]] for _, g, _ in
                                self._named() if any(layout.name in want for layout in g.layouts)} or None
        for name, g, i in self._named():
            shared[f"anchor.{name}"] = g._dtensor(i, self.anchors[id(g)][i])
            if self.momenta:
                shared[f"momentum.{name}"] = g._dtensor(i, self.momenta[id(g)][i])
            if self.corrections is not None and id(g) in self.corrections:
                island[f"correction.{name}"] = g._dtensor(i, self.corrections[id(g)][i])
        return shared, island

    def loaded(self, shared: dict) -> None:
        """After a load into ``state_dict``'s tensors: take the step count (a plain tensor is replaced, not filled)."""
        self.steps = int(shared["steps"])
        self._warm()
