"""Checkpoints across world sizes, topologies and plans, against never stopping; refused loads change nothing.

Save after 2 steps on 4 ranks as 2 nodes of 2 under ``IIG``; load on 2 ranks under ``zero3`` and on 8 ranks
(4 nodes of 2) under ``NIG+qgz``; every parameter and optimizer state must equal the saved
ones, and 2 more steps must equal one process trained 4 steps on the concatenated batches (exact plans: SGD
within 1e-5, AdamW within 1e-3 relative L2, the parity sweep's bounds). A truncated shard, a flipped byte, a
missing metadata file and a missing tensor are refused with the file named, the model untouched.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn

PER_RANK, STEPS, MORE = 2, 2, 2
GLOBAL = 8          # rows of every global batch: 4 ranks x 2, 2 ranks x 4, 8 ranks x 1


def make_opt(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def data():
    return batches(3, STEPS + MORE, 1, 1, GLOBAL)


def steps(model, opt, batch_list, rank, world):
    rows = GLOBAL // world
    for step in batch_list:
        loss_fn(model, step[0][rank * rows:(rank + 1) * rows], 1).backward()
        opt.step()
        opt.zero_grad()


def reference(opt_name):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = make_opt(model.parameters(), opt_name)
    steps(model, opt, data(), 0, 1)
    return {k: v.detach() for k, v in model.state_dict().items()}


def optimizer_state(model, opt):
    """Full optimizer states by parameter name (a collective on every rank)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {}
    for name, state in get_optimizer_state_dict(model, opt)["state"].items():
        for key, value in state.items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}.{key}"] = value.detach().clone()
    return out


def save_run(rank, world, root, opt_name):
    import tiershard as ts

    torch.manual_seed(0)
    model = ts.shard(TinyGPT(), "IIG", ts.Topology((2, 4)), wrap={Block})
    opt = make_opt(model.parameters(), opt_name)
    steps(model, opt, data()[:STEPS], rank, world)
    path = ts.save(Path(root) / "step_2", model, opt, extra={"step": STEPS, "rank": rank})
    if opt_name == "adamw":     # the standard route too: torch's state dicts through dcp.save
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(root) / "standard"))
    if rank == 0:
        torch.save((ts.full_state_dict(model), optimizer_state(model, opt)), Path(root) / f"saved-{opt_name}.pt")
    else:
        ts.full_state_dict(model), optimizer_state(model, opt)
    return str(path)


def load_run(rank, world, root, opt_name, plan, sizes):
    import tiershard as ts

    torch.manual_seed(1)                       # different initial weights: everything must come from the file
    model = ts.shard(TinyGPT(), plan, ts.Topology(sizes), wrap={Block})
    opt = make_opt(model.parameters(), opt_name)
    extra = ts.load(root, model, opt)          # the folder of checkpoints: its `latest`
    saved_params, saved_opt = torch.load(Path(root) / f"saved-{opt_name}.pt")
    params, states = ts.full_state_dict(model), optimizer_state(model, opt)
    out = {"extra": extra,
           "params": max((params[k] - saved_params[k]).abs().max().item() for k in saved_params),
           "opt_keys": sorted(states) == sorted(saved_opt),
           "opt": max((states[k].float() - saved_opt[k].float()).abs().max().item() for k in saved_opt)}
    steps(model, opt, data()[STEPS:], rank, world)
    ref = reference(opt_name)
    state = ts.full_state_dict(model)
    out["per_tensor"] = max(((state[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
    num = sum(((state[k] - ref[k]) ** 2).sum() for k in ref) ** 0.5
    out["rel_l2"] = (num / sum((ref[k] ** 2).sum() for k in ref) ** 0.5).item()
    if opt_name == "adamw" and plan == "zero3":    # the standard route, into yet another model
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        torch.manual_seed(2)
        other = ts.shard(TinyGPT(), plan, ts.Topology(sizes), wrap={Block})
        other_opt = make_opt(other.parameters(), opt_name)
        model_sd, optim_sd = get_state_dict(other, other_opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(root) / "standard"))
        set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        standard, standard_opt = ts.full_state_dict(other), optimizer_state(other, other_opt)
        out["standard"] = (max((standard[k] - saved_params[k]).abs().max().item() for k in saved_params),
                           max((standard_opt[k].float() - saved_opt[k].float()).abs().max().item() for k in saved_opt))
    return out


OPTIMIZERS = ("adamw", "sgd")
TARGETS = [("zero3", (1, 2), 2, OPTIMIZERS), ("NIG+qgz", (2, 8), 8, ("adamw",))]


def save_each(rank, world, root):
    """``save_run`` for every optimizer, each into its own folder, in one launch of the ranks."""
    return {name: save_run(rank, world, str(Path(root) / name), name) for name in OPTIMIZERS}


def load_each(rank, world, root, opt_names, plan, sizes):
    """``load_run`` for each of ``opt_names`` from its folder, in one launch of the ranks."""
    return {name: load_run(rank, world, str(Path(root) / name), name, plan, sizes) for name in opt_names}


def test_save_on_4_ranks_load_on_2_and_8_under_other_plans(tmp_path):
    run_ranks(save_each, 4, str(tmp_path))
    for opt_name in OPTIMIZERS:
        assert (tmp_path / opt_name / "latest").read_text().strip() == "step_2"
    for plan, sizes, world, opt_names in TARGETS:
        for rank, by_opt in enumerate(run_ranks(load_each, world, str(tmp_path), opt_names, plan, sizes)):
            for opt_name, r in by_opt.items():
                assert r["params"] == 0.0 and r["opt_keys"] and r["opt"] == 0.0, (plan, opt_name, rank, r)
                assert r["extra"] == {"step": STEPS, "rank": rank if world == 4 else 0}, r["extra"]
                assert r.get("standard", (0.0, 0.0)) == (0.0, 0.0), r["standard"]
                if "qgz" in plan or "qwz" in plan:
                    assert r["rel_l2"] <= 0.05, (plan, rank, r)       # quantized: the steps after loading
                elif opt_name == "sgd":
                    assert r["per_tensor"] <= 1e-5, (plan, rank, r)
                else:
                    assert r["rel_l2"] <= 1e-3, (plan, rank, r)


# ---- refused loads -------------------------------------------------------------------------------------
DAMAGES = {"truncate": "__1_0.distcp has", "flip": "__0_0.distcp does not match",
           "metadata": ".metadata is missing", "shape": "does not fit"}


def refused_run(rank, world, folder):
    """Each damage in turn, in one launch: the load is refused naming the file, and nothing changes."""
    import torch.distributed as dist

    import tiershard as ts

    out = {}
    for damage in DAMAGES:
        torch.manual_seed(0)
        model = ts.shard(TinyGPT(), "GGG", ts.Topology((2, 4)), wrap={Block})
        opt = make_opt(model.parameters(), "adamw")
        steps(model, opt, data()[:1], rank, world)
        target = Path(folder) / damage
        ts.save(target, model, opt, extra={"step": 1})
        torch.manual_seed(2)
        other = ts.shard(TinyGPT(d=16) if damage == "shape" else TinyGPT(), "GGG", ts.Topology((2, 4)),
                         wrap={Block})
        other_opt = make_opt(other.parameters(), "adamw")
        steps(other, other_opt, data()[1:2], rank, world)
        before = (ts.full_state_dict(other), optimizer_state(other, other_opt))
        if rank == 0:
            files = sorted(target.glob("*.distcp"))
            if damage == "truncate":
                with open(files[1], "r+b") as f:
                    f.truncate(files[1].stat().st_size // 2)
            elif damage == "flip":
                data_bytes = bytearray(files[0].read_bytes())
                data_bytes[len(data_bytes) // 2] ^= 0xFF
                files[0].write_bytes(bytes(data_bytes))
            elif damage == "metadata":
                (target / ".metadata").unlink()
        dist.barrier()
        try:
            ts.load(target, other, other_opt)
            message = "no error"
        except ts.CheckpointError as err:
            message = str(err)
        after = (ts.full_state_dict(other), optimizer_state(other, other_opt))
        out[damage] = (message, all(torch.equal(before[i][k], after[i][k]) for i in range(2) for k in before[i]))
    return out


def test_a_damaged_checkpoint_is_refused_and_changes_nothing(tmp_path):
    for result in run_ranks(refused_run, 4, str(tmp_path)):
        for damage, (message, unchanged) in result.items():
            assert DAMAGES[damage] in message, (damage, message)
            assert unchanged, f"a refused load ({damage}) changed the model or the optimizer"


def test_no_checkpoint_names_the_folder(tmp_path):
    from tiershard.checkpoint import CheckpointError, resolve

    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="neither"):
        resolve(tmp_path)
    shutil.rmtree(tmp_path)
