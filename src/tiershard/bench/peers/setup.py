"""What every peer system is built from (``Setup``) and the three calls the shared loop makes on it (``Runner``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn as nn

from ...train.models.gpt import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything a system needs to build its model and optimizer on this rank."""

    system: str
    model_cfg: GPTConfig
    micro_steps: int
    batch_per_rank: int
    seq: int
    seed: int
    rank: int
    world: int
    ranks_per_node: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_name: str
    lr: float
    weight_decay: float
    tiers: tuple[int, ...] | None = None     # tiershard's topology; None: (ranks_per_node, world)

    def model(self) -> GPT:
        """The fp32 GPT every system starts from: the same weights on every rank and in every system."""
        torch.manual_seed(self.seed)
        return GPT(self.model_cfg)

    def optimizer(self, params) -> torch.optim.Optimizer:
        """AdamW, or SGD with momentum: linear in the gradient, so a wrong averaging factor shows in losses."""
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)


class Runner:
    """One system's model and optimizer behind the three calls the shared loop makes.

    The default is plain PyTorch: the loss is divided by the number of micro-steps (the systems average
    gradients over ranks themselves), and the optimizer steps once per step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, setup: Setup):
        self.model, self.optimizer, self.setup = model, optimizer, setup

    def micro_step(self, last: bool) -> ContextManager:
        """Context around one micro-step's forward and backward; ``last`` is the accumulation boundary."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.setup.micro_steps).backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
