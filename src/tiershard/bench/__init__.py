"""``tiershard bench``: tiershard's plans against FSDP2 and DeepSpeed on an emulated cluster, side by side.

``config`` holds a bench's settings and the systems it compares, ``runner`` runs a bench (the cluster, the
launches, the cost model's predictions, the rows of the results), ``rank`` is the per-rank job it launches,
``report`` renders the results as tables and plots, ``peers`` builds every system behind one training loop,
``measure`` holds the smaller measurements the benchmarks share.
"""
from __future__ import annotations

from .config import DEFAULT_SYSTEMS, PEERS, BenchConfig, BenchError
from .report import render_check, render_markdown, write_outputs
from .runner import bench_check, run_bench

__all__ = ["BenchConfig", "BenchError", "DEFAULT_SYSTEMS", "PEERS", "bench_check", "render_check", "render_markdown",
           "run_bench", "write_outputs"]
