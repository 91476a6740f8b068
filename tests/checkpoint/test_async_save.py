"""``ts.save(..., async_save=True)`` against the synchronous save, in one launch of 4 ranks (2 nodes of 2, IIG).

An asynchronous save, then two training steps, then the wait, must hold exactly (bitwise) what a synchronous save at
the same point holds: the staging copy, taken in the background, is waited for by the optimizer's step (checked with
the copy held back until the step waits), as is taking a parameter's ``.data``, and an in-place write it cannot see
coming fails the save. A second save waits for the first. A save whose write fails on one rank raises
``CheckpointError`` on every rank from its handle and leaves the previous checkpoint and ``latest`` as they were,
loadable to the same bits. In the same launch, ``ts.load_full_state_dict(..., broadcast_from_rank0=True)`` from rank
0's state dict alone restores every rank.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from _dist import run_ranks
from _models import Block, TinyGPT, batches, loss_fn


def _local_state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of every master and optimizer state, cloned."""
    out = {f"param.{name}": p._local_tensor.clone() for name, p in model.named_parameters()}
    names = {id(p): name for name, p in model.named_parameters()}
    for param, state in opt.state.items():
        for key, value in state.items():
            value = getattr(value, "_local_tensor", value)
            out[f"optim.{names[id(param)]}.{key}"] = value.clone()
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def async_run(rank, world, root):
    import torch.distributed.checkpoint.filesystem as fs

    import tiershard as ts
    from tiershard.checkpoint import latest

    root = Path(root)
    torch.manual_seed(0)
    model = ts.shard(TinyGPT(), "IIG", ts.Topology((2, 4)), wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(5, 6, 1, world)

    def train(i):
        loss_fn(model, data[i][0][rank * 2:(rank + 1) * 2], 1).backward()
        opt.step()
        opt.zero_grad()

    train(0)
    saved = _local_state(model, opt)
    ts.save(root / "sync" / "step_1", model, opt, extra={"rank": rank})
    handle = ts.save(root / "async" / "step_1", model, opt, extra={"rank": rank}, async_save=True)
    out = {"future": isinstance(handle, Future)}
    train(1)                                      # training goes on while the files are written
    train(2)
    out["result"] = str(handle.result())
    out["latest"] = latest(root / "async").name
    out["trained_differs"] = not _same(_local_state(model, opt), saved)

    # a second save waits for the first: a synchronous save right after an asynchronous one. Before it, the
    # stager is closed as torch 2.11's dcp.async_save closes the stager it is given: its buffers serve on
    from tiershard.checkpoint.sharded import _engine
    stager = _engine(model)._tiershard_stager
    buffers = stager.buffers()                      # held: a buffer made anew could not reuse their memory
    stager.close()
    first = ts.save(root / "order" / "step_2", model, opt, async_save=True)
    ts.save(root / "order" / "step_3", model, opt)
    out["first_done_before_second"] = first.done() and first.exception() is None
    out["order_latest"] = latest(root / "order").name
    out["buffers_reused"] = (_engine(model)._tiershard_stager is stager and len(buffers) > 0
                             and {id(b) for b in stager.buffers()} == {id(b) for b in buffers})

    # the staged copy: every tensor equal, on the CPU, DTensors with their placements, shared storages still
    # shared (the tied embedding and head), one buffer per storage, plain entries copied
    from torch.distributed.tensor import DTensor
    from tiershard.checkpoint.sharded import _state
    from tiershard.checkpoint.staging import ShardStager, _local
    from torch.utils._pytree import tree_flatten

    state = _state(model, opt)
    staged = ShardStager(torch.device("cpu")).stage(state).result()
    pairs = list(zip(tree_flatten(state)[0], tree_flatten(staged)[0]))
    tensors = [(a, b) for a, b in pairs if isinstance(a, torch.Tensor)]
    out["staged_equal"] = len(tensors) > 0 and all(
        type(a) is type(b) and torch.equal(_local(a), _local(b)) and _local(b).device.type == "cpu"
        and (not isinstance(a, DTensor) or a._spec == b._spec) for a, b in tensors)
    out["staged_plain"] = all(a == b for a, b in pairs if not isinstance(a, torch.Tensor))
    sources = {_local(a).untyped_storage().data_ptr() for a, _ in tensors}
    copies = {_local(b).untyped_storage().data_ptr() for _, b in tensors}
    out["staged_storages"] = (len(sources), len(copies), sources.isdisjoint(copies))
    model_sd = staged["model"]
    out["staged_tied"] = (_local(model_sd["wte.weight"]).untyped_storage().data_ptr()
                          == _local(model_sd["head.weight"]).untyped_storage().data_ptr())

    # a save whose write fails (rank 1's disk) changes neither the previous checkpoint nor latest
    original = fs.FileSystemWriter.write_data

    def failing(self, plan, planner):
        raise OSError(28, "No space left on device")

    if rank == 1:
        fs.FileSystemWriter.write_data = failing
    try:
        broken = ts.save(root / "async" / "step_4", model, opt, async_save=True)
        train(3)
        try:
            broken.result()
            out["failed"] = None
        except ts.CheckpointError as err:
            out["failed"] = str(err)
    finally:
        fs.FileSystemWriter.write_data = original
    out["latest_after_failure"] = latest(root / "async").name
    out["step_4_exists"] = (root / "async" / "step_4").exists()

    extra = ts.load(root / "async", model, opt)
    out["async_equals_sync_state"] = _same(_local_state(model, opt), saved)
    out["extra"] = extra
    ts.load(root / "sync", model, opt)
    out["sync_equals_state"] = _same(_local_state(model, opt), saved)

    # a load into a fresh optimizer creates its states one parameter at a time: never every gradient at once
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    hook = fresh.register_step_pre_hook(
        lambda o, args, kwargs: counts.append(sum(p.grad is not None for p in model.parameters())))
    ts.load(root / "sync", model, fresh)
    hook.remove()
    out["grads_at_once"] = max(counts)
    out["fresh_equals_state"] = _same(_local_state(model, fresh), saved)

    # ts.load_full_state_dict(broadcast_from_rank0=True): only rank 0 holds the state dict
    full = ts.full_state_dict(model)
    probe = data[5][0][:2, :-1]
    with torch.no_grad():
        logits = model(probe)
        for p in model.parameters():
            p.add_(1.0)
    bad = {**full, "wpe": torch.zeros(3)} if rank == 0 else {}
    try:
        ts.load_full_state_dict(model, bad, broadcast_from_rank0=True)
        out["shape_error"] = None
    except ValueError as err:
        out["shape_error"] = str(err)
    out["unchanged_by_refusal"] = not _same(ts.full_state_dict(model), full)
    ts.load_full_state_dict(model, full if rank == 0 else {}, broadcast_from_rank0=True)
    out["broadcast_loaded"] = _same(ts.full_state_dict(model), full)
    with torch.no_grad():
        out["same_logits"] = torch.equal(model(probe), logits)

    # the copy is taken in the background; held back here until released, so the orders below are certain
    gate, stage = threading.Event(), ShardStager._stage

    def held(self, *args, **kwargs):
        gate.wait(60)
        return stage(self, *args, **kwargs)

    ShardStager._stage = held
    try:
        # the optimizer's step waits for the copy: the checkpoint holds the state before the step
        before_step = _local_state(model, opt)
        waited = ts.save(root / "held" / "step_5", model, opt, async_save=True)
        threading.Timer(0.5, gate.set).start()   # released while the step below waits
        train(4)
        out["step_waited"] = str(waited.result())
        # an in-place write the engine cannot see coming, made while the copy is held back, fails the save
        gate.clear()
        torn = ts.save(root / "held" / "step_6", model, opt, async_save=True)
        with torch.no_grad():
            next(model.parameters()).mul_(0.5)
        gate.set()
        try:
            torn.result()
            out["torn"] = None
        except ts.CheckpointError as err:
            out["torn"] = str(err)
        out["latest_after_torn"] = latest(root / "held").name
        # taking .data (a write no version counter sees) waits for the copy
        gate.clear()
        before_data = _local_state(model, opt)
        through_data = ts.save(root / "held" / "step_7", model, opt, async_save=True)
        threading.Timer(0.5, gate.set).start()
        next(model.parameters()).data.add_(1.0)
        through_data.result()
    finally:
        ShardStager._stage = stage
    ts.load(root / "held" / "step_5", model, opt)
    out["held_equals_state_before_step"] = _same(_local_state(model, opt), before_step)
    ts.load(root / "held" / "step_7", model, opt)
    out["data_write_after_copy"] = _same(_local_state(model, opt), before_data)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return root, run_ranks(async_run, 4, str(root))


def test_async_save_equals_sync_save_and_a_failed_write_changes_nothing(results):
    tmp_path, outs = results
    for rank, out in enumerate(outs):
        assert out["future"]
        assert out["result"] == str(tmp_path / "async" / "step_1")
        assert out["latest"] == "step_1"
        assert out["trained_differs"]
        assert out["async_equals_sync_state"] and out["sync_equals_state"]
        assert out["extra"] == {"rank": rank}
        assert out["first_done_before_second"] and out["order_latest"] == "step_3"
        assert out["buffers_reused"]
        assert out["failed"] is not None and "No space left on device" in out["failed"], out["failed"]
        assert out["latest_after_failure"] == "step_1" and not out["step_4_exists"]


def test_the_staged_copy_holds_every_tensor_and_shares_what_the_state_shares(results):
    for out in results[1]:
        assert out["staged_equal"] and out["staged_plain"] and out["staged_tied"]
        sources, copies, disjoint = out["staged_storages"]
        assert sources == copies and disjoint


def test_a_load_into_a_fresh_optimizer_sets_one_gradient_at_a_time(results):
    for out in results[1]:
        assert out["grads_at_once"] == 1
        assert out["fresh_equals_state"]


def test_load_full_state_dict_from_rank0_only(results):
    _, outs = results
    for out in outs:
        assert out["shape_error"] == "wpe: shape (3,) in the state dict, (8, 12) in the model; nothing was loaded"
        assert out["unchanged_by_refusal"]
        assert out["broadcast_loaded"] and out["same_logits"]


def test_writes_wait_for_the_background_copy_and_a_write_it_misses_fails_the_save(results):
    _, outs = results
    for rank, out in enumerate(outs):
        assert out["step_waited"].endswith("step_5")
        assert out["held_equals_state_before_step"]
        assert out["torn"] is not None and "rank 0's model/wpe was written while the save copied it" in out["torn"], \
            out["torn"]
        assert out["latest_after_torn"] == "step_5"
        assert out["data_write_after_copy"]


def test_the_stager_reuses_a_buffer_and_remakes_it_when_its_storage_was_resized():
    from tiershard.checkpoint.staging import ShardStager

    weight = torch.randn(100)
    stager = ShardStager(torch.device("cpu"))
    first = stager.stage({"w": weight, "view": weight[10:20], "lr": [0.1]}).result()
    assert torch.equal(first["w"], weight) and first["view"].untyped_storage() is first["w"].untyped_storage()
    buffer = stager.buffers()[0]
    weight.mul_(2)
    again = stager.stage({"w": weight}).result()
    assert torch.equal(again["w"], weight) and stager.buffers()[0] is buffer   # the same buffer, new values
    weight.untyped_storage().resize_(800)        # as storage-freeing code does: the same storage object, resized
    weight.set_(weight.untyped_storage(), 0, (200,)).normal_()
    resized = stager.stage({"w": weight}).result()
    assert torch.equal(resized["w"], weight) and stager.buffers()[0].numel() == 800
