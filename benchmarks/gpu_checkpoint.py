"""Checkpoints and memory of a 100M-parameter GPT on CUDA: asynchronous save against synchronous, and the GPU
memory that save, load, clipping and a full state dict add.

Run with one process per GPU (NCCL)::

    torchrun --nproc-per-node 1 benchmarks/gpu_checkpoint.py --dir /tmp/ckpt

The model (12 layers, width 832, about 100M parameters) is sharded ``GGG`` with AdamW and trains on random
tokens. Printed:

- ``ts.memory_stats``' engine total against ``torch.cuda.memory_allocated()`` after a step (what the engine
  accounts for, against what the allocator holds; the difference is activations' leftovers and torch's own);
- blocking time of ``ts.save`` (synchronous) and of ``ts.save(..., async_save=True)`` (two rounds: the first
  makes the pinned staging buffers), and how much longer the training step after an asynchronous save takes
  than a plain step (its ``opt.step()`` waits for the staging copy);
- the rise of the GPU allocator's peak over the memory held before each of save, async save, load,
  ``ts.clip_grad_norm_`` and ``ts.full_state_dict(cpu_offload=True, rank0_only=True)``;
- whether the asynchronous checkpoint, loaded into a fresh model, holds the weights as they were when the save
  was called (the step taken right after it must not leak in). Exits 1 if not.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = {"n_layer": 12, "n_embd": 832, "n_head": 8, "block_size": 128}
MiB = 1 << 20


CUDA = torch.cuda.is_available()


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()
    if dist.get_world_size() > 1:
        dist.barrier()


def step_peaks(build, batches, device) -> str:
    """The GPU allocator's peak during a training step and what stays between steps, above what was allocated
    before the model was built: tiershard's model (``build()``) against FSDP2 ``fully_shard`` (each block, then
    the root) on the same ranks, model and batches, one model alive at a time."""
    import gc

    from torch.distributed.fsdp import fully_shard

    from tiershard.train.models import GPT, Block, gpt_config, lm_loss

    def fsdp2():
        torch.manual_seed(0)
        ref = GPT(gpt_config("tiny", **SIZES)).to(device)
        for block in ref.modules():
            if isinstance(block, Block):
                fully_shard(block)
        fully_shard(ref)
        return ref, torch.optim.AdamW(ref.parameters(), lr=1e-4)

    def peak(make) -> tuple[float, float]:
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        m, o = make()
        for i in range(2):
            x = batches[i]
            lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
            o.step()
            o.zero_grad()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        x = batches[2]
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
        o.step()
        o.zero_grad()
        torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated() - base
        del m, o
        return held / MiB, top / MiB

    ts_held, ts_peak = peak(build)
    ref_held, ref_peak = peak(fsdp2)
    return (f"step peak (allocated, above the start): tiershard GGG {ts_peak:.0f} MiB (held between steps "
            f"{ts_held:.0f}), FSDP2 fully_shard {ref_peak:.0f} MiB (held {ref_held:.0f})")


def main() -> int:
    import tiershard as ts
    from tiershard.train.models import GPT, Block, gpt_config, lm_loss
    from tiershard.checkpoint.sharded import _engine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp folder)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=SIZES["n_layer"], help="fewer for a quick run on a CPU")
    args = parser.parse_args()
    SIZES["n_layer"] = args.layers
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank = dist.get_rank()
    if CUDA:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")
    allocated = torch.cuda.memory_allocated if CUDA else lambda: 0
    peak = torch.cuda.max_memory_allocated if CUDA else lambda: 0
    reset = torch.cuda.reset_peak_memory_stats if CUDA else lambda: None
    root = Path(args.dir or tempfile.mkdtemp(prefix="ts-gpu-ckpt-"))
    topo = ts.Topology.from_env()

    def build():
        torch.manual_seed(0)
        model = ts.shard(GPT(gpt_config("tiny", **SIZES)).to(device), "GGG", topo, wrap={Block})
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    g = torch.Generator(device=device).manual_seed(rank)
    batches = [torch.randint(0, 256, (args.batch, SIZES["block_size"] + 1), device=device, generator=g)
               for _ in range(4)]

    def step(model, opt, i=0) -> float:
        _sync()
        t0 = time.perf_counter()
        x = batches[i % len(batches)]
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        ts.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        _sync()
        return time.perf_counter() - t0

    model, opt = build()
    params = sum(p.numel() for p in model.parameters())
    for i in range(3):
        step(model, opt, i)
    plain = sorted(step(model, opt, i) for i in range(5))[2]
    stats = ts.memory_stats(model, opt)
    name = torch.cuda.get_device_name() if CUDA else "CPU"
    report = [f"{params / 1e6:.1f}M parameters, GGG on {dist.get_world_size()} rank(s), {name}",
              f"engine total {stats['engine_total'] / MiB:.0f} MiB (model states {stats['model_states'] / MiB:.0f}) "
              f"against cuda memory_allocated {allocated() / MiB:.0f} MiB; plain step {plain * 1e3:.0f} ms"]

    def rise(fn):
        _sync()
        before = allocated()
        reset()
        t0 = time.perf_counter()
        out = fn()
        blocked = time.perf_counter() - t0
        _sync()
        return out, blocked, (peak() - before) / MiB

    _, t_sync, r_sync = rise(lambda: ts.save(root / "sync", model, opt))
    report.append(f"ts.save: {t_sync:.2f} s, GPU peak rise {r_sync:.0f} MiB")
    ok = True
    for round_ in (1, 2):
        expected = {k: v.clone() for k, v in ts.full_state_dict(model, cpu_offload=True).items()}
        future, t_block, r_async = rise(lambda: ts.save(root / f"async{round_}", model, opt, async_save=True))
        t_step = step(model, opt, round_)              # trains on while the checkpoint is written
        t0 = time.perf_counter()
        try:
            future.result()
        except ts.CheckpointError as err:
            ok = False
            report.append(f"async save #{round_} FAILED:\n" + "".join(traceback.format_exception(err)))
            continue
        t_rest = time.perf_counter() - t0
        report.append(f"async save #{round_}: blocked {t_block:.2f} s ({t_block / t_sync:.2f}x sync), next step "
                      f"{t_step * 1e3:.0f} ms (+{(t_step - plain) * 1e3:.0f} ms), then result() {t_rest:.2f} s; "
                      f"GPU peak rise {r_async:.0f} MiB")
        staged = getattr(_engine(model), "_tiershard_stager", None)
        if staged is not None and staged.timings:
            t = staged.timings
            report.append(f"  staging: {t['staged'] / MiB:.0f} MiB copied in {t['copy']:.2f} s; new buffers "
                          f"{t['made'] / MiB:.0f} MiB, faulted in {t['fault']:.2f} s, pinned in {t['pin']:.2f} s")
        fresh, fresh_opt = build()
        _, t_load, r_load = rise(lambda: ts.load(root / f"async{round_}", fresh, fresh_opt))
        loaded = ts.full_state_dict(fresh, cpu_offload=True)
        same = all(torch.equal(loaded[k], expected[k]) for k in expected)
        ok &= same
        report.append(f"  loaded into a fresh model in {t_load:.2f} s (GPU peak rise {r_load:.0f} MiB): "
                      f"{'weights as at the save' if same else 'DIFFERENT from the weights at the save'}")
        del fresh, fresh_opt, loaded
    x = batches[0]
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    _, _, r_clip = rise(lambda: ts.clip_grad_norm_(model, 1.0))
    opt.zero_grad()
    _, _, r_full = rise(lambda: ts.full_state_dict(model, cpu_offload=True, rank0_only=True))
    largest = max(sum(p.numel() for p in b.parameters()) for b in model.modules() if isinstance(b, Block)) * 4 / MiB
    report.append(f"GPU peak rise: clip_grad_norm_ {r_clip:.0f} MiB, full_state_dict(cpu_offload, rank0_only) "
                  f"{r_full:.0f} MiB; largest unit {largest:.0f} MiB in fp32")
    if CUDA:
        del model, opt
        report.append(step_peaks(build, batches, device))
    if rank == 0:
        print("\n".join(report), flush=True)
        print("ok" if ok else "FAIL", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
