"""A small transformer with tied embeddings, odd sizes and a buffer: what the engine tests train."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int, checkpoint: bool = False):
        super().__init__()
        self.heads, self.checkpoint = heads, checkpoint
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d + 1), nn.Linear(4 * d + 1, d)

    def _attn(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))

    def _body(self, x):
        x = x + self._attn(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x):
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 12, layers: int = 2, heads: int = 2, seq: int = 8,
                 checkpoint: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, checkpoint) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight          # tied, as in GPT-2
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.scale


def batches(seed: int, steps: int, micro: int, world: int, per_rank: int = 2, seq: int = 8, vocab: int = 37):
    """Token batches [step][micro] of shape (world * per_rank, seq + 1); rank r takes rows r*per_rank.."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (world * per_rank, seq + 1), generator=g) for _ in range(micro)]
            for _ in range(steps)]


def loss_fn(model, tokens, micro: int):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)) / micro


def pattern_batches(seed: int, steps: int, world: int, per_rank: int = 4, seq: int = 8, vocab: int = 37):
    """Learnable tokens: arithmetic progressions mod vocab with a random start and stride 1..3."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (world * per_rank, 1), generator=g)
        stride = torch.randint(1, 4, (world * per_rank, 1), generator=g)
        out.append((start + stride * torch.arange(seq + 1)) % vocab)
    return out


class TPBlock(nn.Module):
    """A pre-norm MLP block laid out for tensor parallelism with sequence parallelism (``tp_plan``)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPNet(nn.Module):
    """Embedding, MLP blocks, norm and head, with odd sizes: TP shards of 19/18 vocabulary rows and 18 hidden
    rows, which the tiers cut unevenly again. (The hidden size is even: a row-parallel layer's input is rebuilt
    from its local shard as if TP cut it evenly, so torch's TP takes no uneven hidden size.)"""

    def __init__(self, vocab: int = 37, d: int = 8, hidden: int = 36, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TPBlock(d, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tp_plan(model: TPNet, loss_parallel: bool = False) -> dict:
    """torchtitan's layout on ``TPNet``: a vocab-parallel embedding into a sequence-sharded residual stream,
    sequence-parallel norms, column- then row-parallel MLPs, a column-parallel head (its logits sharded over the
    vocabulary with ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                    use_local_output=not loss_parallel)}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan
