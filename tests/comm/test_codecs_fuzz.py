"""The codec fuzzer's fixed-seed fast set (``benchmarks/fuzz_codecs.py``; the long run is ``make fuzz``): the C
kernels built with AddressSanitizer and UndefinedBehaviorSanitizer on about 150 random cases against the torch
reference, and the fuzzer's own oracles, each shown to fail: the cases reach every option, a sanitizer report ends
the run, and a kernel that differs from the reference is reported. The Triton kernels are left to the long run (their
interpreter takes seconds a case; ``test_codecs.py`` runs them on fixed cases)."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiershard.comm.codecs import block, native

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fuzz_codecs.py"
SEED, CASES, MAX_VALUES = 7, 150, 70_000  # the 148 cases of at most 70K values among the first 150 of seed 7


def _load_fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_codecs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_codecs"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzzer()
RUNTIME = fuzz.sanitizer_runtime()
pytestmark = pytest.mark.skipif(RUNTIME is None, reason="gcc with AddressSanitizer (libasan) not found: the sanitized "
                                                        "C kernels cannot be built")


@pytest.fixture(scope="module")
def fast_set() -> str:
    """The fuzzer's output on the fast set (its sanitized build is cached in the kernel cache folder)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--seed", str(SEED), "--cases", str(CASES),
                           "--max-values", str(MAX_VALUES), "--triton-cases", "0"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc.stdout


def _fast_cases() -> list:
    return [c for c in (fuzz.make_case(SEED, i) for i in range(CASES)) if c.k * c.n <= MAX_VALUES]


def test_fast_set_equals_the_reference_under_the_sanitizers(fast_set: str) -> None:
    line = re.search(r"sanitized\]: (\d+) cases, (\d+) comparisons equal the reference(.*)", fast_set)
    assert line is not None, fast_set
    cases, equal = int(line[1]), int(line[2])
    assert cases == len(_fast_cases()) > 140 and equal >= 5 * cases and "differ" not in line[3], line[0]
    assert "MISMATCH" not in fast_set and "no findings" in fast_set


def test_fast_set_reaches_every_option() -> None:
    """The fast set holds every codec option, dtype and input kind, tails, row layouts, random wires, and chunks
    large enough for two threads: a generator that stopped drawing one would pass the fast set unseen."""
    cases = _fast_cases()
    assert {(c.codec.bits, c.codec.rotate, c.codec.stochastic) for c in cases} == {
        (b, r, s) for b in (4, 8) for r in (False, True) for s in (False, True)}
    assert {c.dtype for c in cases} == set(fuzz.DTYPES) and {c.kind for c in cases} == set(fuzz.KINDS)
    flat = [c for c in cases if c.segments is None and c.n]
    assert any(c.n % c.codec.block for c in flat) and any(c.n % c.codec.block == 0 and c.n > c.codec.block
                                                          for c in flat)
    assert sum(c.segments is not None for c in cases) > 20 and sum(c.wire_only for c in cases) > 5
    assert any(c.threads == 2 for c in cases) and any(c.order is not None and c.k > 2 for c in cases)
    x = torch.cat([fuzz.make_input(c).float() for c in cases if not c.wire_only])
    assert torch.isnan(x).any() and torch.isinf(x).any() and ((x != 0) & (x.abs() < 2.0 ** -126)).any()


_OVERFLOW = textwrap.dedent("""
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    x, pay = (ctypes.c_float * 1000)(), (ctypes.c_uint8 * 8192)()
    p = ctypes.addressof(pay)
    # 2000 values read from a buffer of 1000: the bug a sanitizer exists to catch
    lib.ts_encode(x, 0, ctypes.c_int64(2000), ctypes.c_int64(1), None, ctypes.c_int64(64), 8, ctypes.c_void_p(p),
                  ctypes.c_int64(0), ctypes.c_void_p(p + 4096), ctypes.c_int64(0), ctypes.c_int64(0), 1)
    print("not caught")
""")


def test_a_read_past_a_buffer_ends_the_run(fast_set: str) -> None:
    """The fast set's library, called past the end of its input as the fuzzer's children run it: AddressSanitizer
    reports it and the process exits with the fuzzer's code (a build or environment without the sanitizer armed
    would print "not caught")."""
    path = re.search(r"Kernels\(.*, (/\S+\.so)\)", fast_set)
    assert path is not None, fast_set
    env = dict(fuzz.sanitizer_env(RUNTIME), PYTHONMALLOC="malloc")
    proc = subprocess.run([sys.executable, "-c", _OVERFLOW, path[1]], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == fuzz.ASAN_EXIT and "AddressSanitizer" in proc.stderr, proc.stdout + proc.stderr[-3000:]
    assert "not caught" not in proc.stdout


class _Off:
    """The real kernels, except that every encode flips the low bit of the first payload byte of row 0."""

    def __init__(self, lib: native.Kernels):
        self._lib, self.has_f16 = lib, lib.has_f16

    def __getattr__(self, name: str):
        return getattr(self._lib, name)

    def _flipped(self, fn, pay_arg: int):
        def call(*args):
            rc = fn(*args)
            if args[2] and args[3]:  # n and k: a payload byte exists
                ctypes.c_uint8.from_address(args[pay_arg]).value ^= 1
            return rc
        return call

    @property
    def encode(self):
        return self._flipped(self._lib.encode, 7)

    @property
    def encode_seg(self):
        return self._flipped(self._lib.encode_seg, 10)

    @property
    def encode_x(self):
        return self._flipped(self._lib.encode_x, 13)


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler")
def test_a_kernel_that_differs_is_reported(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The fuzzer's comparisons, in this process on the unsanitized kernels with one flipped bit per encode:
    every case that encodes is reported, with its case and the comparisons that differ."""
    lib = native.load()
    assert lib is not None, native.status()
    monkeypatch.setattr(block, "_cpu_lib", block._cpu_lib)
    monkeypatch.setattr(block, "_gpu_lib", block._gpu_lib)
    threads = torch.get_num_threads()
    cases = [c for c in (fuzz.make_case(SEED, i) for i in range(40)) if not c.wire_only and c.n and c.threads == 1]
    try:
        assert fuzz.run_cases(cases[:12], fuzz.native_backend(lib), "good") == 0
        differ = fuzz.run_cases(cases[:12], fuzz.native_backend(_Off(lib)), "off")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert differ >= 12 and out.count("MISMATCH off case") == 12, out
    assert "encode_wire" in out and "12 cases" in out and "differ" in out
