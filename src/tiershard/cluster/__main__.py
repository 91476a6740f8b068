"""``python -m tiershard.cluster allreduce ...``: the per-rank job behind ``tiershard cluster check``."""
import sys

from .emulated import _main

sys.exit(_main())
