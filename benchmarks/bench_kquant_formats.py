"""The K-quant kernel on each format it runs, one process, the formats alternated, medians:
milliseconds a layer and GB/s of the blocks read.

    .venv/bin/python benchmarks/bench_kquant_formats.py [--n 8192 --k 2048 --layers 12]
        [--rows 1] [--rounds 8]

Random blocks (every byte pattern is a valid K-quant block) with fp16 scales of a trained
model's size, `layers` matrices [n, k] of each format, so a round streams them from memory as a
decode step does; each round runs every format's layers in turn on the build this process
selects (`loom_linear_kq`: up to 8 rows the integer kernel, past 8 the GEMM).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from loom.kernels import cpu_kernels, kernel_choice
from loom.quant.kquant import KQ_TYPES

# where each format keeps its fp16 d (and dmin after it, where it has one)
D_AT = {GGMLQuantizationType.Q2_K: 80, GGMLQuantizationType.Q3_K: 108,
        GGMLQuantizationType.Q4_K: 0, GGMLQuantizationType.Q5_K: 0,
        GGMLQuantizationType.Q6_K: 208}


def random_rows(qtype: GGMLQuantizationType, rows: int, cols: int,
                rng: np.random.Generator) -> np.ndarray:
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
    halves = 1 if qtype in (GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q6_K) else 2
    d = rng.uniform(2e-4, 2e-3, (raw.shape[0], halves)).astype(np.float16)
    raw[:, D_AT[qtype]:D_AT[qtype] + 2 * halves] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    lib = cpu_kernels()
    if lib is None:
        raise SystemExit("bench_kquant_formats: no C kernels on this machine")
    rng = np.random.default_rng(0)
    mats = {q: [random_rows(q, a.n, a.k, rng) for _ in range(a.layers)] for q in KQ_TYPES}
    x = torch.randn(a.rows, a.k)
    y = torch.empty(a.rows, a.n)
    times: dict[GGMLQuantizationType, list[float]] = {q: [] for q in KQ_TYPES}
    for r in range(a.rounds + 1):  # the first round warms up, unrecorded
        order = list(KQ_TYPES) if r % 2 == 0 else list(reversed(KQ_TYPES))
        for q in order:
            t = time.perf_counter()
            for w in mats[q]:
                rc = lib.loom_linear_kq(x.data_ptr(), a.rows, a.k, a.k, w.ctypes.data,
                                        KQ_TYPES[q], None, a.n, y.data_ptr(), a.n, a.threads)
                assert rc == 0, rc
            if r:
                times[q].append((time.perf_counter() - t) / a.layers)
    print(f"build {kernel_choice().variant}, {a.rows} row(s), {a.threads} threads, "
          f"{a.layers} layers of {a.n} x {a.k}, medians of {a.rounds} rounds")
    for q in KQ_TYPES:
        m = statistics.median(times[q])
        print(f"{q.name}: {m * 1e3:.3f} ms a layer, {mats[q][0].nbytes / m / 1e9:.1f} GB/s "
              f"({mats[q][0].nbytes / 1e6:.1f} MB a layer)")


if __name__ == "__main__":
    main()
