"""The K-quant decode kernel (loom_linear_kq) on SmolLM2-1.7B's linears, as a decode step reads
them: bytes per second against the machine's read bandwidth.

    .venv/bin/python benchmarks/bench_kquant_shapes.py [--layers 24 --rows 1 --threads 2
        --repeats 10]

Random blocks (valid K-quants with a trained model's scales) in the shapes and formats of the
1.7B shape's Q4_K_M file, per layer: q, k, o Q4_K 2048 x 2048, v Q6_K 2048 x 2048, gate and up
Q4_K 8192 x 2048, down Q6_K 2048 x 8192 (43 MB a layer; 24 layers ~1 GB, far past the caches, as
in a real step). Each repeat runs every layer's linears in order (one call each, as the module
path does; the one-call C stack runs the same kernel in one OpenMP region); the best and the
median of the repeats are reported. Then each shape alone, in cache (the kernel's compute rate).
The build is the one this process selects (LOOM_CPU_KERNELS=avx2 to try another).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from loom.kernels import cpu_kernels, kernel_choice
from loom.quant.kquant import KBlocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model.test_kquant import random_blocks  # noqa: E402

SHAPES = [("q", T.Q4_K, 2048, 2048), ("k", T.Q4_K, 2048, 2048), ("v", T.Q6_K, 2048, 2048),
          ("o", T.Q4_K, 2048, 2048), ("gate", T.Q4_K, 8192, 2048), ("up", T.Q4_K, 8192, 2048),
          ("down", T.Q6_K, 2048, 8192)]


def run(lib, x: torch.Tensor, y: torch.Tensor, b: KBlocks, threads: int) -> None:
    rows, cols = b.shape
    rc = lib.loom_linear_kq(x.data_ptr(), x.shape[0], cols, cols, b.data.data_ptr(), b.fmt, None,
                            rows, y.data_ptr(), rows, threads)
    assert rc == 0, rc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rows", type=int, default=1, help="x rows (1..8: decode)")
    p.add_argument("--threads", type=int, default=0, help="default: torch's")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    lib, nt = cpu_kernels(), a.threads or torch.get_num_threads()
    rng = np.random.default_rng(0)
    layers = [[random_blocks(q, n, k, rng) for _, q, n, k in SHAPES] for _ in range(a.layers)]
    nbytes = sum(b.data.numel() for layer in layers for b in layer)
    x = torch.from_numpy(rng.standard_normal((a.rows, 8192)).astype(np.float32))
    y = torch.empty(a.rows, 8192)
    xs = {k: x[:, :k].contiguous() for k in (2048, 8192)}
    times = []
    for _ in range(a.repeats + 1):
        t = time.perf_counter()
        for layer in layers:
            for b in layer:
                run(lib, xs[b.cols], y, b, nt)
        times.append(time.perf_counter() - t)
    times = times[1:]
    print(f"{kernel_choice().variant} build, {nt} threads, {a.rows} row(s), {a.layers} layers "
          f"({nbytes / 2**20:.0f} MiB), {a.repeats} repeats")
    for name, s in (("best", min(times)), ("median", statistics.median(times))):
        print(f"  {name:6s} {s * 1e3:8.2f} ms a step  {nbytes / s / 1e9:6.1f} GB/s")
    print("  each shape alone, in cache (best of 50):")
    for (name, q, n, k), b in zip(SHAPES, layers[0]):
        best = min(_timed(lambda: run(lib, xs[k], y, b, nt)) for _ in range(50))
        print(f"    {name:5s} {q.name} {n:5d} x {k:5d} {best * 1e6:8.1f} us  "
              f"{b.data.numel() / best / 1e9:6.1f} GB/s")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
