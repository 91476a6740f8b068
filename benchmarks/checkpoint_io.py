"""Checkpoint throughput: ``ts.save`` / ``ts.load`` on 4 gloo ranks against ``torch.save`` / ``torch.load`` of the
same bytes in one process.

For each model (the built-in GPT at about 26M and 100M parameters, sharded ``IIG`` over 2 emulated nodes of 2,
with AdamW states after one step), rounds alternate: ``ts.save`` (every rank writes its shards in parallel,
checksums and fsyncs them, rank 0 writes the manifest and renames), ``ts.load`` (manifest check with CRC-32 of
every file, then DCP reads and reshards), and in the parent process ``torch.save`` + fsync and ``torch.load``
of a dict of tensors of the checkpoint's shapes and dtypes. Throughput is the checkpoint's bytes on disk over
the median wall time; loads read what was just written (the page cache, for both)::

    .venv/bin/python benchmarks/checkpoint_io.py                       # both models, 3 rounds, in a temp folder
    .venv/bin/python benchmarks/checkpoint_io.py --models 26M --rounds 5 --dir /scratch
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODELS = {  # name -> GPT sizes (byte vocabulary, tied head)
    "26M": {"n_layer": 8, "n_embd": 512, "n_head": 8, "block_size": 128},
    "100M": {"n_layer": 12, "n_embd": 832, "n_head": 8, "block_size": 128},
}


def _ranks(rank: int, world: int, sizes: dict, root: str, rounds: int) -> dict:
    import torch.distributed as dist

    import tiershard as ts
    from tiershard.train.models import GPT, Block, gpt_config, lm_loss

    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", **sizes))
    params = model.num_params()
    model = ts.shard(model, "IIG", ts.Topology((2, world)), wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (1, 9))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()        # one step: AdamW's states exist
    opt.step()
    opt.zero_grad()
    saves, loads = [], []
    for i in range(rounds):
        path = Path(root) / f"step_{i}"
        dist.barrier()
        t0 = time.perf_counter()
        ts.save(path, model, opt, extra={"step": i})
        dist.barrier()
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ts.load(path, model, opt)
        dist.barrier()
        loads.append(time.perf_counter() - t0)
        if i < rounds - 1 and rank == 0:
            shutil.rmtree(path)
        dist.barrier()
    return {"params": params, "save": saves, "load": loads}


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _plain(checkpoint: Path, root: Path, rounds: int) -> tuple[list[float], list[float]]:
    """torch.save (+ fsync) and torch.load of tensors with the checkpoint's shapes and dtypes, in one process."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {k: torch.randn(m.size).to(m.properties.dtype) if m.properties.dtype.is_floating_point
             else torch.zeros(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    saves, loads = [], []
    for i in range(rounds):
        path = root / f"plain_{i}.pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path)
        loads.append(time.perf_counter() - t0)
        path.unlink()
    return saves, loads


def main() -> None:
    from tiershard.cluster.local import run_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="26M,100M", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks, as 2 emulated nodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"ckpt-{name}-", dir=args.dir))
        try:
            results = run_local(_ranks, args.ranks, MODELS[name], str(root), args.rounds, timeout=3600)
            last = root / f"step_{args.rounds - 1}"
            size = _folder_bytes(last)
            save = statistics.median(max(r["save"][i] for r in results) for i in range(args.rounds))
            load = statistics.median(max(r["load"][i] for r in results) for i in range(args.rounds))
            plain_save, plain_load = _plain(last, root, args.rounds)
            rows.append((name, results[0]["params"], size, save, load, statistics.median(plain_save),
                         statistics.median(plain_load)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{args.ranks} gloo ranks, plan IIG over (2, {args.ranks}); AdamW states; median of {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs")
    print(f"{'model':>6} {'params':>8} {'checkpoint':>11} | {'ts.save':>17} {'ts.load':>17} | "
          f"{'torch.save+fsync':>17} {'torch.load':>17}")
    for name, params, size, save, load, psave, pload in rows:
        mbs = lambda t: f"{t:5.2f} s {size / t / 1e6:5.0f} MB/s"  # noqa: E731
        print(f"{name:>6} {params / 1e6:7.1f}M {size / 1e6:8.0f} MB | {mbs(save):>17} {mbs(load):>17} | "
              f"{mbs(psave):>17} {mbs(pload):>17}")


if __name__ == "__main__":
    main()
