"""``tiershard cluster``: emulate nodes with slow links on this machine (network namespaces, a bridge, tbf caps).

  tiershard cluster up --nodes 2 --ranks-per-node 2 --inter-bw 250mbit
  tiershard cluster status
  tiershard cluster set-bw 1gbit            # or none
  tiershard cluster check --size 16MiB      # world and intra-node all_reduce: time and NIC bytes vs the formula
  tiershard cluster launch -- python examples/quickstart.py IIG
  tiershard cluster down

Each node is a namespace ts-<name>-n<i> with NIC eth0 at 10.77.0.<i+1>; every uplink and switch port is capped
at --inter-bw (a tc rate: 250mbit, 1gbit, ..., or none). Ranks of one node talk over loopback, so only inter-node
traffic is capped and counted. `up` refuses to build over an existing cluster of the same name; --replace tears
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
    up.add_argument("--replace", action="store_true", help="tear down an existing cluster of this name first")

    down = named(sub.add_parser("down", help="remove the cluster's namespaces (and stop what runs in them)"))
    down.add_argument("--all", action="store_true", help="remove every ts- cluster on this machine")

    status = named(sub.add_parser("status", help="nodes, addresses, cap and NIC byte counters"))
    status.set_defaults(name=None)
    status.add_argument("--json", action="store_true", help="print JSON")

    bw = named(sub.add_parser("set-bw", help="change the cap of a running cluster"))
    bw.add_argument("rate", help="a tc rate (250mbit, 1gbit, ...) or none")

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
    from ..cluster.emulated import ClusterError, LaunchError

    try:
        return ACTIONS[args.action](args)
    except (ClusterError, LaunchError) as err:
        raise CliError(str(err)) from None
    except KeyboardInterrupt:
        print(f"tiershard cluster {args.action}: interrupted", file=sys.stderr)
        return 130


def _up(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster, _terminate_as_interrupt, format_rate

    cluster = EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_bw, name=args.name, replace=args.replace)
    with _terminate_as_interrupt():
        cluster.up()
    print(f"cluster {cluster.name!r} up: {cluster.nodes} nodes x {cluster.ranks_per_node} ranks, inter-node cap "
          f"{format_rate(cluster.inter_bw)} each way")
    _print_status(cluster)
    return 0


def _down(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster, down_all, list_clusters

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
    from ..cluster.emulated import EmulatedCluster, list_clusters

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
    from ..cluster.emulated import IFNAME, format_rate

    caps, counts = cluster.link_caps(), cluster.nic_bytes()
    return {"name": cluster.name, "nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node,
            "inter_bw": format_rate(cluster.bandwidth()),
            "node_list": [{"node": i, "namespace": cluster.node_namespace(i), "address": cluster.node_address(i),
                           "nic": IFNAME, "uplink_cap": format_rate(caps[i]["uplink"]),
                           "port_cap": format_rate(caps[i]["port"]), "tx_bytes": counts[i]["tx"],
                           "rx_bytes": counts[i]["rx"]} for i in range(cluster.nodes)]}


def _print_status(cluster) -> None:
    doc = _describe(cluster)
    print(f"cluster {doc['name']!r}: {doc['nodes']} nodes x {doc['ranks_per_node']} ranks "
          f"(world {doc['nodes'] * doc['ranks_per_node']}), cap {doc['inter_bw']} per link and direction")
    print(f"  {'node':>4}  {'namespace':<16} {'address':<12} {'nic':<5} {'cap up/down':<17} "
          f"{'tx bytes':>15} {'rx bytes':>15}")
    for n in doc["node_list"]:
        print(f"  {n['node']:>4}  {n['namespace']:<16} {n['address']:<12} {n['nic']:<5} "
              f"{n['uplink_cap'] + '/' + n['port_cap']:<17} {n['tx_bytes']:>15,} {n['rx_bytes']:>15,}")


def _set_bw(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster, format_rate, parse_rate

    bits = parse_rate(args.rate)          # a bad rate is reported before touching the cluster
    cluster = EmulatedCluster.attach(args.name)
    cluster.set_bandwidth(bits)
    print(f"cluster {cluster.name!r}: cap {format_rate(cluster.bandwidth())} per link and direction")
    return 0


def _check(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster, format_rate, summarize_allreduce
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


def _launch(args: argparse.Namespace) -> int:
    from ..cluster.emulated import EmulatedCluster

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise CliError("no command to launch: give it after --, e.g. tiershard cluster launch -- python train.py")
    cluster = EmulatedCluster.attach(args.name)
    cluster.launch(argv, timeout=args.timeout, echo=True)
    return 0


ACTIONS = {"up": _up, "down": _down, "status": _status, "set-bw": _set_bw, "check": _check, "launch": _launch}
