"""Fuzz the codec kernels against the torch reference: the C kernels built with AddressSanitizer and
UndefinedBehaviorSanitizer, and the Triton kernels in Triton's CPU interpreter, on the same random cases.

Why: the hand-picked cases of ``tests/comm/test_codecs.py`` cover the corners someone thought of; random sizes,
block sizes, row layouts, dtypes and non-finite or subnormal values find the others, and the sanitizers turn a read
or write outside a buffer (which may give the right bits by luck) or undefined behaviour into a failure.

A case (``make_case``) is a codec (int8 or int4, a block size, with or without rotation and stochastic rounding),
``k`` chunks of ``n`` values (tails of every length), flat or a random row layout, an order, an input dtype, one
of several input kinds (normal over many magnitudes, exact ties, subnormals, values near the dtype's largest,
sparse, spread) with nan, inf and -0.0 sprinkled in, and the thread count. Each backend runs the wire API (and the
separate payload / scales API on flat cases) and is compared with the reference as the codec tests compare: the
wire and payload bytes equal (``torch.equal``, scales included), decoded values and sums equal bit for bit with any
nan equal to any nan (``same_bits``). Decoding is checked on the reference's wire, so a decode finding never hides
behind an encode one. One case in ten decodes random bytes with special scales (nan, inf, negative, subnormal)
instead: wires no encoder writes, but every decoder must read them as the reference does.

The C cases run in a child process with the sanitizer runtime preloaded (a sanitized library cannot be loaded
otherwise), the library built once per flag set into the kernel cache folder (``native.build``); a sanitizer
report ends the child, and the case it was running is printed with the command that reruns it alone. (GCC's
AddressSanitizer does not check AVX-512 masked loads and stores, which the AVX-512 paths use for the tails of
blocks: a wrong mask there shows only through the bits. The portable and AVX2 builds have none.) The Triton cases run in a child with ``TRITON_INTERPRET=1``, the interpreter corrected where it computes
otherwise than a GPU (``_patch_interpreter``).

    .venv/bin/python benchmarks/fuzz_codecs.py --seed 0 --cases 2000
    .venv/bin/python benchmarks/fuzz_codecs.py --seed 0 --cases 20000 --builds native portable avx2 --opt 3
    .venv/bin/python benchmarks/fuzz_codecs.py --seed 0 --case 1234          # one case, e.g. a reported one
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tiershard.comm.codecs import BlockCodec, block, native, same_bits
from tiershard.comm.codecs.format import Encoded

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKS = (1, 2, 3, 5, 7, 8, 16, 17, 31, 32, 33, 37, 48, 63, 64, 65, 96, 100, 127, 128, 129, 160, 255, 256, 500, 512,
          1000, 1024, 1500, 2048, 2049, 4096, 4097, 5000, 8192)
WIDTHS = (0, 1, 2, 3, 5, 7, 31, 32, 33, 37, 63, 64, 65, 96, 127, 128, 129, 200, 257, 1000)
WIDE = (4095, 4096, 4097, 5001, 8190, 8191, 8193)  # int4 blocks past the C kernels' staging buffer, units' ends
KINDS = ("normal", "spread", "ties", "subnormal", "huge", "sparse", "mixed")
SANITIZE = ("-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
            "-g")
BUILDS = {"native": ("-march=native",), "portable": (), "avx2": ("-march=x86-64-v3",), "avx512": ("-march=x86-64-v4",)}
ASAN_EXIT, UBSAN_EXIT = 86, 87
TRITON_MAX_VALUES = 8192  # larger cases take minutes in the interpreter


@dataclass(frozen=True)
class Case:
    """One fuzz case; ``make_case(seed, index)`` makes the same one on every run."""

    index: int
    codec: BlockCodec
    dtype: torch.dtype
    k: int
    n: int
    segments: tuple[int, ...] | None
    order: tuple[int, ...] | None
    seed: int | None
    kind: str
    wire_only: bool
    threads: int
    data_seed: int

    def __str__(self) -> str:
        what = "random wire" if self.wire_only else f"{str(self.dtype)[6:]} {self.kind}"
        seed = "" if self.seed is None else f" seed={self.seed:#x}"
        return (f"case {self.index}: {self.codec.spec} k={self.k} n={self.n} segments={self.segments} "
                f"order={self.order} {what} threads={self.threads}{seed}")


def _size(rng: random.Random, blk: int, k: int) -> int:
    """Sizes that leave every kind of tail: tiny, small, a multiple of the block give or take, larger, and now and
    then over 64K values in all (the kernels split those across threads)."""
    r = rng.random()
    if r < 0.01:
        return 0
    if r < 0.25:
        return rng.randint(1, 40)
    if r < 0.6:
        return rng.randint(1, 700)
    if r < 0.88:
        whole = blk * rng.randint(1, max(1, 3000 // blk))
        return max(1, whole + rng.choice([-1, 0, 1, rng.randint(-blk, blk)]))
    if r < 0.97:
        return rng.randint(700, 6000)
    return rng.randint((1 << 16) // k, (150_000) // k)


def _segments(rng: random.Random) -> tuple[int, ...]:
    """A row layout of 1 to 7 segments: the widths that leave odd starts and short blocks, zero widths, now and then
    a wide one."""
    def width() -> int:
        r = rng.random()
        return rng.choice(WIDE) if r < 0.05 else rng.choice(WIDTHS) if r < 0.7 else rng.randint(1, 300)
    widths = [width() for _ in range(rng.randint(1, 7))]
    return tuple(widths) if sum(widths) else (*widths, rng.randint(1, 99))


def make_case(seed: int, index: int) -> Case:
    """Case ``index`` of the stream of ``seed``: drawn from its own generator, so any case reruns alone."""
    rng = random.Random(seed * 1_000_003 + index)
    codec = BlockCodec(rng.choice((4, 8)), rng.choice(BLOCKS), rng.random() < 0.5, rng.random() < 0.5)
    k = rng.choice((1, 1, 2, 2, 3, 4, 5, 8))
    n, segments = _size(rng, codec.block, k), None
    if n and n < 6000 and rng.random() < 0.4:
        segments = _segments(rng)
        n = sum(segments) * (1 if sum(segments) > 3000 else rng.randint(1, 3))
    order = None if rng.random() < 0.3 else tuple(rng.sample(range(k), k))
    key = None
    if codec.stochastic:
        key = rng.choice((0, (1 << 64) - 1, rng.randrange(1 << 32), rng.randrange(1 << 64), rng.randrange(1 << 64)))
    return Case(index, codec, rng.choice(DTYPES), k, n, segments, order, key, rng.choice(KINDS), rng.random() < 0.1,
                2 if k * n >= 1 << 16 else 1, rng.randrange(1 << 62))


SMALLEST = {torch.float32: -149, torch.bfloat16: -133, torch.float16: -24}  # log2 of the least subnormal


def _kind_values(kind: str, m: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``m`` fp32 values of one input kind for ``dtype`` (its range and its subnormals)."""
    info = torch.finfo(dtype)
    normal = torch.randn(m, generator=g)
    if kind == "normal":
        lo, hi = (-35.0, 35.0) if dtype is not torch.float16 else (-6.0, 4.0)
        return normal * 10.0 ** (lo + (hi - lo) * float(torch.rand(1, generator=g)))
    if kind == "spread":  # neighbouring blocks many orders of magnitude apart
        return normal * torch.exp(torch.randn(m, generator=g) * (3.0 if dtype is torch.float16 else 12.0))
    if kind == "ties":  # multiples of half a power of two: many values sit exactly between two levels
        e = int(torch.randint(-20, 10, (1,), generator=g))
        return torch.randint(-254, 255, (m,), generator=g).float() * 0.5 * 2.0 ** e
    if kind == "subnormal":  # the dtype's subnormals, a few of its smallest normals among them
        lo, hi = SMALLEST[dtype], int(torch.tensor(info.smallest_normal).log2()) + 2
        exps = torch.randint(lo, hi, (m,), generator=g).double()
        return (torch.sign(normal).double() * 2.0 ** exps * (1 + torch.rand(m, generator=g).double())).float()
    if kind == "huge":  # near the dtype's largest: the rotation overflows to inf in fp32 for fp32 input
        return torch.sign(normal) * info.max * (0.25 + 0.75 * torch.rand(m, generator=g))
    if kind == "sparse":  # zeros, half of them -0.0
        return torch.where(torch.rand(m, generator=g) < 0.05, normal, torch.zeros(m) * torch.sign(normal))
    return torch.cat([_kind_values(KINDS[int(i)], len(p), dtype, g)  # mixed: runs of every other kind
                      for i, p in zip(torch.randint(0, 6, (8,), generator=g), torch.arange(m).tensor_split(8))])


def make_input(case: Case) -> torch.Tensor:
    """The case's k * n input values in its dtype, with nan, +-inf, -0.0 and the extremes sprinkled in."""
    g = torch.Generator().manual_seed(case.data_seed)
    m = case.k * case.n
    x = _kind_values(case.kind, m, case.dtype, g).to(case.dtype)
    info = torch.finfo(case.dtype)
    specials = (float("nan"), float("inf"), -float("inf"), -0.0, info.max, -info.max, info.tiny,
                2.0 ** SMALLEST[case.dtype])
    if m and float(torch.rand(1, generator=g)) < 0.4:
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            x[int(torch.randint(0, m, (1,), generator=g))] = specials[int(torch.randint(0, len(specials), (1,),
                                                                                       generator=g))]
    return x


SCALES = (float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 1e-40, -1.5, 2.0 ** -126, 3e38, 1.0, 0.1)


def random_wire(case: Case) -> torch.Tensor:
    """Random wire bytes for the case's codec and size, with special fp32 values among the scales."""
    g = torch.Generator().manual_seed(case.data_seed)
    W = case.codec.wire_bytes(case.n, case.segments)
    wire = torch.randint(0, 256, (case.k, W), dtype=torch.uint8, generator=g)
    nb, P4 = case.codec.scales_numel(case.n, case.segments), case.codec.padded_payload_bytes(case.n)
    scales = torch.randn(case.k, nb, generator=g) * 10.0 ** torch.randint(-40, 38, (case.k, nb), generator=g)
    pick = torch.rand(case.k, nb, generator=g) < 0.3
    special = torch.tensor(SCALES)[torch.randint(0, len(SCALES), (case.k, nb), generator=g)]
    wire[:, P4:] = torch.where(pick, special, scales).view(torch.uint8).view(case.k, 4 * nb)
    return wire.view(-1)


def encode_outputs(case: Case, x: torch.Tensor, separate: bool) -> dict[str, torch.Tensor]:
    """What the backend routed to encodes from ``x``: the wire, and with ``separate`` on flat cases the separate
    payload / scales API's encoding (CPU kernels only: it has no Triton path)."""
    c = case.codec
    out = {"encode_wire": c.encode_wire(x, case.k, order=case.order, segments=case.segments, seed=case.seed)}
    if separate and case.segments is None:
        enc = c.encode(x, seed=case.seed)
        out["encode payload"], out["encode scales"] = enc.payload, enc.scales
    return out


def decode_outputs(case: Case, wire: torch.Tensor, enc: Encoded | None) -> dict[str, torch.Tensor]:
    """What the backend routed to decodes from ``wire``: every output dtype and the sum (and ``enc``, the separate
    API's encoding of a flat case, decoded to the input dtype)."""
    c, k, n, seg = case.codec, case.k, case.n, case.segments
    out = {f"decode_wire {str(d)[6:]}": c.decode_wire(wire, k, n, dtype=d, segments=seg) for d in DTYPES}
    out["decode_wire_sum"] = c.decode_wire_sum(wire, k, n, segments=seg)
    if enc is not None:
        out["decode"] = c.decode(enc, dtype=case.dtype)
    return out


def route(cpu, gpu) -> None:
    """Send the codec API's calls to a backend: ``cpu(t, dtype)`` and ``gpu(t, wire)`` return the kernels or None
    (the reference when both do)."""
    block._cpu_lib, block._gpu_lib = cpu, gpu


def reference() -> None:
    route(lambda t, dtype: None, lambda t, wire: None)


def run_case(case: Case, use_backend, separate: bool = True) -> tuple[int, list[str]]:
    """Compare the backend that ``use_backend()`` routes to with the reference on one case: (comparisons, the names
    of those that differ). Decoding reads the reference's wire, so a decode mismatch is the decoder's own."""
    reference()
    if case.wire_only:
        x, want = None, {}
        wire = random_wire(case)
    else:
        x = make_input(case)
        want = encode_outputs(case, x, separate)
        wire = want["encode_wire"]
    enc = Encoded(want["encode payload"], want["encode scales"], case.k * case.n) if "encode payload" in want else None
    want.update(decode_outputs(case, wire, enc))
    use_backend()
    torch.set_num_threads(case.threads)
    try:
        got = {} if x is None else encode_outputs(case, x, separate)
        got.update(decode_outputs(case, wire, enc))
    finally:
        torch.set_num_threads(1)
        reference()
    bad = [name for name, t in want.items()
           if not (same_bits(got[name], t) if t.is_floating_point() else torch.equal(got[name], t))]
    return len(want), bad


def run_cases(cases, use_backend, label: str, separate: bool = True, progress: Path | None = None) -> int:
    """Run ``cases``, printing each mismatch and then the summary line; returns the number of differing
    comparisons. ``progress`` gets each case before it runs, so a sanitizer's abort can be traced to it."""
    start, total, differ, count = time.perf_counter(), 0, 0, 0
    for case in cases:
        if progress is not None:
            progress.write_text(str(case))
        compared, bad = run_case(case, use_backend, separate)
        count, total, differ = count + 1, total + compared, differ + len(bad)
        if bad:
            print(f"MISMATCH {label} {case}: {', '.join(bad)}", flush=True)
    tail = f", {differ} differ" if differ else ""
    print(f"{label}: {count} cases, {total - differ} comparisons equal the reference{tail} "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    return differ


# ---- the C kernels, sanitized, in a child process -----------------------------------------------------------
def sanitizer_runtime() -> str | None:
    """The compiler's AddressSanitizer runtime (what a sanitized library needs preloaded), or None without one."""
    cc = native._compiler()
    if cc is None:
        return None
    try:
        found = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    path = found.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def sanitizer_env(runtime: str) -> dict[str, str]:
    """The environment of a process that loads a sanitized library: the runtime first, leaks not checked (Python
    keeps its objects to the end), every report fatal with its own exit code."""
    return dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS=f"detect_leaks=0:exitcode={ASAN_EXIT}",
                UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:exitcode={UBSAN_EXIT}",
                PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def build_sanitized(build: str, opt: int) -> native.Kernels:
    """The kernels with ``build``'s target flags, OpenMP and the sanitizers, compiled once per flag set into the
    kernel cache folder (never into the source tree)."""
    return native.build(BUILDS[build] + ("-fopenmp", f"-O{opt}") + SANITIZE, native._cache_dir() / "sanitized")


def native_backend(lib: native.Kernels):
    """A ``use_backend`` for ``run_case`` that routes CPU calls to ``lib``."""
    return lambda: route(lambda t, dtype: lib if dtype is not torch.float16 or lib.has_f16 else None,
                         lambda t, wire: None)


def _native_child(args: argparse.Namespace) -> int:
    lib = build_sanitized(args.build, args.opt)
    print(f"C kernels [{args.build}]: {lib}", flush=True)
    return int(run_cases(_cases(args), native_backend(lib), f"C kernels [{args.build} -O{args.opt}, sanitized]",
                         progress=Path(args.progress)) > 0)


# ---- the Triton kernels in Triton's interpreter, in a child process -------------------------------------------
def _patch_interpreter() -> None:
    """Make Triton's interpreter compute what a GPU computes where it does not (its own bugs, not the kernels'):

    - Triton 3.6's interpreter turns a scalar argument into an int with int() of a 1-element array, which NumPy
      >= 2.4 refuses (as in tests/comm/test_codecs.py): read the element instead.
    - Triton 3.9's interpreter widens bf16 to fp32 by renormalizing the significand, which turns every bf16
      subnormal into a wrong value (1.0e-39 into 4.4e-39, 1.8e-40 into 0); a GPU widens by a 16-bit shift, exact.
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is not None:
        def patch_index(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interpreter._patch_lang_tensor = patch_index
    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def widen_bf16_exactly(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            bits = src.data.view(np.uint16).astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return cast(self, src, dst_type)
    builder.cast_impl = widen_bf16_exactly  # the fp_ext and int-to-fp builders call it


def _triton_child(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # NumPy's overflow warnings: inf input is a case
    _patch_interpreter()
    from tiershard.comm.codecs import triton_kernels as T

    cases = [c for c in _cases(args) if c.k * c.n <= TRITON_MAX_VALUES]
    use = lambda: route(lambda t, dtype: None, lambda t, wire: T if wire.data_ptr() % 4 == 0 else None)  # noqa: E731
    label = f"Triton kernels [interpreter, triton {T.triton.__version__}, cases of <= {TRITON_MAX_VALUES} values]"
    return int(run_cases(cases[:args.triton_cases], use, label, separate=False) > 0)


# ---- the driver ----------------------------------------------------------------------------------------------
def _cases(args: argparse.Namespace) -> list[Case]:
    """The cases to run: ``--case`` alone, or cases 0..N-1 of the seed's stream without those over ``--max-values``
    values in all."""
    if args.case is not None:
        return [make_case(args.seed, args.case)]
    cases = (make_case(args.seed, i) for i in range(args.cases))
    return [c for c in cases if args.max_values is None or c.k * c.n <= args.max_values]


def _child(kind: str, args: argparse.Namespace, env: dict[str, str], extra: list[str]) -> tuple[int, str]:
    """Run one child; (exit code, the case it was running when it stopped)."""
    with tempfile.TemporaryDirectory(prefix="tiershard-fuzz-") as tmp:
        progress = Path(tmp) / "case"
        cmd = [sys.executable, __file__, "--child", kind, "--seed", str(args.seed), "--cases", str(args.cases),
               "--opt", str(args.opt), "--triton-cases", str(args.triton_cases), "--progress", str(progress), *extra]
        for name in ("case", "max_values"):
            if getattr(args, name) is not None:
                cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        rc = subprocess.run(cmd, env=env).returncode
        return rc, progress.read_text() if progress.exists() else "before the first case"


def _fuzz_native(args: argparse.Namespace) -> bool:
    runtime = sanitizer_runtime()
    if runtime is None:
        print("C kernels: gcc with AddressSanitizer (libasan) not found: skipped", flush=True)
        return True
    ok = True
    for build in args.builds:
        rc, case = _child("native", args, sanitizer_env(runtime), ["--build", build])
        if rc in (ASAN_EXIT, UBSAN_EXIT) or rc < 0:
            what = {ASAN_EXIT: "AddressSanitizer", UBSAN_EXIT: "UndefinedBehaviorSanitizer"}.get(rc, f"signal {-rc}")
            index = case.split(":")[0].split()[-1]
            print(f"SANITIZER [{build}] {what} report in {case}; rerun it alone: python {__file__} --seed {args.seed} "
                  f"--case {index} --builds {build} --opt {args.opt}", flush=True)
        ok &= rc == 0
    return ok


def _fuzz_triton(args: argparse.Namespace) -> bool:
    import importlib.util

    if args.triton_cases == 0:
        return True
    if importlib.util.find_spec("triton") is None:
        print("Triton kernels: triton not installed: skipped", flush=True)
        return True
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return _child("triton", args, env, [])[0] == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=2000, help="cases 0..N-1 of the seed's stream")
    parser.add_argument("--case", type=int, default=None, help="only this case (to rerun a reported one)")
    parser.add_argument("--max-values", type=int, default=None, help="leave out cases of more values in all")
    parser.add_argument("--builds", nargs="*", default=["native"], choices=sorted(BUILDS),
                        help="target flags of the sanitized C builds (each runs every case)")
    parser.add_argument("--opt", type=int, default=1, choices=(1, 2, 3), help="optimization level of those builds")
    parser.add_argument("--triton-cases", type=int, default=200,
                        help=f"Triton runs the first N cases of at most {TRITON_MAX_VALUES} values (0: none)")
    parser.add_argument("--child", choices=("native", "triton"), help=argparse.SUPPRESS)
    parser.add_argument("--build", default="native", help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=os.devnull, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child == "native":
        return _native_child(args)
    if args.child == "triton":
        return _triton_child(args)
    start = time.perf_counter()
    ok = _fuzz_native(args) & _fuzz_triton(args)
    print(f"fuzz seed {args.seed}: {'no findings' if ok else 'FINDINGS above'} ({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
