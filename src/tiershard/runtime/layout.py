"""Where each row of each parameter sits in a unit's flat buffers: the per-parameter side of the ownership map.

[Note: slot-major layout] A parameter of shape ``(d, *rest)`` is cut on dim 0 as ``Topology.chunking`` says:
into the fan-out of each tier below level ``os`` in turn with ``torch.chunk``'s rule (ceil-sized, trailing
chunks short or empty), exactly as DTensor cuts the master under nested ``Shard(0)`` placements
(``Topology.placements``); then each of those into its ``world / size(os)`` slots by the same rule. The ``W``
slots (one per rank, indexed by ``chunk_index`` at the top level) are padded to a common ``R`` rows, the size
of the first one.

A unit's buffer at any level is a ``(slots, U)`` matrix in *slot-major* order: row ``c`` holds finest chunk
``c`` of every parameter side by side (parameter ``j`` in columns ``[offset_j, offset_j + R_j * row_j)``,
``U`` = the sum of those widths). The level-``k`` chunk a rank owns is a contiguous band of ``W / size(k)``
rows, so every level move is one flat collective over a cross group on contiguous memory (the v1 ownership
map, unchanged), and a parameter's level-``k`` DTensor shard is its column block of that band, with padding
rows dropped. Only the ends of the pipeline touch parameters: the copy-out of a gathered unit into
per-parameter working tensors, the copy-in of their gradients, and the exchange with the fp32 masters.

When the real rows of a band form a prefix of its padded rows (always when ``d`` divides evenly, and always
with one tier or replicated masters), a shard is a view of the padded block; otherwise (uneven nesting, e.g.
5 rows cut 2 then 2) the rows are picked by index. Either way it is one copy per
parameter, never per unit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from .tensor_parallel import TPSpec


def finest_chunks(dim0: int, fanouts: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each finest chunk of ``dim0`` rows, in ownership (innermost-first) order."""
    chunks = [(0, dim0)]
    for t in fanouts:
        nxt = []
        for start, length in chunks:
            size = -(-length // t)
            for i in range(t):
                lo, hi = min(i * size, length), min((i + 1) * size, length)
                nxt.append((start + lo, hi - lo))
        chunks = nxt
    return chunks


@dataclass
class ParamLayout:
    """One original parameter: its names and uses, the shape the engine stores, and its columns in the unit's
    matrices. ``shape`` is the global shape, or for a tensor-parallel parameter (``tp``) its local TP shard's
    ([Note: TP parameters under the tiers], tensor_parallel.py)."""

    uses: list[tuple[nn.Module, str]]
    names: list[str]
    shape: torch.Size
    chunks: list[tuple[int, int]]      # finest chunks (start, length), one per slot
    offset: int = 0                     # first column in the unit's matrix
    tp: "TPSpec | None" = None          # how parallelize_module placed it, None when it is not tensor-parallel
    rows: int = field(init=False)       # R: padded rows per slot
    row: int = field(init=False)        # elements per row
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.rows = self.chunks[0][1] if self.chunks else 0
        self.row = math.prod(self.shape[1:])

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as users see it (across TP too)."""
        return self.shape if self.tp is None else self.tp.shape

    @property
    def cols(self) -> int:
        """Width of this parameter's column block: ``R * row``."""
        return self.rows * self.row

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def exact(self) -> bool:
        """Every finest chunk is full: the padded parameter is the parameter (no padding rows at all)."""
        return self.rows * len(self.chunks) == self.shape[0]

    def band(self, first: int, count: int) -> "Band":
        """The real rows inside slots ``[first, first + count)``: where they are in the padded block."""
        key = (first, count)
        band = self._cache.get(key)
        if band is None:
            band = Band.of(self.chunks[first:first + count], self.rows, self.row, self.shape)
            self._cache[key] = band
        return band


@dataclass(frozen=True)
class Band:
    """A run of consecutive slots of one parameter: its real rows and how they sit in the padded rows."""

    start: int                          # first real row (global)
    length: int                         # real rows
    padded: int                         # padded rows = slots * R
    index: torch.Tensor | None          # padded positions of the real rows, None when they are a prefix
    shape: tuple[int, ...]              # shape of the real shard

    @classmethod
    def of(cls, chunks: Sequence[tuple[int, int]], R: int, row: int, shape: torch.Size) -> "Band":
        start = chunks[0][0] if chunks else 0
        length = sum(n for _, n in chunks)
        # a prefix: every slot before the last non-empty one is full
        nonempty = [i for i, (_, n) in enumerate(chunks) if n]
        prefix = all(chunks[i][1] == R for i in range(nonempty[-1])) if nonempty else True
        index = None
        if not prefix:
            index = torch.cat([torch.arange(i * R, i * R + n) for i, (_, n) in enumerate(chunks)])
        return cls(start, length, len(chunks) * R, index, (length, *shape[1:]))

    def real(self, padded: torch.Tensor) -> torch.Tensor:
        """The real rows of a padded block (``padded`` rows x row): a view when they form a prefix."""
        if self.index is None:
            return padded[: self.length].view(self.shape)
        return padded.index_select(0, self.index.to(padded.device)).view(self.shape)

    def padded_flat(self, real: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``real`` as this band's padded rows, flattened: the tensor itself when it has no padding rows,
        else a padded copy."""
        if self.index is None and self.length == self.padded:
            return real.reshape(-1)
        padded = torch.empty(self.padded, math.prod(self.shape[1:]), dtype=dtype or real.dtype, device=real.device)
        self.pad_into(real, padded)
        return padded.view(-1)

    def pad_into(self, real: torch.Tensor, padded: torch.Tensor) -> None:
        """Write ``real`` rows into a padded block, zeroing the padding rows."""
        real = real.reshape(self.length, math.prod(self.shape[1:]))
        if self.index is None:
            padded[: self.length].copy_(real)
            padded[self.length:].zero_()
        else:
            padded.zero_()
            padded.index_copy_(0, self.index.to(padded.device), real.to(padded.dtype))


def plan_columns(layouts: Sequence[ParamLayout]) -> int:
    """Assign each parameter its column offset; returns U, the width of the unit's matrices."""
    offset = 0
    for layout in layouts:
        layout.offset = offset
        offset += layout.cols
    return offset


def unit_columns(shapes: Sequence[Sequence[int]], chunking: Sequence[int]) -> tuple[int, ...]:
    """Each parameter's width in the unit's (slots x U) matrix, for parameters of these shapes cut by
    ``chunking`` (``Topology.chunking``): the row layout qgZ's blocks follow, and ``U`` is their sum."""
    return tuple(finest_chunks(shape[0], chunking)[0][1] * math.prod(shape[1:]) for shape in map(tuple, shapes)
                 if shape)


def padded_unit_numel(shapes: Sequence[Sequence[int]], chunking: Sequence[int]) -> int:
    """``S`` = slots x U for parameters of these shapes cut by ``chunking``: what every flat buffer of the unit
    is cut from."""
    return math.prod(chunking) * sum(unit_columns(shapes, chunking))
