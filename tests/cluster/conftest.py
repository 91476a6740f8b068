"""The emulated cluster the fault tests share: 2 nodes of 2 ranks, uncapped, one per test module."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def cluster(request):
    from tiershard.cluster.emulated import EmulatedCluster, namespaces_unavailable

    reason = namespaces_unavailable("probe")
    if reason:
        pytest.skip(reason)
    tag = request.module.__name__.rsplit("_", 1)[-1][:4]        # "cluster", "matrix": distinct per module
    with EmulatedCluster(2, 2, None, name=f"{tag}{os.getpid() % 100000}") as made:
        yield made
