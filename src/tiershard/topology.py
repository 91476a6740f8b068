"""Tiers of the network, rank coordinates and the process groups of each tier.

A topology is an ordered list of nested tier sizes, innermost first, the last being the world size:
``(2, 4)`` is two nodes of two ranks, ``(2, 8, 64)`` GCD pairs, nodes of 8 and a world of 64. Ranks are laid
out tier-contiguously. A *level* is an index into ``(1, *sizes)``: level 0 is ``N`` (a group of one rank),
level ``k`` is the group of tier ``k - 1``.

[Note: tensor parallelism is not a tier] ``Topology(sizes, tp=k)`` makes each position of the tiers a group of
``k`` adjacent ranks that run tensor parallelism together (torch's ``parallelize_module`` over ``tp_mesh``). The
tiers then count data-parallel positions, as a DeviceMesh's dims do (``init_device_mesh((dp, tp))``): global rank
``r`` is position ``r // k`` of the tiers and TP coordinate ``r % k``, so ``Topology((2, 4), tp=2)`` is 8 ranks,
nodes of 4 (2 positions of 2 TP ranks), 2 nodes. Every rank argument below is a global rank and every group holds
global ranks: a group of the tiers joins the ranks of one TP coordinate, so each TP coordinate runs the tiers'
collectives on its own copy of the groups, and nothing of the engine ever crosses a TP group. ``mesh`` gains a
first dim ``"tp"`` (innermost, as the tiers are ordered), which is why nested ``Shard`` placements on it and on
the tiers need no ``_StridedShard`` (docs/parallelism.md).

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
import re
import socket
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

DEFAULT_NAMES = {1: ("world",), 2: ("node", "world"), 3: ("pair", "node", "world")}
TIMEOUT_ENV = "TIERSHARD_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 60.0      # seconds: how long a rank waits for the others in one of the engine's collectives
HOST_ENV = "TIERSHARD_HOST_ID"


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


def process_group_timeout() -> float:
    """Seconds of the default process group's timeout: how long a live rank is waited for."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:     # no backend for that device, or a torch without the option
            continue
    return dist.default_pg_timeout.total_seconds()


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


def host_identity() -> str:
    """Which host this process runs on, for checking the node tier: ``TIERSHARD_HOST_ID`` if set, else the
    hostname plus the inode of its network namespace, so that ranks in separate network namespaces of one
    machine (the emulated cluster's nodes, containers), whose traffic crosses a network, count as separate hosts."""
    override = os.environ.get(HOST_ENV, "").strip()
    if override:
        return override
    name = socket.gethostname()
    try:
        return f"{name}/net:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:         # no /proc (not Linux): the hostname alone
        return name


def _env_int(name: str) -> int | None:
    """An integer environment variable, None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise TopologyError(f"{name}={text!r} is not a whole number: fix or unset it (the launcher sets it to a "
                            "count of ranks)") from None


def _slurm_counts(name: str) -> list[int] | None:
    """Slurm's per-node task counts, "4(x2),3" -> [4, 4, 3]; None when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise TopologyError(f"{name}={text!r} is not Slurm's list of tasks per node (like '4' or '4(x2),3'): "
                                "fix or unset it")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _ranks_per_node_from_env(world: int, note: str) -> int:
    """Ranks per node: LOCAL_WORLD_SIZE (torchrun, Ray Train, the emulated cluster), else Slurm's counts when Slurm
    itself started every rank (SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE, SLURM_NTASKS / SLURM_NNODES)."""
    fix = (f"declare it: Topology((ranks_per_node, {world})) in the script, or TIERSHARD_TOPOLOGY=ranks_per_node,"
           f"{world} in the environment (docs/launchers.md)")
    local = _env_int("LOCAL_WORLD_SIZE")
    if local is not None:
        if local < 1 or world % local:
            raise TopologyError(f"LOCAL_WORLD_SIZE={local} does not divide the world of {world} ranks{note}: every "
                                f"node must run the same number of ranks; {fix}")
        return local
    if world == 1:          # one process (python in an sbatch script too, whatever Slurm allocated)
        return 1
    tasks = _env_int("SLURM_NTASKS") or _env_int("SLURM_NPROCS")
    nodes = _env_int("SLURM_NNODES") or _env_int("SLURM_JOB_NUM_NODES")
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = _slurm_counts(name)
        if counts is None:
            continue
        total = tasks if tasks is not None else (sum(counts) if len(counts) > 1 or nodes is None
                                                 else counts[0] * nodes)
        if total != world:
            raise TopologyError(f"Slurm runs {total} tasks but the world has {world} ranks{note}, so {name} does not "
                                "count its ranks (a launcher inside srun, such as torchrun, sets LOCAL_WORLD_SIZE): "
                                f"{fix}")
        if len(set(counts)) > 1:
            raise TopologyError(f"{name}={os.environ[name]!r}: tiers need the same number of ranks on every node; "
                                "ask Slurm for --ntasks-per-node, or " + fix)
        return counts[0]
    if tasks is not None and nodes is not None:
        if tasks != world:
            raise TopologyError(f"Slurm runs SLURM_NTASKS={tasks} tasks but the world has {world} ranks{note}: {fix}")
        if nodes < 1 or tasks % nodes:
            raise TopologyError(f"SLURM_NTASKS={tasks} ranks on SLURM_NNODES={nodes} nodes is not the same number "
                                "on every node: ask Slurm for --ntasks-per-node, or " + fix)
        return tasks // nodes
    raise TopologyError(
        f"nothing in the environment says how many of the {world} ranks share a node{note}: looked for "
        "LOCAL_WORLD_SIZE (torchrun, Ray Train), SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE and SLURM_NTASKS with "
        f"SLURM_NNODES (srun); {fix}")


class Topology:
    """Nested tiers of ranks; owns the process groups of every tier and cross-tier set, made once.

    ``timeout`` (seconds; default ``TIERSHARD_COLLECTIVE_TIMEOUT`` or 60) is how soon a rank that waits in a
    collective of the engine or of ``ts.save``/``ts.load`` ends, naming the rank, when that rank died, stopped
    beating, exited, or waits in a different collective itself; a rank that is alive and busy outside the
    collectives is waited for up to the default process group's timeout ([Note: slow is not dead] in
    comm/liveness.py, [Note: bounded collectives] in comm/failure.py).
    """

    def __init__(self, sizes: Sequence[int], names: Sequence[str] | None = None, timeout: float | None = None,
                 tp: int = 1):
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
        if len(set(names)) != len(names) or any(n in ("N", "I", "G", "", "tp") for n in names):
            raise TopologyError(f"tier names must be distinct and not N, I, G or tp: {names}")
        self.sizes = sizes
        self.tp = _checked_tp(tp)
        self.names = names
        self.timeout = collective_timeout(timeout)
        self._control: TierGroup | None = None
        self._groups: dict[tuple[int, int, int], TierGroup] = {}
        self._initialised = False
        self._mesh = None

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, names: Sequence[str] | None = None, timeout: float | None = None,
                 tp: int = 1) -> "Topology":
        """Tiers from the launcher: ``TIERSHARD_TOPOLOGY`` ("2,8,64") if set, else (ranks per node, world).

        The world is the initialised process group's size (collectives run on it), else ``WORLD_SIZE`` (torchrun,
        Ray Train, PyTorchJob), else ``SLURM_NTASKS`` (srun); a ``WORLD_SIZE`` that disagrees with the process
        group (Kubeflow's older PyTorchJob counts pods) gives a warning naming both. Ranks per node come from
        ``LOCAL_WORLD_SIZE``, else Slurm's counts when Slurm started every rank; when nothing says, a
        ``TopologyError`` names the variables looked for and the fix (docs/launchers.md). With ``tp`` the counts of
        ranks are divided by it (the tiers count TP groups); ``TIERSHARD_TOPOLOGY`` counts them already.
        """
        spec = os.environ.get("TIERSHARD_TOPOLOGY")
        if spec:
            try:
                sizes = tuple(int(s) for s in spec.replace("x", ",").split(","))
            except ValueError:
                raise TopologyError(f"TIERSHARD_TOPOLOGY={spec!r} is not a list of sizes like '2,8,64'") from None
            return cls(sizes, names, timeout, tp)
        env_world = _env_int("WORLD_SIZE")
        if env_world is not None and env_world < 1:
            raise TopologyError(f"WORLD_SIZE={env_world} is not a world size: the launcher sets it to the number of "
                                "ranks; fix or unset it")
        note = ""
        if dist.is_initialized():
            world = dist.get_world_size()
            if env_world is not None and env_world != world:
                note = (f" (WORLD_SIZE={env_world} but the process group has {world} ranks; Kubeflow's older "
                        "PyTorchJob sets WORLD_SIZE to the number of pods)")
                warnings.warn(f"WORLD_SIZE={env_world} but the process group has {world} ranks: using {world}, the "
                              "ranks the collectives run on (Kubeflow's older PyTorchJob sets WORLD_SIZE to the "
                              "number of pods, not of processes)", stacklevel=2)
        elif env_world is not None:
            world = env_world
        else:       # srun starting every rank, else one process
            world = _env_int("SLURM_NTASKS") or _env_int("SLURM_NPROCS") or 1
            if world == 1 and (_env_int("LOCAL_WORLD_SIZE") or 1) > 1:
                raise TopologyError("LOCAL_WORLD_SIZE is set but neither WORLD_SIZE nor a process group says the "
                                    "world size: call dist.init_process_group() first, or set WORLD_SIZE")
        per_node = _ranks_per_node_from_env(world, note)
        if per_node % _checked_tp(tp):
            raise TopologyError(f"tp={tp} does not divide the {per_node} ranks of a node: tensor parallelism runs "
                                f"inside the node, so pick a tp that divides {per_node}")
        return cls((per_node // tp, world // tp), names, timeout, tp)

    def __repr__(self) -> str:
        return f"Topology({self.sizes}, names={self.names}{f', tp={self.tp}' if self.tp > 1 else ''})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and (self.sizes, self.names, self.tp) == (other.sizes, other.names,
                                                                                      other.tp)

    def __hash__(self) -> int:
        return hash((self.sizes, self.names, self.tp))

    # ---- arithmetic (no process group needed) -------------------------------------------------
    @property
    def world_size(self) -> int:
        """Positions of the outermost tier: the data-parallel world (the ranks too, without tensor parallelism)."""
        return self.sizes[-1]

    @property
    def num_ranks(self) -> int:
        """Every rank: the data-parallel world times ``tp``."""
        return self.sizes[-1] * self.tp

    def tp_ranks(self, rank: int) -> tuple[int, ...]:
        """The tensor-parallel group of ``rank``: ``tp`` adjacent ranks."""
        start = rank - rank % self.tp
        return tuple(range(start, start + self.tp))

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
        out, radix, position = [], 1, rank // self.tp
        for size in self.sizes:
            out.append((position % size) // radix)
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
        """The ranks of ``rank``'s level-``level`` group (of its TP coordinate: [Note: tensor parallelism is not a
        tier])."""
        size, tp = self.level_size(level), self.tp
        position = rank // tp
        start = position - position % size
        return tuple((start + i) * tp + rank % tp for i in range(size))

    def cross_ranks(self, rank: int, inner: int, outer: int) -> tuple[int, ...]:
        """Ranks in ``rank``'s level-``outer`` group that sit at its position in their level-``inner`` group."""
        size = self.level_size(inner)
        pos = rank // self.tp % size
        return tuple(r for r in self.group_ranks(rank, outer) if r // self.tp % size == pos)

    def tier_of_link(self, a: int, b: int) -> str:
        """The smallest tier whose group holds both ranks: the tier a byte between them is counted on (the
        innermost for two ranks of one TP group)."""
        for size, name in zip(self.sizes, self.names):
            if a // self.tp // size == b // self.tp // size:
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

    def placements(self, level: int, tp=None) -> tuple:
        """DTensor placements over ``mesh`` of a state at ``level``: Shard(0) on the tiers below it; with tensor
        parallelism first the parameter's own placement on the ``tp`` dim (``tp``, default ``Replicate()``).

        Nested ``Shard(0)`` on mesh dims ordered innermost tier first chunk dim 0 innermost tier first, which is
        the ownership map: a rank's DTensor shard at level ``k`` is its level-``k`` chunk. (A single flattened
        mesh dim cannot express it: its process group would order ranks by rank, not by chunk.) The ``tp`` dim
        comes first, so a TP shard of dim 0 is cut by the tiers after TP, as the engine cuts it.
        """
        from torch.distributed.tensor import Replicate, Shard

        tiers = tuple(Shard(0) if dim < level else Replicate() for dim in range(len(self.sizes)))
        return ((tp or Replicate()), *tiers) if self.tp > 1 else tiers

    def _grid(self):
        """Ranks as a tensor whose dims are the tiers' fan-outs, innermost first: ``grid[c0, c1, ...] = rank``
        (with tensor parallelism the TP coordinate first: ``grid[t, c0, c1, ...]``)."""
        import torch

        grid = torch.arange(self.num_ranks).view(*reversed(self.fanouts()), self.tp)
        grid = grid.permute(*reversed(range(grid.dim()))).contiguous()
        return grid if self.tp > 1 else grid[0]

    @property
    def mesh(self):
        """The DeviceMesh whose dims are the tiers, innermost first, after a ``"tp"`` dim when ``tp > 1`` (made by
        ``init_process_groups``)."""
        if self._mesh is None:
            raise TopologyError("the topology has no device mesh yet: ts.shard (or init_process_groups) makes it")
        return self._mesh

    @property
    def tp_mesh(self):
        """The 1-D DeviceMesh of this rank's tensor-parallel group: what ``parallelize_module`` takes (made by
        ``init_process_groups``, which ``ts.shard`` calls; call it first to parallelise before sharding)."""
        if self.tp == 1:
            raise TopologyError(f"{self} has no tensor parallelism: declare it, e.g. Topology(sizes, tp=2)")
        if self._mesh is None:
            raise TopologyError("the topology has no device mesh yet: call topology.init_process_groups(device_type) "
                                "before parallelize_module(model, topology.tp_mesh, plan)")
        return self._mesh["tp"]

    # ---- process groups -----------------------------------------------------------------------
    @property
    def report_window(self) -> float:
        """Seconds a rank whose collective failed waits for the other members' reports (inside ``timeout``)."""
        return min(5.0, self.timeout / 4)

    @property
    def group_timeout(self) -> float:
        """Seconds each operation of the engine's groups may take: the default process group's timeout (how long
        a live rank is waited for), at least ``timeout``, less the report window that comes on top."""
        return max(process_group_timeout(), self.timeout) - self.report_window

    @property
    def control_group(self) -> TierGroup:
        """Every rank, on a process group of its own bounded as the others are: for the main thread's collectives
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
        # every rank reaches the same verdict: each judges the same gathered list ([Note: hosts at shard])
        declared: list = [None] * world
        dist.all_gather_object(declared, (self.sizes, self.names, host_identity()))
        for rank, (sizes, names, _) in enumerate(declared):
            if (sizes, names) != declared[0][:2]:
                raise TopologyError(
                    f"rank 0 declares Topology({declared[0][0]}, names={declared[0][1]}) but rank {rank} declares "
                    f"Topology({sizes}, names={names}): every rank must pass the same topology (ranks that read "
                    "different LOCAL_WORLD_SIZE values give this): declare it, e.g. TIERSHARD_TOPOLOGY=8,64")
        if world != self.num_ranks:
            if self.tp > 1:
                raise TopologyError(
                    f"{self} covers {self.world_size} x tp {self.tp} = {self.num_ranks} ranks but the world has "
                    f"{world}: the tiers count TP groups, so make the last tier size {world // self.tp}"
                    if world % self.tp == 0 else
                    f"{self} covers {self.num_ranks} ranks but the world has {world}, which tp={self.tp} does not "
                    "divide: pick a tp that divides the ranks of a node")
            raise TopologyError(
                f"{self} covers {self.world_size} ranks but the world has {world}: "
                f"make the last tier size {world}, e.g. Topology((ranks_per_node, {world}))")
        self.check_hosts([host for _, _, host in declared])
        me = dist.get_rank()
        # gloo and NCCL apply a group's timeout to each of its operations: the process group's own, so that a live
        # rank is waited for; the heartbeat names a dead one within ``timeout`` ([Note: slow is not dead])
        bound = timedelta(seconds=self.group_timeout)
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

    def node_level(self) -> int | None:
        """The level whose groups must each sit on one host: the tier named ``node``, else the tier below world
        (``node`` under the default names); None for a single tier, which assumes nothing about nodes."""
        if "node" in self.names:
            return self.names.index("node") + 1
        return len(self.sizes) - 1 if len(self.sizes) > 1 else None

    def check_hosts(self, hosts: Sequence[str]) -> None:
        """Raise ``TopologyError`` unless every node-tier group runs on one host (``hosts[r]``: rank r's
        ``host_identity()``).

        [Note: hosts at shard] The engine keeps the collectives of node-tier groups (and every tier inside them)
        inside a node and counts their bytes as intra-node; a group spanning two hosts would silently send them
        over the network. One host holding several node groups is allowed: that is how nodes are emulated on one
        machine (the test suite runs Topology((2, 4)) on 4 loopback ranks). ``init_process_groups`` (so
        ``ts.shard``) calls this with the hosts all-gathered over the default group.
        """
        level = self.node_level()
        if level is None:
            return
        if len(hosts) != self.num_ranks:
            raise TopologyError(f"{len(hosts)} host names for the {self.num_ranks} ranks of {self}")
        for start in range(0, self.num_ranks, self.tp):
            members = list(hosts[start:start + self.tp])
            if len(set(members)) > 1:
                raise TopologyError(
                    f"the tensor-parallel group of ranks {start}-{start + self.tp - 1} of {self} spans hosts "
                    f"{', '.join(repr(h) for h in dict.fromkeys(members))}: tensor parallelism runs inside a node, so "
                    f"run each {self.tp} adjacent ranks on one host or pick a tp that divides the ranks per host "
                    "(docs/parallelism.md)")
        size, tier = self.level_size(level) * self.tp, self.level_name(level)
        problems = []
        for start in range(0, self.num_ranks, size):
            members = list(hosts[start:start + size])
            if len(set(members)) > 1:
                runs = _runs(members, start)
                shown = ", ".join(f"{_span(a, b)} on {h!r}" for a, b, h in runs[:6]) + (", ..." if len(runs) > 6
                                                                                          else "")
                problems.append(f"{tier} group of ranks {start}-{start + size - 1} spans {len(set(members))} hosts: "
                                f"{shown}")
        if not problems:
            return
        runs = _runs(list(hosts), 0)
        lengths = [b - a + 1 for a, b, _ in runs]
        contiguous = len({h for _, _, h in runs}) == len(runs)
        per_host = lengths[0] if contiguous and len(set(lengths)) == 1 else None
        if contiguous and per_host is None:
            hint = (f"the hosts run different numbers of ranks ({', '.join(map(str, lengths[:8]))}"
                    f"{', ...' if len(lengths) > 8 else ''}): tiers need the same number on every node")
        elif per_host is not None and per_host % self.tp == 0:
            sizes = (*self.sizes[:level - 1], per_host // self.tp, *self.sizes[level:])
            try:
                hint = (f"the ranks run {per_host} per host, node by node: declare Topology({Topology(sizes).sizes}"
                        f"{f', tp={self.tp}' if self.tp > 1 else ''})")
            except TopologyError:
                hint = f"the ranks run {per_host} per host, node by node"
        else:
            hint = ("the ranks are not placed node by node (rank r on node r // ranks_per_node): torchrun places "
                    "them so; under srun use --distribution=block")
        raise TopologyError(
            f"{self} does not match where the ranks run: {'; '.join(problems[:4])}"
            f"{'; ...' if len(problems) > 4 else ''}. Collectives assumed inside a node would cross the network; "
            f"{hint}. Fix: Topology((ranks_per_node, world)) or TIERSHARD_TOPOLOGY with the real ranks per node "
            f"(docs/launchers.md). Hosts are hostname plus network namespace: give containers of one machine one "
            f"{HOST_ENV} if their ranks should count as one node")

    def _make_mesh(self, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        names = ("tp", *self.names) if self.tp > 1 else self.names
        return DeviceMesh(device_type, self._grid(), mesh_dim_names=names)

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0


def _checked_tp(tp: object) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TopologyError(f"tp={tp!r} must be a positive whole number: the ranks of one tensor-parallel group "
                            "(1: no tensor parallelism)")
    return tp


def _runs(hosts: list, start: int) -> list[tuple[int, int, str]]:
    """Consecutive ranks on one host as (first, last, host), ranks numbered from ``start``."""
    runs: list[tuple[int, int, str]] = []
    for offset, host in enumerate(hosts):
        if runs and runs[-1][2] == host:
            runs[-1] = (runs[-1][0], start + offset, host)
        else:
            runs.append((start + offset, start + offset, host))
    return runs


def _span(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
