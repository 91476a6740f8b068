"""Habits of users of a sharded model that used to give a silent wrong result or die in torch's words.

Each either gives the result of the same code on an unsharded model in one process, or refuses at once with
tiershard's own error naming the fix, leaving the model untouched (it still trains like the reference):

- ``init=fn`` on a meta-built model where ``fn`` writes through ``.data`` (older ``transformers`` style);
- ``model.half()`` / ``.bfloat16()`` / ``.to(dtype)`` / ``.to(device)`` / ``.cuda()`` / ``.to_empty()`` after
  ``ts.shard`` (refused), ``.float()`` / ``.to("cpu")`` when they change nothing (allowed);
- ``model.load_state_dict(full plain tensors)``, strict or not, as torch does on the unsharded model;
- an optimizer built before ``ts.shard`` (refused at its first step; unrelated optimizers untouched);
- ``Plan.auto(model)`` without ``wrap`` counts units as ``ts.shard`` cuts them by default.

All the multi-rank checks in one launch of 4 ranks (2 nodes of 2).
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from _dist import run_ranks
from _models import Block, batches, loss_fn

PER_RANK = 2


class HabitNet(nn.Module):
    """Only torch layers (every draw in a ``reset_parameters``), a tied head: meta replay draws as eager does."""

    def __init__(self, vocab: int = 37, d: int = 12, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList(Block(d, 2) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def data_init(module: nn.Module) -> None:
    """An older ``transformers``-style ``_init_weights``: every write goes through ``.data``."""
    if isinstance(module, nn.Linear):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.data.normal_(mean=0.0, std=0.02)
        module.weight.data[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.data.fill_(1.0)
        module.bias.data = torch.zeros_like(module.bias.data)      # assigning .data, as some repos do


def _max_diff(state, ref) -> float:
    assert state.keys() == ref.keys(), sorted(state.keys() ^ ref.keys())
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


def _step(model, rank, seed, sharded, opt=None):
    """One SGD step on the batch of ``seed`` (this rank's rows when sharded); returns the optimizer."""
    tokens = batches(seed, 1, 1, 4, PER_RANK)[0][0]
    if sharded:
        tokens = tokens[rank * PER_RANK:(rank + 1) * PER_RANK]
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, tokens, 1).backward()
    opt.step()
    opt.zero_grad()
    return opt


CASTS = {      # name -> (call, allowed: it changes nothing on an fp32 CPU model)
    "half()": (lambda m: m.half(), False),
    "bfloat16()": (lambda m: m.bfloat16(), False),
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), False),
    "double()": (lambda m: m.double(), False),
    "type(float16)": (lambda m: m.type(torch.float16), False),
    "blocks[0].half()": (lambda m: m.blocks[0].half(), False),
    "to('meta')": (lambda m: m.to("meta"), False),
    "cuda()": (lambda m: m.cuda(), False),
    "to_empty(cpu)": (lambda m: m.to_empty(device="cpu"), False),
    "float()": (lambda m: m.float(), True),
    "to('cpu')": (lambda m: m.to("cpu"), True),
    "cpu()": (lambda m: m.cpu(), True),
    "to(float32)": (lambda m: m.to(torch.float32), True),
}


def _meta_data_init(rank, world, topo):
    import tiershard as ts

    torch.manual_seed(0)
    eager = HabitNet()
    eager.apply(data_init)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = HabitNet()
    model = ts.shard(meta, "IIG", topo, wrap={Block}, init=data_init)
    state = ts.full_state_dict(model)
    return {"diff": _max_diff(state, eager.state_dict()),
            "std": (state["blocks.0.fc.weight"].std().item(), eager.blocks[0].fc.weight.std().item())}


def _early_optimizer_and_casts(rank, world, topo):
    """An optimizer built before ts.shard, then every cast; the model must still train like the reference."""
    import tiershard as ts

    out = {}
    torch.manual_seed(0)
    ref = HabitNet()
    torch.manual_seed(0)
    net = HabitNet()
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    model = ts.shard(net, "IIG", topo, wrap={Block})
    before = ts.full_state_dict(model)
    try:
        _step(model, rank, 1, True, early)
        out["early"] = "no error"
    except Exception as err:         # noqa: BLE001 - the test reports whatever came out
        out["early"] = f"{type(err).__name__}: {err}"
    out["early_untouched"] = _max_diff(ts.full_state_dict(model), before)
    # an unrelated optimizer (a plain module beside the sharded model) steps as always
    side = nn.Linear(3, 2)
    side_before = side.weight.detach().clone()
    side_opt = torch.optim.SGD(side.parameters(), lr=0.1)
    side(torch.ones(1, 3)).sum().backward()
    side_opt.step()
    out["side_stepped"] = (side.weight - side_before).abs().max().item()
    # the gradients of the failed step are still there: the optimizer built after ts.shard steps them
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
    opt.zero_grad()
    ref_opt = _step(ref, rank, 1, False)
    out["after_early"] = _max_diff(ts.full_state_dict(model), ref.state_dict())
    casts = {}
    for name, (call, _) in CASTS.items():
        state = ts.full_state_dict(model)
        try:
            returned = call(model)
            casts[name] = ("ok", returned is model)
        except Exception as err:     # noqa: BLE001
            casts[name] = (type(err).__name__, str(err))
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        casts[name] += (_max_diff(ts.full_state_dict(model), state), dtypes)
    out["casts"] = casts
    _step(model, rank, 2, True, opt)
    _step(ref, rank, 2, False, ref_opt)
    out["after_casts"] = _max_diff(ts.full_state_dict(model), ref.state_dict())
    return out


def _load_state_dict(rank, world, topo):
    """model.load_state_dict(full tensors) as torch does it on the unsharded model, then a step like it."""
    import tiershard as ts

    out = {}
    torch.manual_seed(1)
    src = HabitNet()                   # other weights than the sharded model's
    torch.manual_seed(0)
    model = ts.shard(HabitNet(), "IIG", topo, wrap={Block})
    full = src.state_dict()
    result = model.load_state_dict(full)
    out["keys"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["loaded"] = _max_diff(ts.full_state_dict(model), full)
    # strict=False with a missing and an unexpected key: the same report as torch's on the unsharded model
    partial = {k: v for k, v in full.items() if not k.startswith("ln_f.")}
    partial["extra.weight"] = torch.zeros(2)
    theirs = copy.deepcopy(src).load_state_dict(partial, strict=False)
    ours = model.load_state_dict(partial, strict=False)
    out["partial"] = ((sorted(ours.missing_keys), sorted(ours.unexpected_keys)),
                      (sorted(theirs.missing_keys), sorted(theirs.unexpected_keys)))
    errors = {}
    for name, bad in (("strict", partial), ("shape", {**full, "ln_f.bias": torch.zeros(5)})):
        try:
            copy.deepcopy(src).load_state_dict(bad)
        except RuntimeError as err:
            torch_msg = str(err)
        try:
            model.load_state_dict(bad)
            errors[name] = ("no error", torch_msg)
        except RuntimeError as err:
            errors[name] = (str(err), torch_msg)
    out["errors"] = errors
    out["untouched"] = _max_diff(ts.full_state_dict(model), full)
    model.load_state_dict(model.state_dict())          # DTensor values (DCP style) still load as before
    out["roundtrip"] = _max_diff(ts.full_state_dict(model), full)
    _step(model, rank, 3, True)
    _step(src, rank, 3, False)
    out["trained"] = _max_diff(ts.full_state_dict(model), src.state_dict())
    return out


def run_all(rank, world):
    import tiershard as ts

    topo = ts.Topology((2, 4))
    return {"meta": _meta_data_init(rank, world, topo), "optim": _early_optimizer_and_casts(rank, world, topo),
            "load": _load_state_dict(rank, world, topo)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, 4)


def test_meta_init_writes_through_data_reach_the_shards(results):
    for rank, res in enumerate(results):
        r = res["meta"]
        assert r["diff"] <= 1e-6, (rank, r)


def test_optimizer_built_before_shard_is_refused_at_its_first_step(results):
    for rank, res in enumerate(results):
        r = res["optim"]
        assert "the optimizer after ts.shard(model, ...)" in r["early"], r["early"]
        assert r["early_untouched"] == 0.0 and r["side_stepped"] > 0, r
        assert r["after_early"] <= 1e-6, r


def test_casts_and_moves_are_refused_before_anything_changes(results):
    for rank, res in enumerate(results):
        r = res["optim"]
        for name, (kind, detail, changed, dtypes) in r["casts"].items():
            assert changed == 0.0 and dtypes == ["torch.float32"], (name, kind, detail, changed, dtypes)
            if CASTS[name][1]:
                assert (kind, detail) == ("ok", True), (name, kind, detail)
                continue
            assert kind == "RuntimeError", (name, kind, detail)
            assert name.split("(")[0].split(".")[-1] in detail, (name, detail)
            if name in ("to('meta')", "cuda()"):
                assert "shard it on the target device" in detail, (name, detail)
            elif name == "to_empty(cpu)":
                assert "already materialised" in detail, (name, detail)
            else:
                assert "the masters stay fp32" in detail and "param_dtype=torch.bfloat16" in detail, (name, detail)
        assert r["after_casts"] <= 1e-6, r["after_casts"]


def test_load_state_dict_of_full_tensors_behaves_as_torch(results):
    for rank, res in enumerate(results):
        r = res["load"]
        assert r["keys"] == ([], []) and r["loaded"] == 0.0, r
        assert r["partial"][0] == r["partial"][1], r["partial"]
        for name, (ours, theirs) in r["errors"].items():
            first = {"strict": "Missing key(s) in state_dict", "shape": "size mismatch for ln_f.bias"}[name]
            assert first in ours and first in theirs, (name, ours, theirs)
        assert r["untouched"] == 0.0 and r["roundtrip"] == 0.0, r
        assert r["trained"] <= 1e-6, r


def test_plan_auto_counts_units_as_shard_cuts_them_by_default():
    """A transformers model: ts.shard(model, ...) without wrap cuts it at its _no_split_modules, and the
    planner counts the same units (no process group needed)."""
    transformers = pytest.importorskip("transformers")
    import tiershard as ts
    from tiershard import cost
    from tiershard.cost import Cluster, Job, ModelSpec
    from tiershard.runtime.wrap import find_units

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    explicit = ModelSpec.from_module(model, wrap=set(model._no_split_modules))
    assert len(explicit.units) == 3                               # two decoder layers and the root
    assert len([u for u in find_units(model, None) if u.params]) == 3     # what ts.shard cuts without wrap
    assert len(find_units(model, ())) == 1                                 # one unit on purpose
    default = cost.coerce_model(model)
    assert default.units == explicit.units and default.param_shapes == explicit.param_shapes
    cluster = Cluster.two_tier(gpus=16, gpus_per_node=8, intra_bw=300e9, inter_bw=25e9, gpu_memory=80e9,
                               peak_flops=312e12)
    for plan in ("GGG", "IIG", "NNN"):
        assert cost.evaluate(plan, default, cluster, Job()).memory.total == \
            cost.evaluate(plan, explicit, cluster, Job()).memory.total, plan
    assert ts.Plan.auto(model, cluster) == cost.auto_plan(explicit, cluster)


@pytest.mark.parametrize("keyword, value, fix", [
    ("mesh", None, "use topology="), ("mp_policy", None, "use param_dtype= and reduce_dtype="),
    ("reshard_after_forward", True, "True is 'zero3'"), ("auto_wrap_policy", None, "use wrap="),
    ("param_dtyp", "bf16", "did you mean param_dtype=?"), ("foo", 1, "it takes plan=, topology=, wrap=")])
def test_foreign_keywords_name_the_equivalent(keyword, value, fix):
    """FSDP's keywords (and typos) raise a TypeError naming what ts.shard takes, before any process group."""
    import tiershard as ts

    with pytest.raises(TypeError) as caught:
        ts.shard(nn.Linear(2, 2), "zero3", (2, 4), **{keyword: value})
    assert fix in str(caught.value), str(caught.value)
    if keyword in ("mesh", "mp_policy", "reshard_after_forward"):
        assert "README's 'Plans' section has the table of FSDP2 settings" in str(caught.value)
        readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
        plans = readme[readme.index("\n## Plans\n"):]
        assert "| what you ran | the same schedule in tiershard |" in plans[:plans.index("\n## ", 1)]


def test_mp_policy_names_its_own_dtypes_and_bad_spellings_say_what_to_pass():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tiershard as ts
    from tiershard.runtime.arguments import as_dtype, as_topology

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"use param_dtype=torch.bfloat16, reduce_dtype=torch.float32"):
        ts.shard(nn.Linear(2, 2), mp_policy=policy)
    assert [as_dtype(n, "param_dtype") for n in ("bf16", "BFloat16", "fp16", "float32", "torch.float16")] == [
        torch.bfloat16, torch.bfloat16, torch.float16, torch.float32, torch.float16]
    assert as_topology([2, 4]) == ts.Topology((2, 4)) and as_topology((4,)) == ts.Topology((4,))
    for kwargs, error, fragment in ((dict(param_dtype="bf17"), ValueError, "'bf16', 'bfloat16'"),
                                    (dict(reduce_dtype=16), TypeError, "a torch dtype or its name"),
                                    (dict(topology="2,4"), TypeError, "e.g. (2, 4)"),
                                    (dict(topology=None), TypeError, "needs a topology"),
                                    (dict(plan=None), TypeError, "needs a plan")):
        with pytest.raises(error, match=re.escape(fragment)):
            ts.shard(nn.Linear(2, 2), **{"plan": "zero3", "topology": (2, 4), **kwargs})
