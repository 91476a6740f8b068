"""What users' models do, on 4 ranks as 2 nodes of 2, each against single-process training with SGD + momentum.

Frozen parameters, parameters and whole units unused in a step, a unit called twice in one forward,
activation checkpointing inside a unit, a write to the weights between steps (under no_grad, through
load_full_state_dict and through ``.data``) that must reach the next forward on every rank, and hpZ caches
under those writes.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn

PER_RANK = 2


class Variants(TinyGPT):
    """TinyGPT with an unused Linear inside the root, an unused Block, and block 0 optionally called twice."""

    def __init__(self, twice=False, **kw):
        super().__init__(**kw)
        self.unused_linear = nn.Linear(5, 3)
        self.spare = Block(12, 2)
        self.twice = twice

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        x = self.blocks[0](x)
        if self.twice:
            x = self.blocks[0](x)
        x = self.blocks[1](x)
        return self.head(self.ln_f(x)) * self.scale


def build(case):
    torch.manual_seed(0)
    if case == "frozen":
        model = TinyGPT()
        model.blocks[0].fc.weight.requires_grad_(False)
        model.ln_f.requires_grad_(False)
        return model
    if case == "unused":
        return Variants()
    if case == "twice":
        return Variants(twice=True)
    if case == "checkpoint":
        return TinyGPT(checkpoint=True)
    if case == "writes":
        return TinyGPT()
    raise ValueError(case)


def between_steps(model, step, params, load=None):
    """The writes of the 'writes' case, applied the same way to the sharded and the reference model."""
    with torch.no_grad():
        if step == 0:
            for p in params:
                p.mul_(0.5)
        if step == 1 and load is not None:
            load()
            for p in params[::3]:       # writes through .data reach no version counter
                p.data.mul_(0.9)


def run_case(case, world, rank=None, plan=None, topo=None):
    import tiershard as ts

    model = build(case)
    sharded = rank is not None
    if sharded:
        model = ts.shard(model, plan, topo, wrap={Block})
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    new_weights = {k: v * 1.5 for k, v in build(case).state_dict().items()}
    losses = []
    for s, step in enumerate(batches(2, 3, 2, world, PER_RANK)):
        total = 0.0
        for i, tokens in enumerate(step):
            if sharded:
                tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
            if sharded and i == 0:
                with ts.no_sync(model):
                    loss = loss_fn(model, tokens, 2)
                    loss.backward()
            else:
                loss = loss_fn(model, tokens, 2)
                loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
        if case == "writes":
            if sharded:
                load = lambda: ts.load_full_state_dict(model, new_weights)  # noqa: E731
            else:
                load = lambda: model.load_state_dict(new_weights)  # noqa: E731
            between_steps(model, s, list(model.parameters()), load)
    state = ts.full_state_dict(model) if sharded else {k: v.detach() for k, v in model.state_dict().items()}
    return losses, state


CASES = ["frozen", "unused", "twice", "checkpoint", "writes"]
PLANS = ["GGG", "NNN", "IIG", "NGI", "GGG+hpz", "IGN"]


def sweep(rank, world):
    import tiershard as ts

    topo = ts.Topology((2, 4))
    out = {}
    for case in CASES:
        ref_losses, ref_state = run_case(case, world)
        for plan in PLANS:
            losses, state = run_case(case, world, rank, plan, topo)
            err = max(((state[k] - ref_state[k]).abs().max() / (ref_state[k].abs().max() + 1e-12)).item()
                      for k in ref_state)
            out[(case, plan)] = (err, losses, ref_losses, sorted(state.keys() ^ ref_state.keys()))
    # unused parameters get an exact zero gradient (and no hang)
    model = ts.shard(build("unused"), "GGG", topo, wrap={Block})
    loss_fn(model, batches(3, 1, 1, world, PER_RANK)[0][0][rank * 2:rank * 2 + 2], 1).backward()
    out["spare_grad_zero"] = all(p.grad is not None and not p.grad.full_tensor().any()
                                 for p in model.spare.parameters())
    return out


def test_user_model_features_match_single_process():
    results = run_ranks(sweep, 4)
    failures = []
    for rank, res in enumerate(results):
        assert res.pop("spare_grad_zero"), "a unit unused in the step must get a zero gradient"
        for (case, plan), (err, losses, ref_losses, key_diff) in res.items():
            if key_diff:
                failures.append(f"{case} {plan}: state keys differ {key_diff}")
            if err > 1e-5:
                failures.append(f"{case} {plan} rank {rank}: parameters off by {err:.2e}; "
                                f"losses {losses} vs {ref_losses}")
    assert not failures, "\n".join(failures)
