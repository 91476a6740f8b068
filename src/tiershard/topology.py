"""Tiers of the network, rank coordinates and the process groups of each tier.

A topology is an ordered list of nested tier sizes, innermost first, the last being the world size:
``(2, 4)`` is two nodes of two ranks, ``(2, 8, 64)`` GCD pairs, nodes of 8 and a world of 64. Ranks are laid
out tier-contiguously. A *level* is an index into ``(1, *sizes)``: level 0 is ``N`` (a group of one rank),
level ``k`` is the group of tier ``k - 1``.

[Note: ownership map] A state sharded at level ``k`` is cut into ``size(k)`` equal chunks. The chunk a rank
holds is its position inside its level-``k`` group written with the *innermost digit most significant*
(see ``chunk_index``). With that map, every finer shard a rank holds (a larger group) lies inside every coarser
shard it holds, so moving a state between levels never needs data a rank does not already own or receive from
the ranks that share its coarser chunk. This is PaRO's "transposed" layout generalised to any number of tiers;
docs/ownership.md works through an example.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

DEFAULT_NAMES = {1: ("world",), 2: ("node", "world"), 3: ("pair", "node", "world")}
TIMEOUT_ENV = "TIERSHARD_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0      # seconds: how long a rank waits for the others in one of the engine's collectives


class TopologyError(ValueError):
    """A topology that is malformed or does not match the running world."""


@dataclass(frozen=True)
class TierGroup:
    """A set of ranks that run one collective together, with each member's chunk slot.

    ``ranks`` are sorted global ranks (torch's group order); ``slots[i]`` is the chunk index that
    ``ranks[i]`` owns inside the group's joint buffer (the ownership map, not the rank order).
    """

    ranks: tuple[int, ...]
    slots: tuple[int, ...]
    pg: object | None = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def slot_of(self, rank: int) -> int:
        return self.slots[self.ranks.index(rank)]

    @property
    def in_rank_order(self) -> bool:
        """Slots follow torch's group rank order: collectives can write their joint buffer directly."""
        return self.slots == tuple(range(len(self.slots)))

    @property
    def backend(self) -> str:
        return dist.get_backend(self.pg) if self.pg is not None else "local"


def collective_timeout(timeout: float | None = None) -> float:
    """The bound in seconds: ``timeout`` if given, else ``TIERSHARD_COLLECTIVE_TIMEOUT``, else 60."""
    source = "timeout"
    if timeout is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        source = f"{TIMEOUT_ENV}={text!r}"
        try:
            timeout = float(text)
        except ValueError:
            raise TopologyError(f"{source} is not a number of seconds: set it like {TIMEOUT_ENV}=60") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise TopologyError(f"{source} must be a positive number of seconds, got {timeout!r}: e.g. timeout=60 "
                            f"(the time a rank waits for the others in one collective)")
    return float(timeout)


class Topology:
    """Nested tiers of ranks; owns the process groups of every tier and cross-tier set, made once.

    ``timeout`` (seconds; default ``TIERSHARD_COLLECTIVE_TIMEOUT`` or 60) bounds every collective of the engine
    and of ``ts.save``/``ts.load``: a collective that cannot complete (a rank skipped it or died) ends every rank
    that waits in it with ``ts.CollectiveError`` within that time ([Note: bounded collectives] in
    comm/failure.py). It is independent of the default process group's timeout.
    """

    def __init__(self, sizes: Sequence[int], names: Sequence[str] | None = None, timeout: float | None = None):
        sizes = tuple(int(s) for s in sizes)
        if not sizes:
            raise TopologyError("a topology needs at least one tier, e.g. Topology((2, 4)) for 2 nodes of 2 ranks")
        if any(s < 1 for s in sizes):
            raise TopologyError(f"tier sizes must be positive, got {sizes}")
        for inner, outer in zip(sizes, sizes[1:]):
            if outer % inner:
                raise TopologyError(
                    f"tier size {inner} does not divide the next tier's {outer} in {sizes}: "
                    "each tier must hold a whole number of the tier inside it")
        if names is None:
            names = DEFAULT_NAMES.get(len(sizes)) or tuple(f"tier{i}" for i in range(len(sizes) - 1)) + ("world",)
        names = tuple(names)
        if len(names) != len(sizes):
            raise TopologyError(f"{len(sizes)} tier sizes {sizes} but {len(names)} names {names}")
        if len(set(names)) != len(names) or any(n in ("N", "I", "G", "") for n in names):
            raise TopologyError(f"tier names must be distinct and not N, I or G: {names}")
        self.sizes = sizes
        self.names = names
        self.timeout = collective_timeout(timeout)
        self._control: TierGroup | None = None
        self._groups: dict[tuple[int, int, int], TierGroup] = {}
        self._initialised = False
        self._mesh = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, names: Sequence[str] | None = None, timeout: float | None = None) -> "Topology":
        """Tiers from the launcher: ``TIERSHARD_TOPOLOGY`` ("2,8,64") if set, else (LOCAL_WORLD_SIZE, WORLD_SIZE)."""
        spec = os.environ.get("TIERSHARD_TOPOLOGY")
        if spec:
            try:
                sizes = tuple(int(s) for s in spec.replace("x", ",").split(","))
            except ValueError:
                raise TopologyError(f"TIERSHARD_TOPOLOGY={spec!r} is not a list of sizes like '2,8,64'") from None
            return cls(sizes, names, timeout)
        world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls((local, world), names, timeout)

    def __repr__(self) -> str:
        return f"Topology({self.sizes}, names={self.names})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and (self.sizes, self.names) == (other.sizes, other.names)

    def __hash__(self) -> int:
        return hash((self.sizes, self.names))

    # ---- arithmetic (no process group needed) -------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sizes[-1]

    @property
    def num_levels(self) -> int:
        """Levels 0 (N) .. len(sizes) (world)."""
        return len(self.sizes) + 1

    def level_size(self, level: int) -> int:
        return 1 if level == 0 else self.sizes[level - 1]

    def level_name(self, level: int) -> str:
        return "N" if level == 0 else self.names[level - 1]

    def level_of(self, name: str) -> int:
        """Level index of ``N``, ``I`` (the tier just below world), ``G`` (world) or a tier name."""
        if name == "N":
            return 0
        if name == "G":
            return len(self.sizes)
        if name == "I":
            if len(self.sizes) < 2:
                raise TopologyError(f"level I is the tier below world, but {self} has a single tier")
            return len(self.sizes) - 1
        if name in self.names:
            return self.names.index(name) + 1
        raise TopologyError(f"unknown level {name!r}: use N, I, G or a tier name of {self.names}")

    def digits(self, rank: int) -> tuple[int, ...]:
        """Mixed-radix coordinates: digit k is the rank's position among the tier-(k-1) groups inside tier k."""
        out, radix = [], 1
        for size in self.sizes:
            out.append((rank % size) // radix)
            radix = size
        return tuple(out)

    def chunk_index(self, rank: int, level: int) -> int:
        """The chunk of a level-``level`` shard that ``rank`` owns: its digits, innermost most significant."""
        index = 0
        digs = self.digits(rank)
        prev = 1
        for k in range(level):
            base = self.sizes[k] // prev
            index = index * base + digs[k]
            prev = self.sizes[k]
        return index

    def group_ranks(self, rank: int, level: int) -> tuple[int, ...]:
        size = self.level_size(level)
        start = rank - rank % size
        return tuple(range(start, start + size))

    def cross_ranks(self, rank: int, inner: int, outer: int) -> tuple[int, ...]:
        """Ranks in ``rank``'s level-``outer`` group that sit at its position in their level-``inner`` group."""
        pos = rank % self.level_size(inner)
        return tuple(r for r in self.group_ranks(rank, outer) if r % self.level_size(inner) == pos)

    def tier_of_link(self, a: int, b: int) -> str:
        """The smallest tier whose group holds both ranks: the tier a byte between them is counted on."""
        for size, name in zip(self.sizes, self.names):
            if a // size == b // size:
                return name
        raise TopologyError(f"ranks {a} and {b} are not both in {self}")

    def group_for(self, rank: int, inner: int, outer: int) -> TierGroup:
        """The collective group that moves a state from level ``inner`` to the finer level ``outer``.

        Members share ``rank``'s level-``inner`` chunk and split it into ``size(outer)/size(inner)`` slots.
        ``inner = 0`` gives the whole level-``outer`` group.
        """
        if not 0 <= inner <= outer < self.num_levels:
            raise TopologyError(f"no group from level {inner} to level {outer} in {self}")
        key = (inner, outer, rank)
        group = self._groups.get(key)
        if group is None:
            group = self._make_group(rank, inner, outer, pg=None)
        return group

    def _make_group(self, rank: int, inner: int, outer: int, pg) -> TierGroup:
        ranks = self.cross_ranks(rank, inner, outer)
        ratio = self.level_size(outer) // self.level_size(inner)
        slots = tuple(self.chunk_index(r, outer) % ratio for r in ranks)
        return TierGroup(ranks, slots, pg)

    def fanouts(self) -> tuple[int, ...]:
        """How many groups of the tier below each tier holds: (2, 4, 16) -> (2, 2, 4)."""
        return tuple(size // inner for inner, size in zip((1, *self.sizes), self.sizes))

    def chunking(self, level: int) -> tuple[int, ...]:
        """How a parameter's dim 0 is cut when its masters live at ``level``: by torch.chunk's rule into the
        fan-out of each tier below ``level`` in turn, innermost first (DTensor's nested ``Shard(0)``, see
        ``placements``), then each of those chunks into its ``world / size(level)`` slots."""
        return (*self.fanouts()[:level], self.world_size // self.level_size(level))

    def placements(self, level: int) -> tuple:
        """DTensor placements over ``mesh`` of a state at ``level``: Shard(0) on the tiers below it.

        Nested ``Shard(0)`` on mesh dims ordered innermost tier first chunk dim 0 innermost tier first, which is
        the ownership map: a rank's DTensor shard at level ``k`` is its level-``k`` chunk. (A single flattened
        mesh dim cannot express it: its process group would order ranks by rank, not by chunk.)
        """
        from torch.distributed.tensor import Replicate, Shard

        return tuple(Shard(0) if dim < level else Replicate() for dim in range(len(self.sizes)))

    def _grid(self):
        """Ranks as a tensor whose dims are the tiers' fan-outs, innermost first: ``grid[c0, c1, ...] = rank``."""
        import torch

        grid = torch.arange(self.world_size).view(*reversed(self.fanouts()))
        return grid.permute(*reversed(range(grid.dim()))).contiguous()

    @property
    def mesh(self):
        """The DeviceMesh whose dims are the tiers, innermost first (made by ``init_process_groups``)."""
        if self._mesh is None:
            raise TopologyError("the topology has no device mesh yet: ts.shard (or init_process_groups) makes it")
        return self._mesh

    # ---- process groups -----------------------------------------------------------------------
    @property
    def report_window(self) -> float:
        """Seconds a rank whose collective failed waits for the other members' reports (inside ``timeout``)."""
        return min(5.0, self.timeout / 4)

    @property
    def control_group(self) -> TierGroup:
        """Every rank, on a process group of its own bounded by ``timeout``: for the main thread's collectives
        (checkpoints), which must never interleave with the stream's on the engine's world group."""
        if not self._initialised:
            raise TopologyError("the topology has no process groups yet: ts.shard (or init_process_groups) makes them")
        return self._control

    def init_process_groups(self, device_type: str = "cpu") -> None:
        """Create every group this topology can need, and its DeviceMesh, once, in the same order on every rank."""
        if self._initialised:
            if self._mesh.device_type != device_type:
                raise TopologyError(f"{self} was set up for {self._mesh.device_type} tensors, not {device_type}: "
                                    "use one Topology object per device type")
            return
        if not dist.is_initialized():
            raise TopologyError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() "
                "(torchrun sets the environment) before ts.shard")
        world = dist.get_world_size()
        if world != self.world_size:
            raise TopologyError(
                f"{self} covers {self.world_size} ranks but the world has {world}: "
                f"make the last tier size {world}, e.g. Topology((ranks_per_node, {world}))")
        me = dist.get_rank()
        # gloo and NCCL apply a group's timeout to each of its operations; the report window comes on top
        bound = timedelta(seconds=self.timeout - self.report_window)
        made: dict[tuple[int, ...], object] = {}
        for inner in range(self.num_levels):
            for outer in range(inner, self.num_levels):
                seen: set[tuple[int, ...]] = set()
                for r in range(world):
                    ranks = self.cross_ranks(r, inner, outer)
                    if ranks in seen:
                        continue
                    seen.add(ranks)
                    if ranks not in made:
                        if len(ranks) == 1:
                            made[ranks] = None
                        else:     # the world too: the engine's collectives never share the user's group
                            made[ranks] = dist.new_group(list(ranks), timeout=bound)
                    pg = made[ranks]
                    if me in ranks:
                        self._groups[(inner, outer, me)] = self._make_group(me, inner, outer, pg)
        everyone = tuple(range(world))
        self._control = TierGroup(everyone, everyone, dist.new_group(list(everyone), timeout=bound)
                                  if world > 1 else None)
        self._mesh = self._make_mesh(device_type)
        self._initialised = True

    def _make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, self._grid(), mesh_dim_names=self.names)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0
