"""Token streams and batches: deterministic, disjoint splits, per-rank slices of one global batch."""
from __future__ import annotations

import sysconfig

import numpy as np
import pytest
import torch

from tiershard.train import data
from tiershard.train.data import DataConfig, DataError


def test_stdlib_corpus_is_sorted_capped_and_has_no_installed_packages():
    files = data.stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any("site-packages" in r or "dist-packages" in r for r in rel)
    a, _ = data.stdlib_tokens(50_000)
    b, _ = data.stdlib_tokens(50_000)
    assert a.dtype == np.uint8 and len(a) == 50_000
    assert np.array_equal(a, b)
    assert bytes(a[:200]) == files[0].read_bytes()[:200]


def test_split_is_deterministic_disjoint_and_complete():
    tokens = np.arange(100_000, dtype=np.int64)  # each value marks its position
    train, val = data.split(tokens, 0.1, block=1000)
    assert len(train) + len(val) == len(tokens)
    assert not set(train.tolist()) & set(val.tolist())
    assert 0.08 < len(val) / len(tokens) < 0.12
    assert val.min() < 20_000 and val.max() > 80_000  # spread over the corpus, not one tail
    train2, val2 = data.split(tokens, 0.1, block=1000)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)


def test_batches_are_deterministic_and_rank_slices_of_one_global_batch():
    tokens = np.frombuffer(bytes(range(256)) * 400, dtype=np.uint8)
    x1, y1 = data.train_batch(tokens, 16, batch=8, rank=0, world=1, seed=3, step=5)
    parts = [data.train_batch(tokens, 16, batch=2, rank=r, world=4, seed=3, step=5) for r in range(4)]
    assert torch.equal(x1, torch.cat([p[0] for p in parts]))
    assert torch.equal(y1, torch.cat([p[1] for p in parts]))
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # targets are the inputs shifted by one
    again, _ = data.train_batch(tokens, 16, batch=8, rank=0, world=1, seed=3, step=5)
    assert torch.equal(x1, again)
    other_step, _ = data.train_batch(tokens, 16, batch=8, rank=0, world=1, seed=3, step=6)
    other_micro, _ = data.train_batch(tokens, 16, batch=8, rank=0, world=1, seed=3, step=5, micro=1)
    other_seed, _ = data.train_batch(tokens, 16, batch=8, rank=0, world=1, seed=4, step=5)
    assert not torch.equal(x1, other_step) and not torch.equal(x1, other_micro) and not torch.equal(x1, other_seed)
    assert x1.dtype == torch.int64 and x1.shape == (8, 16)


def test_val_batches_fixed_and_split_over_ranks():
    tokens = np.arange(10_000, dtype=np.int64)
    whole = data.val_batches(tokens, 8, batch=4, rank=0, world=1, count=2)
    shares = [data.val_batches(tokens, 8, batch=2, rank=r, world=2, count=2) for r in range(2)]
    starts = sorted(int(x[i, 0]) for share in shares for x, _ in share for i in range(len(x)))
    assert starts == sorted(int(x[i, 0]) for x, _ in whole for i in range(len(x)))
    assert len(set(starts)) == 8


def test_text_file(tmp_path):
    path = tmp_path / "story.txt"
    path.write_bytes(b"hello tiershard\n" * 1000)
    tokens = data.load(DataConfig(source=str(path), val_fraction=0.1))
    assert tokens.vocab_size == 256
    assert len(tokens.train) + len(tokens.val) == 16_000
    assert bytes(tokens.train[:16]) == b"hello tiershard\n"
    capped = data.load(DataConfig(source=str(path), max_bytes=4096))
    assert len(capped.train) + len(capped.val) == 4096


def test_bin_token_file_is_memory_mapped(tmp_path):
    ids = (np.arange(20_000) * 7 % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    tokens = data.load(DataConfig(source=str(tmp_path / "tokens.bin")))
    assert isinstance(tokens.train, np.ndarray) and tokens.train.dtype == np.uint16
    assert isinstance(np.asarray(data.bin_tokens(tmp_path / "tokens.bin")), np.memmap) or \
        isinstance(data.bin_tokens(tmp_path / "tokens.bin"), np.memmap)
    assert tokens.vocab_size == 1000
    assert np.array_equal(np.concatenate([tokens.train, tokens.val]).astype(np.int64).sum(),
                          ids.astype(np.int64).sum())
    x, _ = data.train_batch(tokens.train, 32, 2, 0, 1, seed=0, step=0)
    assert x.max() < 1000 and x.dtype == torch.int64


def test_bin_folder_with_train_and_val(tmp_path):
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.full(3000, 300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    tokens = data.load(DataConfig(source=str(tmp_path)))
    assert len(tokens.train) == 5000 and len(tokens.val) == 3000
    assert tokens.vocab_size == 5000
    (tmp_path / "val.bin").unlink()
    with pytest.raises(DataError, match="no val.bin"):
        data.load(DataConfig(source=str(tmp_path)))


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        data.load(DataConfig(source=str(tmp_path / "missing.txt")))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="not a uint16 token file"):
        data.load(DataConfig(source=str(tmp_path / "odd.bin")))
    (tmp_path / "short.txt").write_bytes(b"x" * 2000)
    short = data.load(DataConfig(source=str(tmp_path / "short.txt")))
    with pytest.raises(DataError, match="fewer than one sequence"):
        short.check_fits(512)
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=0.7)
