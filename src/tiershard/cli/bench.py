"""``tiershard bench``: tiershard's plans against FSDP2 and DeepSpeed on the emulated cluster, side by side.

  tiershard bench                                        # 3.7M GPT, 2 nodes x 2 ranks, every system,
                                                         # accum 1 and 4, at 250mbit, 1gbit and uncapped
  tiershard bench --size 26M --rates 1gbit,none --accum 1 --out bench-26M
  tiershard bench --systems zero3,IIG,auto,fsdp2,deepspeed-hpz --rates 250mbit --check
  tiershard bench --local --systems zero3,fsdp2 --accum 2   # loopback ranks: no root, no caps, no NIC counters
  tiershard bench --tiers 2,4,8 --rates 'none,2gbit,250mbit;none,none,none' --systems IIG,zero++,auto,fsdp2
                                                         # three tiers: 2 nodes x 2 pairs x 2 ranks, two settings

Every system trains the same GPT from the same seed on the same batches (bf16 gathers, compute and reductions,
fp32 masters, AdamW) through one per-rank loop; the systems alternate round by round, warm-up excluded. Per
(rate, accum) a table gives, per system: median step time, tokens/s, node-crossing bytes per step and node from
the NIC counters and (our plans) from ts.comm_stats(), the cost model's prediction, the step time relative to
FSDP2 fully_shard and DeepSpeed ZeRO-3 + hpZ, the floor max(compute, bytes / link rate), peak memory per rank
and the final loss. The bench check compares NIC and comm_stats bytes for every plan and capped tier (within 5%;
--check makes a failure the exit code). With --tiers the cluster has those tiers (three: groups of ranks sharing a
namespace, nodes of groups behind a capped bridge, the world), and each ;-separated entry of --rates sets every
tier's cap, innermost (none) first. Needs root for the emulated cluster (network namespaces), unless --local.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from ..bench import DEFAULT_SYSTEMS, PEERS
from ..bench.config import SLOW_WORLD
from . import CliError
from .plan import one_line_errors

DEFAULTS = dict(size="3.7M", systems=",".join(DEFAULT_SYSTEMS), accum="1,4", rates="250mbit,1gbit,none")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="tiershard plans vs FSDP2 and DeepSpeed on the emulated cluster (root)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=DEFAULTS["size"], help="GPT size: 3.7M (default), 26M or tiny")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--tiers", help="tier sizes innermost first instead of --nodes/--ranks-per-node, e.g. 2,4,8 "
                                   "(2 nodes x 2 groups x 2 ranks: tiers pair, node, world); --rates then sets "
                                   "every tier per entry, entries separated by ';'")
    p.add_argument("--systems", default=DEFAULTS["systems"],
                   help="comma list of our plans (any plan text, p=pair,g=node,os=world too, or auto: the planner's "
                        f"pick for this cluster, rate and accum) and peers ({', '.join(PEERS)}); "
                        f"default {DEFAULTS['systems']}")
    p.add_argument("--accum", default=DEFAULTS["accum"],
                   help="micro-steps per optimizer step, comma list (default 1,4)")
    p.add_argument("--rates", default=DEFAULTS["rates"],
                   help="inter-node caps, tc rates (250mbit, 1gbit, ..., none); default 250mbit,1gbit,none. With "
                        "--tiers: settings separated by ';', each a comma list of one rate per tier, innermost (none) "
                        "first, e.g. 'none,2gbit,250mbit;none,none,none' (default: every tier uncapped)")
    p.add_argument("--slow-world", action="store_true",
                   help="two islands behind a slow link: systems " + ",".join(SLOW_WORLD["systems"]) + ", rates "
                        + ",".join(SLOW_WORLD["rates"]) + ", accum 1, " + str(SLOW_WORLD["steps_per_round"])
                        + " steps per round (one outer period), auto with --allow-lossy --allow-outer; flags given "
                        "explicitly win")
    p.add_argument("--allow-lossy", action="store_true", help="let auto pick quantized plans (qwz, qgz) too")
    p.add_argument("--allow-outer", action="store_true",
                   help="with --allow-lossy, let auto pick outer-sync plans (+outer=H) too")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--steps-per-round", type=int, default=2, help="timed steps per system and round (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per system first (default 1)")
    p.add_argument("--batch-per-rank", type=int, default=2, help="rows per rank and micro-step (default 2)")
    p.add_argument("--seq", type=int, help="tokens per row (default: the model's block size, 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intra-bw", help="bandwidth per rank inside a node for the planner (e.g. 2GB/s); default: "
                                      "measured by tiershard probe")
    p.add_argument("--out", help="folder for bench.md, bench.json and the PNG plots")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless NIC bytes and comm_stats bytes agree within 5%% for every plan and capped "
                        "tier")
    p.add_argument("--local", action="store_true",
                   help="run on loopback gloo ranks of this machine: no root, no rate caps, no NIC counters")
    p.add_argument("--name", default="bench", help="name of the emulated cluster (default bench)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch of the ranks (default 3600)")
    p.set_defaults(func=run)
    one_line_errors(p)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CliError(f"--{what} {text!r} must be a comma list of integers, e.g. 1,4") from None
    if not values:
        raise CliError(f"--{what} is empty: give e.g. 1,4")
    return values


def split_systems(text: str) -> tuple[str, ...]:
    """The comma list of systems; a plan of the ``p=..,g=..,os=..`` form keeps its own commas."""
    return tuple(s.strip() for s in re.split(r",(?!\s*(?:g|os)=)", text) if s.strip())


def config(args: argparse.Namespace):
    """The BenchConfig the arguments describe."""
    from ..bench import BenchConfig
    from ..cost.presets import parse_bandwidth

    intra = None
    if args.intra_bw is not None:
        try:
            intra = parse_bandwidth(args.intra_bw)
        except ValueError as err:
            raise CliError(f"--intra-bw: {err}") from None
    if args.check and args.local:
        raise CliError("--check compares NIC counters, which --local does not have: drop --local (as root) or --check")
    if args.slow_world:
        if args.tiers:
            raise CliError("--slow-world is two tiers, islands of --ranks-per-node ranks: drop --tiers")
        for flag, key, value in (("systems", "systems", ",".join(SLOW_WORLD["systems"])),
                                 ("rates", "rates", ",".join(SLOW_WORLD["rates"])), ("accum", "accum", "1")):
            if getattr(args, flag) == DEFAULTS[key]:
                setattr(args, flag, value)
        if args.steps_per_round == 2:
            args.steps_per_round = SLOW_WORLD["steps_per_round"]
        args.allow_lossy = args.allow_outer = True
    nodes, per_node, tiers = args.nodes, args.ranks_per_node, None
    rates = tuple(r.strip() for r in args.rates.split(",") if r.strip())
    if args.tiers:
        tiers = _ints(args.tiers, "tiers")
        if len(tiers) < 2 or tiers[-1] % tiers[-2]:
            raise CliError(f"--tiers {args.tiers!r} must be 2 or 3 sizes innermost first, each dividing the next, "
                           "e.g. 2,4,8")
        nodes, per_node = tiers[-1] // tiers[-2], tiers[-2]
        rates = tuple(r.strip() for r in args.rates.split(";") if r.strip()) if args.rates != DEFAULTS["rates"] \
            else (",".join(["none"] * len(tiers)),)
    elif ";" in args.rates:
        raise CliError(f"--rates {args.rates!r}: ';' separates per-tier settings, which need --tiers (e.g. --tiers "
                       "2,4,8 --rates 'none,2gbit,250mbit')")
    return BenchConfig(size=args.size, nodes=nodes, ranks_per_node=per_node, tiers=tiers,
                       systems=split_systems(args.systems),
                       accums=_ints(args.accum, "accum"), rates=rates,
                       rounds=args.rounds, steps_per_round=args.steps_per_round, warmup=args.warmup,
                       batch_per_rank=args.batch_per_rank, seq=args.seq, seed=args.seed, local=args.local,
                       intra_bw=intra, cluster_name=args.name, timeout=args.timeout,
                       allow_lossy=args.allow_lossy, allow_outer=args.allow_outer)


def run(args: argparse.Namespace) -> int:
    from ..bench import BenchError, render_check, render_markdown, run_bench, write_outputs

    cfg = config(args)
    if args.local and args.rates != DEFAULTS["rates"]:
        print("tiershard bench: --local runs uncapped loopback ranks; --rates is not applied", file=sys.stderr)
    try:
        results = run_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    except BenchError as err:
        raise CliError(str(err)) from None
    except KeyboardInterrupt:
        print("tiershard bench: interrupted", file=sys.stderr)
        return 130
    command = "tiershard bench " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    print(render_markdown(results, command))
    if args.out:
        paths = write_outputs(results, Path(args.out), command)
        print(f"tiershard bench: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    if args.check:
        failed = [c for c in results["check"] if not c["ok"]]
        if not results["check"] or failed:
            print(f"tiershard bench: check failed: {render_check(results).splitlines()[0]}", file=sys.stderr)
            return 1
    return 0
