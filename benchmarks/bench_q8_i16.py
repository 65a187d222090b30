"""The int8 grid's two kernels past 8 rows in one build and one process, interleaved call by call:
loom_linear_q8_f32 (fp32 FMAs) against loom_linear_q8_i16 (the int16 tiles of linear_kq_gemm.c),
on SmolLM2-135M's shapes (4-bit, K 576 and 1536), Gemma 3 270M's (8-bit, K 640) and the 1.7B's
Q4_0 gate/up (4-bit, 4096 x 2048); medians, GMAC/s, and the largest difference between the two.

    .venv/bin/python benchmarks/bench_q8_i16.py [--rows 128] [--threads 2] [--variant avx2]

`--variant`: a build with the int16 tiles (avx2; vnni or avx512, whose tiles are 512 bits wide)
this CPU runs. Random weights, scales and minimums: the speed of
a layer does not depend on its values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from loom.kernels import cpu_kernels, select

SHAPES = [(4, 576, 576), (4, 3072, 576), (4, 576, 1536), (8, 1024, 640), (8, 4096, 640),
          (4, 4096, 2048)]  # (bits, N, K)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", default="avx2", choices=["avx2", "avx512", "vnni"])
    a = p.parse_args()
    select(a.variant)
    lib = cpu_kernels()
    rng = np.random.default_rng(0)
    for bits, n, k in SHAPES:
        w = torch.from_numpy(rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8))
        s = torch.from_numpy((rng.random((n, k // 32)) * 1e-2).astype(np.float32))
        m = torch.from_numpy((-rng.random((n, k // 32)) * 0.1).astype(np.float32))
        x = torch.from_numpy(rng.standard_normal((a.rows, k)).astype(np.float32))
        ys = [torch.empty(a.rows, n) for _ in range(2)]
        kernels = [lib.loom_linear_q8_f32, lib.loom_linear_q8_i16]
        ts: list[list[float]] = [[], []]
        for _ in range(max(5, int(2e9 / (a.rows * n * k)))):
            for i, f in enumerate(kernels):
                t = time.perf_counter()
                rc = f(x.data_ptr(), a.rows, k, k, w.data_ptr(), s.data_ptr(), m.data_ptr(), None,
                       n, ys[i].data_ptr(), n, bits, a.threads)
                ts[i].append(time.perf_counter() - t)
                assert rc == 0, rc
        med = [statistics.median(t) for t in ts]
        rate = [a.rows * n * k / t / 1e9 for t in med]
        rel = ((ys[0] - ys[1]).abs().max() / ys[0].abs().max()).item()
        print(f"{bits}-bit {n} x {k}, {a.rows} rows: fp32 {med[0] * 1e3:.3f} ms ({rate[0]:.0f} "
              f"GMAC/s), int16 {med[1] * 1e3:.3f} ms ({rate[1]:.0f} GMAC/s): "
              f"{med[1] / med[0]:.3f}x; largest difference / largest output {rel:.1e}", flush=True)


if __name__ == "__main__":
    main()
