"""The papers' headline configurations run through tiershard's cost model, as the tables of docs/paper-tables.md.

    python benchmarks/paper_tables.py                             # print every table
    python benchmarks/paper_tables.py --write docs/paper-tables.md   # refresh the generated blocks in place
    python benchmarks/paper_tables.py --check docs/paper-tables.md   # exit 1 if the doc is stale

Every number comes from ``tiershard.cost`` with the cluster presets of ``tiershard.cost.presets`` and the default
``Job`` (bf16 weights and reduction, 12 B/param Adam, 50% of peak in compute, 80% overlap, recompute on),
changed only where a table says so. The papers' numbers are quoted from reference/papers.md.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

from tiershard.cost import presets as clusters
from tiershard.comm.codecs import DEFAULT_BLOCKS
from tiershard.cost import Cluster, Estimate, Job, ModelSpec, candidate_plans, evaluate, price_plan, rank_plans
from tiershard.plan import Plan

ZERO3, ZEROPP = "GGG", "GGG+hpz+qwz+qgz=int4"       # the paper's ZeRO++: int4 gradients on every hop
PARO = ["NGG", "GGG", "III", ZEROPP, "NIG", "NII", "ING", "IIG", "IGG"]
NAMES = {"NGG": "ZeRO-2 (NGG)", "GGG": "ZeRO-3 (GGG)", "III": "MiCS / FSDP-hz (III)", ZEROPP: "ZeRO++",
         "GGG+hpz=pair+qwz+qgz=int4": "3-level (hpz=pair)", "GGG+hpz=pair+qwz+qgz=int4+cc": "3-level + cc"}


def with_inter(cluster: Cluster, per_node: float) -> Cluster:
    """The cluster with its inter-node tier at ``per_node`` bytes/s for a whole node (shared by its devices)."""
    outer, node = cluster.tiers[-1], cluster.tiers[-2].size
    return replace(cluster, tiers=(*cluster.tiers[:-1], replace(outer, bandwidth=per_node / node)))


def gbps(bits: float) -> float:
    return bits * 1e9 / 8


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- ZeRO++ ------------------------------------------------------------------------------------
V100_MODEL = ModelSpec.named("18b")      # the ZeRO++ tutorial's 18B GPT-2 (40 layers, hidden 6144)


def cross_node_by_phase(plan: str, cluster: Cluster, job: Job, model: ModelSpec) -> dict[str, float]:
    """Inter-node bytes per node per step, in M (= 2Ψ), by phase."""
    pl = Plan.parse(plan).resolve(cluster.topology)
    nodes = cluster.world_size // cluster.tiers[-2].size
    phases = {"param_gather": 0.0, "param_gather_backward": 0.0, "grad": 0.0}
    for p in price_plan(pl, model, job, cluster):
        key = "grad" if p.collective.op.startswith("grad") else p.collective.op
        phases[key] = phases.get(key, 0.0) + p.tier_bytes.get("world", 0) / nodes / (2 * model.params)
    return phases


def zeropp_volume() -> str:
    cluster = clusters.preset("v100-100g", 384)
    rows = []
    paper = {(ZERO3, 1): ["1", "1", "1", "3"], (ZEROPP, 1): ["0.5", "0", "0.25", "0.75"],
             (ZERO3, 4): ["", "", "", "3A = 12"], (ZEROPP, 4): ["", "", "", "0.5 + 0.25A = 1.5 (DeepSpeed)"]}
    for accum in (1, 4):
        for plan in (ZERO3, ZEROPP):
            phase = cross_node_by_phase(plan, cluster, Job(accum=accum), V100_MODEL)
            ours = [phase["param_gather"], phase["param_gather_backward"], phase["grad"]]
            cells = [f"{v:.3f}" for v in ours] + [f"**{sum(ours):.3f}**"]
            rows.append([NAMES[plan], str(accum), *cells, " / ".join(x for x in paper[(plan, accum)] if x)])
    b8, b4 = DEFAULT_BLOCKS[8], DEFAULT_BLOCKS[4]
    return table(["plan", "A", "fwd gather", "bwd gather", "grad reduce", "total", "paper (M)"], rows) + \
        f"\n\nScales: int8 blocks of {b8} add {400 / b8:.2g}% to the weight payload, int4 blocks of {b4} add " \
        f"{800 / b4:.3g}% to the gradient payload (`comm/codecs/` defaults)."


def zeropp_throughput() -> str:
    rows = []
    paper = {(1024, 400): "+28% to +36%", (2048, 400): "+24% to +29%", (1024, 100): "up to 2.2x, ~2x avg",
             (2048, 100): "up to 2.2x, ~2x avg"}
    for tokens in (1024, 2048):
        job = Job(micro_batch=tokens // 512, seq=512)
        for bits in (100, 200, 400, 800):
            cluster = with_inter(clusters.preset("v100-100g", 384), gbps(bits))
            z3, zp = evaluate(ZERO3, V100_MODEL, cluster, job), evaluate(ZEROPP, V100_MODEL, cluster, job)
            low = replace(job, overlap=0.3)
            low_ratio = evaluate(ZERO3, V100_MODEL, cluster, low).step_time / \
                evaluate(ZEROPP, V100_MODEL, cluster, low).step_time
            rows.append([f"{tokens // 1024}K", f"{bits} Gbps", f"{z3.tflops_per_device:.1f}",
                         f"{zp.tflops_per_device:.1f}", f"**{z3.step_time / zp.step_time:.2f}x**",
                         f"{low_ratio:.2f}x", paper.get((tokens, bits), "")])
    return table(["tokens/GPU", "inter-node per node", "ZeRO-3 TFLOPS/GPU", "ZeRO++ TFLOPS/GPU",
                  "ZeRO++ / ZeRO-3", "same, overlap 0.3", "paper"], rows)


def zeropp_equivalence() -> str:
    rows = []
    for model in (V100_MODEL, ModelSpec.from_params(138e9)):
        job = Job(micro_batch=2, seq=512)
        at = {(plan, bits): evaluate(plan, model, with_inter(clusters.preset("v100-100g", 384), gbps(bits)), job)
              for plan in (ZERO3, ZEROPP) for bits in (200, 800)}
        rows.append([model.label, f"{at[(ZEROPP, 200)].tflops_per_device:.1f}",
                     f"{at[(ZERO3, 800)].tflops_per_device:.1f}", f"{at[(ZERO3, 200)].tflops_per_device:.1f}",
                     "yes" if at[(ZEROPP, 200)].fits else "no", "ZeRO++@200 ≈ ZeRO-3@800"])
    return table(["model (1K tokens/GPU)", "ZeRO++ @200 Gbps", "ZeRO-3 @800 Gbps", "ZeRO-3 @200 Gbps",
                  "ZeRO++ fits", "paper"], rows)


def zeropp_ablation() -> str:
    cluster = with_inter(clusters.preset("v100-100g", 384), gbps(100))
    job = Job(micro_batch=2, seq=512)
    base = evaluate(ZERO3, V100_MODEL, cluster, job).step_time
    rows, product = [], 1.0
    for option, paper in (("qwz", "1.4x"), ("hpz", "1.26x"), ("qgz", "1.3x")):
        speedup = base / evaluate(f"GGG+{option}", V100_MODEL, cluster, job).step_time
        product *= speedup
        rows.append([f"GGG+{option} alone", f"{speedup:.2f}x", paper])
    rows.append(["product of the three", f"{product:.2f}x", "2.29x"])
    rows.append(["all three (ZeRO++)", f"**{base / evaluate(ZEROPP, V100_MODEL, cluster, job).step_time:.2f}x**",
                 "2.26x"])
    return table(["vs ZeRO-3, 18B, 1K tokens/GPU, 100 Gbps", "model", "paper (order assumed)"], rows)


# ---- PaRO --------------------------------------------------------------------------------------
PARO_CASES = [("1600 Gbps/node", 1600, 1.0, 4), ("200 Gbps/node", 200, 1.0, 4), ("200 Gbps/node", 200, 1.0, 16),
              ("200 Gbps/node", 200, 1 / 16, 4)]


def a100(gpus: int, node_bits: float) -> Cluster:
    return with_inter(clusters.preset("dgx-a100", gpus), gbps(node_bits))


def paro_ranking(name: str, gpus: int) -> str:
    columns, picks, head = [], [], ["strategy"]
    for label, bits, fraction, accum in PARO_CASES:
        model = ModelSpec.named(name).with_trainable(fraction)
        ranked = rank_plans(model, a100(gpus, bits), Job(accum=accum), PARO)
        zero3 = next(e for e in ranked if str(e.plan) == ZERO3).step_time
        columns.append({str(e.plan): (i, e, zero3) for i, e in enumerate(ranked, 1)})
        cluster = a100(gpus, bits)
        picks.append([rank_plans(model, cluster, Job(accum=accum), candidate_plans(cluster.topology, options))[0]
                      for options in (False, True)] + [zero3])
        head.append(f"{label}, Ψ'/Ψ={'1' if fraction == 1 else '1/16'}, A={accum}")
    rows = []
    for plan in PARO:
        cells = []
        for col in columns:
            i, e, zero3 = col[plan]
            cells.append(f"#{i} {zero3 / e.step_time:.2f}x" if e.fits else "does not fit")
        rows.append([NAMES.get(plan, plan), *cells])
    for index, label in ((0, "planner, 27 placements"), (1, "planner, all options")):
        rows.append([f"*{label}*", *(f"{p[index].plan} {p[2] / p[index].step_time:.2f}x" for p in picks)])
    return table(head, rows)


def best_paro(model: ModelSpec, cluster: Cluster, job: Job) -> Estimate:
    ranked = rank_plans(model, cluster, job, ["NIG", "NII", "ING", "IIG", "IGG"])
    return next(e for e in ranked if e.fits)


def bandwidth_for_ratio(model: ModelSpec, gpus: int, job: Job, ratio: float) -> tuple[float, Estimate]:
    """The per-node inter bandwidth (Gbps) at which the best PaRO strategy is ``ratio`` x ZeRO-3 (bisection)."""
    def speedup(bits: float) -> tuple[float, Estimate]:
        cluster = a100(gpus, bits)
        best = best_paro(model, cluster, job)
        return evaluate(ZERO3, model, cluster, job).step_time / best.step_time, best

    lo, hi = 1.0, 3200.0
    if speedup(lo)[0] < ratio:
        return float("nan"), speedup(lo)[1]     # not reached even at 1 Gbps
    for _ in range(24):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if speedup(mid)[0] >= ratio else (lo, mid)
    return lo, speedup(lo)[1]


def paro_266() -> str:
    rows = []
    for name, gpus in (("7b", 32), ("65b", 64)):
        for accum in (1, 4, 16):
            model = ModelSpec.named(name)
            job = Job(accum=accum)
            bits, best = bandwidth_for_ratio(model, gpus, job, 2.66)
            if bits != bits:   # nan: the ratio is out of reach
                limit = evaluate(ZERO3, model, a100(gpus, 1.0), job).step_time / best.step_time
                where = f"never (at most {limit:.2f}x, at 1 Gbps)"
            else:
                where = f"{bits:.0f} Gbps"
            rows.append([f"LLaMA-{name.upper()}, {gpus} GPUs", str(accum), where, str(best.plan)])
    return table(["model", "A", "inter-node bandwidth per node where best PaRO = 2.66x ZeRO-3", "that strategy"], rows)


def paro_peft() -> str:
    model = ModelSpec.named("65b").with_trainable(3 / 1000)
    rows = []
    for bits in (1600, 200):
        ranked = rank_plans(model, a100(64, bits), Job(accum=4), [ZERO3, "ING", ZEROPP, "III"])
        zero3 = next(e for e in ranked if str(e.plan) == ZERO3).step_time
        rows += [[f"{bits} Gbps/node", NAMES.get(str(e.plan), str(e.plan)), f"#{i}", f"{zero3 / e.step_time:.2f}x",
                  f"{e.memory.total / 1e9:.1f}", f"{e.bytes_per_group('world') / 1e9:.3g}"]
                 for i, e in enumerate(ranked, 1)]
    return table(["network", "strategy", "rank", "vs ZeRO-3", "GB/GPU", "inter GB/node/step"], rows)


# ---- Frontier ----------------------------------------------------------------------------------
FRONTIER = [ZERO3, ZEROPP, "GGG+hpz=pair+qwz+qgz=int4", "GGG+hpz=pair+qwz+qgz=int4+cc"]


def frontier() -> str:
    model = ModelSpec.named("20b")
    rows = []
    for node_bw in (100e9, 50e9):
        cluster = with_inter(clusters.preset("frontier", 384), node_bw)
        for tokens in (512, 1024, 2048):
            job = Job(seq=tokens)
            est = {p: evaluate(p, model, cluster, job) for p in FRONTIER}
            best = rank_plans(model, cluster, job, allow_lossy=True)[0]
            z3, zp, three = (est[p].step_time for p in FRONTIER[:3])
            rows.append([f"{node_bw / 1e9:.0f} GB/s", str(tokens), f"{est[ZERO3].tflops_per_device:.1f}",
                         f"{z3 / zp:.2f}x", f"{zp / three:.2f}x", f"{z3 / three:.2f}x",
                         f"{zp / est[FRONTIER[3]].step_time:.2f}x", f"{best.plan} ({z3 / best.step_time:.2f}x)",
                         f"{est[ZEROPP].memory.total / 1e9:.1f} / {est[FRONTIER[2]].memory.total / 1e9:.1f}"])
    rows.append(["paper", "?", "", "1.405x", "1.71x", "2.40x", "", "", ""])
    return table(["inter-node per node", "tokens/GCD", "ZeRO-3 TFLOPS/GCD", "ZeRO++ / ZeRO-3",
                  "3-level / ZeRO++", "3-level / ZeRO-3", "3-level+cc / ZeRO++", "planner's pick (vs ZeRO-3)",
                  "GB/GCD ZeRO++ / 3-level"], rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "zeropp-volume": zeropp_volume, "zeropp-throughput": zeropp_throughput,
    "zeropp-equivalence": zeropp_equivalence, "zeropp-ablation": zeropp_ablation,
    "paro-7b": lambda: paro_ranking("7b", 32), "paro-65b": lambda: paro_ranking("65b", 64),
    "paro-266": paro_266, "paro-peft": paro_peft, "frontier": frontier,
}
MARK = re.compile(r"(<!-- BEGIN (?P<name>[\w-]+) -->\n)(.*?)(<!-- END (?P=name) -->)", re.S)


def render(doc: str) -> str:
    def fill(m: re.Match) -> str:
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"unknown generated block {name!r}")
        return m.group(1) + BLOCKS[name]() + "\n" + m.group(4)
    return MARK.sub(fill, doc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DOC", help="refresh the generated blocks of DOC in place")
    group.add_argument("--check", metavar="DOC", help="exit 1 if DOC's generated blocks are stale")
    args = ap.parse_args(argv)
    if not args.write and not args.check:
        for name, make in BLOCKS.items():
            print(f"## {name}\n\n{make()}\n")
        return 0
    path = Path(args.write or args.check)
    doc = path.read_text()
    fresh = render(doc)
    if args.check:
        if fresh != doc:
            print(f"{path} is stale: run python benchmarks/paper_tables.py --write {path}", file=sys.stderr)
            return 1
        return 0
    path.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
