"""Token streams for the ``train`` job and the per-rank batches drawn from them.

The default corpus needs no download: the bytes of the Python standard library's source files on this machine
(sorted paths, capped, so the same machine always yields the same tokens). User data is a text file (bytes are
tokens) or nanoGPT-style token files (``.bin`` of uint16, read through ``numpy.memmap``).

[Note: batches are a function of (seed, step, micro-step)] A step's *global* batch is drawn from one generator
seeded by ``(seed, step, micro)``; rank ``r`` takes rows ``r*B .. (r+1)*B``. A run is therefore reproducible,
and the global batch does not depend on how many ranks share it.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STDLIB = "stdlib"
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """A data source that is missing, unreadable or too small; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from.

    ``source``: ``"stdlib"``, a text file, a ``.bin`` token file, or a folder holding ``train.bin`` and
    ``val.bin``. ``max_bytes`` caps the stdlib corpus and text files. ``val_fraction`` of a single stream goes
    to validation (ignored when a folder gives ``val.bin``).
    """

    source: str = STDLIB
    max_bytes: int = 4_000_000
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"data.source must be 'stdlib' or a path, got {self.source!r}")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1024:
            raise ValueError(f"data.max_bytes must be an integer of at least 1024, got {self.max_bytes!r}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction!r}")


@dataclass(frozen=True)
class TokenData:
    """Train and validation token streams (uint8 or uint16 arrays, possibly memory-mapped)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str

    def check_fits(self, seq_len: int) -> None:
        for name, stream in (("train", self.train), ("validation", self.val)):
            if len(stream) < seq_len + 2:
                raise DataError(f"{self.description}: the {name} split has {len(stream)} tokens, fewer than one "
                                f"sequence of {seq_len + 1}; use more data or a smaller model.block_size")


def load(cfg: DataConfig) -> TokenData:
    """Load the configured source; raises DataError for a missing or unusable one."""
    if cfg.source == STDLIB:
        tokens, desc = stdlib_tokens(cfg.max_bytes)
        train, val = split(tokens, cfg.val_fraction)
        return TokenData(train, val, 256, desc)
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data file {cfg.source} does not exist (data.source: 'stdlib', a text file, "
                        "a .bin token file or a folder with train.bin and val.bin)")
    if path.is_dir():
        train_p, val_p = path / "train.bin", path / "val.bin"
        for p in (train_p, val_p):
            if not p.is_file():
                raise DataError(f"data folder {path} has no {p.name}: a folder source needs train.bin and val.bin")
        train, val = bin_tokens(train_p), bin_tokens(val_p)
        return TokenData(train, val, _vocab(train, val), f"{path} (train.bin, val.bin)")
    if path.suffix == ".bin":
        tokens = bin_tokens(path)
        train, val = split(tokens, cfg.val_fraction)
        return TokenData(train, val, _vocab(tokens), f"{path} ({len(tokens):,} uint16 tokens)")
    tokens = text_tokens(path, cfg.max_bytes)
    train, val = split(tokens, cfg.val_fraction)
    return TokenData(train, val, 256, f"{path} ({len(tokens):,} bytes)")


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order, without installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # prune: site-packages can be larger than the stdlib
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def stdlib_tokens(max_bytes: int) -> tuple[np.ndarray, str]:
    """Bytes of the stdlib sources, files joined by a blank line, cut at ``max_bytes``."""
    chunks, total, count = [], 0, 0
    for f in stdlib_files():
        if total >= max_bytes:
            break
        data = f.read_bytes() + b"\n\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        count += 1
    if total == 0:
        raise DataError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}: "
                        "give data.source a text file")
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return tokens, f"Python stdlib sources ({count} files, {total:,} bytes)"


def text_tokens(path: Path, max_bytes: int) -> np.ndarray:
    """A file's bytes as tokens (byte-level vocabulary of 256), the first ``max_bytes`` of it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes)
    except OSError as err:
        raise DataError(f"cannot read data file {path}: {err.strerror}") from None
    return np.frombuffer(data, dtype=np.uint8)


def bin_tokens(path: Path) -> np.ndarray:
    """A nanoGPT token file: raw uint16, memory-mapped so it is never read whole."""
    size = path.stat().st_size
    if size < 2 or size % 2:
        raise DataError(f"{path} is not a uint16 token file: its size, {size} bytes, is not a positive even number")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _vocab(*streams: np.ndarray) -> int:
    return max(256, max(int(s.max()) for s in streams) + 1)


def split(tokens: np.ndarray, val_fraction: float, block: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/validation split by blocks: block ``i`` is validation when ``floor(i*f)`` steps.

    Interleaved blocks give validation text from all over the corpus (not just its last files), and the two
    splits never share a token position.
    """
    n_blocks = -(-len(tokens) // block)
    idx = np.arange(n_blocks)
    is_val = np.floor((idx + 1) * val_fraction) > np.floor(idx * val_fraction)
    if n_blocks < 2 or is_val.all() or not is_val.any():
        cut = int(len(tokens) * (1 - val_fraction))
        return tokens[:cut], tokens[cut:]
    take = lambda mask: np.concatenate([tokens[i * block:(i + 1) * block] for i in idx[mask]])  # noqa: E731
    return take(~is_val), take(is_val)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def train_batch(tokens: np.ndarray, seq_len: int, batch: int, rank: int, world: int,
                seed: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``batch`` rows of the global batch of ``(seed, step, micro)`` (see the note above)."""
    rng = np.random.default_rng([seed, step, micro])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch * world)
    return _windows(tokens, starts[rank * batch:(rank + 1) * batch], seq_len)


def val_batches(tokens: np.ndarray, seq_len: int, batch: int, rank: int, world: int,
                count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` global batches of evenly spaced windows, the same every evaluation; this rank's rows."""
    n = count * batch * world
    starts = np.linspace(0, len(tokens) - seq_len - 1, num=n).astype(np.int64)
    mine = starts.reshape(count, world, batch)[:, rank]
    return [_windows(tokens, row, seq_len) for row in mine]
