"""PyTorch's own tools on a sharded model, each against single-process training on the concatenated batch.

What users do without thinking about sharding: AdamW with parameter groups chosen by name and shape, fused and
foreach kernels, ``torch.nn.utils.clip_grad_norm_`` over ``model.parameters()``, ``torch.amp.GradScaler`` with
an overflow that only one rank sees, ``optimizer.zero_grad()`` between micro-steps, an exception in the middle
of a backward, units returning dataclasses, reading weights between steps. And the errors for what cannot
work: a wrap policy that matches nothing, ranks that built different models, ``requires_grad_`` after sharding,
a model FSDP2's ``fully_shard`` already sharded; dtypes by name and a topology by its sizes. All of it in one
launch of 4 ranks (2 nodes of 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn

PER_RANK, STEPS, MICRO = 2, 3, 2
EXACT_PLANS = ["GGG", "IIG", "NNN", "NGI"]


def decay_groups(model, wd=0.1):
    """The usual recipe: no weight decay on biases, norms and embeddings, chosen by name and by p.dim()."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or "ln" in name or name.startswith(("wte", "wpe")):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]


OPTIMIZERS = {
    "adamw_groups": lambda m: torch.optim.AdamW(decay_groups(m), lr=1e-2),
    "adamw_fused": lambda m: torch.optim.AdamW(decay_groups(m), lr=1e-2, fused=True),
    "adamw_foreach": lambda m: torch.optim.AdamW(decay_groups(m), lr=1e-2, foreach=True),
    "sgd_clip": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
}


def train(model, opt_name, rank=None, world=4, clip=None, zero_between=False):
    """STEPS optimizer steps of MICRO micro-steps; returns (losses, clip norms). ``rank`` None = single process."""
    import tiershard as ts

    opt = OPTIMIZERS[opt_name](model)
    losses, norms = [], []
    for step in batches(4, STEPS, MICRO, world, PER_RANK):
        total = 0.0
        for i, tokens in enumerate(step):
            if rank is not None:
                tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
            last = i == MICRO - 1
            with (ts.no_sync(model) if rank is not None and not last else _nothing()):
                loss = loss_fn(model, tokens, MICRO)
                loss.backward()
            total += loss.item()
            if zero_between and i == 0:
                opt.zero_grad(set_to_none=zero_between == "none")
        losses.append(total)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return losses, norms


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def full_state(model, sharded):
    import tiershard as ts

    return ts.full_state_dict(model) if sharded else {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel_error(state, ref):
    assert state.keys() == ref.keys(), sorted(state.keys() ^ ref.keys())
    return max(((state[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)).item() for k in ref)


def rel_l2(state, ref):
    num = sum(((state[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5
    return (num / sum((ref[k] ** 2).sum() for k in ref) ** 0.5).item()


# ---- optimizers, groups, clipping, zero_grad -------------------------------------------------------
def _optimizer_cases(rank, world, topo):
    import tiershard as ts

    out = {}
    for opt_name, clip, zero in [("adamw_groups", None, False), ("adamw_fused", None, False),
                                 ("adamw_foreach", None, False), ("sgd_clip", 0.05, False),
                                 ("sgd_clip", None, "none"), ("sgd_clip", None, "zeros")]:
        torch.manual_seed(0)
        ref_model = TinyGPT()
        ref_losses, ref_norms = train(ref_model, opt_name, clip=clip, zero_between=zero)
        ref = full_state(ref_model, False)
        for plan in EXACT_PLANS:
            torch.manual_seed(0)
            model = ts.shard(TinyGPT(), plan, topo, wrap={Block})
            names = [(n, tuple(p.shape), p.dim()) for n, p in model.named_parameters()]
            losses, norms = train(model, opt_name, rank, world, clip=clip, zero_between=zero)
            state = full_state(model, True)
            out[(opt_name, clip, zero, plan)] = {
                "names": names == [(n, tuple(p.shape), p.dim()) for n, p in ref_model.named_parameters()],
                "err": rel_error(state, ref), "l2": rel_l2(state, ref),
                "norms": (norms, ref_norms), "losses": (losses, ref_losses)}
    return out


# ---- GradScaler with an overflow on one rank --------------------------------------------------------
class _InfAt(torch.autograd.Function):
    """Identity whose backward puts inf into one element of the gradient: an overflow only some shards see."""

    @staticmethod
    def forward(ctx, x, where):
        ctx.where = where
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.where is not None:
            grad[ctx.where] = float("inf")
        return grad, None


class ScaledGPT(TinyGPT):
    def forward(self, idx, where=None):
        x = _InfAt.apply(self.wte(idx), where) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) * self.scale


def _scaler_case(rank, world, topo, plan):
    """Step 1: sample 0 of rank 1 overflows (in the reference: the same row of the concatenated batch)."""
    import tiershard as ts

    def run(model, sharded):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        skipped = []
        for s, step in enumerate(batches(5, STEPS, 1, world, PER_RANK)):
            tokens = step[0]
            where = None
            if sharded:
                tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
                if s == 1 and rank == 1:
                    where = (0, 3, 5)
            elif s == 1:
                where = (1 * PER_RANK, 3, 5)
            logits = model(tokens[:, :-1], where)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
            opt.zero_grad()
        return skipped, scaler.get_scale()

    torch.manual_seed(0)
    ref_model = ScaledGPT()
    ref_skipped, ref_scale = run(ref_model, False)
    torch.manual_seed(0)
    model = ts.shard(ScaledGPT(), plan, topo, wrap={Block})
    skipped, scale = run(model, True)
    return {"err": rel_error(full_state(model, True), full_state(ref_model, False)),
            "skipped": (skipped, ref_skipped), "scale": (scale, ref_scale)}


# ---- an exception in backward, then clean steps ---------------------------------------------------------
class Boom(Exception):
    pass


def _raise(grad):
    raise Boom("backward failed")


class FragileGPT(TinyGPT):
    """Raises in backward once, after the last block has already reduced its gradients."""

    fail = False

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        x = self.blocks[0](x)
        if self.fail:
            x.register_hook(_raise)
        x = self.blocks[1](x)
        return self.head(self.ln_f(x)) * self.scale


def _exception_case(rank, world, topo, plan, no_sync):
    """The optimizer exists before the failed step, as in a training loop; after the exception the loop clears
    the gradients and goes on. The state dict read right after the exception must already be the masters."""
    import tiershard as ts
    from torch.distributed.tensor import DTensor

    def steps(model, opt, sharded):
        for step in batches(6, 2, 1, world, PER_RANK):
            tokens = step[0][rank * PER_RANK:(rank + 1) * PER_RANK] if sharded else step[0]
            loss_fn(model, tokens, 1).backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    ref_model = FragileGPT()
    steps(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9), False)
    torch.manual_seed(0)
    model = ts.shard(FragileGPT(), plan, topo, wrap={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.fail = True
    tokens = batches(7, 1, 1, world, PER_RANK)[0][0][rank * PER_RANK:(rank + 1) * PER_RANK]
    raised = False
    try:
        with (ts.no_sync(model) if no_sync else _nothing()):
            loss_fn(model, tokens, 1).backward()
    except Boom:
        raised = True
    model.fail = False
    shows_masters = all(isinstance(v, DTensor) for k, v in model.state_dict().items() if k != "scale")
    opt.zero_grad()
    steps(model, opt, True)
    return {"raised": raised, "shows_masters": shows_masters,
            "err": rel_error(full_state(model, True), full_state(ref_model, False))}


# ---- units returning dataclasses, weights read between steps ----------------------------------------------
@dataclass
class BlockOutput:
    hidden: torch.Tensor
    extra: tuple


class DataclassBlock(Block):
    def forward(self, x):
        return BlockOutput(hidden=super().forward(x), extra=(None, "tag"))


class DataclassGPT(TinyGPT):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock(12, 2) for _ in range(2))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x).hidden
        return self.head(self.ln_f(x)) * self.scale


def _dataclass_case(rank, world, topo, plan):
    import tiershard as ts

    torch.manual_seed(0)
    ref_model = DataclassGPT()
    train(ref_model, "sgd_clip")
    torch.manual_seed(0)
    model = ts.shard(DataclassGPT(), plan, topo, wrap={"DataclassBlock"})     # by class name
    train(model, "sgd_clip", rank, world)
    from torch.distributed.tensor import DTensor

    weight = model.blocks[1].fc.weight         # read between steps: a DTensor of the original shape
    ref_weight = ref_model.blocks[1].fc.weight.detach()
    read_ok = isinstance(weight, DTensor) and tuple(weight.shape) == (49, 12) and bool(
        (weight.full_tensor() - ref_weight).abs().max() <= 1e-5 * ref_weight.abs().max())
    keys_ok = list(model.state_dict().keys()) == list(ref_model.state_dict().keys())
    return {"err": rel_error(full_state(model, True), full_state(ref_model, False)), "read": read_ok,
            "keys": keys_ok}


# ---- errors and set-up ---------------------------------------------------------------------------------
def _setup_cases(rank, world, topo):
    import tiershard as ts

    out = {}
    try:
        ts.shard(TinyGPT(), "GGG", topo, wrap={nn.GRU})
        out["bad_wrap"] = "no error"
    except ValueError as err:
        out["bad_wrap"] = str(err)
    try:       # rank 1 builds a wider model
        ts.shard(TinyGPT(d=12 if rank != 1 else 16), "GGG", topo, wrap={Block})
        out["mismatch"] = "no error"
    except ValueError as err:
        out["mismatch"] = str(err)
    model = ts.shard(TinyGPT(), "IIG", topo, wrap={Block})
    model.blocks[0].fc.weight.requires_grad_(False)
    try:
        loss_fn(model, batches(1, 1, 1, world)[0][0][:2], 1).backward()
        out["requires_grad"] = "no error"
    except RuntimeError as err:
        out["requires_grad"] = str(err)
    try:
        model.blocks[1].fc.weight.data = torch.zeros(49, 12)
        out["data_assign"] = "no error"
    except RuntimeError as err:
        out["data_assign"] = str(err)
    x = batches(1, 1, 1, world)[0][0][:2, :-1]
    evals = {}
    for plan in ("NGG", "GGG", "zero++"):        # forwards under no_grad: exact weights, whatever p is
        torch.manual_seed(0)
        sharded = ts.shard(TinyGPT(), plan, topo, wrap={Block})
        with torch.no_grad():
            evals[plan] = sharded(x)
    torch.manual_seed(0)
    with torch.no_grad():
        expected = TinyGPT()(x)
    out["eval"] = {plan: (y - expected).abs().max().item() for plan, y in evals.items()}
    model = TinyGPT().to(torch.bfloat16)      # param_dtype defaults to the parameters' dtype
    model.scale.fill_(1.0 + rank)             # buffers come from rank 0
    model = ts.shard(model, "GGG", topo, wrap={Block})
    logits = model(batches(1, 1, 1, world)[0][0][:2, :-1])
    out["dtypes"] = (str(logits.dtype), str(next(model.parameters()).dtype))
    out["buffer"] = model.scale.item()
    # the obvious spellings: dtypes by name, the topology by its sizes
    named = ts.shard(TinyGPT(), "GGG", (2, 4), wrap={Block}, param_dtype="bf16", reduce_dtype="float32")
    engine = named._tiershard
    out["named"] = (str(named(x).dtype), engine.topology == topo, str(engine.reduce_dtype))
    # a model FSDP2 already sharded: refused before any collective, naming what to pass
    from torch.distributed.fsdp import fully_shard

    fsdp2 = TinyGPT()
    for block in fsdp2.blocks:
        fully_shard(block)
    try:
        ts.shard(fully_shard(fsdp2), "GGG", topo, wrap={Block})
        out["fsdp2"] = "no error"
    except ValueError as err:
        out["fsdp2"] = str(err)
    try:                                      # a submodule of it: no FSDPModule, but its DTensor parameters
        ts.shard(fsdp2.blocks[0].fc, "GGG", topo)
        out["fsdp2_part"] = "no error"
    except ValueError as err:
        out["fsdp2_part"] = str(err)
    return out


def run_all(rank, world):
    import tiershard as ts

    topo = ts.Topology((2, 4))
    out = {"optim": _optimizer_cases(rank, world, topo)}
    for plan in ("GGG", "IIG"):
        out[("scaler", plan)] = _scaler_case(rank, world, topo, plan)
        out[("dataclass", plan)] = _dataclass_case(rank, world, topo, plan)
        for no_sync in (False, True):
            out[("exception", plan, no_sync)] = _exception_case(rank, world, topo, plan, no_sync)
    out["setup"] = _setup_cases(rank, world, topo)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, 4)


def test_optimizers_groups_clipping_and_zero_grad_match_single_process(results):
    failures = []
    for rank, res in enumerate(results):
        for (opt_name, clip, zero, plan), r in res["optim"].items():
            tag = f"{opt_name} clip={clip} zero_grad_between={zero} {plan} rank {rank}"
            if not r["names"]:
                failures.append(f"{tag}: named_parameters differ from the unsharded model")
            bound_ok = r["err"] <= 1e-5 if opt_name.startswith("sgd") else r["l2"] <= 1e-3
            if not bound_ok:
                failures.append(f"{tag}: parameters off (max {r['err']:.2e}, L2 {r['l2']:.2e}); losses {r['losses']}")
            norms, ref_norms = r["norms"]
            if any(abs(a - b) > 1e-5 * b for a, b in zip(norms, ref_norms)) or len(norms) != len(ref_norms):
                failures.append(f"{tag}: clip norms {norms} vs single process {ref_norms}")
    assert not failures, "\n".join(failures[:20])
    # the bound is tight enough to notice a missing weight decay group or an unclipped step
    r = results[0]["optim"][("sgd_clip", 0.05, False, "GGG")]
    assert r["norms"][1][0] > 0.05, "the clip threshold must be active for the test to mean anything"


def test_grad_scaler_agrees_on_an_overflow_that_one_rank_sees(results):
    for rank, res in enumerate(results):
        for plan in ("GGG", "IIG"):
            r = res[("scaler", plan)]
            assert r["skipped"][0] == r["skipped"][1] == [False, True, False], (plan, rank, r)
            assert r["scale"][0] == r["scale"][1], (plan, rank, r)
            assert r["err"] <= 1e-5, (plan, rank, r)


def test_exception_in_backward_then_clean_steps(results):
    for rank, res in enumerate(results):
        for plan in ("GGG", "IIG"):
            for no_sync in (False, True):
                r = res[("exception", plan, no_sync)]
                assert r["raised"] and r["shows_masters"], r
                assert r["err"] <= 1e-5, (plan, no_sync, rank, r)


def test_dataclass_outputs_class_name_wrap_and_reads_between_steps(results):
    for rank, res in enumerate(results):
        for plan in ("GGG", "IIG"):
            r = res[("dataclass", plan)]
            assert r["err"] <= 1e-5 and r["read"] and r["keys"], (plan, rank, r)


def test_clear_errors_and_setup(results):
    for rank, res in enumerate(results):
        s = res["setup"]
        assert "matches no submodule" in s["bad_wrap"], s["bad_wrap"]
        assert "wpe has shape (8, 12)" in s["mismatch"] and "(8, 16)" in s["mismatch"], s["mismatch"]
        assert "requires_grad" in s["requires_grad"] and "blocks.0.fc.weight" in s["requires_grad"], s
        assert "param.copy_(value)" in s["data_assign"], s["data_assign"]
        assert all(err <= 1e-6 for err in s["eval"].values()), s["eval"]
        assert s["dtypes"] == ("torch.bfloat16", "torch.float32"), s["dtypes"]
        assert s["buffer"] == 1.0, s["buffer"]
        assert s["named"] == ("torch.bfloat16", True, "torch.float32"), s["named"]
        assert "FSDP2 model" in s["fsdp2"] and "pass the unwrapped model (built without fully_shard)" in s["fsdp2"]
        assert "if FSDP2's fully_shard made it, pass the model built without fully_shard" in s["fsdp2_part"], s
