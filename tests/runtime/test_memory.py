"""What a rank holds, measured from the engine's live tensors (``ts.memory_stats``), against the cost model's
prediction for the same plan (``cost.memory.breakdown``), exactly, category by category.

One launch of 4 ranks (2 nodes of 2) trains the tiny GPT (odd sizes, tied embeddings, one frozen parameter) under
several plans, with one and four micro-steps and two prefetch depths, and returns every breakdown: measured at
the end of the second step's last backward, with the peaks of gathered weights over that step, and the
communication buffers still held right after a forward.
"""
from __future__ import annotations

import torch

from _dist import run_ranks
from _models import TinyGPT, batches, loss_fn

PER_RANK = 2
CASES = [("GGG", 1, 1), ("GGG", 4, 1), ("GGG", 1, 2), ("IIG", 1, 1), ("IIG", 4, 1), ("NNG", 1, 1), ("NNG", 4, 1),
         ("GGG+hpz", 1, 1), ("GGG+qgz=int4+ef", 1, 1), ("GGG+qgz=int4+ef", 4, 1), ("GGG+hpz+qwz", 1, 1)]


def _run(rank, world):
    import tiershard as ts
    from tiershard.cost.memory import breakdown, engine_layouts
    from tiershard.runtime.api import BREAKDOWN

    from _models import Block

    topo = ts.Topology((2, 4))
    out = {}
    for plan, micro, prefetch in CASES:
        torch.manual_seed(0)
        model = TinyGPT()
        model.blocks[0].ln1.weight.requires_grad_(False)          # a frozen group in one unit
        model = ts.shard(model, plan, topo, wrap={Block}, prefetch=prefetch)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        after_forward = []
        for step, micros in enumerate(batches(0, 2, micro, world, PER_RANK)):
            if step == 1:
                ts.memory_stats(model, opt, reset_peaks=True)
            for m, tokens in enumerate(micros):
                local = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
                ctx = ts.no_sync(model) if m < micro - 1 else torch.enable_grad()
                with ctx:
                    loss = loss_fn(model, local, micro)
                    after_forward.append(ts.memory_stats(model)["comm_buffers"])
                    loss.backward()
            if step == 1:
                mem = ts.memory_stats(model, opt)
            opt.step()
            opt.zero_grad()
        engine = model._tiershard
        predicted = breakdown(engine.placement, engine_layouts(engine), rank, 4, 2, prefetch, micro)
        keys = (*BREAKDOWN, "peak_gathered", "peak_gather_buffers")
        out[(plan, micro, prefetch)] = {
            "measured": {k: mem[k] for k in keys}, "predicted": {k: predicted[k] for k in keys},
            "after_forward": after_forward,
            "sums": (mem["model_states"], sum(mem[k] for k in BREAKDOWN[:6]), mem["engine_total"],
                     sum(mem[k] for k in BREAKDOWN)),
            "old": {k: mem[k] for k in ("params", "grads", "masters", "optimizer", "hpz")}}
    return out


def test_measured_breakdown_equals_the_cost_model():
    results = run_ranks(_run, 4)
    failures = []
    for rank, res in enumerate(results):
        for case, r in res.items():
            measured, predicted = r["measured"], r["predicted"]
            if measured != predicted:
                diff = {k: (measured[k], predicted[k]) for k in measured if measured[k] != predicted[k]}
                failures.append(f"{case} rank {rank}: measured != predicted on {diff}")
            if any(r["after_forward"]):
                failures.append(f"{case} rank {rank}: buffers held after a forward {r['after_forward']}")
            states, parts, total, all_parts = r["sums"]
            if states != parts or total != all_parts:
                failures.append(f"{case} rank {rank}: totals {r['sums']}")
            # the old keys keep their meaning: the masters and the optimizer states are the same bytes
            if r["old"]["masters"] != measured["master_weights"] or \
                    r["old"]["optimizer"] != measured["optimizer_states"]:
                failures.append(f"{case} rank {rank}: old keys {r['old']} vs {measured}")
    assert not failures, "\n".join(failures[:20])
    zero3 = results[0][("GGG", 1, 1)]["measured"]
    assert zero3["working_weights"] == 0 and zero3["peak_gathered"] > 0 and zero3["gradients"] > 0
