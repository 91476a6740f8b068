"""Memory spikes outside the training step: each rank's peak RSS rise during save, load, full state dict,
gradient clipping and conversion, against what the rank holds; and the blocking time of an asynchronous save.

    python -m tiershard.bench.spikes                       # 4 gloo ranks on the CPU, 2 nodes of 2, ~120M GPT
    python -m tiershard.bench.spikes --layers 4 --embd 256 --heads 8   # a quick run

Each operation runs between two marks: ``gc`` and ``malloc_trim`` return freed memory to the OS, then
``/proc/self/clear_refs`` restarts the peak (VmHWM) at the current RSS (as ``bench.rank`` measures a system's
peak); the rise is VmHWM after the operation minus RSS before it. The goal: a rise of at most the rank's shards
(its masters and optimizer states: what it saves and loads) plus 1.5 times the largest unit's full fp32 bytes.
``full_state_dict(rank0_only=True)`` leaves the whole model on rank 0 by design: its row also gives the rise
beyond the returned tensors. ``convert`` runs in one process (rank 0), with no process group. The loads into a
fresh optimizer create its states (two thirds of the shards under AdamW), once through torch's state-dict helper
and once as ``ts.load`` does. Last, the blocking time of ``ts.save(..., async_save=True)`` (the call, plus how
much longer the next optimizer step takes while it waits for the background copy) against a synchronous save of
the same state (the first asynchronous save, which makes the staging buffers, apart).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import tempfile
import time
from pathlib import Path

MB = 1e6


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: peak RSS is measured on Linux only")


def _mark() -> int:
    """Return freed memory to the OS and restart the peak at the current RSS; that RSS."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _measure(fn):
    """(result, peak RSS rise in bytes, seconds) of ``fn()``, after a mark."""
    base = _mark()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return result, _status("VmHWM") - base, seconds


def _tensor_bytes(obj) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        obj = obj._local_tensor
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):                   # a tied weight, under two names, counts once
        unique = {id(v): v for v in obj.values()}
        return sum(_tensor_bytes(v) for v in unique.values())
    return 0


def rank_job(rank: int, world: int, cfg: dict, folder: str) -> dict:
    """One rank: build, shard and step the model, then measure each operation. Returns this rank's rows."""
    import torch
    import torch.distributed as dist

    import tiershard as ts
    from tiershard.checkpoint import convert
    from tiershard.train.models.gpt import GPT, Block, GPTConfig, lm_loss

    torch.set_num_threads(1)
    model_cfg = GPTConfig(vocab_size=cfg["vocab"], block_size=64, n_layer=cfg["layers"], n_head=cfg["heads"],
                          n_embd=cfg["embd"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(model_cfg)
    topology = ts.Topology((2, world))
    model = ts.shard(model, cfg["plan"], topology, wrap={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg["vocab"], (1, 33), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()

    step()
    opt.step()
    opt.zero_grad()
    engine = model._tiershard
    params = sum(p.numel() for p in model.parameters())
    masters = sum(_tensor_bytes(p) for p in model.parameters())
    shards = masters + sum(_tensor_bytes(s) for s in opt.state.values())
    unit = max(sum(g.S for g in u.groups) * 4 for u in engine.units)
    rows: dict[str, dict] = {}

    def record(name: str, fn, kept: int = 0) -> object:
        dist.barrier()
        result, rise, seconds = _measure(fn)
        rows[name] = {"rise": rise, "seconds": seconds, "kept": kept}
        return result

    root = Path(folder)
    record("save", lambda: ts.save(root / "sync" / "step_1", model, opt))
    record("load", lambda: ts.load(root / "sync" / "step_1", model, opt))

    def load_fresh(torch_init: bool) -> None:
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if torch_init:          # torch's state-dict helpers: one step with every zero gradient set at once
            from torch.distributed.checkpoint.state_dict import _init_optim_state
            _init_optim_state(fresh)
        ts.load(root / "sync" / "step_1", model, fresh)

    record("load, fresh optimizer, torch's state init", lambda: load_fresh(True))
    record("load, fresh optimizer", lambda: load_fresh(False))
    state = record("full_state_dict", lambda: ts.full_state_dict(model, cpu_offload=True, rank0_only=True))
    rows["full_state_dict"]["kept"] = _tensor_bytes(state)
    record("load_full_state_dict (broadcast_from_rank0)",
           lambda: ts.load_full_state_dict(model, state, broadcast_from_rank0=True))
    state = None
    step()
    record("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.zero_grad()
    dist.barrier()
    if rank == 0:
        record_convert = _measure(lambda: convert.to_safetensors(root / "sync", root / "hf",
                                                                   max_shard_size="100MB"))
        rows["convert"] = {"rise": record_convert[1], "seconds": record_convert[2], "kept": 0}
    dist.barrier()

    def step_wait(baseline: float) -> float:
        """A training step; how much longer its ``opt.step()`` took than ``baseline`` (the wait for a copy)."""
        step()
        start = time.perf_counter()
        opt.step()
        seconds = time.perf_counter() - start
        opt.zero_grad()
        return max(0.0, seconds - baseline)

    baseline = min(step_wait(0.0) for _ in range(2))       # opt.step() alone, nothing in flight
    first = record("save (async, first)", lambda: ts.save(root / "timed" / "step_0", model, opt, async_save=True))
    rows["save (async, first)"]["step_wait"] = step_wait(baseline)
    first.result()              # the first one makes the staging buffers and the background group
    record("save (sync, timed)", lambda: ts.save(root / "timed" / "step_1", model, opt))
    handle = record("save (async, blocking)", lambda: ts.save(root / "timed" / "step_2", model, opt,
                                                              async_save=True))
    rows["save (async, blocking)"]["step_wait"] = step_wait(baseline)
    start = time.perf_counter()
    handle.result()
    rows["save (async, blocking)"]["write_seconds"] = time.perf_counter() - start
    dist.barrier()
    largest = max(p.numel() for p in model.parameters()) * 4
    return {"rank": rank, "params": params, "shards": shards, "unit": unit, "largest_tensor": largest, "rows": rows}


def table(results: list[dict]) -> str:
    """A markdown table: one row per operation, each rank's rise and the goal (shards + 1.5 x largest unit)."""
    r0 = results[0]
    lines = [f"{r0['params'] / 1e6:.1f}M parameters on {len(results)} ranks; per rank: shards "
             + ", ".join(f"{r['shards'] / MB:.0f}" for r in results) + f" MB, largest unit {r0['unit'] / MB:.1f} MB "
             f"(fp32 full), largest tensor {r0['largest_tensor'] / MB:.1f} MB", "",
             "| operation | peak RSS rise per rank (MB) | goal per rank (MB) | within | seconds (rank 0) |",
             "| --- | --- | ---: | --- | ---: |"]
    for name in r0["rows"]:
        if name.startswith("save ("):
            continue
        ranks = [r for r in results if name in r["rows"]]
        rises = [r["rows"][name]["rise"] - r["rows"][name]["kept"] for r in ranks]
        goals = [r["shards"] + 1.5 * r["unit"] for r in ranks]
        label = name + (" (beyond the returned tensors)" if any(r["rows"][name]["kept"] for r in ranks) else "")
        lines.append(f"| {label} | {' / '.join(f'{x / MB:.0f}' for x in rises)} | "
                     f"{' / '.join(f'{g / MB:.0f}' for g in goals)} | "
                     f"{'yes' if all(x <= g for x, g in zip(rises, goals)) else 'no'} | "
                     f"{r0['rows'][name]['seconds']:.2f} |")
    if "save (async, blocking)" in r0["rows"]:
        sync = max(r["rows"]["save (sync, timed)"]["seconds"] for r in results)

        def blocked(name: str) -> tuple[float, float, float]:
            """The slowest rank's (call + the next step's wait, call, wait) in seconds."""
            return max((r["rows"][name]["seconds"] + r["rows"][name]["step_wait"], r["rows"][name]["seconds"],
                        r["rows"][name]["step_wait"]) for r in results)

        def rises(name: str) -> str:
            return " / ".join(f"{r['rows'][name]['rise'] / MB:.0f}" for r in results)

        later, first = blocked("save (async, blocking)"), blocked("save (async, first)")
        lines += ["", f"save blocking time (slowest rank): synchronous {sync:.2f} s; asynchronous {later[0]:.2f} s "
                  f"({later[0] / sync:.2f}x: the call {later[1]:.2f} s, the next step's wait for the copy "
                  f"{later[2]:.2f} s; the write then took "
                  f"{r0['rows']['save (async, blocking)']['write_seconds']:.2f} s more on rank 0); the first "
                  f"asynchronous save, which makes the staging buffers, {first[0]:.2f} s ({first[0] / sync:.2f}x: "
                  f"call {first[1]:.2f} s, wait {first[2]:.2f} s). Peak RSS rise per rank during the call: first "
                  f"{rises('save (async, first)')} MB, later {rises('save (async, blocking)')} MB (the staging copy "
                  "is made in the background and kept for later saves)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiershard.bench.spikes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--plan", default="IIG")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", metavar="FILE", help="also write every rank's measurements here")
    args = parser.parse_args(argv)
    from tiershard.cluster.local import run_local

    cfg = {"layers": args.layers, "embd": args.embd, "heads": args.heads, "vocab": args.vocab, "plan": args.plan}
    with tempfile.TemporaryDirectory(prefix="tiershard-spikes-") as folder:
        results = run_local(rank_job, args.world, cfg, folder, timeout=3600)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
