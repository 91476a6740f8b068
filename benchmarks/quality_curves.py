"""Validation loss of several plans over several seeds, against a reference plan: the table and the plot of
docs/zeropp.md's quality section.

Each run is a ``tiershard train --out DIR`` folder (its ``metrics.jsonl``). Runs are named by a pattern with
``{seed}`` in it, one pattern per plan; the first plan is the reference. For every plan the script prints, per
seed, the final validation loss and its difference from the reference's run of the same seed, then the mean and
standard deviation of those differences, and at every evaluated step the mean difference over the seeds.
Differences are paired by seed because a seed fixes the initial weights and the batches: the noise that remains
is the plans' own.

    .venv/bin/python benchmarks/quality_curves.py --seeds 1234 1 2 3 \\
        --plan zero3=runs/q/zero3_{seed} --plan zero++=runs/q/zpp_{seed} --png docs/zeropp-quality.png
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def val_losses(run: Path) -> dict[int, float]:
    """{step (1-based, as the progress line counts): validation loss} of one run."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "val":
            out[rec["step"] + 1] = rec["val_loss"]
    return out


def relative(curve: dict[int, float], ref: dict[int, float]) -> dict[int, float]:
    """Percent difference at the steps both curves have."""
    return {s: (curve[s] / ref[s] - 1) * 100 for s in sorted(set(curve) & set(ref))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", required=True)
    ap.add_argument("--plan", action="append", required=True, metavar="LABEL=PATTERN",
                    help="a plan's label and its run folders, with {seed} in the pattern; the first is the reference")
    ap.add_argument("--png", type=Path, help="write the curves (mean loss, mean difference) here")
    args = ap.parse_args()
    plans = [p.split("=", 1) for p in args.plan]
    if any(len(p) != 2 or "{seed}" not in p[1] for p in plans):
        ap.error("each --plan is LABEL=PATTERN with {seed} in the pattern")
    curves = {label: {s: val_losses(Path(pat.format(seed=s))) for s in args.seeds} for label, pat in plans}
    ref_label = plans[0][0]
    ref = curves[ref_label]

    print(f"final validation loss; difference from {ref_label} of the same seed")
    print("| plan | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | sd |")
    print("| --- |" + " ---: |" * (len(args.seeds) + 2))
    means: dict[str, dict[int, float]] = {}
    for label, _ in plans:
        lasts = [curves[label][s][max(curves[label][s])] for s in args.seeds]
        if label == ref_label:
            print(f"| {label} | " + " | ".join(f"{v:.4f}" for v in lasts) + " |  |  |")
            continue
        per_seed = [relative(curves[label][s], ref[s]) for s in args.seeds]
        diffs = [p[max(curves[label][s])] for p, s in zip(per_seed, args.seeds)]
        sd = f"{statistics.stdev(diffs):.2f}" if len(diffs) > 1 else ""
        print(f"| {label} | " + " | ".join(f"{v:.4f} ({d:+.1f}%)" for v, d in zip(lasts, diffs))
              + f" | {statistics.mean(diffs):+.2f}% | {sd} |")
        steps = sorted(set.intersection(*(set(p) for p in per_seed)))
        means[label] = {t: statistics.mean(p[t] for p in per_seed) for t in steps}

    steps = sorted(set.intersection(*(set(m) for m in means.values()))) if means else []
    print(f"\nmean difference from {ref_label} over the seeds, by step")
    print("| step | " + " | ".join(means) + " |")
    print("| ---: |" + " ---: |" * len(means))
    for t in steps:
        print(f"| {t} | " + " | ".join(f"{means[m][t]:+.2f}%" for m in means) + " |")
    if args.png:
        plot(curves, means, ref_label, args.seeds, args.png)
        print(f"\nwrote {args.png}")


def plot(curves: dict, means: dict, ref_label: str, seeds: list[str], path: Path) -> None:
    """Left: each plan's validation loss averaged over the seeds; right: its mean difference from the reference."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colour = {label: f"C{i}" for i, label in enumerate(curves)}     # one colour per plan in both panels
    for label, runs in curves.items():
        steps = sorted(set.intersection(*(set(runs[s]) for s in seeds)))
        left.plot(steps, [statistics.mean(runs[s][t] for s in seeds) for t in steps], label=label, marker=".",
                  color=colour[label])
    left.set(xlabel="step", ylabel=f"validation loss (mean of {len(seeds)} seeds)", yscale="log")
    left.legend()
    right.axhline(0, color="black", lw=0.8)
    for band in (-0.5, 0.5):
        right.axhline(band, color="grey", lw=0.6, ls="--")
    for label, m in means.items():
        right.plot(sorted(m), [m[t] for t in sorted(m)], label=label, marker=".", color=colour[label])
    right.set(xlabel="step", ylabel=f"difference from {ref_label}, % (mean over seeds)")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
