"""``tiershard train``: config, schedule, progress and plot in-process; then real multi-rank runs.

The end-to-end runs launch 4 gloo ranks (2 emulated nodes) through the command line, exactly as ``make train``
does, with the tiny model.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiershard.cli import train as train_cli
from tiershard.cli.train import tomllib
from tiershard.train.progress import Progress, plot_run, read_metrics
from tiershard.train.config import JobConfig, TrainConfig, to_toml
from tiershard.train.trainer import lr_at, param_groups

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


# ---- configuration ------------------------------------------------------------------------------
def test_default_toml_is_the_builtin_default():
    raw = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    assert JobConfig.from_dict(raw) == JobConfig()


def test_tiny_toml_loads():
    cfg = JobConfig.from_dict(tomllib.loads((ROOT / "configs" / "tiny.toml").read_text()))
    assert cfg.preset == "tiny" and cfg.model.n_embd == 32 and cfg.parallel.nproc == 4


def test_config_round_trips_through_toml():
    cfg = JobConfig.from_dict({"model": {"preset": "tiny", "n_layer": 3}, "train": {"lr": 0.01, "out": 'a "b"'},
                               "parallel": {"plan": "zero3"}})
    assert JobConfig.from_dict(tomllib.loads(to_toml(cfg.to_dict()))) == cfg
    assert cfg.model.n_layer == 3 and cfg.model.n_embd == 32


@pytest.mark.parametrize("raw, match", [
    ({"train": {"stepz": 3}}, "unknown key 'stepz' in \\[train\\]"),
    ({"trian": {}}, "unknown section \\[trian\\]"),
    ({"model": {"preset": "huge"}}, "unknown model preset"),
    ({"parallel": {"nproc": 3, "ranks_per_node": 2}}, "not divisible"),
    ({"train": {"precision": "fp8"}}, "precision"),
    ({"train": {"lr": 1e-4, "min_lr": 1e-3}}, "min_lr"),
    ({"train": {"steps": 0}}, "train.steps"),
])
def test_config_rejects(raw, match):
    with pytest.raises(ValueError, match=match):
        JobConfig.from_dict(raw)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1)
    short = TrainConfig(steps=3, warmup=10, lr=1.0, min_lr=0.1)
    assert [lr_at(s, short) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])


def test_weight_decay_only_on_linear_matrices():
    from tiershard.train.models import GPT, gpt_config

    model = GPT(gpt_config("tiny", bias=True))
    decay, exempt = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decay["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert decayed and all(n.endswith(".weight") and ("attn" in n or "mlp" in n) for n in decayed), decayed
    exempt_names = {names[id(p)] for p in exempt["params"]}
    assert "transformer.wte.weight" in exempt_names and any(".ln_" in n for n in exempt_names), exempt_names
    assert any(n.endswith(".bias") for n in exempt_names), exempt_names
    assert len(decay["params"]) + len(exempt["params"]) == len(list(model.parameters()))


def test_every_flag_is_documented():
    doc = (ROOT / "docs" / "training.md").read_text()
    missing = [flag for flag, *_ in train_cli.FLAGS if f"`{flag}" not in doc]
    assert not missing, f"flags missing from docs/training.md: {missing}"
    assert "`--config" in doc


# ---- progress and plot --------------------------------------------------------------------------
def _rec(step, loss=3.0):
    return {"kind": "train", "step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 1234.0,
            "bytes": {"node": 2_000_000, "world": 500_000}, "seconds": 0.1, "grad_norm": 1.0}


def test_progress_without_a_terminal_prints_one_line_per_interval():
    out = io.StringIO()
    bar = Progress(steps=25, log_interval=10, stream=out, tty=False)
    for s in range(25):
        bar.update(_rec(s))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "\r" not in out.getvalue()
    assert "node 2.0 MB" in lines[0] and "world 500.0 kB" in lines[0] and "1.2k tok/s" in lines[0]


def test_progress_on_a_terminal_rewrites_one_line():
    out = io.StringIO()
    bar = Progress(steps=3, log_interval=10, stream=out, tty=True)
    bar.update(_rec(0))
    bar.message("validation loss 2.5")
    bar.update(_rec(1))
    bar.update(_rec(2))
    text = out.getvalue()
    assert text.count("\r") >= 3 and text.endswith("\n")
    assert "validation loss 2.5\n" in text
    assert text.rstrip("\n").split("\r")[-1].endswith("[0:00<0:00]")


def test_plot_writes_a_png(tmp_path):
    records = [_rec(s, 5 - s / 10) for s in range(20)] + [{"kind": "val", "step": 19, "val_loss": 3.1}]
    path = plot_run(records, tmp_path / "sub" / "train.png", title="t")
    assert path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


# ---- the command line, end to end ---------------------------------------------------------------
def _tiershard(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TIERSHARD_TOPOLOGY"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "tiershard.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def test_train_four_ranks_two_nodes_learns(tmp_path):
    """The default plan on 2 nodes of 2 learns, logs and plots. (Same seed, same losses bit for bit is
    tests/checkpoint/test_resume.py's whole-log comparison.)"""
    out = tmp_path / "out"
    proc = _tiershard("--config", str(ROOT / "configs" / "tiny.toml"), "--steps", "24", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(24))
    assert [r["step"] for r in val] == [14, 23]
    losses = [r["loss"] for r in train]
    assert losses[0] == pytest.approx(5.55, abs=0.25)  # ln 256: an untrained byte model
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert val[-1]["val_loss"] < losses[0] - 1.0
    # IIG on 2 nodes of 2: traffic on both tiers, the same every step but the one after a validation, whose
    # forward ran the last step's all-gather of the updated weights (G -> I crosses nodes): counted in the val record
    assert train[0]["bytes"]["node"] > 0 and train[0]["bytes"]["world"] > 0
    after_val = {v["step"] + 1 for v in val}
    assert all(r["bytes"] == train[0]["bytes"] for r in train if r["step"] not in after_val)
    post = train[val[0]["step"] + 1]["bytes"]
    missing = {t: train[0]["bytes"][t] - post[t] for t in post}
    assert missing["world"] > 0 and all(0 <= missing[t] <= val[0]["bytes"][t] for t in post), (missing, val[0])
    assert (out / "train.png").read_bytes()[:8] == PNG
    assert tomllib.loads((out / "config.toml").read_text())["model"]["preset"] == "tiny"
    assert "validation loss" in proc.stdout and str(out / "train.png") in proc.stdout
    assert "Traceback" not in proc.stderr


def test_train_bf16_with_accumulation(tmp_path):
    """2 nodes of 1 rank, bf16 working weights, 2 micro-steps per step (no_sync on the first)."""
    out = tmp_path / "bf16"
    proc = _tiershard("--config", str(ROOT / "configs" / "tiny.toml"), "--nproc", "2", "--ranks-per-node", "1",
                      "--precision", "bf16", "--accum", "2", "--batch", "2", "--steps", "16", "--plan", "zero2",
                      "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _train_losses(out)
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < losses[0] - 0.7, losses
    assert "global batch 8 x 32" in proc.stdout


# ---- bad input: one line, non-zero exit, nothing started ---------------------------------------
@pytest.mark.parametrize("args, match", [
    (["--data", "no/such/file.txt"], "data file no/such/file.txt does not exist"),
    (["--plan", "p=pair,g=node,os=world"], "does not fit topology"),
    (["--nproc", "3", "--ranks-per-node", "2"], "--nproc 3 is not divisible by --ranks-per-node 2"),
    (["--config", "BAD"], "unknown key 'learning_rate' in [train]"),
])
def test_bad_input_is_one_line(tmp_path, args, match):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlearning_rate = 0.1\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    proc = _tiershard("--model", "tiny", "--out", str(tmp_path / "out"), *args, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ---- plan auto ----------------------------------------------------------------------------------
def _tiny_cfg(**parallel):
    return JobConfig.from_dict({"model": {"preset": "tiny"}, "data": {"max_bytes": 20_000},
                                "parallel": parallel})


def test_plan_auto_is_resolved_before_launch():
    from tiershard.plan import Plan
    from tiershard.topology import Topology

    pytest.importorskip("tiershard.cost")
    cfg = train_cli.check(_tiny_cfg(plan="auto"), Topology((2, 4)))
    assert cfg.parallel.plan != "auto"
    Plan.parse(cfg.parallel.plan).resolve(Topology((2, 4)))


def test_plan_auto_without_the_planner_is_a_clear_error(monkeypatch):
    from tiershard.cli import CliError
    from tiershard.topology import Topology

    monkeypatch.setitem(sys.modules, "tiershard.cost", None)  # import fails as if the module were absent
    with pytest.raises(CliError, match="needs the planner"):
        train_cli.check(_tiny_cfg(plan="auto"), Topology((2, 4)))
