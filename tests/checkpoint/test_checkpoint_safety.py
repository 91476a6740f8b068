"""Nothing runs from a checkpoint file, and a checkpoint of another model is refused unless ``strict=False``.

One launch of 2 ranks (tiny GPT under ``zero3``) checks everything; the tests below assert on its results:

- a payload planted in a rank's extra, in DCP's ``.metadata`` or in a non-tensor DCP entry (an optimizer
  hyperparameter) is refused by ``ts.load`` (and ``.metadata`` by ``tiershard convert``) with a
  ``CheckpointError`` naming the file, without running it (its marker file is never created) and without
  changing the model; each planted file is resealed into the manifest, as someone handing over a checkpoint would;
- an extra that ``ts.load`` could not read back (an object of a user class) is refused by ``ts.save`` on every
  rank, leaving ``latest`` and the folder as they were; the trainer's extra (torch, Python and NumPy RNG states)
  round-trips exactly;
- loading a 2-layer checkpoint into 1 layer (unexpected keys), 1 layer into 2 (missing keys), a renamed
  parameter (both), an AdamW checkpoint into SGD and a model-only checkpoint with an optimizer raise
  ``CheckpointError`` naming the keys, the model untouched, as ``nn.Module.load_state_dict`` does; ``strict=False``
  loads the keys that match and keeps the rest.
"""
from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from _dist import checkpoint_error as _error, run_ranks
from _models import Block, TinyGPT, batches, loss_fn


class Payload:
    """Unpickling it creates the file ``marker``: what a planted checkpoint file would do instead."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class UserObject:
    """Any object of a user class: not plain data."""


def _reseal(folder: Path) -> None:
    """Rewrite the manifest to match the files as they are now (size and CRC-32 of each)."""
    manifest = json.loads((folder / "tiershard.json").read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    (folder / "tiershard.json").write_text(json.dumps(manifest))


def safety_run(rank, world, root):
    import random

    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tiershard as ts
    from tiershard.checkpoint import convert

    root = Path(root)
    out = {}

    def model_of(layers=2, seed=0, opt="adamw", rename=False):
        torch.manual_seed(seed)
        module = TinyGPT(layers=layers)
        if rename:
            module.norm = module.ln_f
            del module.ln_f
        model = ts.shard(module, "zero3", ts.Topology((1, 2)), wrap={Block})
        optim = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw" else
                 torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if not rename:
            tokens = batches(3, 1, 1, 1, 4)[0][0][rank * 2:(rank + 1) * 2]
            loss_fn(model, tokens, 1).backward()
            optim.step()
            optim.zero_grad()
        return model, optim

    def snapshot(model):
        return {k: v.clone() for k, v in ts.full_state_dict(model).items()}

    def same(a, b):
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    def refused(name, load):
        """Load a planted checkpoint: (message, marker created, model unchanged)."""
        model, optim = model_of(seed=5)
        before = snapshot(model)
        message = _error(lambda: load(model, optim))
        dist.barrier()
        return message, (root / f"marker-{name}").exists(), same(before, snapshot(model))

    # the trainer's extra round-trips; an extra that is not plain data is refused by ts.save
    model, optim = model_of()
    saved = snapshot(model)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    extra = {"step": 1, "rng": rng, "config": {"lr": 0.1, "name": "x", "none": None}, "rank": rank}
    ts.save(root / "good", model, optim, extra=extra)
    bad = _error(lambda: ts.save(root / "bad_extra", model, optim, extra={"step": 1, "obj": UserObject()}))
    dist.barrier()                                # rank 0 removes the refused save's folder
    out["save_refused"] = (bad, (root / "bad_extra").exists(), (root / "latest").read_text().strip(),
                           sorted(p.name for p in root.glob(".bad_extra*")))
    other, other_opt = model_of(seed=1)
    back = ts.load(root / "good", other, other_opt)
    out["roundtrip"] = (same(saved, snapshot(other)) and back["step"] == 1 and back["rank"] == rank
                        and back["config"] == extra["config"] and torch.equal(back["rng"]["torch"], rng["torch"])
                        and back["rng"]["python"] == rng["python"]
                        and all(np.array_equal(a, b) for a, b in zip(back["rng"]["numpy"], rng["numpy"])))

    # a replacing save killed between its two renames: step_1 aside as .step_1.old-T, the new one still at
    # .step_1.tmp-T, `latest` naming step_1. The previous checkpoint still loads, and the next save puts it back
    from tiershard.checkpoint import latest

    rep = root / "rep"
    ts.save(rep / "step_1", model, optim, extra={"step": 1})
    if rank == 0:
        shutil.copytree(rep / "step_1", rep / ".step_1.tmp-0badc0de")
        (rep / "step_1").rename(rep / ".step_1.old-0badc0de")
    dist.barrier()
    found = latest(rep)
    other, other_opt = model_of(seed=3)
    back = ts.load(rep, other, other_opt)
    dist.barrier()
    replaced = {"latest": found.name, "loaded": same(saved, snapshot(other)) and back["step"] == 1}
    ts.save(rep / "step_1", other, other_opt, extra={"step": 2})
    replaced["after"] = (sorted(p.name for p in rep.iterdir()), ts.load(rep, other, other_opt)["step"])
    out["replaced"] = replaced
    # `latest` holds one folder name: a path out of the root is refused, not followed
    ts.save(root / "outside" / "step_1", model, optim)
    if rank == 0:
        (root / "inside").mkdir()
        (root / "inside" / "latest").write_text("../outside/step_1\n")
        (root / "absolute").mkdir()
        (root / "absolute" / "latest").write_text(str(root / "outside" / "step_1") + "\n")
    dist.barrier()
    out["escape"] = [_error(lambda: ts.load(root / where, other, other_opt)) for where in ("inside", "absolute")]

    # planted payloads: in the extras, in .metadata, in a non-tensor DCP entry (AdamW's lr)
    for name in ("extra", "metadata", "bytes"):
        ts.save(root / name, model, optim, extra={"step": 1})
        marker = str(root / f"marker-{name}")
        if name == "bytes":
            model_sd, optim_sd = get_state_dict(model, optim)
            optim_sd["param_groups"][0]["lr"] = Payload(marker)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / name))
        dist.barrier()
        if rank == 0:
            if name == "extra":
                for r in range(world):
                    torch.save(Payload(marker), root / name / "extra" / f"rank{r}.pt")
            elif name == "metadata":
                (root / name / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
            _reseal(root / name)
        dist.barrier()
        out[name] = refused(name, lambda m, o: ts.load(root / name, m, o))
    if rank == 0:
        message = _error(lambda: convert.model_entries(root / "metadata"))
        out["convert"] = (message, (root / "marker-metadata").exists())

    # strict by default, in both directions; strict=False keeps what matches
    one, one_opt = model_of(layers=1, seed=2)
    one_saved = snapshot(one)
    ts.save(root / "one", one, one_opt)
    ts.save(root / "model_only", one)
    cases = {"unexpected": (dict(layers=1, seed=5), "good"), "missing": (dict(layers=2, seed=5), "one"),
             "renamed": (dict(rename=True, seed=5), "good"), "optimizer": (dict(opt="sgd", seed=5), "good"),
             "no_optimizer": (dict(layers=1, seed=5), "model_only")}
    for case, (kwargs, source) in cases.items():
        model, optim = model_of(**kwargs)
        before = snapshot(model)
        message = _error(lambda: ts.load(root / source, model, None if case == "renamed" else optim))
        out[case] = (message, same(before, snapshot(model)))
    loose = {}
    for source, layers, reference in (("good", 1, saved), ("one", 2, one_saved)):
        model, optim = model_of(layers=layers, seed=5)
        before = snapshot(model)
        ts.load(root / source, model, optim, strict=False)
        after = snapshot(model)
        loose[source] = {k: torch.equal(after[k], reference[k] if k in reference else before[k]) for k in after}
    out["loose"] = loose
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(safety_run, 2, str(tmp_path_factory.mktemp("safety")))


@pytest.mark.parametrize("name, file, says", [
    ("extra", "extra/rank0.pt", "not plain data"),      # every rank raises rank 0's error
    ("metadata", ".metadata", "holds an object that is not checkpoint metadata"),
    ("bytes", "__", "not plain data"),
])
def test_a_planted_payload_is_refused_and_never_runs(results, name, file, says):
    for r in results:
        message, ran, unchanged = r[name]
        assert not ran, f"{name}: the planted payload ran on load"
        assert says in message and file in message, (name, message)
        assert unchanged, f"{name}: a refused load changed the model"


def test_a_replace_killed_between_its_renames_keeps_the_previous_checkpoint(results):
    for r in results:
        replaced = r["replaced"]
        assert replaced["latest"] == ".step_1.old-0badc0de" and replaced["loaded"], replaced
        assert replaced["after"] == (["latest", "step_1"], 2), replaced     # put back, then replaced; no leftovers


def test_latest_naming_a_path_out_of_the_root_is_refused(results):
    for r in results:
        for message in r["escape"]:
            assert "is not a folder name inside" in message and "latest" in message, message


def test_convert_refuses_planted_metadata(results):
    message, ran = results[0]["convert"]
    assert not ran and "metadata" in message and "not checkpoint metadata" in message, message


def test_save_refuses_an_extra_load_could_not_read(results):
    for r in results:
        message, written, latest, leftovers = r["save_refused"]
        assert "UserObject" in message and "plain data" in message, message
        assert not written and latest == "good" and leftovers == [], (written, latest, leftovers)
        assert r["roundtrip"], "the trainer's extra (RNG states) did not round-trip"


def test_load_is_strict_by_default(results):
    for r in results:
        message, unchanged = r["unexpected"]
        assert "unexpected" in message and "model.blocks.1.ln1.weight" in message, message
        assert "missing" not in message and "strict=False" in message, message
        message, _ = r["missing"]
        assert "missing" in message and "model.blocks.1." in message and "unexpected" not in message, message
        message, _ = r["renamed"]
        assert "model.norm.weight" in message and "model.ln_f.weight" in message, message
        message, _ = r["optimizer"]
        assert "momentum_buffer" in message and "exp_avg" in message, message
        message, _ = r["no_optimizer"]
        assert "holds no optimizer state" in message and "ts.load(path, model)" in message, message
        assert all(r[case][1] for case in ("unexpected", "missing", "renamed", "optimizer", "no_optimizer")), \
            "a refused load changed the model"


def test_strict_false_loads_what_matches(results):
    for r in results:
        for source, equal in r["loose"].items():
            assert all(equal.values()), (source, [k for k, ok in equal.items() if not ok])
