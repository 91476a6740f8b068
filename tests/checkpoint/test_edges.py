"""Where checkpoints meet other tools' habits: FSDP2's DCP folders, ``strict=False`` reports, an optimizer's own
``state_dict()`` through DCP, and ``verify`` of a ``str`` path.

One launch of 4 gloo ranks (2 emulated nodes of 2, tiny GPT):

- an FSDP2 model (``fully_shard`` on each block and the root, AdamW, two steps) is saved the documented ways,
  ``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict`` and ``dcp.save({"model":
  get_model_state_dict(model)})``; ``ts.load`` reads both into a model sharded under ``IIG`` (the optimizer too
  from the first), every weight and AdamW state equal to FSDP2's full state, and ``tiershard convert`` reads the
  model of both;
- ``ts.load(..., strict=False)`` returns the missing and unexpected keys (1 layer into 2, 2 into 1), and the extra
  as before;
- README's example of ``w.norm()`` on a sharded weight runs as written: each rank's part, and the norm through
  ``full_tensor()``;
- ``dcp.save({"optim": opt.state_dict()})`` of a sharded optimizer warns, naming ``get_state_dict``; loading it
  back the usual way into a fresh optimizer restarts Adam (the loss after a step is measured against
  ``ts.load``'s), and that optimizer's first step warns too; ``ts.load`` of such a folder refuses it by name;
  ``ts.save``/``ts.load``, ``get_state_dict`` + ``dcp.save`` + ``set_state_dict`` and the steps after them, a fresh
  AdamW and an SGD without momentum loaded with its empty state give no warning.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from _dist import checkpoint_error as _error, run_ranks
from _models import Block, TinyGPT, batches, loss_fn


def edges_run(rank, world, root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tiershard as ts
    from tiershard import checkpoint
    from tiershard.checkpoint import convert
    from tiershard.runtime.optim_state import HABIT, RESTARTED

    root = Path(root)
    out = {}
    data = batches(3, 4, 1, world, 2)
    full = StateDictOptions(full_state_dict=True)

    def step(model, opt, i):
        loss = loss_fn(model, data[i][0][rank * 2:(rank + 1) * 2], 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def tiered(layers=2, seed=5):
        torch.manual_seed(seed)
        model = ts.shard(TinyGPT(layers=layers), "IIG", ts.Topology((2, 4)), wrap={Block})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def habit_warnings(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        return [str(w.message) for w in caught if str(w.message) in (HABIT, RESTARTED)]

    def same(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    # ---- an FSDP2 model, saved the documented ways --------------------------------------------------------------
    torch.manual_seed(0)
    fsdp = TinyGPT()
    mesh = init_device_mesh("cpu", (world,))
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    for i in range(2):
        step(fsdp, fsdp_opt, i)
    model_sd, optim_sd = get_state_dict(fsdp, fsdp_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "fsdp2"))
    dcp.save({"model": get_model_state_dict(fsdp)}, checkpoint_id=str(root / "fsdp2_model"))
    ref_model, ref_optim = get_state_dict(fsdp, fsdp_opt, options=full)

    model, opt = tiered()
    loaded = ts.load(root / "fsdp2", model, opt)
    got_model, got_optim = get_state_dict(model, opt, options=full)
    out["fsdp2"] = {
        "model": same(ts.full_state_dict(model), ref_model),
        "optim": sorted(got_optim["state"]) == sorted(ref_optim["state"]) and all(
            same(got_optim["state"][k], ref_optim["state"][k]) for k in ref_optim["state"]),
        "extra": (dict(loaded), loaded.extra, loaded.missing_keys, loaded.unexpected_keys)}
    out["fsdp2_next_losses"] = [(step(model, opt, i).item(), step(fsdp, fsdp_opt, i).item()) for i in (2, 3)]
    model, opt = tiered()
    ts.load(root / "fsdp2_model", model)
    out["fsdp2_model"] = same(ts.full_state_dict(model), ref_model)
    model, opt = tiered()
    out["fsdp2_model_with_opt"] = _error(lambda: ts.load(root / "fsdp2_model", model, opt))
    if rank == 0:
        out["convert"] = {name: same(dict(convert.read_model_tensors(root / name)), ref_model)
                          for name in ("fsdp2", "fsdp2_model")}
        out["verify_plain"] = _error(lambda: checkpoint.verify(str(root / "fsdp2")))
        torch.save(ref_model, root / "fsdp2-full.pt")
    dcp.save({"app": get_model_state_dict(model)}, checkpoint_id=str(root / "other_keys"))
    out["other_keys"] = _error(lambda: ts.load(root / "other_keys", model))

    # ---- strict=False reports what it skipped ------------------------------------------------------------------
    one, one_opt = tiered(layers=1, seed=2)
    step(one, one_opt, 0)
    two, two_opt = tiered(layers=2, seed=3)
    step(two, two_opt, 0)
    ts.save(root / "one", one, one_opt, extra={"step": 1})
    ts.save(root / "two", two, two_opt)
    strict = ts.load(root / "one", *tiered(layers=1, seed=4))
    into_two = ts.load(root / "one", *tiered(layers=2, seed=4), strict=False)
    into_one = ts.load(root / "two", *tiered(layers=1, seed=4), strict=False)
    out["report"] = {name: (dict(r), r.extra, r.missing_keys, r.unexpected_keys)
                     for name, r in (("strict", strict), ("into_two", into_two), ("into_one", into_one))}

    # ---- an optimizer's own state_dict() through DCP: warned, and refused by ts.load by name ---------------------
    model, opt = tiered(seed=0)
    step(model, opt, 0)
    out["habit_save"] = habit_warnings(lambda: dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                                                        checkpoint_id=str(root / "habit")))
    correct = {}
    correct["ts.save"] = habit_warnings(lambda: ts.save(root / "right", model, opt))

    def standard_save():
        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o}, checkpoint_id=str(root / "standard"))

    correct["get_state_dict"] = habit_warnings(standard_save)
    correct["torch.save"] = habit_warnings(lambda: torch.save(opt.state_dict(), root / f"opt{rank}.pt"))
    back = torch.load(root / f"opt{rank}.pt", weights_only=True)
    out["torch.save"] = (sorted(back) == ["param_groups", "state"], len(back["state"]) == len(opt.state))
    def after_one_step(model, opt):                  # the loss after one more step: what Adam's state changes
        step(model, opt, 1)
        return step(model, opt, 2).item()

    reference = after_one_step(model, opt)           # the uninterrupted run's

    fresh, fresh_opt = tiered(seed=9)                # the habit's resume: DCP into a fresh optimizer's state_dict()
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(state, checkpoint_id=str(root / "habit"))
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    habit_state = len(fresh_opt.state)
    losses = []
    resumed = habit_warnings(lambda: losses.append(after_one_step(fresh, fresh_opt)))
    habit_loss = losses[0]

    right, right_opt = tiered(seed=9)
    correct["ts.load"] = habit_warnings(lambda: ts.load(root / "right", right, right_opt))
    correct["ts.load then steps"] = habit_warnings(lambda: losses.append(after_one_step(right, right_opt)))
    ts_loss = losses[1]
    standard, standard_opt = tiered(seed=9)

    def standard_load():
        m, o = get_state_dict(standard, standard_opt)
        state = {"model": m, "optim": o}
        dcp.load(state, checkpoint_id=str(root / "standard"))
        set_state_dict(standard, standard_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    correct["set_state_dict"] = habit_warnings(standard_load)
    correct["set_state_dict then steps"] = habit_warnings(lambda: losses.append(after_one_step(standard,
                                                                                              standard_opt)))
    standard_loss = losses[2]
    sgd, _ = tiered(seed=9)                          # SGD without momentum keeps no state: loading none is right
    sgd_opt = torch.optim.SGD(sgd.parameters(), lr=0.1)
    sgd_opt.load_state_dict(torch.optim.SGD(sgd.parameters(), lr=0.1).state_dict())
    correct["SGD, no momentum"] = habit_warnings(lambda: after_one_step(sgd, sgd_opt))
    fine, _ = tiered(seed=9)                         # a fresh optimizer, param groups as users write them
    fine_opt = torch.optim.AdamW([{"weight_decay": 0.1, "params": list(fine.parameters())}], lr=1e-2)
    correct["a fresh AdamW"] = habit_warnings(lambda: after_one_step(fine, fine_opt))
    out["habit"] = {"state": habit_state, "losses": (reference, habit_loss, ts_loss, standard_loss),
                    "correct": correct, "resumed": resumed}
    again, again_opt = tiered(seed=9)
    out["habit_ts_load"] = _error(lambda: ts.load(root / "habit", again, again_opt))

    # ---- README's example of a sharded weight's norm, run as written --------------------------------------------
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    code = readme.split("**A reduction of a sharded weight is this rank's part**")[1].split("```python")[1]
    scope = {}
    exec(code.split("```")[0].split('if __name__ == "__main__":')[0], scope)
    out["norms"] = scope["norms"](rank, world)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    return root, run_ranks(edges_run, 4, str(root))


def test_verify_takes_str_and_pathlike(results):
    import os

    import tiershard.checkpoint

    root, _ = results
    for path in (str(root / "one"), root / "one", os.fspath(root / "one")):
        assert tiershard.checkpoint.verify(path)["world_size"] == 4
    message = results[1][0]["verify_plain"]
    assert "plain DCP folder" in message and "no tiershard.json" in message, message


def test_fsdp2_dcp_folder_loads_into_a_sharded_model(results):
    for r in results[1]:
        assert r["fsdp2"]["model"], "FSDP2's weights differ after ts.load"
        assert r["fsdp2"]["optim"], "FSDP2's AdamW states differ after ts.load"
        assert r["fsdp2"]["extra"] == ({}, None, [], []), r["fsdp2"]["extra"]
        for ours, theirs in r["fsdp2_next_losses"]:          # the second after a step from the loaded states
            assert abs(ours - theirs) < 1e-5, r["fsdp2_next_losses"]
        assert r["fsdp2_model"], "FSDP2's model-only folder differs after ts.load"
        assert "holds no optimizer state" in r["fsdp2_model_with_opt"], r["fsdp2_model_with_opt"]
        message = r["other_keys"]
        assert "plain DCP folder" in message and "get_state_dict" in message and "'app'" in message, message
    assert results[1][0]["convert"] == {"fsdp2": True, "fsdp2_model": True}


def test_tiershard_convert_reads_an_fsdp2_folder(results, tmp_path):
    from tiershard.cli import main

    root, _ = results
    assert main(["convert", str(root / "fsdp2_model"), "--to", "torch", str(tmp_path / "model.pt")]) == 0
    got, want = torch.load(tmp_path / "model.pt"), torch.load(root / "fsdp2-full.pt")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_strict_false_reports_missing_and_unexpected_keys(results):
    for rank, r in enumerate(results[1]):
        report = r["report"]
        assert report["strict"] == ({"step": 1}, {"step": 1}, [], []), report["strict"]
        items, extra, missing, unexpected = report["into_two"]
        assert items == {"step": 1} and not unexpected, report["into_two"]
        assert missing and all(k.startswith(("model.blocks.1.", "optim.state.blocks.1.", "optim.param_groups."))
                               for k in missing), missing
        assert "model.blocks.1.qkv.weight" in missing and "optim.state.blocks.1.qkv.weight.exp_avg" in missing
        items, extra, missing, unexpected = report["into_one"]
        assert items == {} and extra is None and "model.blocks.1.fc.bias" in unexpected, report["into_one"]


def test_an_optimizers_own_state_dict_through_dcp_warns(results):
    from tiershard.runtime.optim_state import HABIT, RESTARTED

    for r in results[1]:
        assert r["habit_save"] == [HABIT], r["habit_save"]
        assert r["habit"]["resumed"] == [RESTARTED], r["habit"]["resumed"]
        habit = r["habit"]
        assert all(not w for w in habit["correct"].values()), habit["correct"]
        assert habit["state"] == 0, "the habit's fresh optimizer got states"   # what the warning is about
        reference, habit_loss, ts_loss, standard_loss = habit["losses"]
        assert ts_loss == reference and standard_loss == reference, habit["losses"]
        assert abs(habit_loss - reference) > 1e-3, habit["losses"]      # Adam restarted: off the resumed run
        message = r["habit_ts_load"]
        assert "state_dict()" in message and "get_state_dict" in message, message
        assert r["torch.save"] == (True, True), r["torch.save"]


def test_readme_norm_example_shows_the_partial_and_the_full_norm(results):
    norms = [r["norms"] for r in results[1]]
    full = norms[0][1]
    assert all(abs(n[1] - full) < 1e-6 and abs(n[2] - full) < 1e-5 for n in norms), norms
    assert all(n[0] < full - 1e-3 for n in norms), norms                  # each rank's part, not the norm
    assert abs(sum(n[0] ** 2 for n in norms) - full ** 2) < 1e-4, norms    # the parts' squares add up
