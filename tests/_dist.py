"""The suite launches its ranks with the package's own local launcher."""
from tiershard.cluster.local import free_port, run_local as run_ranks  # noqa: F401
