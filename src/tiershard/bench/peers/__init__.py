"""The systems tiershard is measured against, trained by one shared per-rank loop.

Comparisons are only fair when everything but the sharding is the same, so every system here trains the
built-in GPT from the same seed, on the same token batches, with the same torch optimizer, loss scaling and
timing code. Only the way the model is wrapped and how a micro-step skips gradient synchronisation differ:

==================  ==========================================================================================
system              what runs
==================  ==========================================================================================
``single``          this process alone, unsharded, on all ``batch_per_rank`` rows (the oracle: call it with
                    ``batch_per_rank = world x per-rank rows`` to reproduce a sharded run's global batch)
``fsdp2``           torch FSDP2 ``fully_shard`` per block and the root on a 1-D mesh: ZeRO-3
``fsdp2-rs``        ``fsdp2`` reducing every micro-step (no ``set_requires_gradient_sync``): sharded gradients
                    between micro-steps, like tiershard ``zero3``; ``fsdp2`` keeps them unsharded (``GNG``)
``fsdp2-hpz``       ``fully_shard(reshard_after_forward=ranks_per_node)``: backward gathers inside the node
``fsdp2-hsdp``      HSDP, a (nodes, ranks_per_node) mesh replicating x sharding; non-final micro-steps skip all
                    gradient sync (``set_requires_gradient_sync(False)``)
``fsdp2-hsdp-ar``   HSDP; non-final micro-steps keep the in-node reduce-scatter and skip only the cross-node
                    all-reduce (``set_requires_all_reduce(False)``), tiershard ``hsdp``'s accumulation
``deepspeed-zero3`` DeepSpeed ZeRO-3 (the optional extra ``bench``; see :mod:`tiershard.bench.peers.deepspeed`)
``deepspeed-hpz``   DeepSpeed ZeRO-3 with ``zero_hpz_partition_size = ranks_per_node``
``tiershard:PLAN``  ``ts.shard(GPT, PLAN, Topology((ranks_per_node, world)), wrap={Block})`` and ``ts.no_sync``
==================  ==========================================================================================

Batches come from the seed alone: step ``s`` draws a global batch of ``world x batch_per_rank`` rows and rank
``r`` trains on rows ``r*batch_per_rank ..``, so any system at any world size sees the same global batch.
Every rank calls the same function (inside ``tiershard.cluster.local.run_local`` or under ``torchrun``)::

    result = train_steps("fsdp2", gpt_config("small"), steps=10, micro_steps=2, ranks_per_node=2,
                         param_dtype=torch.bfloat16)
    result["losses"], result["step_times"]       # identical on every rank
"""
from __future__ import annotations

import contextlib
import resource
import time
from typing import ContextManager

import torch
import torch.distributed as dist

from ...train.models.gpt import Block, GPTConfig, lm_loss
from .setup import Runner, Setup

__all__ = ["SYSTEMS", "Setup", "Runner", "Trainer", "make_trainer", "train_steps", "step_batch", "interleaved"]

SYSTEMS: tuple[str, ...] = ("single", "fsdp2", "fsdp2-rs", "fsdp2-hpz", "fsdp2-hsdp", "fsdp2-hsdp-ar",
                            "deepspeed-zero3", "deepspeed-hpz", "tiershard:PLAN")


class _Tiershard(Runner):
    def micro_step(self, last: bool) -> ContextManager:
        import tiershard as ts

        return contextlib.nullcontext() if last else ts.no_sync(self.model)


def _build_single(setup: Setup) -> Runner:
    if setup.param_dtype != torch.float32 or setup.reduce_dtype != torch.float32:
        raise ValueError("system 'single' trains in fp32 only: it is the oracle for the sharded systems")
    model = setup.model()
    return Runner(model, setup.optimizer(model.parameters()), setup)


def _build_tiershard(setup: Setup) -> Runner:
    import tiershard as ts

    plan = setup.system.split(":", 1)[1]
    topo = ts.Topology(setup.tiers or (setup.ranks_per_node, setup.world))
    model = ts.shard(setup.model(), plan, topo, wrap={Block}, param_dtype=setup.param_dtype,
                     reduce_dtype=setup.reduce_dtype)
    return _Tiershard(model, setup.optimizer(model.parameters()), setup)


def _build(setup: Setup) -> Runner:
    system = setup.system
    if system == "single":
        return _build_single(setup)
    if system.startswith("tiershard:"):
        return _build_tiershard(setup)
    if system.startswith("fsdp2"):
        from .fsdp2 import build

        return build(setup)
    if system.startswith("deepspeed"):
        from .deepspeed import build

        return build(setup)
    raise ValueError(f"unknown system {system!r}: choose one of {', '.join(SYSTEMS)}")


def step_batch(seed: int, step: int, micro_steps: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """Token ids of shape (micro_steps, rows, seq + 1) for optimizer step ``step``, from the seed alone.

    One generator per step, so a trainer resumed at step ``s`` sees what a fresh one would at step ``s``.
    """
    if not 0 <= step < 2**20:
        raise ValueError(f"step {step} out of range [0, 2**20)")
    g = torch.Generator().manual_seed(seed * 2**20 + step)
    return torch.randint(0, vocab, (micro_steps, rows, seq + 1), generator=g)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


class Trainer:
    """A built system that can train more steps later, so a benchmark can interleave systems round by round."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.num_params = setup.model().num_params()   # counted before sharding changes what parameters hold
        self.runner = _build(setup)
        self.step = 0

    def train(self, steps: int) -> dict:
        """Run ``steps`` optimizer steps; returns per-step global mean losses and slowest-rank step times."""
        s, runner = self.setup, self.runner
        distributed = s.system != "single" and dist.is_initialized()
        lo, hi = s.rank * s.batch_per_rank, (s.rank + 1) * s.batch_per_rank
        losses, times = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
        for i in range(steps):
            tokens = step_batch(s.seed, self.step, s.micro_steps, s.world * s.batch_per_rank, s.seq,
                                s.model_cfg.vocab_size)[:, lo:hi]
            if distributed:
                dist.barrier()               # every rank starts the step together: times are per step
            start = time.perf_counter()
            total = torch.zeros((), dtype=torch.float64)
            for m in range(s.micro_steps):
                with runner.micro_step(m == s.micro_steps - 1):
                    loss = lm_loss(runner.model(tokens[m, :, :-1]), tokens[m, :, 1:])
                    runner.backward(loss)
                total += loss.detach().double()
            runner.optimizer_step()
            times[i] = time.perf_counter() - start
            losses[i] = total / s.micro_steps
            self.step += 1
        rss = torch.tensor([_peak_rss_bytes()], dtype=torch.float64)
        if distributed:                      # after the timed loop: reductions add nothing to step times
            dist.all_reduce(losses)
            losses /= s.world
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        return dict(system=s.system, world=s.world, ranks_per_node=s.ranks_per_node, params=self.num_params,
                    param_dtype=str(s.param_dtype).removeprefix("torch."), optimizer=s.optimizer_name,
                    micro_steps=s.micro_steps,
                    tokens_per_step=s.world * s.batch_per_rank * s.micro_steps * s.seq,
                    losses=losses.tolist(), step_times=times.tolist(), peak_rss_bytes=int(rss.item()))


def make_trainer(system: str, model_cfg: GPTConfig, micro_steps: int = 1, batch_per_rank: int = 2,
                 seq: int | None = None, seed: int = 0, ranks_per_node: int | None = None,
                 param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                 optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.01,
                 tiers: tuple[int, ...] | None = None) -> Trainer:
    """Build ``system`` on this rank (every rank calls it); see :func:`train_steps` for the arguments. ``tiers``
    (e.g. ``(2, 4, 8)``) is tiershard's topology, by default ``(ranks_per_node, world)``."""
    if system not in SYSTEMS[:-1] and not system.startswith("tiershard:"):
        raise ValueError(f"unknown system {system!r}: choose one of {', '.join(SYSTEMS)}")
    if system == "single":
        rank, world = 0, 1
    else:
        if not dist.is_initialized():
            raise RuntimeError(f"system {system!r} needs torch.distributed initialised on every rank")
        if dist.get_backend() != "gloo":
            raise ValueError(f"the peers run on CPU ranks over gloo, not {dist.get_backend()!r}")
        rank, world = dist.get_rank(), dist.get_world_size()
    rpn = world if ranks_per_node is None else ranks_per_node
    if rpn < 1 or world % rpn:
        raise ValueError(f"ranks_per_node={rpn} must divide the world size {world}")
    seq = model_cfg.block_size if seq is None else seq
    if not 1 <= seq <= model_cfg.block_size:
        raise ValueError(f"seq={seq} must be in [1, block_size={model_cfg.block_size}]")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}: choose adamw or sgd")
    if micro_steps < 1 or batch_per_rank < 1:
        raise ValueError(f"micro_steps={micro_steps} and batch_per_rank={batch_per_rank} must be positive")
    setup = Setup(system=system, model_cfg=model_cfg, micro_steps=micro_steps, batch_per_rank=batch_per_rank,
                  seq=seq, seed=seed, rank=rank, world=world, ranks_per_node=rpn, param_dtype=param_dtype,
                  reduce_dtype=reduce_dtype or param_dtype, optimizer_name=optimizer, lr=lr,
                  weight_decay=weight_decay, tiers=tuple(tiers) if tiers else None)
    return Trainer(setup)


def train_steps(system: str, model_cfg: GPTConfig, steps: int, micro_steps: int = 1, batch_per_rank: int = 2,
                seq: int | None = None, seed: int = 0, ranks_per_node: int | None = None,
                param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                optimizer: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.01) -> dict:
    """Train the built-in GPT with ``system`` for ``steps`` optimizer steps on the current process group.

    Every rank calls it with the same arguments. ``micro_steps`` micro-batches of ``batch_per_rank`` rows of
    ``seq`` tokens (default: the model's block size) per rank and step; ``ranks_per_node`` (default: all
    ranks on one node) is the inner tier for HSDP, hpZ and tiershard's topology. ``param_dtype`` is the
    gather and compute dtype, ``reduce_dtype`` the gradient reduction dtype (default ``param_dtype``);
    weights and optimizer states stay fp32 masters in every system. ``optimizer`` is ``adamw`` or ``sgd``
    (momentum 0.9), with ``lr`` and ``weight_decay`` on every parameter.

    Returns a dict, equal on every rank: ``losses`` (per step, the mean over micro-steps and ranks),
    ``step_times`` (seconds, the slowest rank's, per step; the first includes warm-up), ``peak_rss_bytes``
    (the largest process high-water mark over ranks, since the process started), ``params``,
    ``tokens_per_step`` and the settings.
    """
    return make_trainer(system, model_cfg, micro_steps, batch_per_rank, seq, seed, ranks_per_node,
                        param_dtype, reduce_dtype, optimizer, lr, weight_decay).train(steps)


def interleaved(rank: int, world: int, systems: list[str], model_cfg: GPTConfig, rounds: int, steps_per_round: int,
                warmup: int = 1, options: dict | None = None) -> dict:
    """Time several systems on the same ranks, alternating them round by round so load drifts hit all alike.

    For ``run_local(interleaved, world, ...)``: builds every system once (``options`` are
    :func:`make_trainer`'s keyword arguments), trains each ``warmup`` steps untimed, then for each round trains
    each system ``steps_per_round`` steps, the order rotated every round. Returns per system the measured
    ``step_times`` (slowest rank's, warm-up excluded), every step's ``losses`` and ``params``.
    """
    options = options or {}
    trainers = {system: make_trainer(system, model_cfg, **options) for system in systems}
    out = {system: dict(step_times=[], losses=[], params=t.num_params) for system, t in trainers.items()}
    for system, trainer in trainers.items():
        if warmup:
            out[system]["losses"] += trainer.train(warmup)["losses"]
    for r in range(rounds):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:
            result = trainers[system].train(steps_per_round)
            out[system]["step_times"] += result["step_times"]
            out[system]["losses"] += result["losses"]
    return out
