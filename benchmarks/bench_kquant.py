"""K-quant decode kernel against the int8-grid kernels on the same weights, one process,
interleaved, medians.

    .venv/bin/python benchmarks/bench_kquant.py [--n 2048 --k 8192 --rows 1 --repeats 200]

A random Q4_K matrix [n, k] (loom.quant.kquant: its blocks as stored, 4.5 bits a weight) and the
same values on Loom's int8 grid (Q4_K's sub-blocks of 32 are 4-bit groups exactly: scale d sc,
minimum -dmin m; 4 bits a weight plus fp32 scales and minimums, fp16 copies for VNNI). Each
kernel runs `repeats` times in turn, on the build this process selects; GB/s counts the bytes
each kernel reads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from loom.kernels import cpu_kernels, kernel_choice
from loom.quant.int8 import Int8Linear, Q8Groups
from loom.quant.kquant import KBlocks


def q4k_on_grid(blocks: KBlocks) -> Q8Groups:
    """Q4_K's sub-blocks of 32 as 4-bit int8-grid groups (exact)."""
    rows, cols = blocks.shape
    raw = blocks.data.numpy().reshape(-1, 144)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = raw[:, 4:16].astype(np.uint8)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    qs = raw[:, 16:].reshape(-1, 4, 32)
    vals = np.stack([qs & 15, qs >> 4], 2).reshape(-1, 8, 32)  # [blocks, sub-block, 32]
    packed = (vals[:, :, :16] | vals[:, :, 16:] << 4).reshape(rows, cols // 2)
    scale = (d * sc).reshape(rows, cols // 32)
    mins = (-(dmin * mn)).reshape(rows, cols // 32)
    return Q8Groups(torch.from_numpy(packed.astype(np.uint8)), torch.from_numpy(scale),
                    torch.from_numpy(mins), 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: torch's)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(a.n * a.k // 256, 144), dtype=np.uint8)
    raw[:, 0:4] = rng.uniform(2e-4, 2e-3, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    blocks = KBlocks.from_gguf(raw.reshape(-1), GGMLQuantizationType.Q4_K, (a.n, a.k))
    grid = q4k_on_grid(blocks)
    lin = Int8Linear.empty(a.k, a.n, False, grid, bits=4)
    vnni = Int8Linear.empty(a.k, a.n, False, grid, bits=4)
    vnni.use_vnni()
    x = torch.from_numpy(rng.standard_normal((a.rows, a.k)).astype(np.float32))
    y = torch.empty(a.rows, a.n)
    lib, nt = cpu_kernels(), torch.get_num_threads()
    ref = x.double() @ blocks.dequantize().double().T

    def kq() -> None:
        lib.loom_linear_kq(x.data_ptr(), a.rows, a.k, a.k, blocks.data.data_ptr(), 12, None,
                           a.n, y.data_ptr(), a.n, nt)

    runs = {"kquant Q4_K": (kq, blocks.data.numel()),
            "int8 grid fp32 kernel": (lambda: lin(x), a.n * a.k // 2 + a.n * a.k // 32 * 8),
            "int8 grid vnni kernel": (lambda: vnni(x), a.n * a.k // 2 + a.n * a.k // 32 * 4)}
    kq()
    assert float((y.double() - ref).abs().max()) < 1e-3 * float(ref.abs().max())
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, (fn, _) in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    print(f"{kernel_choice().variant} build, {nt} threads, {a.n} x {a.k}, {a.rows} row(s), "
          f"median of {a.repeats} interleaved runs")
    for name, (_, nbytes) in runs.items():
        med = statistics.median(times[name])
        print(f"  {name:24s} {med * 1e6:9.1f} us  {nbytes / 2**20:6.2f} MiB  "
              f"{nbytes / med / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
