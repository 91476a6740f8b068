"""The per-rank training loop of ``tiershard train``: shard the GPT, step, evaluate, report.

Every rank runs ``train(cfg)`` inside an initialised (or initialisable, from torchrun's environment) process
group. Rank 0 prints progress and writes ``metrics.jsonl``, the plot and the model. Reported bytes are cluster
totals: each rank's ``ts.comm_stats()`` for the step, summed over ranks with one all-reduce that also averages
the loss (that all-reduce is bookkeeping and not itself counted).

[Note: resuming reproduces the run] Everything a step depends on is a function of the step or is in the
checkpoint: the batches are drawn from ``(seed, step, micro-step)`` (so the data position *is* the step), the
learning rate is ``lr_at(step)``, and ``ts.save`` keeps the fp32 masters and the optimizer states; each
rank's extra keeps the next step and its torch, CUDA, Python and NumPy RNG states (dropout). A run resumed
from step N with the same config and world therefore repeats the uninterrupted run's losses bit for bit.
``metrics.jsonl`` is cut back to the steps before N, so a step is never logged twice.

[Note: test hooks] Two environment variables make a rank kill itself with SIGKILL, for the tests of
restarts and of interrupted saves. Unset (always, outside tests) they cost a lookup at start-up and an
integer comparison per step:
``TIERSHARD_TEST_KILL_AT=RANK:STEP[:PHASE]`` (rank RANK, before running step STEP, 0-based; or inside that
step's ``forward``, ``backward`` or ``optimizer`` step) and
``TIERSHARD_TEST_KILL_IN_SAVE=RANK:STEP`` (rank RANK, inside ``ts.save`` of ``step_STEP``, after its
checkpoint shards are written and before the folder is renamed into place: while ``ts.save`` pickles the
rank's extra). Both act only on a job's first attempt (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a
restarted job runs through.
"""
from __future__ import annotations

import math
import os
import random
import signal
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import tiershard as ts

from .. import checkpoint
from . import data as data_mod
from .models import GPT, Block, lm_loss
from .progress import MetricsLog, Progress, human_bytes, human_count, plot_run, read_metrics, truncate_metrics
from .config import JobConfig


class SetupError(ValueError):
    """A job this machine or this data cannot run (no GPU for NCCL, token ids beyond the vocabulary)."""


class ResumeError(SetupError):
    """A checkpoint the job cannot resume from (refused by ``ts.load``, not written by this trainer, or past
    the end of the run); the message names the checkpoint and the way out."""


def lr_at(step: int, cfg) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then a cosine from ``lr`` down to ``min_lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - 1 - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def pick_device(backend: str) -> tuple[str, torch.device]:
    """``auto``: NCCL when every local rank can have its own GPU, else gloo on the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend == "auto":
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if enough else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
            raise SetupError(f"backend nccl needs a GPU for each of the {local_world} local ranks, but "
                             f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} GPU(s) are "
                             "visible: use --backend gloo or auto")
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def train(cfg: JobConfig) -> dict:
    """Run the job on this rank; returns the summary (on every rank; only rank 0's has the paths filled)."""
    backend, device = pick_device(cfg.parallel.backend)
    owns_group = not dist.is_initialized()
    if owns_group:
        init_process_group(backend)
    try:
        return _train(cfg, device)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(backend: str) -> None:
    """``dist.init_process_group`` from torchrun's environment, with keys of its own for each restart.

    Under torchrun, ranks keep their rendezvous keys in the agent's store (``TORCHELASTIC_USE_AGENT_STORE``),
    and after a restart (``--max-restarts``) torch 2.13 hands the new ranks the same store, stale keys
    included: the restarted ranks then read the dead ranks' addresses and fail to connect. A prefix per
    ``TORCHELASTIC_RESTART_COUNT`` keeps each attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    timeout = timedelta(minutes=10)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    store = dist.PrefixStore(f"tiershard/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


KILL_PHASES = ("start", "forward", "backward", "optimizer")


def _test_hook(name: str, rank: int, phases: tuple[str, ...] = ("start",)) -> tuple[int, str] | None:
    """(step, phase) of a kill hook aimed at this rank on the first attempt, else None ([Note: test hooks])."""
    value = os.environ.get(name)
    if not value or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    parts = value.split(":")
    try:
        target, step = int(parts[0]), int(parts[1])
        phase = parts[2] if len(parts) == 3 else "start"
        if len(parts) not in (2, 3) or phase not in phases:
            raise ValueError
    except (ValueError, IndexError):
        shape = "RANK:STEP" + (f"[:{'|'.join(phases)}]" if len(phases) > 1 else "")
        raise SetupError(f"{name}={value!r} is not {shape} (a test hook; unset it)") from None
    return (step, phase) if target == rank else None


def _kill_in(phase: str, model, opt) -> None:
    """Test hook: SIGKILL this process inside ``phase`` of the step about to run ([Note: test hooks])."""
    def die(*_) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if phase == "start":
        die()
    elif phase == "forward":             # the last block's: the earlier blocks' gathers are done
        blocks[-1].register_forward_pre_hook(die)
    elif phase == "backward":            # the first block's: its backward comes last, after the others' reductions
        blocks[0].register_full_backward_pre_hook(die)
    else:
        opt.register_step_pre_hook(die)


class _KillWhenPickled:
    """Test hook: SIGKILLs the process that pickles it, as ``ts.save`` does with a rank's extra ([Note: test
    hooks])."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)                     # never reached: SIGKILL to oneself is delivered before kill returns
        raise AssertionError("SIGKILL did not end the process")


def rng_states(device: torch.device) -> dict:
    """Every random generator a step may draw from (dropout, user code), to restore on resume."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def resume_path(cfg: JobConfig) -> Path | None:
    """The checkpoint this run resumes from: None to start fresh (``resume = ""``, or ``"auto"`` before any
    checkpoint exists). Raises ``CheckpointError`` for a ``resume`` path that holds no checkpoint."""
    resume = cfg.train.resume
    if not resume:
        return None
    if resume == "auto":
        return checkpoint.latest(Path(cfg.train.out) / "checkpoints")
    return checkpoint.resolve(resume)


# settings that do not change what a step computes: a resumed run may change them freely
_FREE = {("train", "out"), ("train", "resume"), ("train", "save_every"), ("train", "save"),
         ("train", "log_interval"), ("parallel", "max_restarts"), ("parallel", "backend")}


def config_changes(saved: dict, cfg: JobConfig) -> list[str]:
    """Settings that differ from the run that wrote the checkpoint and change what the steps compute."""
    now = cfg.to_dict()
    changes = []
    for section, values in now.items():
        for key, value in values.items():
            old = saved.get(section, {}).get(key, value)
            if old != value and (section, key) not in _FREE:
                changes.append(f"{section}.{key} {value!r} (was {old!r})")
    return changes


def _train(cfg: JobConfig, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tc = cfg.train
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    topo = ts.Topology.from_env()  # TIERSHARD_TOPOLOGY (the launcher sets it to emulate nodes), else torchrun's
    tokens = data_mod.load(cfg.data)
    tokens.check_fits(cfg.model.block_size)
    if tokens.vocab_size > cfg.model.vocab_size:
        raise SetupError(f"{tokens.description} has token ids up to {tokens.vocab_size - 1}, beyond "
                         f"model.vocab_size={cfg.model.vocab_size}: set model.vocab_size = {tokens.vocab_size}")

    torch.manual_seed(tc.seed)
    model = GPT(cfg.model).to(device)
    n_params = model.num_params()
    param_dtype = torch.bfloat16 if tc.precision == "bf16" else None
    if tc.compile:      # per block, before sharding: torchtitan's order ([Note: hooks outside the graphs])
        for module in model.modules():
            if isinstance(module, Block):
                module.compile(fullgraph=True)
    model = ts.shard(model, cfg.parallel.plan, topo, wrap={Block}, param_dtype=param_dtype)
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95))

    out = Path(tc.out)
    ckpt_root = out / "checkpoints"
    lead = rank == 0
    kill_at = _test_hook("TIERSHARD_TEST_KILL_AT", rank, KILL_PHASES) or (None, None)
    kill_in_save = (_test_hook("TIERSHARD_TEST_KILL_IN_SAVE", rank) or (None,))[0]
    start, resumed, notes = 0, None, []
    source = resume_path(cfg)
    if source is not None:
        start, notes = _resume(source, model, opt, cfg, device)
        resumed = source
    progress = Progress(tc.steps, tc.log_interval, start=start) if lead else None
    if lead and start > 0:
        truncate_metrics(out / "metrics.jsonl", start)
    metrics = MetricsLog(out / "metrics.jsonl", append=start > 0) if lead else None
    if lead:
        progress.message(
            f"training GPT '{cfg.preset}' ({human_count(n_params)} params) on {tokens.description}\n"
            f"  plan {cfg.parallel.plan} over {topo.names} = {topo.sizes}, {world} ranks, {dist.get_backend()}, "
            f"{tc.precision}; global batch {tc.batch * tc.accum * world} x {cfg.model.block_size} tokens\n"
            f"  bytes are per step, summed over all ranks, by tier: "
            f"{topo.names[0]} = inside a node, {topo.names[-1]} = between nodes")
        if resumed is not None:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            progress.message(f"  resumed from {resumed} at step {start}"
                             + (f" (restart {attempt})" if attempt != "0" else "")
                             + "".join(f"\n  changed since the checkpoint: {n}" for n in notes))

    seq, step_tokens = cfg.model.block_size, tc.batch * tc.accum * world * cfg.model.block_size
    val_sets = data_mod.val_batches(tokens.val, seq, tc.batch, rank, world, tc.eval_batches)
    timed_tokens, timed_seconds, last_val = 0, 0.0, None
    try:
        for step in range(start, tc.steps):
            if step == kill_at[0]:
                _kill_in(kill_at[1], model, opt)
            t0 = time.perf_counter()
            lr = lr_at(step, tc)
            for group in opt.param_groups:
                group["lr"] = lr
            ts.reset_comm_stats()
            loss_sum = 0.0
            for micro in range(tc.accum):
                x, y = data_mod.train_batch(tokens.train, seq, tc.batch, rank, world, tc.seed, step, micro)
                boundary = micro == tc.accum - 1
                with nullcontext() if boundary else ts.no_sync(model):
                    loss = lm_loss(model(x.to(device)), y.to(device))
                    (loss / tc.accum).backward()
                loss_sum += loss.item()
            norm = ts.clip_grad_norm_(model, tc.clip if tc.clip > 0 else math.inf)
            opt.step()
            opt.zero_grad(set_to_none=True)
            (loss_total,), step_bytes = _summed_over_ranks([loss_sum / tc.accum], topo, device)
            dt = time.perf_counter() - t0
            if step > start:  # the first step pays for lazy set-up; throughput leaves it out
                timed_tokens, timed_seconds = timed_tokens + step_tokens, timed_seconds + dt
            if lead:
                rec = {"kind": "train", "step": step, "loss": loss_total / world, "lr": lr,
                       "grad_norm": float(norm), "tokens_per_s": step_tokens / dt, "seconds": dt,
                       "bytes": step_bytes}
                metrics.write(rec)
                progress.update(rec)
            if (step + 1) % tc.eval_interval == 0 or step + 1 == tc.steps:
                ts.reset_comm_stats()
                last_val = evaluate(model, val_sets, device)
                _, val_bytes = _summed_over_ranks([], topo, device)
                if lead:
                    metrics.write({"kind": "val", "step": step, "val_loss": last_val, "bytes": val_bytes})
                    progress.message(f"  validation loss {last_val:.4f} at step {step + 1}")
            if tc.save_every and ((step + 1) % tc.save_every == 0 or step + 1 == tc.steps):
                extra = {"step": step + 1, "data": {"seed": tc.seed, "step": step + 1, "micro": 0},
                         "rng": rng_states(device), "config": cfg.to_dict(), "world": world}
                if step + 1 == kill_in_save:
                    extra["test_hook"] = _KillWhenPickled()
                path = ts.save(ckpt_root / f"step_{step + 1}", model, opt, extra=extra)
                if lead:
                    progress.message(f"  checkpoint {path}")
        if start >= tc.steps:       # resumed from the run's last checkpoint: nothing left but the summary
            last_val = evaluate(model, val_sets, device)
        saved = None
        if tc.save:
            state = ts.full_state_dict(model)
            if lead:
                saved = out / "model.pt"
                torch.save({"model": cfg.model.to_dict(), "state_dict": state}, saved)
    finally:
        if metrics is not None:
            metrics.close()
    summary = {"steps": tc.steps, "val_loss": last_val, "params": n_params,
               "tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None}
    if lead:
        records = read_metrics(out / "metrics.jsonl")
        if any(r["kind"] == "train" for r in records):
            summary.update(_finish(records, out, cfg, topo, saved, progress, summary))
        else:                       # resumed at the last step into a folder without the earlier metrics
            progress.message(f"done: the checkpoint is at the last step ({start}), nothing left to train; "
                             f"validation loss {last_val:.3f}" + (f"\n  model   {saved}" if saved else ""))
    dist.barrier()
    return summary


def _resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: JobConfig,
            device: torch.device) -> tuple[int, list[str]]:
    """Load ``path`` into the model and optimizer, restore this rank's RNG states ([Note: resuming reproduces
    the run]); returns the step to start from and the settings changed since the checkpoint."""
    try:
        extra = ts.load(path, model, opt)
    except checkpoint.CheckpointError as err:
        raise ResumeError(f"cannot resume: {err}; resume from an earlier checkpoint with --resume "
                          f"{path.parent}/step_N, or start afresh in another --out") from None
    if not isinstance(extra, dict) or not isinstance(extra.get("step"), int):
        raise ResumeError(f"cannot resume from {path}: it was not written by tiershard train (its extra has no "
                          "step); load it with ts.load in your own loop instead")
    start = extra["step"]
    if start > cfg.train.steps:
        raise ResumeError(f"cannot resume from {path}: it is at step {start}, past train.steps = "
                          f"{cfg.train.steps}; raise --steps or start afresh in another --out")
    set_rng_states(extra["rng"], device)
    notes = config_changes(extra.get("config", {}), cfg)
    if extra.get("world") != dist.get_world_size():
        notes.append(f"world {dist.get_world_size()} (was {extra.get('world')}): the checkpoint is resharded, "
                     "every rank takes rank 0's RNG states")
    return start, notes


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's usual groups: weight decay on the matrices of linear layers, none on biases, norms and embeddings
    (a weight tied to an embedding counts as the embedding). Chosen from the sharded model's own parameters,
    which keep their names, shapes and modules."""
    exempt = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, (torch.nn.Embedding, torch.nn.LayerNorm)) or p.dim() < 2:
                exempt.add(id(p))
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
            {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]


@torch.no_grad()
def _summed_over_ranks(values: list[float], topo: ts.Topology,
                       device: torch.device) -> tuple[list[float], dict[str, int]]:
    """``values`` and this rank's ``ts.comm_stats()`` bytes per tier since the last reset, each summed over all
    ranks in one all-reduce."""
    tiers = ts.comm_stats()["tiers"]
    vec = torch.tensor(values + [float(tiers.get(n, 0)) for n in topo.names], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    summed = vec.tolist()
    return summed[:len(values)], {n: int(b) for n, b in zip(topo.names, summed[len(values):])}


def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean validation loss over every rank's share of the fixed validation batches."""
    model.eval()
    try:
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in batches:
            total[0] += lm_loss(model(x.to(device)), y.to(device)).item()
            total[1] += 1
        dist.all_reduce(total)
        return (total[0] / total[1]).item()
    finally:
        model.train()


def _finish(records: list[dict], out: Path, cfg: JobConfig, topo: ts.Topology, saved: Path | None,
            progress: Progress, summary: dict) -> dict:
    """Plot and print the summary; returns the paths and the final train loss."""
    train = [r for r in records if r["kind"] == "train"]
    tail = train[-min(10, len(train)):]
    final = sum(r["loss"] for r in tail) / len(tail)
    plot = plot_run(records, out / "train.png",
                    title=f"GPT '{cfg.preset}', plan {cfg.parallel.plan}, topology {topo.sizes}")
    per_step = {n: sum(r["bytes"][n] for r in train) / len(train) for n in topo.names}
    elapsed = sum(r["seconds"] for r in train)
    tps = summary["tokens_per_s"]
    lines = [
        f"done: {len(train)} steps in {elapsed:.0f} s; loss {train[0]['loss']:.3f} -> {final:.3f} "
        f"(mean of the last {len(tail)} steps), validation loss {summary['val_loss']:.3f}",
        f"  {human_count(tps) if tps else '-'} tokens/s; bytes per step, all ranks: "
        + ", ".join(f"{n} {human_bytes(b)}" for n, b in per_step.items()),
        f"  metrics {out / 'metrics.jsonl'}",
        f"  plot    {plot}",
    ]
    if saved:
        lines.append(f"  model   {saved}")
    progress.message("\n".join(lines))
    return {"final_loss": final, "first_loss": train[0]["loss"], "plot": str(plot),
            "metrics": str(out / "metrics.jsonl"), "model": str(saved) if saved else None,
            "bytes_per_step": per_step}
