"""Tensor parallelism under the tiers: a model parallelised with torch's ``parallelize_module`` inside the node,
sharded by tiershard over the rest, against FSDP2 + TP on the same mesh and against one process.

One launch of 8 gloo ranks (2 emulated nodes x 2 data-parallel positions x 2 TP ranks, ``Topology((2, 4),
tp=2)``) runs everything, so the suite pays for one start. ``TPNet`` (tests/_models.py) has a vocab-parallel
embedding into a sequence-sharded residual stream, sequence-parallel norms (replicated weights whose gradients are
``Partial`` over TP), column- and row-parallel MLPs and a column-parallel head, with odd sizes: TP shards of 19/18
and 18 rows (9 at TP 4) that the tiers then cut unevenly. Oracles:
- SGD with momentum, nine placements that put each level of each state beside each level of the others, and
  the ZeRO++ options (hpz, cc, zero++'s qwz + qgz), with ``ts.no_sync`` accumulation: each tensor within 1e-5
  relative of one process on the concatenated batch (zero++ excepted); the exact options within 1e-6 of their
  plan without them; zero++'s update (weights int8, gradients int8 and int4) within 20% of one process's
  (relative L2; it measures 10%);
- AdamW with parameter groups (no decay on norms and biases), ``ts.no_sync`` accumulation and clipping through
  ``torch.nn.utils.clip_grad_norm_`` (the global norm across TP and the tiers): every step's clip norm within 1e-6
  of FSDP2 + TP's, the parameters within 1e-5 (relative L2);
- checkpoints across TP degrees: ``ts.save`` at TP 2, ``ts.load`` without TP and at TP 4 gives the saved values
  bit for bit, and one more AdamW step from the loaded state (its moments too) equals the TP 2 run's; saved without
  TP it loads back at TP 2; ``ts.full_state_dict`` / ``ts.load_full_state_dict`` carry the same values across;
- three tiers outside TP (``Topology((1, 2, 4), tp=2)``: TP over the GCD pair, the tiers node and world),
  placements named by tier with hpZ across two of them: each tensor within 1e-5 relative of one process;
- the errors for a TP model that does not fit: TP over other ranks than the topology's, a DTensor parameter
  under a topology without ``tp=``, a ``Partial`` parameter: one sentence each, naming the fix;
- ``examples/tp_tiers.py`` runs on the same ranks and its result equals its FSDP2 + TP twin's.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from _dist import run_ranks
from _models import TPBlock, TPNet, batches, loss_fn, tp_plan

WORLD, TP, SIZES = 8, 2, (2, 4)        # tiers over the 4 data-parallel positions: 2 nodes of 2
DP = WORLD // TP
STEPS, MICRO, PER = 2, 2, 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tp_tiers.py"

# Each level of p, g and os beside each level of the others once (os = p + g mod 3: nine placements, a Latin
# square), before the options compared with them. The other 18 placements run the same per-state code on the same
# groups; tests/runtime/test_engine_parity.py sweeps all 27 without TP.
LATIN = ["NNN", "NII", "NGG", "INI", "IIG", "IGN", "GNG", "GIN", "GGI"]
OPTIONS = {"GGI+hpz": "GGI", "IIG+cc": "IIG", "zero++": None}     # option -> the exact plan it must equal
THREE_TIERS = ["p=pair,g=node,os=world", "p=world,g=world,os=world+hpz=node"]


def _lossy(code: str) -> bool:
    return code in OPTIONS and OPTIONS[code] is None


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(model):
    """Two parameter groups by name: no weight decay on norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2)


def _data(seed: int = 1):
    return batches(seed, STEPS, MICRO, DP, PER)


def reference() -> dict:
    """One process, SGD, the whole batch."""
    torch.manual_seed(0)
    model = TPNet()
    opt = _sgd(model.parameters())
    for step in _data():
        for tokens in step:
            loss_fn(model, tokens, MICRO).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _train(model, opt, rank: int, data, clip: bool = False, no_sync=None) -> list[float]:
    """STEPS optimizer steps of MICRO micro-steps on this rank's data-parallel slice; the clip norms."""
    import contextlib

    lo = rank // TP * PER               # both ranks of a TP group read their position's rows
    norms = []
    for step in data:
        for i, tokens in enumerate(step):
            with no_sync(model) if no_sync and i < MICRO - 1 else contextlib.nullcontext():
                loss_fn(model, tokens[lo:lo + PER], MICRO).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())
        opt.step()
        opt.zero_grad()
    return norms


def _tiershard(plan: str, topo, parallel: bool = True, seed: int = 0):
    import tiershard as ts
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = TPNet()
    if parallel:
        parallelize_module(model, topo.tp_mesh, tp_plan(model))
    return ts.shard(model, plan, topo, wrap={TPBlock})


def _fsdp2_tp(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = TPNet()
    parallelize_module(model, mesh["tp"], tp_plan(model))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _full(model) -> dict:
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _rel(a: dict, b: dict) -> float:
    """The largest difference over any tensor, relative to its largest value."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def _rel_l2(a: dict, b: dict) -> float:
    """The L2 norm of the difference over all tensors relative to ``b``'s: AdamW turns round-off in near-zero
    gradients into lr-sized steps, so a per-tensor bound would test round-off (tests/runtime/test_engine_parity.py)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return (sum(((a[k] - b[k]) ** 2).sum() for k in b) / sum((b[k] ** 2).sum() for k in b)).sqrt().item()


def _example():
    spec = importlib.util.spec_from_file_location("tp_tiers", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tp_tiers"] = module
    spec.loader.exec_module(module)
    return module


def tp_sweep(rank: int, world: int, ref: dict, codes: list[str], folder: str) -> dict:
    import tiershard as ts
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    topo = ts.Topology(SIZES, tp=TP)
    topo.init_process_groups("cpu")
    # every placement, SGD, against one process
    states = {}
    for code in codes:
        model = _tiershard(code, topo)
        _train(model, _sgd(model.parameters()), rank, _data(), no_sync=ts.no_sync)
        states[code] = ts.full_state_dict(model)
        out[code] = {"vs_one": _rel(states[code], ref)}
        if OPTIONS.get(code):
            out[code]["vs_exact"] = _rel(states[code], states[OPTIONS[code]])
        elif code in OPTIONS:            # the error of the update, whose weights and gradients went through codecs
            torch.manual_seed(0)
            init = TPNet().state_dict()
            out[code]["vs_exact"] = _rel_l2({k: states[code][k] - init[k] for k in init},
                                            {k: ref[k] - init[k] for k in init})
        del model

    # AdamW with groups, no_sync and clipping, against FSDP2 + TP on the same mesh
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    fsdp = _fsdp2_tp(mesh)
    fsdp_opt = _adamw(fsdp)
    fsdp_norms = _train(fsdp, fsdp_opt, rank, _data(), clip=True)
    fsdp_state = _full(fsdp)
    kept = _tiershard("IIG", topo)
    kept_opt = _adamw(kept)
    norms = _train(kept, kept_opt, rank, _data(), clip=True, no_sync=ts.no_sync)
    out["adamw"] = {"vs_fsdp2": _rel_l2(ts.full_state_dict(kept), fsdp_state),
                    "norms": max(abs(a - b) / b for a, b in zip(norms, fsdp_norms))}

    # checkpoints across TP degrees: save at TP 2; load without TP and at TP 4; one more step from each
    saved = ts.full_state_dict(kept)
    ts.save(f"{folder}/tp2", kept, kept_opt)
    more = _data(seed=7)[:1]
    _train(kept, kept_opt, rank, more)
    after = ts.full_state_dict(kept)
    plain, tp4 = ts.Topology((4, 8)), ts.Topology((2,), tp=4)
    tp4.init_process_groups("cpu")

    def loads(code, topology, parallel, path, reference_after=None):
        model = _tiershard(code, topology, parallel=parallel, seed=5)
        opt = _adamw(model)
        ts.load(path, model, opt)
        loaded = ts.full_state_dict(model)
        exact = all(torch.equal(loaded[k], saved[k]) for k in saved)
        if reference_after is None:
            return exact, model, opt
        _train_global(model, opt, rank, topology, more)     # the same global batch, cut by this layout
        return exact, _rel(ts.full_state_dict(model), reference_after)

    out["load_no_tp"] = loads("GGG", plain, False, f"{folder}/tp2", after)
    out["load_tp4"] = loads("GGG", tp4, True, f"{folder}/tp2", after)
    # and back: saved without TP, loaded at TP 2 (the values saved at TP 2, through a layout without TP)
    _, model, opt = loads("NGG", plain, False, f"{folder}/tp2")
    ts.save(f"{folder}/plain", model, opt)
    out["back_to_tp2"] = loads("GGG", topo, True, f"{folder}/plain")[0]
    # full state dicts across TP degrees
    other = _tiershard("NGG", tp4, seed=9)
    ts.load_full_state_dict(other, saved)
    out["full_state_tp4"] = all(torch.equal(v, saved[k]) for k, v in ts.full_state_dict(other).items())

    # three tiers outside TP (Frontier's layout: TP over the GCD pair, the pair tier left with one position),
    # against one process
    three = ts.Topology((1, 2, 4), tp=TP)
    three.init_process_groups("cpu")
    for code in THREE_TIERS:
        model = _tiershard(code, three)
        _train(model, _sgd(model.parameters()), rank, _data(), no_sync=ts.no_sync)
        out[f"three/{code}"] = _rel(ts.full_state_dict(model), ref)

    out["errors"] = _errors(topo, plain)

    # the example, beside its FSDP2 + TP twin
    example = _example()
    out["example"] = (example.train(topo, steps=3), example.train(topo, steps=3, fsdp2_mesh=mesh))
    return out


def _errors(topo, plain) -> list[str]:
    """What ``ts.shard`` says to a TP model that does not fit the topology, or to a placement it does not take."""
    import tiershard as ts
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.parallel import parallelize_module

    def message(model, topology):
        try:
            ts.shard(model, "IIG", topology, wrap={TPBlock})
        except ValueError as e:
            return str(e)
        return "no error"

    torch.manual_seed(0)
    wrong = TPNet()            # TP over ranks r and r + 4: the TP dim outermost
    parallelize_module(wrong, init_device_mesh("cpu", (TP, DP), mesh_dim_names=("tp", "dp"))["tp"], tp_plan(wrong))
    torch.manual_seed(0)
    undeclared = TPNet()
    parallelize_module(undeclared, topo.tp_mesh, tp_plan(undeclared))
    torch.manual_seed(0)
    partial = TPNet()
    parallelize_module(partial, topo.tp_mesh, tp_plan(partial))
    norm = next(m for m in partial.modules() if isinstance(getattr(m, "weight", None), DTensor)
                and m.weight.placements[0].is_replicate())
    norm.weight = torch.nn.Parameter(DTensor.from_local(norm.weight.to_local(), topo.tp_mesh, (Partial(),)))
    return [message(wrong, topo), message(undeclared, plain), message(partial, topo)]


def _train_global(model, opt, rank: int, topology, data) -> None:
    """One optimizer step on the whole of each batch in ``data``, cut by this layout's data-parallel position."""
    positions = topology.world_size
    per = DP * PER // positions
    lo = rank // topology.tp * per
    for step in data:
        for tokens in step:
            loss_fn(model, tokens[lo:lo + per], MICRO).backward()
        opt.step()
        opt.zero_grad()


def test_tensor_parallel_under_the_tiers(tmp_path):
    codes = LATIN + list(OPTIONS)
    ref = reference()
    results = run_ranks(tp_sweep, WORLD, ref, codes, str(tmp_path))
    failures = []
    for rank, res in enumerate(results):
        for code in codes:
            r = res[code]
            if not _lossy(code) and r["vs_one"] > 1e-5:
                failures.append(f"{code} rank {rank}: {r['vs_one']:.2e} from one process")
            bound = 0.2 if _lossy(code) else 1e-6
            if r.get("vs_exact", 0) > bound:
                failures.append(f"{code} rank {rank}: {r['vs_exact']:.2e} from exact (bound {bound})")
        if res["adamw"]["vs_fsdp2"] > 1e-5 or res["adamw"]["norms"] > 1e-6:
            failures.append(f"AdamW IIG rank {rank}: {res['adamw']} from FSDP2 + TP")
        for what in ("load_no_tp", "load_tp4"):
            exact, step = res[what]
            if not exact or step > 1e-6:
                failures.append(f"{what} rank {rank}: loaded exactly {exact}, next step {step:.2e} from TP 2's")
        for code in THREE_TIERS:
            if res[f"three/{code}"] > 1e-5:
                failures.append(f"three tiers {code} rank {rank}: {res[f'three/{code}']:.2e} from one process")
        if not res["back_to_tp2"] or not res["full_state_tp4"]:
            failures.append(f"rank {rank}: back to TP 2 {res['back_to_tp2']}, full state at TP 4 "
                            f"{res['full_state_tp4']}")
        for got, want in zip(res["errors"], ("is tensor-parallel over ranks", "has none: declare it",
                                             "has TP placement P(sum), which")):
            if want not in got or ". " in got.replace("e.g. ", ""):
                failures.append(f"rank {rank}: error {got!r}, wanted one sentence with {want!r} and the fix")
        mine, fsdp2 = res["example"]
        if abs(mine - fsdp2) > 1e-6 * abs(fsdp2):
            failures.append(f"examples/tp_tiers.py rank {rank}: loss {mine} vs FSDP2 + TP {fsdp2}")
    assert not failures, "\n".join(failures[:20])
