"""A prototype's measure (benchmarks/kq_i16_decode.c, not a kernel Loom runs): Q4_K decode of 1 to
8 x rows with the weights' integers times their sub-block scales in int16 and x as one int16 a
super-block (vpdpwssd, a conversion a super-block and row), against Loom's VNNI K-quant kernel
(loom_linear_kq: two int8 digits a run of 16) in one process, alternated, medians; and the
prototype's largest error against the float64 product next to the kernel's.

    .venv/bin/python benchmarks/bench_kq_i16_decode.py [--layers 12 --n 8192 --k 2048]
        [--rounds 7] [--threads 2]

Needs an AVX512-VNNI CPU and a C compiler (cc). Random Q4_K blocks (tests/model/test_kquant.py).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from loom.kernels import cpu_kernels, kernel_choice

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.model.test_kquant import random_blocks, reference  # noqa: E402


def build() -> ctypes.CDLL:
    out = Path(tempfile.mkdtemp()) / "kq_i16_decode.so"
    subprocess.run(["cc", "-O3", "-march=x86-64-v4", "-mavx512vnni", "-fopenmp", "-shared",
                    "-fPIC", "-o", str(out), str(ROOT / "benchmarks" / "kq_i16_decode.c")],
                   check=True)
    lib = ctypes.CDLL(str(out))
    lib.proto_q4k.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    lib, proto = cpu_kernels(), build()
    q4k = GGMLQuantizationType.Q4_K
    rng = np.random.default_rng(0)
    blocks = [random_blocks(q4k, a.n, a.k, rng) for _ in range(a.layers)]
    mats = [b.data for b in blocks]
    print(f"build {kernel_choice().variant}, {a.threads} threads, {a.layers} Q4_K layers of "
          f"{a.n} x {a.k}, medians of {a.rounds} rounds")
    w64 = torch.from_numpy(reference(blocks[-1]).astype(np.float64))  # the layer ys hold
    for rows in (1, 2, 3, 4, 6, 8):
        x = torch.randn(rows, a.k)
        ys = {"loom": torch.empty(rows, a.n), "proto": torch.empty(rows, a.n)}
        calls = {
            "loom": lambda w, y: lib.loom_linear_kq(x.data_ptr(), rows, a.k, a.k, w.data_ptr(),
                                                    int(q4k), None, a.n, y.data_ptr(), a.n,
                                                    a.threads),
            "proto": lambda w, y: proto.proto_q4k(x.data_ptr(), rows, a.k, w.data_ptr(), a.n,
                                                  y.data_ptr(), a.threads),
        }
        times: dict[str, list[float]] = {k: [] for k in calls}
        for r in range(a.rounds + 1):
            for name in (calls if r % 2 else reversed(list(calls))):
                t = time.perf_counter()
                for w in mats:
                    assert calls[name](w, ys[name]) == 0
                if r:
                    times[name].append((time.perf_counter() - t) / a.layers)
        ref = x.double() @ w64.T
        err = {k: ((ys[k].double() - ref).abs().max() / ref.abs().max()).item() for k in ys}
        lt, pt = statistics.median(times["loom"]), statistics.median(times["proto"])
        print(f"{rows} row(s): loom {lt * 1e3:.3f} ms a layer, prototype {pt * 1e3:.3f} ms "
              f"({pt / lt:.3f}x); largest error / largest output: loom {err['loom']:.1e}, "
              f"prototype {err['proto']:.1e}", flush=True)


if __name__ == "__main__":
    main()
