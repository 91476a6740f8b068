"""Step time of tiershard against torch FSDP2 on the same GPT, ranks, batches and per-rank loop.

4 gloo ranks on loopback as 2 nodes of 2, bf16 gathers, compute and reductions (fp32 masters), AdamW,
2 micro-steps per optimizer step (non-final ones in ``ts.no_sync`` or FSDP2's equivalent). Every system is
trained by ``tiershard.bench.peers`` (the same ``Trainer.train`` loop; tiershard through its public API as system
``tiershard:PLAN``), systems alternate round by round, warm-up steps are excluded, and the table gives the
median over measured steps of the slowest rank's step time.

FSDP2's HSDP is ``fsdp2-hsdp-ar``: non-final micro-steps keep the in-node reduce-scatter and skip the
cross-node all-reduce, which is what tiershard ``hsdp`` does under ``no_sync``; ``fsdp2-hsdp`` (all sync
skipped) can be added with ``--systems``. Times on CPU ranks show the runtime's overheads and gloo's costs,
not a GPU cluster's::

    .venv/bin/python benchmarks/step_time.py                          # both sizes
    .venv/bin/python benchmarks/step_time.py --sizes 3.7M --rounds 3
    .venv/bin/python benchmarks/step_time.py --systems fsdp2,fsdp2-hsdp,fsdp2-hsdp-ar,deepspeed-zero3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiershard.train.models.gpt import GPTConfig, gpt_config

# vocab and sequence picked so the counts land near 3.7M and 26M parameters
SIZES: dict[str, GPTConfig] = {
    "3.7M": gpt_config("small", vocab_size=2048, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "26M": gpt_config("small", vocab_size=2048, block_size=128, n_layer=8, n_head=8, n_embd=512),
}
SYSTEMS = ["fsdp2", "fsdp2-hsdp-ar", "tiershard:zero3", "tiershard:hsdp"]


def hsdp_peer(systems: list[str]) -> str | None:
    return next((s for s in ("fsdp2-hsdp-ar", "fsdp2-hsdp") if s in systems), None)


def table(results: dict[str, dict]) -> str:
    """Markdown: per size and system the median step, its ratio to fully_shard and (HSDP rows) to FSDP2 HSDP."""
    lines = ["| system | size | params | median step ms | vs FSDP2 fully_shard | vs FSDP2 HSDP | last loss |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for size, per_system in results.items():
        median = {s: statistics.median(r["step_times"]) * 1e3 for s, r in per_system.items()}
        peer = hsdp_peer(list(per_system))
        for system, r in per_system.items():
            vs_fsdp = f"{median[system] / median['fsdp2']:.2f}" if "fsdp2" in median else "-"
            hsdp = peer and (system.startswith("fsdp2-hsdp") or system.endswith(":hsdp"))
            vs_hsdp = f"{median[system] / median[peer]:.2f}" if hsdp else "-"
            lines.append(f"| {system} | {size} | {r['params'] / 1e6:.2f}M | {median[system]:.0f} | {vs_fsdp} "
                         f"| {vs_hsdp} | {r['losses'][-1]:.4f} |")
    return "\n".join(lines)


def main() -> None:
    from tiershard.cluster.local import run_local
    from tiershard.bench.peers import interleaved

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per system before the rounds")
    parser.add_argument("--micro-steps", type=int, default=2)
    parser.add_argument("--batch-per-rank", type=int, default=2)
    args = parser.parse_args()
    systems = args.systems.split(",")
    options = dict(micro_steps=args.micro_steps, batch_per_rank=args.batch_per_rank,
                   ranks_per_node=args.ranks_per_node, param_dtype=torch.bfloat16)

    results = {}
    for size in args.sizes.split(","):
        cfg = SIZES[size]
        start = time.perf_counter()
        results[size] = run_local(interleaved, args.ranks, systems, cfg, args.rounds, args.steps_per_round,
                                  args.warmup, options)[0]
        params = next(iter(results[size].values()))["params"]
        print(f"{size}: {params:,} parameters ({cfg.n_layer} blocks x {cfg.n_embd}, vocab {cfg.vocab_size}, "
              f"seq {cfg.block_size}), {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{args.ranks} gloo ranks as {args.ranks // args.ranks_per_node} nodes of {args.ranks_per_node}, bf16, "
          f"{args.micro_steps} micro-steps x {args.batch_per_rank} rows per rank; median of "
          f"{args.rounds} interleaved rounds x {args.steps_per_round} steps after {args.warmup} warm-up\n")
    print(table(results))


if __name__ == "__main__":
    main()
