"""``tiershard plan``: rank every plan for a model on a cluster by predicted step time, and say why losers lose.

The cluster, model and job come from, in increasing priority: the dgx-a100 preset (for numbers nobody gave),
``--config FILE`` ([model], [cluster], [job] tables), ``--cluster-file FILE`` (e.g. from ``tiershard probe``),
``--cluster PRESET`` or ``--tiers``, then the single-number flags.

Only exact plans are ranked unless ``--allow-lossy`` (qwz, qgz change the training numerics, docs/zeropp.md);
plans named with ``--plans`` are all ranked. Each row says ``exact`` or ``lossy`` with the codecs' bits. Equal
step times are ranked by memory headroom, then bytes on the slowest tier (the table's ``free GB`` and bytes
columns); ``--explain`` shows where the chosen plan's step goes, tier by tier, and whether each codec pays.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from ..cost import presets as clusters
from ..cost.explain import tier_terms
from ..cost import MODELS, REL_TIE, Cluster, Estimate, Job, ModelSpec, coerce_model, no_plan_fits, rank_plans
from ..plan import PlanError
from ..topology import TopologyError
from . import CliError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

JOB_KEYS = {f.name for f in fields(Job)}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank plans by predicted step time for a model on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"a name ({', '.join(MODELS)}) or a parameter count like 1.3e9 (default 7b)")
    m.add_argument("--model-config", metavar="FILE", help="a Hugging Face config.json (llama, mistral, gpt2): the "
                                                          "exact parameter count and units, without the weights")
    m.add_argument("--trainable", type=float, metavar="FRACTION", help="fraction of parameters trained (default 1)")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--vocab", type=int)
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", metavar="PRESET", help=f"one of {', '.join(clusters.PRESETS)}")
    c.add_argument("--cluster-file", metavar="FILE", help="TOML with a [cluster] table, e.g. from tiershard probe")
    c.add_argument("--config", metavar="FILE", help="TOML with [model], [cluster] and [job] tables")
    c.add_argument("--tiers", help="name:size:bandwidth[:latency],... innermost first, e.g. "
                                   "pair:2:200GB/s,node:8:50GB/s,world:384:100GB/s/node")
    c.add_argument("--gpus", type=int, help="devices in all")
    c.add_argument("--gpus-per-node", type=int)
    c.add_argument("--intra-bw", help="per device inside a node, e.g. 300GB/s")
    c.add_argument("--inter-bw", help="per device between nodes, e.g. 25GB/s, or 100Gbps/node for a node's total")
    c.add_argument("--intra-lat", help="latency of one step inside a node, e.g. 3us")
    c.add_argument("--inter-lat", help="latency of one step between nodes, e.g. 10us")
    c.add_argument("--gpu-mem", help="memory per device, e.g. 80GB")
    c.add_argument("--peak-tflops", type=float, help="peak half-precision TFLOPS per device")
    j = p.add_argument_group("job")
    j.add_argument("--micro-batch", type=int)
    j.add_argument("--seq", type=int)
    j.add_argument("--accum", type=int, help="micro-steps per optimizer step")
    j.add_argument("--efficiency", type=float, help="achieved fraction of peak flops (default 0.5)")
    j.add_argument("--overlap", type=float, help="fraction of compute that hides micro-step comm (default 0.8)")
    j.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing (default on)")
    j.add_argument("--reduce-bytes", type=int, help="bytes per gradient element on the wire (2 bf16, 4 fp32)")
    j.add_argument("--grad-bytes", type=int, help="bytes per accumulated gradient element (default 2; the engine's fp32: 4)")
    c.add_argument("--tp", metavar="DEGREES", help="tensor-parallel degrees to weigh beside each placement, e.g. "
                   "1,2,4,8: TP inside the innermost tier, the plans over the tiers outside it (docs/parallelism.md)")
    o = p.add_argument_group("output")
    o.add_argument("--plans", help="comma-separated plans to compare instead of all, e.g. zero3,zero++,IIG")
    o.add_argument("--allow-lossy", action="store_true",
                   help="rank the quantized plans (qwz, qgz) too; they change the training numerics")
    o.add_argument("--allow-outer", action="store_true",
                   help="with --allow-lossy, rank the outer-sync plans (+outer=H, islands that meet every H steps) too")
    o.add_argument("--top", type=int, help="rows to show (default 10; 0 = all; --json shows all)")
    o.add_argument("--json", action="store_true", help="machine-readable output")
    o.add_argument("--explain", action="store_true",
                   help="show, for the chosen plan, each tier's bytes, link time, codec time and exposed time, and "
                        "whether each codec saves more link time than it costs (docs/cost-model.md)")
    p.set_defaults(func=run)
    one_line_errors(p)


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make a subcommand's argument errors one line and exit 2 like CliError, and let values such as
    ``-25GB/s`` reach the validators (which explain them) instead of being taken for options."""
    def error(message: str):
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = error  # type: ignore[method-assign]
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[A-Za-zµ/]*$")


def run(args: argparse.Namespace) -> int:
    try:
        model, cluster, job = build(args)
        candidates = [s.strip() for s in args.plans.split(",") if s.strip()] if args.plans else None
        if args.allow_outer and not args.allow_lossy:
            raise ValueError("--allow-outer ranks outer-sync plans, which are lossy: add --allow-lossy")
        ranked = rank_plans(model, cluster, job, candidates, args.allow_lossy, args.allow_outer,
                            parse_tp(args.tp))
    except (ValueError, PlanError, TopologyError) as err:
        raise CliError(str(err)) from None
    if not ranked or not ranked[0].fits:
        raise CliError(str(no_plan_fits(model, cluster, ranked, job)))
    top = args.top if args.top is not None else (0 if args.json else 10)
    shown = ranked[:top] if top > 0 else ranked
    if args.json:
        doc = as_json(model, cluster, job, ranked, shown) | {"allow_lossy": args.allow_lossy}
        if args.explain and ranked[0].tp == 1:
            doc["explain"] = [asdict(t) | {"codec_pays": t.codec_pays}
                              for t in tier_terms(ranked[0].plan, model, cluster, job)[1]]
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(render(model, cluster, job, ranked, shown))
        if not args.allow_lossy and candidates is None:
            print("(exact plans only: --allow-lossy ranks the quantized ones, qwz and qgz, too)")
        if args.explain:
            print()
            print(explain(model, cluster, job, ranked[0]))
    return 0


# ---- inputs -------------------------------------------------------------------------------------
def parse_tp(text: str | None) -> tuple[int, ...]:
    """``--tp 1,2,4``: the TP degrees, 1 (none) when the flag is absent."""
    if text is None:
        return (1,)
    try:
        degrees = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--tp {text!r} is not a list of TP degrees like 1,2,4,8") from None
    if not degrees:
        raise ValueError("--tp names no TP degree: give some, e.g. --tp 1,2,4,8")
    return degrees

def _load(path: str) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise CliError(f"cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise CliError(f"{path} is not valid TOML: {err}") from None


def build(args: argparse.Namespace) -> tuple[ModelSpec, Cluster, Job]:
    config = _load(args.config) if args.config else {}
    unknown = set(config) - {"model", "cluster", "job"}
    if unknown:
        raise ValueError(f"{args.config}: unknown tables {', '.join(sorted(unknown))}; use [model], [cluster], [job]")
    return build_model(args, config.get("model", {})), build_cluster(args, config.get("cluster")), \
        build_job(args, config.get("job", {}))


def build_model(args: argparse.Namespace, table: dict) -> ModelSpec:
    table = dict(table)
    from_table = [f"[model] {key}" for key in ("name", "params") if key in table]
    name = args.model or table.get("name") or table.get("params") or "7b"
    table.pop("name", None), table.pop("params", None)
    layers = args.layers or table.pop("layers", None)
    hidden = args.hidden or table.pop("hidden", None)
    vocab = args.vocab or table.pop("vocab", None)
    fraction = args.trainable if args.trainable is not None else table.pop("trainable", None)
    if table:
        raise ValueError(f"unknown [model] keys: {', '.join(sorted(table))}")
    if args.model_config:
        given = [flag for flag, v in (("--model", args.model), ("--layers", layers), ("--hidden", hidden),
                                      ("--vocab", vocab)) if v] + from_table
        if given:
            raise ValueError(f"--model-config gives the whole model: drop {', '.join(given)}")
        model = ModelSpec.from_hf_config(args.model_config)
        return model.with_trainable(float(fraction)) if fraction is not None else model
    model = coerce_model(name)
    if not model.name and (layers or hidden):       # a bare parameter count: reshape around the given sizes
        model = ModelSpec.from_params(model.params, layers=layers, hidden=hidden)
    else:
        model = replace(model, **{k: v for k, v in (("layers", layers), ("hidden", hidden)) if v})
    if vocab:
        model = replace(model, vocab=vocab)
    return model.with_trainable(float(fraction)) if fraction is not None else model


def build_cluster(args: argparse.Namespace, table: dict | None) -> Cluster:
    cluster = clusters.preset("dgx-a100", args.gpus)
    if table is not None:
        cluster = clusters.cluster_from_dict(table, cluster)
    if args.cluster_file:
        file_table = _load(args.cluster_file).get("cluster")
        if file_table is None:
            raise ValueError(f"{args.cluster_file} has no [cluster] table")
        cluster = clusters.cluster_from_dict(file_table, cluster)
    if args.cluster:
        cluster = clusters.preset(args.cluster, args.gpus)
    if args.tiers:
        cluster = replace(cluster, tiers=clusters.parse_tiers(args.tiers), name="custom")
    if args.gpus is not None or args.gpus_per_node is not None:
        cluster = cluster.resized(args.gpus, args.gpus_per_node)
    tiers = list(cluster.tiers)
    inter, intra = len(tiers) - 1, len(tiers) - 2
    node = tiers[intra].size if len(tiers) > 1 else 1
    for flag, index, attr, parse in (
            (args.intra_bw, intra, "bandwidth", lambda v: clusters.parse_bandwidth(v)),
            (args.inter_bw, inter, "bandwidth", lambda v: clusters.parse_bandwidth(v, node)),
            (args.intra_lat, intra, "latency", clusters.parse_seconds),
            (args.inter_lat, inter, "latency", clusters.parse_seconds)):
        if flag is not None:
            if index < 0:
                raise ValueError("this cluster has a single tier: there is no intra-node flag to set")
            tiers[index] = replace(tiers[index], **{attr: parse(flag)})
    changes: dict = {"tiers": tuple(tiers)}
    if args.gpu_mem is not None:
        changes["gpu_memory"] = clusters.parse_bytes(args.gpu_mem)
    if args.peak_tflops is not None:
        changes["peak_flops"] = args.peak_tflops * 1e12
    return replace(cluster, **changes)


def build_job(args: argparse.Namespace, table: dict) -> Job:
    values = dict(table)
    unknown = set(values) - JOB_KEYS
    if unknown:
        raise ValueError(f"unknown [job] keys: {', '.join(sorted(unknown))}; known: {', '.join(sorted(JOB_KEYS))}")
    for key in ("micro_batch", "seq", "accum", "efficiency", "overlap", "recompute", "reduce_bytes", "grad_bytes"):
        value = getattr(args, key)
        if value is not None:
            values[key] = value
    return Job(**values)


# ---- output -------------------------------------------------------------------------------------
def describe(model: ModelSpec, cluster: Cluster, job: Job) -> list[str]:
    # the overlap the estimates use: the cluster's measured one wins over the job's ([Note: overlap model])
    overlap, source = (job.overlap, "the job's assumption") if cluster.overlap is None else \
        (cluster.overlap, "measured, from the cluster")
    tiers = ", ".join(f"{t.name} x{t.size} @{t.bandwidth / 1e9:.3g} GB/s {t.latency * 1e6:.3g}us" for t in cluster.tiers)
    return [
        f"model   {model.label}: {model.params:.3g} params, {100 * model.trainable_fraction:.3g}% trainable, "
        f"{model.layers} layers x {model.hidden}",
        f"cluster {cluster.name or 'custom'}: {cluster.world_size} devices; tiers (bandwidth per device) {tiers}; "
        f"{cluster.gpu_memory / 1e9:.3g} GB, {cluster.peak_flops / 1e12:.4g} TFLOPS peak",
        f"job     micro-batch {job.micro_batch} x seq {job.seq}, accum {job.accum}, recompute "
        f"{'on' if job.recompute else 'off'}, efficiency {job.efficiency:g}; micro-step comm hides behind up to "
        f"{overlap:.0%} of compute ({source}), the parameter sync behind at most one forward, the boundary gradient "
        "sync is exposed",
    ]


def render(model: ModelSpec, cluster: Cluster, job: Job, ranked: list[Estimate], shown: list[Estimate]) -> str:
    best = ranked[0]
    slow = best.slowest_tier
    unit = "node" if slow == cluster.tiers[-1].name else "rank" if best.group_sizes[slow] == 1 else "group"
    lines = describe(model, cluster, job)
    lines.append(f"best    {best.label}: {best.step_time:.4g} s per step, {best.tflops_per_device:.3g} TFLOPS per "
                 f"device, {best.memory.total / 1e9:.3g} GB per device; {best.reason}")
    lines.append("")
    head = f"{'#':>4}  {'plan':<24} {'step s':>8} {'x best':>7} {'mem GB':>7} {'free GB':>7} " \
           f"{slow + ' GB/' + unit:>14} {'exposed s':>9}  {'quality':<16}  why"
    lines.append(head)
    for i, e in enumerate(shown, 1):
        lines.append(f"{i:>4}  {e.label:<24} {e.step_time:>8.4g} {e.step_time / best.step_time:>7.3f} "
                     f"{e.memory.total / 1e9:>7.3g} {e.headroom / 1e9:>7.3g} {e.bytes_per_group(slow) / 1e9:>14.4g} "
                     f"{e.exposed:>9.3g}  {short_quality(e):<16}  {e.reason}")
    fit = sum(e.fits for e in ranked)
    lines.append(f"({len(ranked)} plans, {fit} fit; showing {len(shown)}{'; --top 0 for all' if len(shown) < len(ranked) else ''})")
    lines.append(tie_note(ranked, slow))
    return "\n".join(lines)


def tie_note(ranked: list[Estimate], slow: str) -> str:
    """The tie rule as the table applies it ([Note: tie rule] in cost/planner.py), with how many plans tie the best."""
    tied = sum(1 for e in ranked if e.fits and e.step_time <= ranked[0].step_time * (1 + REL_TIE))
    head = f"{tied} plans tie the best step time. " if tied > 1 else ""
    return (f"({head}Ties, step times within {REL_TIE:g} (relative), rank by less quantization, then more free GB "
            f"(memory headroom), then fewer {slow} GB (bytes on the slowest tier))")


def explain(model: ModelSpec, cluster: Cluster, job: Job, best: Estimate) -> str:
    """The chosen plan's step, tier by tier ([Note: terms per tier] in cost/explain.py)."""
    if best.tp != 1:
        return f"(--explain shows plans without tensor parallelism; {best.label} has TP collectives " \
               f"of {best.comm_tp:.3g} s per step on {cluster.tiers[0].name}, exposed)"
    est, rows = tier_terms(best.plan, model, cluster, job)
    rates = ", ".join(f"{spec} {rate / 1e9:.3g}" for spec, rate in cluster.codec_rates)
    source = f"measured per codec (GB/s of values): {rates}" if rates else \
        f"one measured rate, {cluster.codec_rate / 1e9:.3g} GB/s" if cluster.codec_rate else \
        "not measured: codecs priced free (give a cluster file from tiershard probe)"
    lines = [f"where the step goes, {best.label}: {est.step_time:.4g} s = compute {est.compute:.4g} s + exposed "
             f"{est.exposed:.4g} s; codec rates {source}",
             f"  {'tier':<8} {'GB/rank':>9} {'link s':>9} {'latency s':>9} {'codec s':>9} {'exposed s':>9}  codec"]
    for t in rows:
        verdict = "" if t.saved is None else \
            f"{'pays' if t.codec_pays else 'does not pay'}: saves {t.saved:.3g} s of link time, costs {t.codec:.3g} s"
        lines.append(f"  {t.tier:<8} {t.bytes_per_rank / 1e9:>9.4g} {t.link:>9.3g} {t.latency:>9.3g} {t.codec:>9.3g} "
                     f"{t.exposed:>9.3g}  {verdict}")
    lines.append("  (each collective is booked to the tier where its bytes take longest; exposed: what the overlap "
                 "model leaves on the critical path; a codec pays where its encode + decode time is below the link "
                 "time it saves against the same plan without codecs)")
    return "\n".join(lines)


def short_quality(e: Estimate) -> str:
    """``exact``, or ``lossy`` with the bits: ``w8 g8/4`` is int8 weights, int8 then int4 gradients per tier;
    ``w4d`` is int4 weight differences (qwd); ``outer50:f5:q4`` outer sync every 50 steps in 5 fragments, 4-bit."""
    if not e.plan.lossy:
        return "exact"
    w = re.search(r"weights int(\d+)( differences)?", e.quality)
    weights = f" w{w.group(1)}{'d' if w.group(2) else ''}" if w else ""
    grads = e.quality.partition("outer sync")[0].rstrip(", ").partition("gradients ")[2]
    bits = "/".join(part.strip()[3] for part in grads.split("/")) if grads else ""
    outer = e.plan.outer
    sync = f" outer{outer.every}{f':f{outer.fragments}' if outer.fragments > 1 else ''}" \
        f"{':q' + outer.codec.removeprefix('int')[0] if outer.codec else ''}" if outer else ""
    return f"lossy{weights}{' g' + bits if bits else ''}{' +ef' if e.plan.error_feedback and bits else ''}{sync}"


def as_json(model: ModelSpec, cluster: Cluster, job: Job, ranked: list[Estimate], shown: list[Estimate]) -> dict:
    return {
        "model": {"name": model.label, "params": model.params, "trainable": model.trainable,
                  "layers": model.layers, "hidden": model.hidden, "vocab": model.vocab},
        "cluster": {"name": cluster.name, "gpu_memory": cluster.gpu_memory, "peak_flops": cluster.peak_flops,
                    "codec_rate": cluster.codec_rate, "codec_rates": dict(cluster.codec_rates),
                    "tiers": [{"name": t.name, "size": t.size, "bandwidth": t.bandwidth, "latency": t.latency}
                              for t in cluster.tiers]},
        "job": {f.name: getattr(job, f.name) for f in fields(Job)},
        "best": str(ranked[0].plan),
        "best_tp": ranked[0].tp,
        "evaluated": len(ranked),
        "fit": sum(e.fits for e in ranked),
        "plans": [e.as_dict() for e in shown],
    }
