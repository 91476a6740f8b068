"""``python -m tiershard.bench SPEC.json``: the per-rank job that ``run_bench`` launches on the cluster."""
import sys

from .rank import _main

sys.exit(_main())
