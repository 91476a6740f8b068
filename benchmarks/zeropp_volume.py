"""Bytes crossing node boundaries per optimizer step, in units of M, measured by comm_stats and by formula.

M = parameters x bytes of the param dtype (bf16 here). The ZeRO++ paper's accounting: ZeRO-3 moves about 3M
across nodes per step, ZeRO++ about 0.75M. Measured on gloo ranks of this machine (2 ranks per emulated
node), one micro-step per optimizer step:

    .venv/bin/python benchmarks/zeropp_volume.py              # 4 ranks = 2 nodes of 2
    .venv/bin/python benchmarks/zeropp_volume.py --ranks 8    # 4 nodes of 2
"""
from __future__ import annotations

import argparse


PLANS = ["zero3", "zero++", "GGG+qwz", "GGG+hpz", "GGG+qgz", "IIG", "NIG", "hsdp"]


def main() -> None:
    from tiershard.cluster.local import run_local
    from tiershard.bench.measure import cross_node_volume

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--plans", default=",".join(PLANS))
    args = parser.parse_args()
    results = run_local(cross_node_volume, args.ranks, args.plans.split(","))[0]
    print(f"{args.ranks} ranks, {args.ranks // 2} nodes of 2, bf16, one micro-step per optimizer step")
    print(f"{'plan':<18}{'measured / M':>14}{'formula / M':>14}")
    for plan, (measured, closed, _) in results.items():
        print(f"{plan:<18}{measured:>14.4f}{closed:>14.4f}")
    z3, zpp = results.get("zero3"), results.get("zero++")
    if z3 and zpp:
        print(f"zero3 / zero++ cross-node bytes: {z3[0] / zpp[0]:.2f}x")


if __name__ == "__main__":
    main()
