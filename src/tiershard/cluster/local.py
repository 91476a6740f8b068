"""Run a function on several gloo ranks of this machine and collect what each returns.

For development, tests and benchmarks on CPUs: ``run_local(fn, 4, ...)`` starts 4 processes with a process group
over loopback, calls ``fn(rank, world, ...)`` in each and returns their results by rank. ``fn`` must be
importable (defined at module level). Real clusters use ``torchrun`` instead.

[Note: forked ranks] Ranks are forked from a fork server that imported torch, tiershard and what every rank
imports next (``PRELOAD``) once (multiprocessing's ``forkserver``), not started as fresh interpreters: a launch
costs a fork instead of importing torch in every rank, which is most of a short launch's time. The server is
single-threaded (imports only, no CUDA), so forking it is safe. It was started with the environment of its first launch, so each rank takes the caller's environment at
launch time explicitly (as a fresh interpreter would).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports once, so that each rank does not on its first ts.shard, step or save: DTensor,
# torch._dynamo (behind DTensor's torch._disable_dynamo), FSDP2 and DCP, about 0.6 s of CPU per rank. Imports only
# (no threads, no process group); transformers stays out (tiershard.runtime.materialize looks for it in sys.modules).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo", "tiershard",
           "tiershard.runtime.api", "tiershard.checkpoint"]


def _context():
    """The fork-server context of [Note: forked ranks] (spawn where there is no fork server)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world, port, fn, args, queue, environ=None, pg_timeout=None):
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        extra = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world, **extra)
        result = fn(rank, world, *args)
        # by value: a tensor put on the queue as itself is shared through a file descriptor that dies with this
        # process, which may exit before the caller reads it
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()        # the result is in the pipe before teardown can crash or hang
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn, world: int, *args, timeout: float = 600, pg_timeout: float | None = None) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the results by rank, raises the first error.
    ``pg_timeout``: seconds of the process group's timeout (torch's default, 30 minutes, when None)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, environ, pg_timeout))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                silent = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if silent:
                    time.sleep(1.0)   # a result may still be in flight
                    if queue.empty():
                        codes = {r: procs[r].exitcode for r in silent}
                        errors.append(f"ranks {silent} exited without a result (exit codes {codes})")
                elif time.monotonic() > deadline:
                    errors.append(f"no result from ranks {sorted(set(range(world)) - results.keys())} "
                                  f"after {timeout:.0f} s")
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=3 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError(errors[0])
    return [results[r] for r in range(world)]
