"""``python -m tiershard.cluster allreduce ...``: the per-rank job behind ``tiershard cluster check``."""
import sys

from .check import main

sys.exit(main())
