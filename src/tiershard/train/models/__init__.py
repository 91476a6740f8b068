"""Built-in models for the ``train`` job."""
from __future__ import annotations

from .gpt import GPT, PRESETS, Block, GPTConfig, gpt_config, lm_loss

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "gpt_config", "lm_loss"]
