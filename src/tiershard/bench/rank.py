"""The per-rank job of ``tiershard bench``: every rank builds the systems, alternates them round by round and
records step times, losses, peak memory, NIC counters and ``ts.comm_stats()`` around each system's steps.

:func:`~tiershard.bench.runner.run_bench` runs :func:`rank_job` on loopback ranks (``run_local``) or, inside the
emulated cluster's nodes, as ``python -m tiershard.bench SPEC.json`` (:func:`_main`), which writes each rank's
result beside the spec.
"""
from __future__ import annotations

import ctypes
import gc
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..cluster.counters import read_node_uplink
from .config import COMPUTE, PARAM_BYTES, REDUCE_BYTES, RESULT_PREFIX

if TYPE_CHECKING:
    from ..train.models.gpt import GPTConfig


def _read_nic() -> dict[str, int]:
    """This node's NIC counters (the rank runs inside the node's namespace, which shows that node's /sys)."""
    from ..cluster.netns import IFNAME

    stats = Path(f"/sys/class/net/{IFNAME}/statistics")
    return {"tx": int((stats / "tx_bytes").read_text()), "rx": int((stats / "rx_bytes").read_text())}


def _status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _restart_peak() -> bool:
    """Free what can be freed, return it to the OS and restart the peak-RSS mark at the current RSS; whether the
    mark could be restarted. Before the measured warm-up step the baseline is kept: that step's peak is then what
    the system holds plus the step's own, without what its build left in freed blocks."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")     # Linux: reset VmHWM to the current RSS
    except OSError:
        return False
    return True


def _settle_memory() -> int | None:
    """``_restart_peak``, then the resident bytes after it (None where the peak mark cannot be restarted).

    Peak memory per system is then the peak RSS while it builds and trains minus this, so systems built
    earlier in the same process (still resident, their freed pages trimmed) do not count.
    """
    return _status_bytes("VmRSS") if _restart_peak() else None


class ComputeOnly:
    """Forward and backward of the unsharded bf16 model on this rank's rows: no communication, no optimizer.

    The compute part of the floor and the cost model's compute rate, measured in the same rounds (so under the
    same load) as the systems.
    """

    def __init__(self, model_cfg: GPTConfig, micro_steps: int, batch_per_rank: int, seq: int, seed: int, rank: int,
                 world: int):
        import torch

        from ..train.models.gpt import GPT

        torch.manual_seed(seed)
        self.model = GPT(model_cfg).to(torch.bfloat16)
        self.cfg, self.micro_steps, self.rows, self.seq, self.seed = model_cfg, micro_steps, batch_per_rank, seq, seed
        self.rank, self.world, self.step = rank, world, 0

    def train(self, steps: int) -> dict:
        import torch
        import torch.distributed as dist

        from ..train.models.gpt import lm_loss
        from .peers import step_batch

        lo, hi = self.rank * self.rows, (self.rank + 1) * self.rows
        times = torch.zeros(steps, dtype=torch.float64)
        for i in range(steps):
            tokens = step_batch(self.seed, self.step, self.micro_steps, self.world * self.rows, self.seq,
                                self.cfg.vocab_size)[:, lo:hi]
            dist.barrier()
            start = time.perf_counter()
            for m in range(self.micro_steps):
                loss = lm_loss(self.model(tokens[m, :, :-1]), tokens[m, :, 1:])
                (loss / self.micro_steps).backward()
            times[i] = time.perf_counter() - start
            self.model.zero_grad(set_to_none=True)
            self.step += 1
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return {"step_times": times.tolist(), "losses": []}


def _warm_paths(runners: Sequence[str], ranks_per_node: int) -> None:
    """Build and step a tiny model once per family of systems (tiershard, FSDP2, DeepSpeed) and drop it, so the
    first system measured does not carry the memory of lazy imports and first-use caches."""
    import torch

    from ..train.models.gpt import gpt_config
    from .peers import make_trainer

    families = {"tiershard": "tiershard:GGG", "fsdp2": "fsdp2", "deepspeed": "deepspeed-zero3"}
    for family, example in families.items():
        if any(r.startswith(family) for r in runners):
            trainer = make_trainer(example, gpt_config("tiny"), batch_per_rank=1, seq=8,
                                   ranks_per_node=ranks_per_node, param_dtype=torch.bfloat16)
            trainer.train(1)
            del trainer


def _watch_memory(trainer) -> dict:
    """For one of our plans: ``ts.memory_stats`` just before every optimizer step (gradients present, the peaks of
    gathered weights over that step) with the optimizer states just after it, the largest fp32 gradient
    accumulators seen at the start of a micro-step (those of the micro-steps before it), and the cost model's
    exact breakdown (``cost.memory.breakdown``, ``accumulator_bytes``) for the same moments; the returned dict
    fills as the warm-up steps run."""
    import tiershard as ts

    from ..cost.memory import accumulator_bytes, breakdown, engine_layouts, unit_gradients

    model, optimizer = trainer.runner.model, trainer.runner.optimizer
    engine = model._tiershard
    layouts = engine_layouts(engine)
    args = (engine.placement, layouts, engine.topology.rank, PARAM_BYTES)
    between = trainer.setup.micro_steps > 1
    seen: dict = {"states": breakdown(*args, 2, engine.prefetch, trainer.setup.micro_steps), "accumulators": 0,
                  "predicted_accumulators": accumulator_bytes(engine.placement, layouts) if between else 0,
                  "units": unit_gradients(engine.placement, layouts, engine.topology.rank, trainer.setup.micro_steps,
                                          PARAM_BYTES, REDUCE_BYTES)}

    def before_step(opt, a, kw):
        seen["measured"] = ts.memory_stats(model, optimizer, reset_peaks=True)
        seen["predicted"] = breakdown(*args, 2 if optimizer.state else 0, engine.prefetch, trainer.setup.micro_steps)

    def after_step(opt, a, kw):
        seen["optimizer_after_step"] = ts.memory_stats(model, optimizer)["optimizer_states"]

    def before_forward(module, inputs):
        held = sum(g.grad_acc.untyped_storage().nbytes() for g in engine.groups() if g.grad_acc is not None)
        seen["accumulators"] = max(seen["accumulators"], held)
    seen["handles"] = [optimizer.register_step_pre_hook(before_step), optimizer.register_step_post_hook(after_step),
                       model.register_forward_pre_hook(before_forward)]
    return seen


def rank_job(rank: int, world: int, spec: dict) -> dict:
    """Every rank: build the systems one by one (peak RSS of the build, and of the last warm-up step from a
    trimmed start), then alternate them round by round, reading NIC counters (one rank per node) and
    ``ts.comm_stats()`` around each system's steps.

    For ``run_local(rank_job, world, spec)`` or under a launcher (``python -m tiershard.bench SPEC``). Returns this
    rank's measurements; step times and losses are already reduced over ranks (equal on every rank).
    """
    import torch
    import torch.distributed as dist

    import tiershard as ts

    from ..cost import traffic
    from ..train.models.gpt import GPTConfig
    from .peers import make_trainer

    torch.set_num_threads(1)
    model_cfg = GPTConfig(**spec["model"])
    rpn, accum, steps = spec["ranks_per_node"], spec["accum"], spec["steps_per_round"]
    reads_nic = bool(spec["nic"]) and rank % spec.get("ranks_per_group", rpn) == 0     # one per namespace
    reads_uplink = reads_nic and "ranks_per_group" in spec and rank % rpn == 0         # three tiers: one per node
    options = dict(micro_steps=accum, batch_per_rank=spec["batch_per_rank"], seq=spec["seq"], seed=spec["seed"],
                   ranks_per_node=rpn, param_dtype=torch.bfloat16, tiers=spec.get("tiers"))
    trainers: dict[str, object] = {}
    out: dict[str, dict] = {}
    _warm_paths([runner for _, runner in spec["systems"]], rpn)
    for label, runner in spec["systems"]:
        base = _settle_memory()
        if runner == COMPUTE:
            trainer = ComputeOnly(model_cfg, accum, spec["batch_per_rank"], spec["seq"], spec["seed"], rank, world)
        else:
            trainer = make_trainer(runner, model_cfg, **options)
        memory = _watch_memory(trainer) if runner.startswith("tiershard:") else None
        built = _status_bytes("VmHWM")
        losses = trainer.train(spec["warmup"] - 1)["losses"] if spec["warmup"] > 1 else []
        _restart_peak()
        losses += trainer.train(1)["losses"] if spec["warmup"] > 0 else []
        peak = _status_bytes("VmHWM")
        if memory is not None:
            for handle in memory.pop("handles"):
                handle.remove()
        trainers[label] = trainer
        out[label] = {"runner": runner, "losses": list(losses), "step_times": [], "rounds": [],
                      "peak_bytes": None if base is None or peak is None else peak - base,
                      "build_peak_bytes": None if base is None or built is None else built - base,
                      "params": getattr(trainer, "num_params", None), "memory": memory}
    labels = [label for label, _ in spec["systems"]]
    if spec["warmup"] > 0:
        # The builds after a system's trimmed the heap (_restart_peak), handing back to the OS the freed memory its
        # steps reuse; one more untimed step each faults it in again, or every system's first timed step pays for
        # it (docs/bench.md, "The first timed step").
        for label in labels:
            out[label]["losses"] += trainers[label].train(1)["losses"]
    for r in range(spec["rounds"]):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            dist.barrier()
            before = _read_nic() if reads_nic else None
            up_before = read_node_uplink() if reads_uplink else None
            if spec["nic"] and "ranks_per_group" in spec:
                dist.barrier()                  # reading the uplink takes a subprocess: nobody sends before it
            ts.reset_comm_stats()
            result = trainers[label].train(steps)
            stats = ts.comm_stats()
            dist.barrier()
            after = _read_nic() if reads_nic else None
            up_after = read_node_uplink() if reads_uplink else None
            nic = None if before is None else {k: after[k] - before[k] for k in before}
            uplink = None if up_before is None else {k: up_after[k] - up_before[k] for k in up_before}
            out[label]["step_times"] += result["step_times"]
            out[label]["losses"] += result["losses"]
            out[label]["rounds"].append({"steps": steps, "tiers": stats["tiers"], "ops": stats["ops"], "nic": nic,
                                            "uplink": uplink, "seconds": stats["seconds"]})
    for label, runner in spec["systems"]:
        if runner.startswith("tiershard:"):
            engine = trainers[label].runner.model._tiershard
            colls = traffic.step_collectives(engine.placement, traffic.engine_shapes(engine), PARAM_BYTES,
                                             REDUCE_BYTES, accum)
            out[label]["closed_form"] = traffic.total_traffic(colls, engine.topology)
            out[label]["plan"] = str(engine.placement.plan)
    trainers.clear()
    return {"rank": rank, "node": rank // rpn, "systems": out}


def _main(argv: Sequence[str] | None = None) -> int:
    """The per-rank entry under a launcher: ``python -m tiershard.bench SPEC.json``; writes rank<r>.json beside it."""
    import torch.distributed as dist

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m tiershard.bench SPEC.json (the per-rank job of `tiershard bench`)", file=sys.stderr)
        return 2
    spec_path = Path(argv[0])
    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        result = rank_job(rank, world, spec)
        tmp = spec_path.parent / f".{RESULT_PREFIX}{rank}.json"
        tmp.write_text(json.dumps(result))
        tmp.rename(spec_path.parent / f"{RESULT_PREFIX}{rank}.json")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
