"""``tiershard train``: train the built-in GPT with a sharding plan, on ranks it launches or under torchrun.

Launched plainly, it validates everything it can (config keys, topology, plan, data) *before* starting ranks,
writes the resolved config to the output folder and starts ``--nproc`` ranks through
``torch.distributed.run`` (the machinery behind ``torchrun``), each running this same command on that file.
Under an outside ``torchrun`` (RANK, WORLD_SIZE and LOCAL_RANK set) it trains in the current process.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Iterator

from . import CliError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# flag, section, key, type, help (the flag reference in docs/training.md follows this table)
FLAGS: list[tuple[str, str, str, type, str]] = [
    ("--model", "model", "preset", str, "model preset: tiny, small (default), medium"),
    ("--n-layer", "model", "n_layer", int, "transformer blocks"),
    ("--n-head", "model", "n_head", int, "attention heads"),
    ("--n-embd", "model", "n_embd", int, "embedding width"),
    ("--block-size", "model", "block_size", int, "sequence length"),
    ("--data", "data", "source", str, "'stdlib', a text file, a .bin token file or a folder with train.bin/val.bin"),
    ("--max-bytes", "data", "max_bytes", int, "cap on the bytes read from the stdlib or a text file"),
    ("--steps", "train", "steps", int, "optimizer steps"),
    ("--batch", "train", "batch", int, "sequences per rank per micro-step"),
    ("--accum", "train", "accum", int, "micro-steps per optimizer step (gradient accumulation)"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--min-lr", "train", "min_lr", float, "learning rate at the end of the cosine"),
    ("--warmup", "train", "warmup", int, "linear warmup steps"),
    ("--clip", "train", "clip", float, "max global gradient norm, 0 for none"),
    ("--precision", "train", "precision", str, "fp32 or bf16 (bf16 working weights, fp32 masters)"),
    ("--seed", "train", "seed", int, "seed of the initial weights and of the batches"),
    ("--log-interval", "train", "log_interval", int, "steps between progress lines when not on a terminal"),
    ("--eval-interval", "train", "eval_interval", int, "steps between validation losses"),
    ("--out", "train", "out", str, "output folder (metrics.jsonl, train.png, model.pt, config.toml)"),
    ("--save", "train", "save", bool, "write the trained weights to model.pt"),
    ("--save-every", "train", "save_every", int, "steps between checkpoints in OUT/checkpoints (0: none)"),
    ("--resume", "train", "resume", str, "auto (the latest checkpoint in OUT/checkpoints, if any) or a checkpoint"),
    ("--compile", "train", "compile", bool,
     "torch.compile each block (fullgraph, inductor) before sharding; the first step pays the compile"),
    ("--plan", "parallel", "plan", str, "sharding plan: a preset (zero3, hsdp, ...), a code like IIG, or auto"),
    ("--nproc", "parallel", "nproc", int, "ranks to launch on this machine"),
    ("--ranks-per-node", "parallel", "ranks_per_node", int, "ranks per (emulated) node"),
    ("--backend", "parallel", "backend", str, "auto (nccl with a GPU per rank, else gloo), gloo or nccl"),
    ("--max-restarts", "parallel", "max_restarts", int,
     "restarts after a rank fails, each resuming from the last checkpoint (needs --save-every, --resume auto)"),
    ("--allow-lossy", "parallel", "allow_lossy", bool,
     "let --plan auto pick a quantized plan (qwz, qgz), which changes the training numerics; default: exact only"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="train the built-in GPT with a sharding plan",
        description="Train the built-in GPT on an embedded corpus across (emulated) nodes. Flags override the "
                    "TOML config; without --config the defaults are those of configs/default.toml.")
    p.add_argument("--config", metavar="TOML", help="a job config such as configs/default.toml")
    for flag, section, key, kind, text in FLAGS:
        dest = f"{section}.{key}"
        if kind is bool:
            p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, dest=dest, type=kind, default=None, metavar=key.upper(), help=text)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if under_torchrun():
        return _run_rank(cfg)
    from ..topology import Topology

    topo = Topology((cfg.parallel.ranks_per_node, cfg.parallel.nproc))
    cfg = check(cfg, topo)
    return _launch(cfg, topo)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def load_config(args: argparse.Namespace):
    """The TOML file (if any) with the flags laid over it, as a validated JobConfig."""
    from ..train.config import JobConfig, merge

    raw: dict[str, Any] = {}
    where = "the flags"
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise CliError(f"config file {path} does not exist")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise CliError(f"{path} is not valid TOML: {err}") from None
        where = str(path)
    overrides: dict[str, dict[str, Any]] = {}
    for _, section, key, _, _ in FLAGS:
        value = getattr(args, f"{section}.{key}", None)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    try:
        return JobConfig.from_dict(merge(raw, overrides), where)
    except ValueError as err:
        raise CliError(str(err)) from None


def check(cfg, topo):
    """Everything that can fail before ranks start: the plan against the topology, the data, the vocabulary.

    Returns the config with ``plan = "auto"`` replaced by the planner's choice.
    """
    from dataclasses import replace

    from ..train import data as data_mod
    from ..plan import Plan, PlanError

    if cfg.parallel.backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < topo.world_size:
            raise CliError(f"--backend nccl needs a GPU for each of the {topo.world_size} ranks, but {gpus} are "
                           "visible: use --backend gloo or auto")
    if cfg.train.resume not in ("", "auto"):
        from ..checkpoint import CheckpointError, resolve

        try:
            resolve(cfg.train.resume)
        except CheckpointError as err:
            raise CliError(f"--resume: {err}") from None
    if cfg.parallel.plan == "auto":
        plan, reason = _auto_plan(cfg, topo)
        cfg = replace(cfg, parallel=replace(cfg.parallel, plan=plan))
        print(f"plan auto: the planner chose {cfg.parallel.plan} for {topo.sizes} ({reason})", flush=True)
    try:
        placement = Plan.parse(cfg.parallel.plan).resolve(topo)
    except PlanError as err:
        raise CliError(f"plan {cfg.parallel.plan!r} does not fit topology {topo.sizes}: {err}") from None
    if placement.plan.lossy:
        print(f"plan {cfg.parallel.plan} is {placement.quality} (quantized: the loss differs from an exact plan's)",
              flush=True)
    try:
        tokens = data_mod.load(cfg.data)
        tokens.check_fits(cfg.model.block_size)
    except data_mod.DataError as err:
        raise CliError(str(err)) from None
    if tokens.vocab_size > cfg.model.vocab_size:
        raise CliError(f"{tokens.description} has token ids up to {tokens.vocab_size - 1}: "
                       f"set model.vocab_size = {tokens.vocab_size} in the config")
    return cfg


def _auto_plan(cfg, topo) -> tuple[str, str]:
    """The planner's pick for this machine and why: its memory per rank, links of 10 GB/s inside a node, 1 GB/s
    between; exact plans only unless ``parallel.allow_lossy``.

    The bandwidths are an assumption (emulated nodes share one machine); give --plan to choose yourself.
    """
    try:
        cost = importlib.import_module("tiershard.cost")
        auto_estimate, Job = cost.auto_estimate, cost.Job
    except (ImportError, AttributeError):
        raise CliError("--plan auto needs the planner (tiershard.cost.auto_plan), which this install lacks: "
                       "give a plan such as IIG or zero3") from None
    import torch

    from ..cost.presets import this_machine
    from ..train.models import GPT

    cluster = this_machine(topo)
    width = 2 if cfg.train.precision == "bf16" else 4
    job = Job(micro_batch=cfg.train.batch, seq=cfg.model.block_size, accum=cfg.train.accum,
              param_bytes=width, reduce_bytes=width, recompute=False)
    with torch.device("meta"):
        model = GPT(cfg.model)
    try:
        best = auto_estimate(model, cluster, job, allow_lossy=cfg.parallel.allow_lossy)
        return str(best.plan), best.reason
    except ValueError as err:  # NoPlanFits and friends
        raise CliError(f"--plan auto: {err}") from None


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the ranks to inherit, and put the old values back."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch(cfg, topo) -> int:
    from ..train.config import to_toml

    out = Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = (out / "config.toml").resolve()
    resolved.write_text("# the resolved config of this run: `tiershard train --config` on it repeats the run\n"
                        + to_toml(cfg.to_dict()), encoding="utf-8")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # static rendezvous on a free port: the c10d one spends seconds in event logging on every state change
    launch_args = torchrun.get_args_parser().parse_args([
        "--nnodes", "1", "--nproc-per-node", str(topo.world_size), "--max-restarts", str(cfg.parallel.max_restarts),
        "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        "--module", "tiershard.cli", "train", "--config", str(resolved)])
    env = {"TIERSHARD_TOPOLOGY": ",".join(map(str, topo.sizes)), "TIERSHARD_LAUNCHED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        with _env(**env):
            torchrun.run(launch_args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        code = failure.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        restarts = cfg.parallel.max_restarts
        after = f" (after {restarts} restart{'s' if restarts > 1 else ''})" if restarts else ""
        raise CliError(f"rank {failure.local_rank} {how}{after}; its error, if any, is printed above") from None
    except KeyboardInterrupt:
        print("tiershard train: interrupted", file=sys.stderr)
        return 130
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stopped(err: BaseException) -> int:
    """A collective failed on this rank (a peer died, or skipped it): one line, not a traceback per rank; the
    launcher then names the rank that failed first and restarts or ends the job."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(f"tiershard train: rank {os.environ.get('RANK', '?')} stopped: {first}", file=sys.stderr, flush=True)
    return 3


def _run_rank(cfg) -> int:
    """One rank under torchrun: user errors the launcher could not catch become one line from rank 0."""
    from ..train import data as data_mod
    from ..train import trainer
    from ..checkpoint import CheckpointError
    from ..comm.failure import CollectiveError, comm_failure
    from ..plan import PlanError
    from ..topology import TopologyError

    try:
        trainer.train(cfg)
    except (PlanError, TopologyError, data_mod.DataError, trainer.SetupError, CheckpointError) as err:
        if isinstance(err, CheckpointError) and comm_failure(err.__cause__) is not None:
            return _stopped(err)
        if os.environ.get("RANK") == "0":
            raise CliError(str(err)) from None
        return 2
    except Exception as err:
        if isinstance(err, CollectiveError) or comm_failure(err) is not None:
            return _stopped(err)
        raise
    if os.environ.get("TIERSHARD_LAUNCHED") == "1":
        # Ranks this command started have written and closed everything; skipping the interpreter's teardown
        # of torch saves seconds per run (the launcher waits for every rank to exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
