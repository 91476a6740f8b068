"""``tiershard probe`` on 4 CPU ranks (2 emulated nodes of 2): the file parses, every tier gets positive numbers,
and ``tiershard plan --cluster-file`` reads it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tiershard.cli.probe import fit


def test_probe_writes_a_cluster_file_plan_reads(tmp_path):
    out = tmp_path / "cluster.toml"
    proc = subprocess.run([sys.executable, "-m", "tiershard.cli", "probe", "--nproc", "4", "--ranks-per-node", "2",
                           "--sizes", "4KB,32KB", "--iters", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = tomllib.loads(out.read_text())
    tiers = doc["cluster"]["tiers"]
    assert [(t["name"], t["size"]) for t in tiers] == [("node", 2), ("world", 4)]
    for tier in tiers:
        for kind in ("", "all_to_all_", "reduce_scatter_", "all_reduce_", "broadcast_"):
            for key in (f"{kind}bandwidth", f"{kind}latency"):
                assert tier[key] > 0, (tier["name"], key)
    codecs = doc["cluster"]["codecs"]           # every codec the plans use, encode and decode measured
    assert set(codecs) == {"int8:2048", "int8:128:h", "int4:128:h:sr", "int4:2048", "int4:64"}
    for rates in codecs.values():
        assert rates["rate"] == pytest.approx(2 / (1 / rates["encode"] + 1 / rates["decode"]), rel=1e-4)
    assert "codec int4:128:h:sr" in proc.stdout and "reduce-scatter" in proc.stdout
    plan = subprocess.run([sys.executable, "-m", "tiershard.cli", "plan", "--cluster-file", str(out),
                           "--gpus", "16", "--gpus-per-node", "4", "--model", "1.3b", "--json", "--top", "1"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    result = json.loads(plan.stdout)
    assert [t["bandwidth"] for t in result["cluster"]["tiers"]] == [t["bandwidth"] for t in tiers]
    assert result["cluster"]["codec_rates"] == pytest.approx({spec: r["rate"] for spec, r in codecs.items()})


def test_fit_recovers_bandwidth_and_latency():
    k, bandwidth, latency = 4, 2e9, 1e-5
    points = [(x, (k - 1) * latency + x / bandwidth) for x in (1e4, 1e5, 1e6)]
    b, a = fit(points, k)
    assert abs(b / bandwidth - 1) < 1e-9 and abs(a / latency - 1) < 1e-6
    # noise that makes the slope negative falls back to positive, bounded numbers
    b, a = fit([(1e3, 2e-3), (1e4, 1e-3)], 2)
    assert b > 0 and 0 < a <= 1e-3


def test_probe_needs_ranks():
    proc = subprocess.run([sys.executable, "-m", "tiershard.cli", "probe"], capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 2 and "torchrun" in proc.stderr and "Traceback" not in proc.stderr
