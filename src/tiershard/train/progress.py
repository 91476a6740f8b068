"""What rank 0 shows and keeps of a run: the progress line, ``metrics.jsonl`` and the final plot.

Kept apart from the loop so that formatting and plotting can be tested without a process group.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Sequence


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


def clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A one-line progress report: rewritten with ``\\r`` on a terminal, one line per interval otherwise
    (so logs and CI output stay readable)."""

    def __init__(self, steps: int, log_interval: int, stream: IO[str] | None = None, tty: bool | None = None,
                 start: int = 0):
        self.steps = steps
        self.start_step = start  # a resumed run: steps before it were done by an earlier process
        self.log_interval = log_interval
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.start = time.perf_counter()
        self._open = False  # a \r line is on screen and needs a newline before other output

    def line(self, rec: dict) -> str:
        elapsed = time.perf_counter() - self.start
        done = rec["step"] + 1
        eta = elapsed / max(done - self.start_step, 1) * (self.steps - done)
        tiers = "  ".join(f"{t} {human_bytes(b)}" for t, b in rec["bytes"].items())
        width = len(str(self.steps))
        return (f"step {done:>{width}}/{self.steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                f"{human_count(rec['tokens_per_s'])} tok/s  {tiers or 'no traffic'}  "
                f"[{clock(elapsed)}<{clock(eta)}]")

    def update(self, rec: dict) -> None:
        done = rec["step"] + 1
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(rec))
            self._open = True
            if done == self.steps:
                self._newline()
        elif done % self.log_interval == 0 or done == self.steps or done == self.start_step + 1:
            self.stream.write(self.line(rec) + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own (validation, summary) that does not clobber the progress line."""
        if self._open:
            self.stream.write("\r\x1b[2K" if self.tty else "\n")
            self._open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _newline(self) -> None:
        self.stream.write("\n")
        self._open = False


class MetricsLog:
    """Metrics as JSON lines: one record per step (``"kind": "train"``) and per evaluation (``"val"``).

    ``append`` continues an existing file (a resumed run, after ``truncate_metrics``); else it starts empty."""

    def __init__(self, path: Path, append: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, rec: dict) -> None:
        self._fh.write(json.dumps(rec, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def truncate_metrics(path: Path, before_step: int) -> int:
    """Keep the records of steps before ``before_step`` (where a resumed run starts), so that the steps it
    runs again are not logged twice; a last line cut short by a killed process is dropped. The file is
    replaced atomically. Returns the records kept."""
    if not path.is_file():
        return 0
    kept = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                break                         # the write the kill interrupted: nothing valid follows it
            if rec.get("step", before_step) < before_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return len(kept)


def plot_run(records: Iterable[dict], path: Path, title: str = "") -> Path:
    """Two panels: train and validation loss by step, and mean bytes per step on each tier (all ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    tiers: Sequence[str] = list(train[0]["bytes"]) if train else []
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [2, 1]})
    ax_loss.plot([r["step"] + 1 for r in train], [r["loss"] for r in train], lw=1, label="train")
    if val:
        ax_loss.plot([r["step"] + 1 for r in val], [r["val_loss"] for r in val], "o-", ms=4, label="validation")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    means = [sum(r["bytes"].get(t, 0) for r in train) / max(len(train), 1) / 1e6 for t in tiers]
    bars = ax_bytes.bar(tiers, means, color=["tab:green", "tab:red", "tab:purple"][: len(tiers)])
    ax_bytes.bar_label(bars, fmt="%.2f")
    ax_bytes.set_ylim(0, max(means, default=0) * 1.2 or 1)
    ax_bytes.set_ylabel("MB per step, all ranks")
    ax_bytes.set_title("traffic by tier", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
