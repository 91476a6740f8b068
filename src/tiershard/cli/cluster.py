"""``tiershard cluster``: emulate nodes with slow links on this machine (network namespaces, a bridge, tbf caps).

  tiershard cluster up --nodes 2 --ranks-per-node 2 --inter-bw 250mbit
  tiershard cluster up --tiers 2,4,8 --rates none,2gbit,250mbit   # three tiers: pairs, nodes of 2 pairs, world
  tiershard cluster status
  tiershard cluster set-bw 1gbit            # or none
  tiershard cluster check --size 16MiB      # world and intra-node all_reduce: time and NIC bytes vs the formula
  tiershard cluster launch -- python examples/quickstart.py IIG
  tiershard cluster down

Each node is a namespace ts-<name>-n<i> with NIC eth0 at 10.77.0.<i+1>; every uplink and switch port is capped
at --inter-bw (a tc rate: 250mbit, 1gbit, ..., or none). Ranks of one node talk over loopback, so only inter-node
traffic is capped and counted. With --tiers G,N,W (three tiers) the ranks of each group of G share a namespace
(loopback), the N/G groups of a node reach each other through the node's bridge over links capped at the middle
rate, and nodes reach each other over uplinks capped at the last rate; --rates gives one rate per tier, innermost
(loopback: none) first. `up` refuses to build over an existing cluster of the same name; --replace tears
it down and builds it again. Needs root and iproute2.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import CliError
from .plan import one_line_errors


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cluster", help="emulate nodes with capped links on this machine (root)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    def named(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
        q.add_argument("--name", default="main", help="cluster name, part of its namespace names (default main)")
        one_line_errors(q)
        return q

    up = named(sub.add_parser("up", help="create the namespaces, links and caps"))
    up.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    up.add_argument("--ranks-per-node", type=int, default=1, help="ranks that `launch` starts per node (default 1)")
    up.add_argument("--inter-bw", default="none",
                    help="cap per node link and direction, a tc rate: 250mbit, 1gbit, ... or none (default none)")
    up.add_argument("--tiers", help="tier sizes innermost first instead of --nodes/--ranks-per-node: 2,4 (2 nodes of "
                                    "2 ranks) or 2,4,8 (2 nodes of 2 groups of 2 ranks)")
    up.add_argument("--rates", help="with --tiers: one tc rate per tier, innermost (none) first, e.g. "
                                    "none,2gbit,250mbit (default: none for every tier)")
    up.add_argument("--replace", action="store_true", help="tear down an existing cluster of this name first")

    down = named(sub.add_parser("down", help="remove the cluster's namespaces (and stop what runs in them)"))
    down.add_argument("--all", action="store_true", help="remove every ts- cluster on this machine")

    status = named(sub.add_parser("status", help="nodes, addresses, cap and NIC byte counters"))
    status.set_defaults(name=None)
    status.add_argument("--json", action="store_true", help="print JSON")

    bw = named(sub.add_parser("set-bw", help="change the cap of a running cluster"))
    bw.add_argument("rate", nargs="?", help="the inter-node cap: a tc rate (250mbit, 1gbit, ...) or none")
    bw.add_argument("--rates", help="every tier's cap instead, innermost first, e.g. none,2gbit,250mbit")

    check = named(sub.add_parser("check", help="run world and intra-node gloo all_reduces; report time and NIC bytes"))
    check.add_argument("--size", default="16MiB", help="all_reduce buffer (default 16MiB)")
    check.add_argument("--iters", type=int, default=3, help="timed ops per phase; the median is reported")
    check.add_argument("--json", action="store_true", help="print JSON")

    launch = named(sub.add_parser("launch", help="run a command once per rank, torchrun-style, across the nodes"))
    launch.add_argument("--timeout", type=float, default=None, help="seconds before all ranks are stopped")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="the command, after --")

    one_line_errors(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cluster.launch import LaunchError
    from ..cluster.netns import ClusterError

    try:
        return ACTIONS[args.action](args)
    except (ClusterError, LaunchError) as err:
        raise CliError(str(err)) from None
    except KeyboardInterrupt:
        print(f"tiershard cluster {args.action}: interrupted", file=sys.stderr)
        return 130


def _up(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster
    from ..cluster.launch import terminate_as_interrupt
    from ..cluster.netns import format_rate

    if args.tiers:
        sizes = _sizes(args.tiers)
        rates = args.rates.split(",") if args.rates else ["none"] * len(sizes)
        cluster = EmulatedCluster.from_tiers(sizes, rates, name=args.name, replace=args.replace)
    elif args.rates:
        raise CliError("--rates gives one rate per tier of --tiers: add --tiers (e.g. --tiers 2,4,8 --rates "
                       "none,2gbit,250mbit), or use --inter-bw")
    else:
        cluster = EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_bw, name=args.name,
                                  replace=args.replace)
    with terminate_as_interrupt():
        cluster.up()
    groups = "" if cluster.groups_per_node == 1 else \
        f" ({cluster.groups_per_node} groups of {cluster.ranks_per_group}, group links {format_rate(cluster.node_bw)})"
    print(f"cluster {cluster.name!r} up: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks{groups}, inter-node "
          f"cap {format_rate(cluster.inter_bw)} each way")
    _print_status(cluster)
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CliError(f"--tiers {text!r} must be a comma list of tier sizes, innermost first, e.g. 2,4,8") from None


def _down(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster, down_all
    from ..cluster.netns import list_clusters

    if args.all:
        names = down_all()
        print(f"removed {len(names)} cluster(s){': ' + ', '.join(names) if names else ''}")
        return 0
    cluster = EmulatedCluster(1, 1, None, name=args.name)
    if not cluster.exists():
        others = list(list_clusters())
        hint = f" (up: {', '.join(others)}; use --name or --all)" if others else ""
        print(f"no cluster {args.name!r} is up{hint}")
        return 0
    cluster.down()
    print(f"cluster {args.name!r} removed")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster
    from ..cluster.netns import list_clusters

    names = [args.name] if args.name else list(list_clusters())
    if not names:
        print("no tiershard cluster is up (start one with `tiershard cluster up`)")
        return 1
    clusters = [EmulatedCluster.attach(name) for name in names]
    if args.json:
        print(json.dumps([_describe(c) for c in clusters], indent=1))
        return 0
    for cluster in clusters:
        _print_status(cluster)
    return 0


def _describe(cluster) -> dict:
    from ..cluster.netns import IFNAME, format_rate

    caps, counts = cluster.link_caps(), cluster.nic_bytes()
    doc = {"name": cluster.name, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
           "inter_bw": format_rate(cluster.bandwidth()),
           "node_list": [{"node": i, "namespace": cluster.node_namespace(i),
                          "address": "-" if cluster.groups_per_node > 1 else cluster.node_address(i),
                          "nic": IFNAME, "uplink_cap": format_rate(caps[i]["uplink"]),
                          "port_cap": format_rate(caps[i]["port"]), "tx_bytes": counts[i]["tx"],
                          "rx_bytes": counts[i]["rx"]} for i in range(cluster.nodes)]}
    if cluster.groups_per_node > 1:
        groups = cluster.group_nic_bytes()
        doc.update(tiers=list(cluster.tiers), tier_names=list(cluster.tier_names),
                   groups_per_node=cluster.groups_per_node, node_bw=format_rate(caps[0]["groups"][0]["uplink"]))
        for i, node in enumerate(doc["node_list"]):
            node["groups"] = [{"group": j, "namespace": cluster.group_namespace(i, j),
                               "address": cluster.rank_address((i * cluster.groups_per_node + j)
                                                               * cluster.ranks_per_group),
                               "nic": IFNAME, "uplink_cap": format_rate(caps[i]["groups"][j]["uplink"]),
                               "port_cap": format_rate(caps[i]["groups"][j]["port"]),
                               "tx_bytes": groups[i][j]["tx"], "rx_bytes": groups[i][j]["rx"]}
                              for j in range(cluster.groups_per_node)]
    return doc


def _print_status(cluster) -> None:
    doc = _describe(cluster)
    print(f"cluster {doc['name']!r}: {doc['nodes']} nodes x {doc['ranks_per_node']} ranks "
          f"(world {doc['nodes'] * doc['ranks_per_node']}), cap {doc['inter_bw']} per link and direction")
    print(f"  {'node':>4}  {'namespace':<16} {'address':<12} {'nic':<5} {'cap up/down':<17} "
          f"{'tx bytes':>15} {'rx bytes':>15}")
    if "tiers" in doc:
        print(f"  three tiers {tuple(doc['tiers'])} ({', '.join(doc['tier_names'])}): {doc['groups_per_node']} groups "
              f"per node on a node bridge, group links {doc['node_bw']} per direction")
    for n in doc["node_list"]:
        print(f"  {n['node']:>4}  {n['namespace']:<16} {n['address']:<12} {n['nic']:<5} "
              f"{n['uplink_cap'] + '/' + n['port_cap']:<17} {n['tx_bytes']:>15,} {n['rx_bytes']:>15,}")
        for g in n.get("groups", []):
            print(f"  {'':>4}  {g['namespace']:<16} {g['address']:<12} {g['nic']:<5} "
                  f"{g['uplink_cap'] + '/' + g['port_cap']:<17} {g['tx_bytes']:>15,} {g['rx_bytes']:>15,}")


def _set_bw(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster
    from ..cluster.netns import format_rate, parse_rate

    if (args.rate is None) == (args.rates is None):
        raise CliError("set-bw takes either the inter-node rate (set-bw 1gbit) or --rates for every tier")
    if args.rates is not None:
        rates = args.rates.split(",")
        for rate in rates:
            parse_rate(rate)              # a bad rate is reported before touching the cluster
        cluster = EmulatedCluster.attach(args.name)
        cluster.set_tier_rates(rates)
        print(f"cluster {cluster.name!r}: caps {', '.join(format_rate(b) for b in cluster.tier_rates)} for tiers "
              f"{', '.join(cluster.tier_names)}")
        return 0
    bits = parse_rate(args.rate)          # a bad rate is reported before touching the cluster
    cluster = EmulatedCluster.attach(args.name)
    cluster.set_bandwidth(bits)
    print(f"cluster {cluster.name!r}: cap {format_rate(cluster.bandwidth())} per link and direction")
    return 0


def _check(args: argparse.Namespace) -> int:
    from ..cluster.check import summarize_allreduce
    from ..cluster.emulated import EmulatedCluster
    from ..cluster.netns import format_rate
    from ..cost.presets import parse_bytes

    try:
        nbytes = int(parse_bytes(args.size))
    except ValueError as err:
        raise CliError(str(err)) from None
    if nbytes < 4 or args.iters < 1:
        raise CliError("--size must be at least 4B and --iters at least 1")
    cluster = EmulatedCluster.attach(args.name)
    if cluster.world_size < 2:
        raise CliError(f"cluster {cluster.name!r} has 1 rank: up one with --nodes 2 or more")
    if cluster.groups_per_node > 1:
        return _check_tiers(cluster, nbytes, args)
    results = cluster.launch([sys.executable, "-m", "tiershard.cluster", "allreduce", "--bytes", str(nbytes),
                              "--iters", str(args.iters)])
    summary = summarize_allreduce(results, cluster.nodes, cluster.ranks_per_node)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
                          "inter_bw": format_rate(cluster.inter_bw), "phases": summary}, indent=1))
        return 0
    mib = 2**20
    print(f"cluster {cluster.name!r}: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks, cap "
          f"{format_rate(cluster.inter_bw)}; all_reduce of {nbytes / mib:.1f} MiB float32, median of {args.iters}")
    for s in summary:
        what = "world" if s["phase"] == "world" else "intra-node"
        tx = [s["nic"][k]["tx"] for k in sorted(s["nic"], key=int)]
        rx = [s["nic"][k]["rx"] for k in sorted(s["nic"], key=int)]
        print(f"  {what:<10} {s['seconds'] * 1e3:8.1f} ms   {s['bytes'] / s['seconds'] / mib:8.1f} MiB/s   NIC tx "
              f"per node {', '.join(f'{t / mib:.2f}' for t in tx)} MiB, rx {', '.join(f'{r / mib:.2f}' for r in rx)} "
              f"MiB (ring formula {s['expected_nic_bytes'] / mib:.2f})")
    return 0


def _check_tiers(cluster, nbytes: int, args: argparse.Namespace) -> int:
    """Three tiers: world all_reduces only; each tier's link bytes per node and op, read outside the ranks around
    the launch (warm-up and setup included, so a little above the formula)."""
    from ..cluster.counters import ring_allreduce_tier_bytes
    from ..cluster.netns import format_rate

    before = cluster.tier_nic_bytes()
    results = cluster.launch([sys.executable, "-m", "tiershard.cluster", "allreduce", "--bytes", str(nbytes),
                              "--iters", str(args.iters), "--phases", "world"])
    after = cluster.tier_nic_bytes()
    ops = args.iters + 1
    seconds = max(sorted(json.loads(line)["seconds"])[args.iters // 2] for r in results
                  for line in r.stdout.splitlines() if line.startswith("{"))
    expected = ring_allreduce_tier_bytes(nbytes, cluster.tiers)
    tiers = {t: {n: (after[t][n]["tx"] - before[t][n]["tx"]) / ops for n in after[t]} for t in after}
    if args.json:
        print(json.dumps({"cluster": cluster.name, "tiers": list(cluster.tiers), "rates":
                          [format_rate(b) for b in cluster.tier_rates], "bytes": nbytes, "seconds": seconds,
                          "tx_per_op": tiers, "formula": expected}, indent=1))
        return 0
    mib = 2**20
    print(f"cluster {cluster.name!r}: tiers {cluster.tiers} ({', '.join(cluster.tier_names)}), caps "
          f"{', '.join(format_rate(b) for b in cluster.tier_rates)}; world all_reduce of {nbytes / mib:.1f} MiB "
          f"float32: {seconds * 1e3:.1f} ms (median of {args.iters})")
    for tier in ("node", "world"):
        sent = ", ".join(f"{tiers[tier][n] / mib:.2f}" for n in sorted(tiers[tier]))
        print(f"  {tier:<5} links: tx per node and op {sent} MiB (ring formula {expected[tier] / mib:.2f}; the "
              f"launch's setup and barriers included)")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise CliError("no command to launch: give it after --, e.g. tiershard cluster launch -- python train.py")
    cluster = EmulatedCluster.attach(args.name)
    cluster.launch(argv, timeout=args.timeout, echo=True)
    return 0


ACTIONS = {"up": _up, "down": _down, "status": _status, "set-bw": _set_bw, "check": _check, "launch": _launch}
