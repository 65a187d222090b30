"""Two builds of the int8-grid decode kernel (loom_linear_q8_vnni: linear_vnni.c, AVX512-VNNI or
its AVX2 form) side by side in one process, call by call, the order swapped every call: per shape
and row count the median time of each, NEW / OLD, and the largest difference between their
outputs (0 when the arithmetic is the same).

    .venv/bin/python benchmarks/bench_vnni_ab.py OLD.so NEW.so [--threads 1] [--repeats 150]
    .venv/bin/python benchmarks/bench_vnni_ab.py OLD.so NEW.so --check   # bits only, many shapes

OLD.so / NEW.so: any two builds of the kernels, e.g. the variant's library from the cache
(~/.cache/loom/kernels/loom_x86_64_avx2_*.so) copied aside before and after a change to
csrc/linear_vnni.c and `python -m loom.kernels.build`. Random weights (4-bit, the heads 8-bit)
with fp16 scales and minimums, the same for both builds; the shapes are SmolLM2-135M's (576- and
1536-wide rows: the 576-wide end in a tail of 2 groups), Gemma 3's 640-wide rows and the 1.7B
shape's 2048-wide ones. Run it both ways round (OLD NEW, then NEW OLD): a shared VM's drift
shows up as ratios that do not invert. `--check`: 1440 calls of each build, 4- and 8-bit rows
of 1 to 65 groups (tails of every length), with and without minimums, 1 to 12 x rows, 1 to 17
weight rows, two threads; exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vnni import random_weights  # noqa: E402

# (name, N, K, bits)
SHAPES = [("qkv", 960, 576, 4), ("gate_up", 3072, 576, 4), ("down", 576, 1536, 4),
          ("gemma3_640", 2048, 640, 4), ("1.7b", 2048, 2048, 4), ("head", 49152, 576, 8)]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(path).resolve()))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.loom_linear_q8_vnni.argtypes = [p, i64, i64, i64, p, p, p, p, i64, p, i64, ctypes.c_int,
                                        ctypes.c_int]
    if not lib.loom_vnni_available():
        sys.exit(f"{path}: no VNNI kernel in this build (AVX512-VNNI or AVX2)")
    return lib


def call(lib: ctypes.CDLL, x: torch.Tensor, m: int, wts, n: int, bits: int, y: torch.Tensor,
         threads: int) -> None:
    w, scales, low = wts
    k = x.shape[1]
    rc = lib.loom_linear_q8_vnni(x.data_ptr(), m, k, k, w.data_ptr(), scales.data_ptr(),
                                 None if low is None else low.data_ptr(), None, n, y.data_ptr(),
                                 n, bits, threads)
    assert rc == 0, rc


def check(old: ctypes.CDLL, new: ctypes.CDLL) -> int:
    g = torch.Generator().manual_seed(1)
    cases = differ = 0
    for bits in (4, 8):
        for k in (32, 64, 96, 128, 160, 224, 288, 576, 640, 2080):
            for n in (1, 3, 17):
                for mins in (True, False):
                    wts = random_weights(n, k, bits, g, mins)
                    for m in range(1, 13):
                        x = torch.randn(m, k, generator=g)
                        a, b = torch.zeros(m, n), torch.zeros(m, n)
                        call(old, x, m, wts, n, bits, a, 2)
                        call(new, x, m, wts, n, bits, b, 2)
                        cases += 1
                        if not torch.equal(a, b):
                            differ += 1
                            print(f"differ: {bits}-bit K={k} N={n} mins={mins} M={m}: "
                                  f"{(a - b).abs().max().item():.3g}")
    print(f"{cases} calls, {differ} with other outputs")
    return 1 if differ else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=150, help="calls of each (the head: a tenth)")
    ap.add_argument("--check", action="store_true", help="compare the outputs' bits only")
    args = ap.parse_args()
    old, new = load(args.old), load(args.new)
    if args.check:
        sys.exit(check(old, new))
    g = torch.Generator().manual_seed(0)
    for name, n, k, bits in SHAPES:
        wts = random_weights(n, k, bits, g)
        x = torch.randn(8, k, generator=g)
        ya, yb = torch.empty(8, n), torch.empty(8, n)
        cells = []
        for m in (1, 2, 4, 8):
            times: dict[int, list[float]] = {0: [], 1: []}
            for i in range(max(args.repeats // 10, 5) if name == "head" else args.repeats):
                for side in ((0, 1) if i % 2 else (1, 0)):
                    lib, y = (old, ya) if side == 0 else (new, yb)
                    t0 = time.perf_counter()
                    call(lib, x, m, wts, n, bits, y, args.threads)
                    times[side].append(time.perf_counter() - t0)
            a, b = statistics.median(times[0]), statistics.median(times[1])
            diff = (ya[:m] - yb[:m]).abs().max().item()
            cells.append(f"M{m} {a * 1e6:.0f}->{b * 1e6:.0f} us ({b / a:.3f}x, maxdiff {diff:.1e})")
        print(f"{name:>10} {n}x{k} {bits}-bit: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
