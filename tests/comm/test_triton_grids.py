"""The Triton codec launchers keep every grid axis but the first within CUDA's 65535 limit, at any size.

Triton is not needed: the launchers run against a stand-in ``triton`` whose kernels record their grids, on
meta tensors, so this runs on the CPU. Before, the flat kernels put blocks on axis 1 and decode failed above
about 67M values per rank (65535 programs of 1024 values).
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from tiershard.comm.codecs import INT4, INT8, BlockCodec
from tiershard.comm.codecs.format import _layout

AXIS_LIMIT = 65535          # CUDA's limit on grid axes 1 and 2; axis 0 allows 2**31 - 1


@pytest.fixture
def launches(monkeypatch):
    grids: list[tuple[str, tuple[int, ...]]] = []

    class Kernel:
        def __init__(self, fn):
            self.name = fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **kwargs: grids.append((self.name, tuple(grid)))

    fake = types.ModuleType("triton")
    fake.jit = Kernel
    fake.cdiv = lambda a, b: -(-a // b)
    fake.__version__ = "stand-in"
    fake.language = types.ModuleType("triton.language")
    fake.language.constexpr = lambda value: value
    monkeypatch.setitem(sys.modules, "triton", fake)
    monkeypatch.setitem(sys.modules, "triton.language", fake.language)
    monkeypatch.delitem(sys.modules, "tiershard.comm.codecs.triton_kernels", raising=False)
    kernels = importlib.import_module("tiershard.comm.codecs.triton_kernels")
    yield kernels, grids
    sys.modules.pop("tiershard.comm.codecs.triton_kernels", None)


@pytest.mark.parametrize("codec", [INT4, INT8, BlockCodec(8, 8192), BlockCodec(4, 8192),
                                   BlockCodec(8, 128, True, False), BlockCodec(4, 128, True, True)],
                         ids=lambda c: c.spec)
def test_grids_fit_cuda_limits_for_a_70b_layer_on_8_ranks(launches, codec):
    kernels, grids = launches
    k, n = 8, 1 << 28                       # 2**31 values split over 8 ranks: the reduce-scatter of a 70B layer
    x = torch.empty(k * n, dtype=torch.bfloat16, device="meta")
    wire = torch.empty(k * codec.wire_bytes(n), dtype=torch.uint8, device="meta")
    if codec.rotate or codec.stochastic:    # the general path of the rotated and stochastic formats
        lay = _layout(codec.block, (3000, 7, 1 << 20))
        m = n // lay.U * lay.U
        seg_wire = torch.empty(k * codec.wire_bytes(m, (3000, 7, 1 << 20)), dtype=torch.uint8, device="meta")
        kernels.encode_wire_x(codec, x, k, n, wire, None, None, 5 if codec.stochastic else None)
        kernels.decode_wire_x(codec, wire, k, n, torch.empty(k * n, device="meta"), None, False)
        kernels.decode_wire_x(codec, wire, k, n, torch.empty(n, device="meta"), None, True)
        kernels.encode_wire_x(codec, torch.empty(k * m, device="meta"), k, m, seg_wire, None, lay, None)
        kernels.decode_wire_x(codec, seg_wire, k, m, torch.empty(m, device="meta"), lay, True)
        assert len(grids) >= 5
        assert [(name, grid) for name, grid in grids if any(axis > AXIS_LIMIT for axis in grid[1:])] == []
        assert max(grid[0] for _, grid in grids) > AXIS_LIMIT
        return
    kernels.encode_wire(codec, x, k, n, wire, None)
    kernels.decode_wire(codec, wire, k, n, torch.empty(k * n, device="meta"))
    kernels.decode_wire_sum(codec, wire, k, n, torch.empty(n, device="meta"))
    lay = _layout(codec.block, (3000, 7, 1 << 20))
    rows = n // lay.U
    m = rows * lay.U
    seg_wire = torch.empty(k * codec.wire_bytes(m, (3000, 7, 1 << 20)), dtype=torch.uint8, device="meta")
    kernels.encode_wire_seg(codec, torch.empty(k * m, device="meta"), k, m, seg_wire, None, lay)
    kernels.decode_wire_seg(codec, seg_wire, k, m, torch.empty(k * m, device="meta"), lay)
    kernels.decode_wire_sum_seg(codec, seg_wire, k, m, torch.empty(m, device="meta"), lay)
    assert len(grids) >= 6
    too_large = [(name, grid) for name, grid in grids if any(axis > AXIS_LIMIT for axis in grid[1:])]
    assert too_large == []
    assert max(grid[0] for _, grid in grids) > AXIS_LIMIT      # the sizes do need the large axis
