"""``tiershard train --save-every / --resume / --max-restarts`` against one uninterrupted run, loss for loss.

Every run is the tiny GPT for 8 steps on 2 gloo ranks as 2 emulated nodes of 1 under ``zero3`` (parameters,
gradients and optimizer states sharded across both), started through the command line as users start it.
The learning rate warms up for 6 steps and then stays at its peak (``min_lr = lr``), so a first run of 4 steps
and a resumed run of 8 share one schedule while the resume still lands inside the warmup. The reference runs
without checkpoints; every other run must log exactly its losses and learning rates, each step once:

- resume: 4 steps with ``--save-every 2``, then ``--steps 8 --resume auto``;
- restart: rank 1 SIGKILLs itself before step 5 (a test hook, first attempt only) under ``--max-restarts 1``;
  torchrun restarts both ranks, which resume from ``step_3`` by themselves;
- a save killed: rank 0 SIGKILLs itself inside ``ts.save`` of ``step_6`` after its shards are written and before
  the rename; ``latest`` still names ``step_3``, which converts and resumes to the reference's final loss.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiershard.train.progress import Progress, read_metrics, truncate_metrics
from tiershard.train.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--config", str(ROOT / "configs" / "tiny.toml"), "--nproc", "2", "--ranks-per-node", "1", "--plan", "zero3",
        "--steps", "8", "--warmup", "6", "--lr", "0.01", "--min-lr", "0.01", "--max-bytes", "20000",
        "--eval-interval", "4", "--no-save"]


def _train(*args: str, cwd: Path, hooks: dict[str, str] | None = None, timeout: float = 180):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(hooks or {}))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TIERSHARD_TOPOLOGY",
                "TIERSHARD_TEST_KILL_AT", "TIERSHARD_TEST_KILL_IN_SAVE", "TORCHELASTIC_RESTART_COUNT"):
        if key not in (hooks or {}):
            env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "tiershard.cli", "train", *BASE, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _log(out: Path) -> list[tuple]:
    """Every record as (kind, step, loss or validation loss, lr), in the order written."""
    return [(r["kind"], r["step"], r.get("loss", r.get("val_loss")), r.get("lr"))
            for r in read_metrics(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple]:
    cwd = tmp_path_factory.mktemp("reference")
    proc = _train("--out", str(cwd / "out"), cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = _log(cwd / "out")
    assert [(k, s) for k, s, *_ in log] == [("train", s) for s in range(4)] + [("val", 3)] + \
        [("train", s) for s in range(4, 8)] + [("val", 7)]
    assert not (cwd / "out" / "checkpoints").exists()
    return log


def test_resume_continues_exactly(reference, tmp_path):
    out = tmp_path / "out"
    first = _train("--out", str(out), "--steps", "4", "--save-every", "2", "--resume", "auto", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_2", "step_4"]
    assert "resumed" not in first.stdout                       # --resume auto with no checkpoint: fresh start
    second = _train("--out", str(out), "--save-every", "2", "--resume", "auto", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resumed from {out / 'checkpoints' / 'step_4'} at step 4" in second.stdout
    assert "changed since the checkpoint: train.steps 8 (was 4)" in second.stdout
    assert "step 5/8" in second.stdout                          # the progress line continues at step 5
    assert _log(out) == reference                               # losses, lrs and validation, each step once
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_8"


def test_a_killed_rank_restarts_and_resumes(reference, tmp_path):
    out = tmp_path / "out"
    proc = _train("--out", str(out), "--save-every", "3", "--resume", "auto", "--max-restarts", "1", cwd=tmp_path,
                  hooks={"TIERSHARD_TEST_KILL_AT": "1:5:optimizer"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr          # the survivor says one line, not its traceback
    assert f"resumed from {out / 'checkpoints' / 'step_3'} at step 3 (restart 1)" in proc.stdout
    assert _log(out) == reference


def test_a_save_killed_before_the_rename_leaves_the_last_checkpoint(reference, tmp_path):
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    proc = _train("--out", str(out), "--save-every", "3", "--resume", "auto", cwd=tmp_path,
                  hooks={"TIERSHARD_TEST_KILL_IN_SAVE": "0:6"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"tiershard train: error: rank \d (was killed by SIGKILL|exited with code \d+); "
                        r"its error, if any, is printed above", last), last
    assert (ckpts / "latest").read_text().strip() == "step_3"
    assert not (ckpts / "step_6").exists()
    partial = list(ckpts.glob(".step_6.tmp-*"))
    assert len(partial) == 1 and (partial[0] / ".metadata").is_file()     # killed after the shards were written
    assert not (partial[0] / "tiershard.json").exists()
    from tiershard.checkpoint import convert

    assert convert.model_entries(ckpts)                         # `latest` verifies against its manifest

    again = _train("--out", str(out), "--save-every", "3", "--resume", "auto", cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {ckpts / 'step_3'} at step 3" in again.stdout
    assert _log(out) == reference                               # the final loss too
    assert not list(ckpts.glob(".step_6.tmp-*"))                # the next save of step_6 removed the leftovers
    assert (ckpts / "latest").read_text().strip() == "step_8"


# ---- in-process: config, metrics, progress ------------------------------------------------------------------
@pytest.mark.parametrize("raw, match", [
    ({"parallel": {"max_restarts": 1}}, "needs --save-every N and --resume auto"),
    ({"parallel": {"max_restarts": 1}, "train": {"resume": "auto"}}, "needs --save-every N"),
    ({"parallel": {"max_restarts": 1}, "train": {"save_every": 5, "resume": "runs/x"}}, "--resume auto"),
    ({"train": {"save_every": -1}}, "train.save_every"),
    ({"parallel": {"max_restarts": -1}}, "parallel.max_restarts"),
])
def test_config_rejects(raw, match):
    with pytest.raises(ValueError, match=match):
        JobConfig.from_dict(raw)


def test_resume_path_that_holds_no_checkpoint_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "tiershard.cli", "train", *BASE, "--out", str(tmp_path / "o"),
                           "--resume", str(tmp_path / "nowhere")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume: no checkpoint at" in lines[0] and "does not exist" in lines[0], lines


def test_truncate_metrics_keeps_steps_before_and_drops_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 0}\n{"kind": "train", "step": 1}\n{"kind": "val", "step": 1}\n'
                    '{"kind": "train", "step": 2}\n{"kind": "train", "st')
    assert truncate_metrics(path, 2) == 3
    assert [(r["kind"], r["step"]) for r in read_metrics(path)] == [("train", 0), ("train", 1), ("val", 1)]
    assert truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_progress_of_a_resumed_run_starts_at_its_first_step():
    import io

    stream = io.StringIO()
    bar = Progress(steps=30, log_interval=10, stream=stream, tty=False, start=12)
    for step in range(12, 30):
        bar.update({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "bytes": {}})
    assert [line.split()[1] for line in stream.getvalue().splitlines()] == ["13/30", "20/30", "30/30"]
