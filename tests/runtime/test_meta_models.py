"""Meta models as users build them: accelerate's ``init_empty_weights()`` (parameters on meta, buffers real, such as
Llama's rotary ``inv_freq``), sharded with no ``init=`` and loaded next.

A tiny Llama and GPT-2 (random weights, no download) built under ``init_empty_weights``, sharded, then loaded from
the state dict of the same model built on the CPU (``ts.load_full_state_dict``, ``model.load_state_dict`` of full
tensors, ``ts.load`` of a checkpoint): the full state dict equals the CPU model's, the real buffers keep their
values, and two SGD steps give the losses and weights of the CPU model trained on the concatenated batch (GPT-2's
head, untied by ``init_empty_weights``, is tied again: its second loss differed otherwise). A
parameter that nothing initialises and nothing loads raises at the first forward, naming it; loading it then lets
the model run. Parameters on several devices are refused. One launch of 4 ranks runs every case.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import run_ranks
from test_hf import VOCAB, WRAPS, build, max_error, tokens

PER_RANK = 2


def _empty(kind: str):
    from accelerate import init_empty_weights

    with init_empty_weights():
        return build(kind)


def _steps(model, rank, world, sharded: bool, steps: int = 2) -> tuple[list[float], dict]:
    """SGD steps on the concatenated batch (or this rank's slice, the loss averaged over ranks); final weights."""
    import torch.distributed as dist

    import tiershard as ts

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        x = tokens(step, world)
        if sharded:
            x = x[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if sharded:                     # every rank's slice has as many tokens: the mean of means is the mean
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    state = ts.full_state_dict(model) if sharded else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state


def run_all(rank, world, folder):
    import tiershard as ts

    topo = ts.Topology((2, 4))
    out: dict = {}
    for kind, how in (("llama", "load_full_state_dict"), ("gpt2", "load_state_dict")):
        eager = build(kind)
        sd = {k: v.detach().clone() for k, v in eager.state_dict().items()}
        ref_losses, ref_state = _steps(copy.deepcopy(eager), rank, world, sharded=False)
        meta = _empty(kind)
        devices = sorted({str(t.device) for t in list(meta.parameters()) + list(meta.buffers())})
        try:
            model = ts.shard(meta, "IIG", topo, wrap={WRAPS[kind]})
        except ValueError as err:
            out[kind] = {"shard_error": str(err), "devices": devices}
            continue
        if how == "load_full_state_dict":
            ts.load_full_state_dict(model, sd)
        else:
            model.load_state_dict(sd)
        loaded = ts.full_state_dict(model)
        buffers = {n: b for n, b in model.named_buffers()}
        same_buffers = all(torch.equal(buffers[n], b) for n, b in eager.named_buffers())
        if kind == "llama":             # a checkpoint of the loaded model into another empty-built one
            ts.save(f"{folder}/llama", model)
            again = ts.shard(_empty(kind), "IIG", topo, wrap={WRAPS[kind]})
            ts.load(f"{folder}/llama", again)
            x = tokens(11, world)[:2]
            with torch.no_grad():
                out["ts.load"] = {"state": max_error(ts.full_state_dict(again), sd),
                                  "logits": (again(input_ids=x).logits - eager(input_ids=x).logits).abs().max().item()}
        losses, state = _steps(model, rank, world, sharded=True)
        out[kind] = {"devices": devices, "keys": loaded.keys() == sd.keys(), "buffers": same_buffers,
                     "loaded": max(((loaded[k] - sd[k].float()).abs().max().item() for k in sd)),
                     "losses": losses, "ref_losses": ref_losses, "after": max_error(state, ref_state)}

    # one parameter never loaded (and no reset_parameters writes it: an RMSNorm's weight): refused at the first
    # forward, naming it; loading it then lets the model run
    eager = build("llama")
    sd = eager.state_dict()
    x = tokens(12, world)[:2]
    try:
        model = ts.shard(_empty("llama"), "IIG", topo, wrap={WRAPS["llama"]})
        ts.load_full_state_dict(model, {k: v for k, v in sd.items() if k != "model.norm.weight"}, strict=False)
        try:
            with torch.no_grad():
                model(input_ids=x)
            out["unloaded"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads its type and message
            out["unloaded"] = f"{type(err).__name__}: {err}"
        try:
            ts.save(f"{folder}/waiting", model)
            out["save_waiting"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads its type and message
            out["save_waiting"] = f"{type(err).__name__}: {err}"
        ts.load_full_state_dict(model, {"model.norm.weight": sd["model.norm.weight"]}, strict=False)
        with torch.no_grad():
            out["after_load"] = (model(input_ids=x).logits - eager(input_ids=x).logits).abs().max().item()
        # likewise through ts.load(strict=False) of a checkpoint that lacks it (a model without the final norm)
        normless = build("llama")
        normless.model.norm = torch.nn.Identity()
        ts.save(f"{folder}/normless", ts.shard(normless, "IIG", topo, wrap={WRAPS["llama"]}))
        partial = ts.shard(_empty("llama"), "IIG", topo, wrap={WRAPS["llama"]})
        ts.load(f"{folder}/normless", partial, strict=False)
        try:
            with torch.no_grad():
                partial(input_ids=x)
            out["partial_checkpoint"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test reads its type and message
            out["partial_checkpoint"] = f"{type(err).__name__}: {err}"
    except ValueError as err:
        out["unloaded"] = out["after_load"] = f"ts.shard refused: {err}"

    # parameters on several devices (some on meta, some real) cannot be told apart: refused, naming the fix
    mixed = _empty("gpt2")
    mixed.lm_head.weight = torch.nn.Parameter(torch.zeros(VOCAB, 32))
    try:
        ts.shard(mixed, "IIG", topo, wrap={WRAPS["gpt2"]})
        out["mixed"] = "no error"
    except ValueError as err:
        out["mixed"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(run_all, 4, str(tmp_path_factory.mktemp("meta")))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_init_empty_weights_model_loads_and_trains_as_the_cpu_model(results, kind):
    for rank, res in enumerate(results):
        r = res[kind]
        assert "shard_error" not in r, r
        assert r["keys"] and r["loaded"] == 0.0 and r["buffers"], (rank, r)
        losses, ref = r["losses"], r["ref_losses"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref)), (rank, losses, ref)
        assert r["after"] <= 1e-5, (rank, r)


def test_init_empty_weights_keeps_real_buffers(results):
    assert results[0]["llama"]["devices"] == ["cpu", "meta"]      # what accelerate builds: buffers real
    assert all(res["llama"]["buffers"] for res in results)


def test_init_empty_weights_model_loads_a_checkpoint(results):
    for res in results:
        assert res["ts.load"]["state"] == 0.0 and res["ts.load"]["logits"] <= 1e-6, res["ts.load"]


def test_a_parameter_never_loaded_raises_at_the_first_forward(results):
    for res in results:
        assert res["unloaded"].startswith("RuntimeError") and "model.norm.weight" in res["unloaded"], res["unloaded"]
        assert "init=" in res["unloaded"] and "load" in res["unloaded"], res["unloaded"]
        assert isinstance(res["after_load"], float) and res["after_load"] <= 1e-6, res["after_load"]
        assert res["save_waiting"].startswith("RuntimeError: ts.save refused") and \
            "model.norm.weight" in res["save_waiting"], res["save_waiting"]
        partial = res["partial_checkpoint"]
        assert partial.startswith("RuntimeError") and "model.norm.weight" in partial, partial


def test_parameters_on_several_devices_are_refused(results):
    for res in results:
        assert "meta" in res["mixed"] and "init_empty_weights" in res["mixed"], res["mixed"]
