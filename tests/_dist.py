"""The suite launches its ranks with the package's own local launcher."""
from tiershard.cluster.local import free_port, run_local as run_ranks  # noqa: F401


def checkpoint_error(fn) -> str:
    """The message of the ``CheckpointError`` that ``fn()`` raises, or "no error"."""
    from tiershard.checkpoint import CheckpointError

    try:
        fn()
    except CheckpointError as err:
        return str(err)
    return "no error"
