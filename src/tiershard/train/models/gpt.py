"""A small GPT, written plainly (after nanoGPT) so the whole model fits in one read.

``Block`` is the unit to shard: ``ts.shard(model, plan, topo, wrap={Block})`` makes one unit per block and
leaves the embeddings, the final norm and the tied head to the root. The head shares its weight with the token
embedding (``lm_head.weight is transformer.wte.weight``), as in GPT-2.

``forward`` returns logits only: a single tensor output is the simplest thing for a sharding engine to hook,
and the loss (``lm_loss``) is computed in fp32 whatever the parameter dtype.

Its linear layers (``Linear``) multiply bf16 operands on a CPU in fp32 and round the product to bf16: the result a
bf16 matrix multiply gives anyway (it accumulates in fp32), at a fraction of the time on CPUs without bf16
instructions. See [Note: bf16 products on a CPU].
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model sizes. ``vocab_size`` 256 is byte-level text; ``block_size`` is the sequence length."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, GPTConfig] = {
    # for tests: a forward and backward take milliseconds
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    # the default job: about 1.6M parameters, a few minutes on two CPU cores
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=176),
    # about 11M parameters, for a GPU or a patient CPU
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
}


def gpt_config(preset: str = "small", **overrides) -> GPTConfig:
    """A preset with some fields replaced; unknown presets or fields raise ValueError naming the choices."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown model field {unknown[0]!r}: known fields are {', '.join(sorted(known))}")
    return replace(PRESETS[preset], **overrides)


# Note [bf16 products on a CPU]
# On a CPU without bf16 instructions (AVX2 only) torch's bf16 matrix multiply is a generic loop, 15-20x slower
# than fp32: it took 92% of a bf16 training step of the small preset. It accumulates in fp32 and rounds the
# product to bf16, as a GPU's tensor cores do; computing the same product in fp32 from the bf16 operands and
# rounding it gives the same values up to the order of the sums (about one element in 10^4 differs by one bf16
# ulp), and the backward's products, whose operands are the same bf16 tensors, likewise. Weights, activations,
# gradients and every collective stay bf16; only the multiply's arithmetic moves to fp32. On a GPU nothing changes.
#
# Backward keeps what a bf16 ``F.linear`` keeps: the bf16 input and the weight itself, cast to fp32 again when
# the gradients are computed. Letting autograd record ``F.linear(x.float(), w.float())`` would keep both fp32
# copies from forward to backward: twice each input's bytes and an fp32 copy of every weight, which on a sharded
# model outlives the gathered bf16 weight it was cast from (the 3.7M GPT's step peaked 18 MiB higher per rank).
# The backward below makes the products autograd makes for ``addmm`` (same kernels, same layouts: bit-equal).
# Casting again costs time: the 3.7M GPT's forward and backward on one CPU thread take about 7% longer.


class _LinearInFp32(torch.autograd.Function):
    """``F.linear`` of bf16 operands computed in fp32 and rounded to bf16, saving only the bf16 operands."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.mm(weight.float()).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = x.float().reshape(-1, x.shape[-1]).t().mm(g).t().to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(ctx.bias_dtype)
        return gx, gw, gb


class Linear(nn.Linear):
    """``nn.Linear`` whose bf16 product on a CPU is computed in fp32 and rounded to bf16 (same values, much faster)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return _LinearInFp32.apply(x, self.weight, self.bias)
        return super().forward(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.init_std = 0.02 / math.sqrt(2 * cfg.n_layer)     # GPT-2's scaled residual projections
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.init_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer block (pre-norm attention and MLP): the unit a sharding plan wraps."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one parameter, two uses
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation of one module; ``model.apply`` runs it, and so does sharding a GPT built on the
        meta device (``ts.shard(..., init=GPT.init_weights)``), with the same result."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the tied head is the token embedding)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, T, vocab) for token ids of shape (B, T)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 even when the model runs in bf16."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
