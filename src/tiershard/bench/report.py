"""The bench's report: one table per (rate, accum), the lines under it, the bench check, and the files
(``bench.md``, ``bench.json``, the PNG plots), all from the results dict that
:func:`~tiershard.bench.runner.run_bench` returns; nothing here runs anything.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .config import CHECK_TOLERANCE, PEERS, REFERENCES


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value * scale, spec)


def best_plan(run: dict) -> dict | None:
    """The fastest of our plans in one run (auto counts when it ran a plan of its own)."""
    ours = [r for r in run["rows"] if r["plan"] and not r["same_as"]]
    return min(ours, key=lambda r: r["step_s"]) if ours else None


def run_summary(run: dict) -> list[str]:
    """Lines under a table: the best plan against the references and the floor, the planner's pick."""
    lines = []
    best = best_plan(run)
    by = {r["system"]: r for r in run["rows"]}
    if best:
        parts = [f"best tiershard plan **{best['system']}** ({best['plan']}) {best['step_s'] * 1e3:.0f} ms"]
        for ref in REFERENCES:
            if ref in by:
                parts.append(f"{best['step_s'] / by[ref]['step_s']:.2f}x the step time of {ref} "
                             f"({by[ref]['step_s'] / best['step_s']:.2f}x faster)")
        parts.append(f"{best['vs_floor']:.2f}x its floor")
        if best.get("vs_uncapped_floor") is not None:
            parts.append(f"{best['vs_uncapped_floor']:.2f}x max(its uncapped step, its link time)")
        lines.append("- " + "; ".join(parts))
    auto = by.get("auto")
    if auto and best:
        gap = auto["step_s"] / best["step_s"] - 1
        verdict = "the measured best" if gap <= 0 else \
            f"{gap * 100:.1f}% slower than the best ({'within' if gap <= 0.05 else 'outside'} 5%)"
        same = f", the same run as {auto['same_as']}" if auto["same_as"] else ""
        if auto.get("whole_intervals") is False:      # [Note: outer step time]
            verdict = "not comparable: the timed rounds hold part of its sync interval (raise --steps-per-round)"
        lines.append(f"- planner's pick (auto): {auto['plan']}{same}: {verdict}")
    return lines


def render_table(run: dict) -> str:
    head = ("| system | plan / peer | step ms | tokens/s | NIC MB/step/node | comm_stats MB/step/node "
            "| predicted ms | vs fsdp2 | vs deepspeed-hpz | floor ms | vs floor | vs uncapped floor | build peak MiB/rank "
            "| peak MiB/rank | states MiB | gathered MiB | engine other MiB | predicted MiB | peak / predicted | final loss |")
    lines = [head, "| --- | --- |" + " ---: |" * 18]
    for r in run["rows"]:
        what = r["plan"] if r["plan"] else r["peer"]
        if r["same_as"]:
            what += f" (= {r['same_as']})"
        comm = r.get("comm_tiers_per_node", {}).get("world") if r["plan"] else None
        lines.append(
            f"| {r['system']} | {what} | {_fmt(r['step_s'], '.0f', 1e3)} | {_fmt(r['tokens_per_s'], ',.0f')} "
            f"| {_fmt(r['nic_tx_per_node'], '.2f', 1e-6)} | {_fmt(comm, '.2f', 1e-6)} "
            f"| {_fmt(r.get('predicted_s'), '.0f', 1e3)} | {_fmt(r['vs_fsdp2'], '.2f')} "
            f"| {_fmt(r['vs_deepspeed-hpz'], '.2f')} | {_fmt(r['floor_s'], '.0f', 1e3)} | {_fmt(r['vs_floor'], '.2f')} "
            f"| {_fmt(r.get('vs_uncapped_floor'), '.2f')} | {_fmt(r.get('build_peak_bytes'), '.0f', 1 / 2**20)} "
            f"| {_fmt(r['peak_bytes'], '.0f', 1 / 2**20)} "
            f"| {_memory_cells(r)} | {_fmt(r['final_loss'], '.4f')} |")
    return "\n".join(lines)


def render_time_split(run: dict) -> str:
    """Where the time goes, per plan ([Note: where the time goes], comm/ledger.py): the measured step against its
    parts and the cost model's; ms per step, the mean over ranks."""
    rows = [r for r in run["rows"] if r.get("time_split") and not r["same_as"]]
    if not rows:
        return ""
    tiers = list(dict.fromkeys(t for r in rows for t in r["time_split"]["predicted"]["tiers"]))
    head = ("| system | plan | step ms | compute | exposed comm | rest | stream busy | codec | "
            + " | ".join(f"{t} in flight (predicted)" for t in tiers)
            + " | predicted step | predicted exposed | unpriced |")
    lines = [head, "| --- | --- |" + " ---: |" * (9 + len(tiers))]
    for r in rows:
        t, p = r["time_split"], r["time_split"]["predicted"]
        ms = lambda v: _fmt(v, ".0f", 1e3)        # noqa: E731
        flight = [f"{ms(t['tiers'].get(n))} ({ms(p['tiers'].get(n))})" for n in tiers]
        lines.append(f"| {r['system']} | {r['plan']} | {ms(t['step'])} | {ms(t['compute'])} | {ms(t['waited'])} "
                     f"| {ms(t['rest'])} | {ms(t['stream'])} | {ms(t['codec'])} | " + " | ".join(flight)
                     + f" | {ms(p['step'])} | {ms(p['exposed'])} | {ms(t['step'] - p['step'])} |")
    return "\n".join(lines)


def memory_cells(row: dict) -> dict[str, float | None]:
    """Our plans' memory columns (bytes; None for the peers): the measured model states, the peak of gathered
    weights and matrices in flight, the engine's other buffers, the predicted model states and activations at
    their peak over backward + gathered weights (what the cost model knows to be alive at the step's peak), and the
    peak RSS over that."""
    mem = row.get("memory")
    if not mem:
        return dict.fromkeys(("states", "gathered", "engine_other", "predicted", "peak_vs_predicted"))
    gathered = row["predicted_memory"]["peak_gathered"] + row["predicted_memory"]["peak_gather_buffers"]
    predicted = row["predicted_peak_bytes"] + gathered
    return {"states": row["states_bytes"], "gathered": mem["peak_gathered"] + mem["peak_gather_buffers"],
            "engine_other": mem["codec_scratch"] + mem["ef_residuals"] + mem["comm_buffers"],
            "predicted": predicted, "peak_vs_predicted": row["peak_bytes"] / predicted if row["peak_bytes"] else None}


def _memory_cells(row: dict) -> str:
    cells = memory_cells(row)
    mib = [_fmt(cells[k], ".1f", 1 / 2**20) for k in ("states", "gathered", "engine_other", "predicted")]
    return " | ".join(mib + [_fmt(cells["peak_vs_predicted"], ".2f")])


def render_check(results: dict) -> str:
    """The bench check: a headline, then per plan and (rate, accum) the worse node's NIC/comm_stats deviation."""
    checks = results.get("check") or []
    if not checks:
        return "bench check: not available (no NIC counters: --local, or none of our plans ran)"
    bad = [c for c in checks if not c["ok"]]
    devs = [c["deviation"] for c in checks]
    lines = [f"bench check: NIC bytes sent vs comm_stats bytes, per capped tier, node and step, within "
             f"{CHECK_TOLERANCE:.0%}: {'PASS' if not bad else 'FAIL'} ({len(checks) - len(bad)}/{len(checks)} "
             f"node checks; deviation {min(devs) * 100:+.2f}% to {max(devs) * 100:+.2f}%)", ""]
    runs = list(dict.fromkeys((c["rate"], c["accum"]) for c in checks))
    systems = list(dict.fromkeys(c["system"] for c in checks))
    lines += ["| system | " + " | ".join(f"{rate} A={accum}" for rate, accum in runs) + " |",
              "| --- |" + " ---: |" * len(runs)]
    for system in systems:
        cells = []
        for rate, accum in runs:
            mine = [c for c in checks if (c["rate"], c["accum"], c["system"]) == (rate, accum, system)]
            if not mine:
                cells.append("-")
                continue
            worst = max(mine, key=lambda c: abs(c["deviation"]))
            cell = f"{worst['deviation'] * 100:+.2f}%" + ("" if worst["ok"] else " FAIL")
            if system == "auto":
                cell += f" ({worst['plan']})"
            cells.append(cell)
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(results: dict, command: str | None = None) -> str:
    """The report: settings, one table per (rate, accum), the bench check."""
    cfg, links = results["config"], results.get("links", {})
    mc = cfg["model"]
    lines = ["# tiershard bench", ""]
    if command:
        lines += ["```sh", command, "```", ""]
    mode = "local loopback gloo ranks (no caps, no NIC counters)" if cfg["local"] else \
        f"emulated cluster '{cfg['cluster_name']}' (network namespaces, tbf caps)"
    seq = cfg["seq"] or mc["block_size"]
    lines += [
        f"- GPT {results['params'] / 1e6:.2f}M parameters ({mc['n_layer']} blocks x {mc['n_embd']}, vocab "
        f"{mc['vocab_size']}), {cfg['batch_per_rank']} rows x {seq} tokens per rank and micro-step, seed "
        f"{cfg['seed']}, bf16 gathers, compute and reductions, fp32 masters, AdamW",
        f"- {cfg['nodes']} nodes x {cfg['ranks_per_node']} ranks"
        + (f" (tiers {tuple(cfg['tiers'])}: pair, node, world)" if len(cfg.get("tiers") or ()) == 3 else "")
        + f", {mode}",
        f"- {cfg['rounds']} interleaved rounds x {cfg['steps_per_round']} steps per system after {cfg['warmup']} "
        "warm-up step(s)" + (" and, once every system was built, one more untimed step each" if cfg["warmup"] else "")
        + "; step time = median over timed steps of the slowest rank (an outer-sync plan's: the mean, which holds "
        "its syncs)",
        f"- the planner's cluster: node tier {links.get('intra_bw', 0) / 1e9:.3g} GB/s and "
        f"{links.get('intra_latency', 0) * 1e6:.0f} us per rank, uncapped inter-node "
        f"{links.get('inter_bw', 0) / 1e9:.3g} GB/s and {links.get('inter_latency', 0) * 1e6:.0f} us per rank"
        + (f", overlap {links['overlap']:.2f}" if "overlap" in links else "")
        + (f", codec rate {links['codec_rate'] / 1e9:.3g} GB/s" if "codec_rate" in links else "")
        + (", per codec " + ", ".join(f"{spec} {rate / 1e9:.3g}" for spec, rate in links["codec_rates"].items())
           + " GB/s" if links.get("codec_rates") else "")
        + f" ({links.get('source', '-')}); a capped inter-node tier is the cap shared by a node's ranks; peak flops "
        "calibrated to the compute-only step"
        + (f" ({results['calibration_micro_s'] * 1e3:.0f} ms per micro-step for the planner's pick, each "
           "table's own for its predictions)" if results.get("calibration_micro_s") else " of each table"),
        f"- load average (1, 5, 15 min): {results['loadavg'].get('start')} at the start, "
        f"{results['loadavg'].get('end')} at the end; {results.get('seconds', 0):.0f} s in all",
    ]
    lines += [f"- note: {n}" for n in results.get("notes", [])]
    lines += ["", "Ratios are step time / the peer's step time (below 1: faster). NIC MB: bytes the node's NIC "
              "sent per step (mean over nodes); comm_stats MB: the world tier of `ts.comm_stats()` summed over the "
              "node's ranks (our plans only). Floor: max(compute-only step, the node's larger NIC direction per "
              "step / link rate); uncapped floor: max(the same system's step uncapped at the same accumulation, "
              "its link time), the CPU-bound step that a hidden link would leave. Peak MiB: the largest rise of a "
              "rank's resident memory while the system built and trained its warm-up steps.", ""]
    for run in results["runs"]:
        lines += [f"## {run['rate']}, accum {run['accum']}", "",
                  f"compute-only step {run['compute_s'] * 1e3:.0f} ms; {run['tokens_per_step']:,} tokens per step; "
                  f"load average {run['loadavg']['before']} -> {run['loadavg']['after']}", "",
                  render_table(run), ""]
        lines += run_summary(run)
        split = render_time_split(run)
        if split:
            lines += ["", "Where the time goes (ms per step, mean over ranks): compute is the compute-only step; "
                      "exposed comm, the time the step waited for communication; rest = step - compute - exposed "
                      "comm (the engine's host work, the optimizer step, compute slowed by communication beside it); "
                      "stream busy, codec and in flight (issue to completion, per tier) are measured by "
                      "`ts.comm_stats()['seconds']`, beside the cost model's (in brackets: bytes / bandwidth); "
                      "unpriced = step - predicted step.", "", split]
        lines.append("")
    lines += ["## Bench check", "", render_check(results), ""]
    return "\n".join(lines)


def plot(results: dict, out: Path, prefix: str = "") -> list[Path]:
    """Step time against the inter-node rate per system, and bytes per tier per plan; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    accums = list(dict.fromkeys(run["accum"] for run in results["runs"]))
    rates = list(dict.fromkeys(run["rate"] for run in results["runs"]))
    systems = results["config"]["systems"]
    size = f"GPT {results['params'] / 1e6:.1f}M"
    paths = []

    fig, axes = plt.subplots(1, len(accums), figsize=(6 * len(accums), 4.5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        for i, system in enumerate(systems):
            xs, ys = [], []
            for x, rate in enumerate(rates):
                run = next((r for r in results["runs"] if r["rate"] == rate and r["accum"] == accum), None)
                row = next((r for r in run["rows"] if r["system"] == system), None) if run else None
                if row:
                    xs.append(x)
                    ys.append(row["step_s"] * 1e3)
            ours = system not in PEERS
            ax.plot(xs, ys, marker="o" if ours else "s", linestyle="-" if ours else "--", label=system,
                    color=plt.cm.tab20(i % 20))
        ax.set_xticks(range(len(rates)), [r if r != "none" else "none (uncapped)" for r in rates])
        ax.set_yscale("log")
        ax.set_xlabel("inter-node rate (per link and direction)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{size}, accum {accum}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    paths.append(out / f"{prefix}step_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(accums), figsize=(6 * len(accums), 4.5), squeeze=False)
    for ax, accum in zip(axes[0], accums):
        run = next(r for r in results["runs"] if r["accum"] == accum)
        rows = [r for r in run["rows"] if not r["same_as"]]
        names = [r["system"] + (f"\n{r['plan']}" if r["plan"] and r["plan"] != r["system"] else "") for r in rows]
        node = [r["comm_tiers_per_node"]["node"] / 1e6 if r["plan"] else 0 for r in rows]
        world = [(r["comm_tiers_per_node"]["world"] if r["plan"] else (r["nic_tx_per_node"] or 0)) / 1e6 for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], node, width=0.4, color="tab:blue")
        ax.bar([x + 0.2 for x in xs], world, width=0.4, color=["tab:orange" if r["plan"] else "tab:gray" for r in rows])
        ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("MB per step per node")
        ax.set_title(f"{size}, accum {accum}: bytes per tier ({run['rate']})")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(handles=[Patch(color="tab:blue", label="inside the node (comm_stats)"),
                           Patch(color="tab:orange", label="node-crossing (comm_stats)"),
                           Patch(color="tab:gray", label="node-crossing, peers (NIC sent)")], fontsize=8)
    fig.tight_layout()
    paths.append(out / f"{prefix}bytes_per_tier.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(results: dict, out: Path, command: str | None = None, prefix: str = "") -> list[Path]:
    """``bench.md``, ``bench.json`` and the plots under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{prefix}bench.md"
    md.write_text(render_markdown(results, command))
    js = out / f"{prefix}bench.json"
    js.write_text(json.dumps(results, indent=1, default=str))
    return [md, js, *plot(results, out, prefix)]
