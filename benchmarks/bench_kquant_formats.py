"""The K-quant kernel on each format it runs, one process, the formats alternated, medians:
milliseconds a layer and GB/s of the blocks read.

    .venv/bin/python benchmarks/bench_kquant_formats.py [--n 8192 --k 2048 --layers 12]
        [--rows 1] [--rounds 8] [--gemm] [--against OLD.so]

Random blocks (tests/model/test_kquant.py's `random_blocks`: every byte pattern is a valid
K-quant block, with fp16 scales of a trained model's size), `layers` matrices [n, k] of each format, so a round streams them from memory as a
decode step does; each round runs every format's layers in turn on the build this process
selects (`loom_linear_kq`, the integer kernel in chunks of 8 rows, and "Q4_K x16" the same Q4_K
blocks interleaved 16 rows at a time as the loader keeps them on AVX512-VNNI builds; `--gemm`:
`loom_linear_kq_gemm`, past 8 rows the panels' GEMM that prompts run by default). `--against`:
another build of the same kernels (e.g. the variant's library from ~/.cache/loom/kernels copied
aside before a change) run beside it, each format on both in turn, and the ratio (this / OLD).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from loom.kernels import _load, cpu_kernels, kernel_choice
from loom.quant.kquant import KQ_TYPES, R16

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.model.test_kquant import random_blocks  # noqa: E402

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gemm", action="store_true", help="loom_linear_kq_gemm past 8 rows")
    p.add_argument("--against", default=None, help="another build of the kernels (.so)")
    a = p.parse_args()
    lib = cpu_kernels()
    if lib is None:
        raise SystemExit("bench_kquant_formats: no C kernels on this machine")
    libs = {"this": lib} | ({"old": _load(Path(a.against))} if a.against else {})
    formats = [q for q in KQ_TYPES  # those every build runs (an older one may lack some)
               if all(b.loom_kq_check(a.k, KQ_TYPES[q]) == 0 for b in libs.values())]
    rng = np.random.default_rng(0)
    blocks = {q: [random_blocks(q, a.n, a.k, rng) for _ in range(a.layers)] for q in formats}
    codes = {q.name: KQ_TYPES[q] for q in formats}
    mats = {q.name: [b.data for b in blocks[q]] for q in formats}
    q4k = GGMLQuantizationType.Q4_K
    if q4k in formats and all(b.loom_kq_check(a.k, KQ_TYPES[q4k] | R16) == 0
                              for b in libs.values()) and a.n % 16 == 0:
        # the same Q4_K weights interleaved 16 rows at a time (what the loader runs)
        codes["Q4_K x16"] = KQ_TYPES[q4k] | R16
        mats["Q4_K x16"] = [b.interleave().data for b in blocks[q4k]]
    formats = list(codes)
    x = torch.randn(a.rows, a.k)
    y = torch.empty(a.rows, a.n)
    times = {(q, b): [] for q in formats for b in libs}
    for r in range(a.rounds + 1):  # the first round warms up, unrecorded
        order = [(q, b) for q in formats for b in libs]
        for q, b in order if r % 2 == 0 else reversed(order):
            t = time.perf_counter()
            for w in mats[q]:
                call = libs[b].loom_linear_kq_gemm if a.gemm else libs[b].loom_linear_kq
                rc = call(x.data_ptr(), a.rows, a.k, a.k, w.data_ptr(), codes[q], None, a.n,
                          y.data_ptr(), a.n, a.threads)
                assert rc == 0, rc
            if r:
                times[q, b].append((time.perf_counter() - t) / a.layers)
    print(f"build {kernel_choice().variant}, {a.rows} row(s), {a.threads} threads, "
          f"{'the GEMM past 8 rows, ' if a.gemm else ''}{a.layers} layers of {a.n} x {a.k}, "
          f"medians of {a.rounds} rounds")
    for q in formats:
        m = statistics.median(times[q, "this"])
        line = (f"{q}: {m * 1e3:.3f} ms a layer, {mats[q][0].numel() / m / 1e9:.1f} GB/s "
                f"({mats[q][0].numel() / 1e6:.1f} MB a layer)")
        if "old" in libs:
            ratios = [t / o for t, o in zip(times[q, "this"], times[q, "old"])]
            line += (f"; OLD {statistics.median(times[q, 'old']) * 1e3:.3f} ms, this / OLD "
                     f"{statistics.median(ratios):.3f} (rounds {min(ratios):.2f}-"
                     f"{max(ratios):.2f})")
        print(line)


if __name__ == "__main__":
    main()
