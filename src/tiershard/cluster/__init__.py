"""An emulated cluster on one machine: network namespaces as nodes with capped links (``emulated``, with its parts
``netns``, ``launch``, ``counters`` and the check job ``check``), and plain loopback gloo ranks for tests and
benchmarks (``local``)."""
from __future__ import annotations

from .emulated import ClusterError, EmulatedCluster, LaunchError, RankResult, format_rate, parse_rate
from .local import free_port, run_local

__all__ = ["ClusterError", "EmulatedCluster", "LaunchError", "RankResult", "format_rate", "parse_rate", "free_port",
           "run_local"]
