"""Two builds of the K-quant decode kernel (loom_linear_kq; with --gemm the kernel past 8 rows,
loom_linear_kq_gemm) side by side in one process, interleaved call by call: the only A/B that
says anything on a shared machine.

    .venv/bin/python benchmarks/bench_kquant_ab.py OLD.so NEW.so [--rows 1 --threads 1
        --repeats 300 --layers 8 --passes 20 --gemm]

OLD.so / NEW.so: any two builds of the kernels, e.g. the variant's library from the cache
(~/.cache/loom/kernels/loom_x86_64_avx2_*.so) copied aside before and after a change to
csrc/linear_kquant.c (or csrc/linear_kq_gemm.c) and `python -m loom.kernels.build`. Random
blocks with a trained model's scales (tests/model/test_kquant.py's), SmolLM2-1.7B's shapes: each shape alone, in cache
(medians and best of `repeats` calls each, NEW / OLD), then `layers` layers of its linears in
order, from memory (q, k, o Q4_K 2048 x 2048, v Q6_K, gate and up Q4_K 8192 x 2048, down Q6_K
2048 x 8192: 43 MB a layer), `passes` times, each call timed: the sum of the calls' medians.
`maxdiff`: the largest difference between the two builds' outputs (0 when the arithmetic is the
same). With two threads on a loaded 2-core machine every OpenMP region waits out other
processes' time slices: those figures say nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model.test_kquant import random_blocks  # noqa: E402

SHAPES = [(T.Q4_K, 2048, 2048), (T.Q4_K, 8192, 2048), (T.Q4_K, 2048, 8192),
          (T.Q6_K, 2048, 2048), (T.Q6_K, 2048, 8192)]
LAYER = [(T.Q4_K, 2048, 2048), (T.Q4_K, 2048, 2048), (T.Q6_K, 2048, 2048),
         (T.Q4_K, 2048, 2048), (T.Q4_K, 8192, 2048), (T.Q4_K, 8192, 2048),
         (T.Q6_K, 2048, 8192)]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(Path(path).resolve()))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for f in (lib.loom_linear_kq, lib.loom_linear_kq_gemm):
        f.argtypes = [p, i64, i64, i64, p, ctypes.c_int, p, i64, p, i64, ctypes.c_int]
    return lib


GEMM = False  # --gemm: loom_linear_kq_gemm


def call(lib: ctypes.CDLL, b, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    n, k = b.shape
    rc = (lib.loom_linear_kq_gemm if GEMM else lib.loom_linear_kq)(
        x.data_ptr(), x.shape[0], k, k, b.data.data_ptr(), b.fmt, None, n, y.data_ptr(), n,
        threads)
    assert rc == 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--passes", type=int, default=20)
    p.add_argument("--gemm", action="store_true")
    a = p.parse_args()
    global GEMM
    GEMM = a.gemm
    libs = [load(a.old), load(a.new)]
    rng = np.random.default_rng(0)
    for q, n, k in SHAPES:
        b = random_blocks(q, n, k, rng)
        x = torch.from_numpy(rng.standard_normal((a.rows, k)).astype(np.float32))
        ys = [torch.empty(a.rows, n) for _ in libs]
        ts: list[list[float]] = [[], []]
        for _ in range(a.repeats):
            for i, lib in enumerate(libs):
                t = time.perf_counter()
                call(lib, b, x, ys[i], a.threads)
                ts[i].append(time.perf_counter() - t)
        med = [statistics.median(t) * 1e6 for t in ts]
        print(f"{q.name} {n} x {k}: old {med[0]:.0f} us, new {med[1]:.0f} us: "
              f"{med[1] / med[0]:.3f}x (best {min(ts[1]) / min(ts[0]):.3f}x), maxdiff "
              f"{(ys[0] - ys[1]).abs().max().item():.2e}", flush=True)
    if a.layers <= 0:
        return
    blocks = [random_blocks(q, n, k, rng) for _ in range(a.layers) for q, n, k in LAYER]
    xs = {k: torch.from_numpy(rng.standard_normal((a.rows, k)).astype(np.float32))
          for k in (2048, 8192)}
    ys = [torch.empty(a.rows, 8192) for _ in libs]
    # each call timed alone and a pass summed from the calls' medians: a pass's own time on a
    # shared machine is mostly whether another process took the core during it
    ts = [[[] for _ in blocks] for _ in libs]
    for _ in range(a.passes):
        for i, lib in enumerate(libs):
            for j, b in enumerate(blocks):
                t = time.perf_counter()
                call(lib, b, xs[b.shape[1]], ys[i], a.threads)
                ts[i][j].append(time.perf_counter() - t)
    mb = sum(b.data.numel() for b in blocks) / 1e6
    med = [sum(statistics.median(c) for c in t) for t in ts]
    print(f"{a.layers} layers ({mb:.0f} MB) from memory, sums of each call's median over "
          f"{a.passes} passes: old {med[0] * 1e3:.1f} ms ({mb / med[0] / 1e3:.1f} GB/s), new "
          f"{med[1] * 1e3:.1f} ms ({mb / med[1] / 1e3:.1f} GB/s): {med[1] / med[0]:.3f}x")

if __name__ == "__main__":
    main()
