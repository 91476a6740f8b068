"""``tiershard plan``: flags, presets, TOML files, --json, and one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiershard.cli import main

FLAGS = ["plan", "--gpus", "64", "--gpus-per-node", "8", "--intra-bw", "300GB/s", "--inter-bw", "25GB/s",
         "--gpu-mem", "80GB", "--accum", "4"]


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_flags_print_a_ranked_table(capsys):
    assert main(FLAGS + ["--top", "5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 5
    assert "fastest exact plan" in rows[0] and "world GB/node" in out
    times = [float(r.split()[2]) for r in rows]
    assert times == sorted(times)
    assert all("  exact  " in r for r in rows) and "--allow-lossy ranks the quantized ones" in out


def test_allow_lossy_ranks_the_quantized_plans_and_marks_them(capsys):
    slow = ["--inter-bw", "10Gbps/node", "--top", "3"]
    assert main(FLAGS + slow + ["--allow-lossy"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert "lossy w8 g8/4" in rows[0] and "lossy plan allowed: fastest that fits (weights int8, gradients int8 " \
        "(node) / int4 (world))" in rows[0], rows[0]
    assert "best    GNG+hpz+qwz+qgz:" in out and "exact plans only" not in out
    exact = _json(capsys, FLAGS + slow)
    assert exact["allow_lossy"] is False and exact["plans"][0]["quality"] == "exact"
    assert not any(p["lossy"] for p in exact["plans"])
    lossy = _json(capsys, FLAGS + slow + ["--allow-lossy"])
    assert lossy["plans"][0]["lossy"] and lossy["plans"][0]["step_time_s"] < exact["plans"][0]["step_time_s"]


def test_json_matches_the_flags(capsys):
    doc = _json(capsys, FLAGS)
    assert [t["size"] for t in doc["cluster"]["tiers"]] == [8, 64]
    assert doc["cluster"]["tiers"][1]["bandwidth"] == 25e9 and doc["cluster"]["gpu_memory"] == 80e9
    assert doc["job"]["accum"] == 4
    assert doc["evaluated"] == len(doc["plans"]) == 72        # --json shows all; exact plans only
    assert _json(capsys, FLAGS + ["--allow-lossy"])["evaluated"] == 238   # with every qwz / qgz option
    assert doc["plans"][0]["plan"] == doc["best"] and doc["plans"][0]["fits"]
    steps = [float(f'{p["step_time_s"]:.6g}') for p in doc["plans"] if p["fits"]]   # ranked to 6 digits
    assert steps == sorted(steps)
    assert any(not p["fits"] and p["reason"].startswith("does not fit") for p in doc["plans"])


def test_slow_inter_link_changes_the_answer(capsys):
    fast = _json(capsys, FLAGS + ["--top", "1"])["best"]
    slow = _json(capsys, FLAGS + ["--inter-bw", "10Gbps/node", "--top", "1"])["best"]
    assert fast != slow and "hpz" in slow          # exact: a cached weight shard saves inter-node gathers
    lossy = _json(capsys, FLAGS + ["--inter-bw", "10Gbps/node", "--top", "1", "--allow-lossy"])["best"]
    assert "qgz" in lossy or "I" in lossy.split("+")[0]


@pytest.mark.parametrize("preset,tiers", [("frontier", ["pair", "node", "world"]), ("v100-100g", ["node", "world"]),
                                          ("dgx-a100", ["node", "world"])])
def test_presets(capsys, preset, tiers):
    doc = _json(capsys, ["plan", "--cluster", preset, "--model", "13b", "--top", "3"])
    assert [t["name"] for t in doc["cluster"]["tiers"]] == tiers
    assert len(doc["plans"]) == 3 and doc["model"]["params"] == 13_000_000_000


def test_v100_preset_is_100_gbps_per_node():
    from tiershard.cost.presets import preset
    v100 = preset("v100-100g", 384)
    assert v100.tiers[0].size == 16 and v100.tiers[-1].bandwidth * 16 * 8 == pytest.approx(100e9)


def test_tiers_flag_and_model_options(capsys):
    doc = _json(capsys, ["plan", "--tiers", "pair:2:200GB/s:2us,node:8:50GB/s,world:32:100GB/s/node",
                         "--model", "1.3e9", "--trainable", "0.25", "--plans", "zero3,zero++,IIG,GGG+hpz=pair"])
    assert [t["bandwidth"] for t in doc["cluster"]["tiers"]] == [200e9, 50e9, 12.5e9]
    assert doc["cluster"]["tiers"][0]["latency"] == pytest.approx(2e-6)
    assert doc["model"]["params"] == 1_300_000_000 and doc["model"]["trainable"] == 325_000_000
    assert {p["plan"] for p in doc["plans"]} == {"GGG", "GGG+hpz+qwd+qgz", "IIG", "GGG+hpz=pair"}


def test_config_file(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text("""
[model]
name = "7b"
trainable = 0.0625
[cluster]
gpus = 32
gpu_memory = "40GB"
peak_flops = "312TFLOPS"
[[cluster.tiers]]
name = "node"
size = 8
bandwidth = "300GB/s"
latency = "3us"
[[cluster.tiers]]
name = "world"
size = 32
bandwidth = "200Gbps"
[job]
micro_batch = 2
seq = 1024
accum = 8
""")
    doc = _json(capsys, ["plan", "--config", str(cfg)])
    assert doc["cluster"]["gpu_memory"] == 40e9 and doc["cluster"]["tiers"][1]["bandwidth"] == 25e9
    assert doc["job"]["accum"] == 8 and doc["job"]["micro_batch"] == 2
    assert doc["model"]["trainable"] == round(6.74e9 / 16)
    # flags win over the file
    assert _json(capsys, ["plan", "--config", str(cfg), "--accum", "2"])["job"]["accum"] == 2


def test_cluster_file(tmp_path, capsys):
    f = tmp_path / "cluster.toml"
    f.write_text('[cluster]\nname = "lab"\ngpu_memory = 85899345920\npeak_flops = 1.25e14\n'
                 '[[cluster.tiers]]\nname = "node"\nsize = 4\nbandwidth = 1.0e11\nlatency = 2e-6\n'
                 '[[cluster.tiers]]\nname = "world"\nsize = 8\nbandwidth = 5.0e9\nlatency = 1e-5\n')
    doc = _json(capsys, ["plan", "--cluster-file", str(f), "--gpus", "64", "--top", "2"])
    assert doc["cluster"]["name"] == "lab" and [t["size"] for t in doc["cluster"]["tiers"]] == [4, 64]
    assert doc["cluster"]["tiers"][1]["bandwidth"] == 5e9
    # the header names the overlap the estimates use: the cluster's measured one, not the job's default
    assert main(["plan", "--cluster-file", str(f), "--top", "1"]) == 0
    assert "up to 80% of compute (the job's assumption)" in capsys.readouterr().out
    f.write_text(f.read_text().replace('peak_flops = 1.25e14\n', 'peak_flops = 1.25e14\noverlap = 0.05\n'))
    assert main(["plan", "--cluster-file", str(f), "--top", "1"]) == 0
    assert "up to 5% of compute (measured, from the cluster)" in capsys.readouterr().out


BAD = [
    (["--inter-bw", "-25GB/s"], "bandwidth"),
    (["--inter-bw=-25GB/s"], "bandwidth"),
    (["--gpus", "many"], "invalid int value"),
    (["--gpus", "60"], "not divisible by 8"),
    (["--model", "7x"], "unknown model"),
    (["--model", "65b", "--gpus", "8", "--gpu-mem", "16GB"], "does not fit"),
    (["--trainable", "2"], "fraction"),
    (["--cluster", "nope"], "unknown cluster"),
    (["--plans", "XYZ"], "unknown plan"),
    (["--tiers", "node:3:1GB/s,world:8:1GB/s"], "does not divide"),
    (["--intra-bw", "fast"], "cannot read a bandwidth"),
    (["--config", "/nonexistent/x.toml"], "cannot read"),
]


@pytest.mark.parametrize("extra,message", BAD)
def test_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    try:
        code = main(["plan", *extra])
    except SystemExit as exit_:     # argparse's own errors exit from inside parse_args
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("tiershard plan: error:")


def test_bad_toml_and_unknown_keys(tmp_path, capsys):
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text('[[cluster.tiers]]\nname = "world"\nsize = 8\nbandwidth = 1e9\ngpu_memory = 8e10\n')
    assert main(["plan", "--config", str(misplaced)]) == 2
    assert "unknown keys gpu_memory" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    extra = tmp_path / "extra.toml"
    extra.write_text("[job]\nwarp = 3\n")
    assert main(["plan", "--config", str(extra)]) == 2
    assert "unknown [job] keys: warp" in capsys.readouterr().err


def test_console_script_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "tiershard.cli", "plan", "--gpus", "60"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_explain_shows_the_terms_per_tier_with_measured_codec_rates(tmp_path, capsys):
    f = tmp_path / "cluster.toml"
    f.write_text('[cluster]\nname = "lab"\ngpu_memory = 8e10\npeak_flops = 1.25e14\n'
                 '[[cluster.tiers]]\nname = "node"\nsize = 8\nbandwidth = 1.0e11\n'
                 '[[cluster.tiers]]\nname = "world"\nsize = 64\nbandwidth = 3.125e7\n'
                 '[cluster.codecs."int8:128:h"]\nrate = 2e10\n[cluster.codecs."int4:128:h:sr"]\nrate = 5e9\n')
    args = ["plan", "--cluster-file", str(f), "--model", "1.3b", "--allow-lossy", "--plans", "GGG+qgz", "--explain"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "where the step goes, GGG+qgz:" in out and "int4:128:h:sr 5" in out
    world = next(line for line in out.splitlines() if line.strip().startswith("world "))
    assert "pays: saves" in world
    doc = _json(capsys, [*args, "--top", "1"])
    terms = {t["tier"]: t for t in doc["explain"]}
    assert terms["world"]["codec_pays"] is True and terms["world"]["saved"] > terms["world"]["codec"] > 0
    assert sum(t["exposed"] for t in terms.values()) == pytest.approx(doc["plans"][0]["exposed_s"])
    assert doc["cluster"]["codec_rates"] == {"int4:128:h:sr": 5e9, "int8:128:h": 2e10}
