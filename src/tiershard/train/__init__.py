"""The training job behind ``tiershard train``: its config (``config``), data (``data``), the loop and its
checkpoints (``trainer``), progress and metrics (``progress``) and the built-in models (``models``)."""
