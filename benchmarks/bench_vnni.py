"""The int8-group VNNI decode kernel (loom/kernels/csrc/linear_vnni.c) on SmolLM2-135M's shapes,
1 to 8 rows: microseconds a call and each extra row's cost as a fraction of a one-row call.

Random 4-bit weights (the head: 8-bit) with fp16 scales and minimums, the same weights every
call (warm in the caches but for the 49152-row head), one thread by default; per shape and
row count the minimum over `--repeats` calls of the thread's CPU time (robust on a shared
machine). Needs a build with the VNNI kernel (`loom_vnni_available`: its AVX512-VNNI or AVX2
form).

    .venv/bin/python benchmarks/bench_vnni.py [--threads 1] [--repeats 200] [--out FILE.json]
    .venv/bin/python benchmarks/bench_vnni.py --smoke
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump, machine  # noqa: E402

# (name, N, K, bits): 135M's qkv, o, gate or up alone (1536 x 576), gate_up, down, the head
SHAPES = [("qkv", 960, 576, 4), ("o", 576, 576, 4), ("1536x576", 1536, 576, 4),
          ("gate_up", 3072, 576, 4), ("down", 576, 1536, 4), ("head", 49152, 576, 8)]


def random_weights(n: int, k: int, bits: int, g, mins: bool = True) -> tuple:
    """n rows of k random `bits`-bit weights (packed bytes) with fp16 scales and minimums (None
    without), as loom_linear_q8_vnni reads them; g: a torch.Generator."""
    import torch

    w = torch.randint(0, 256, (n * k * bits // 8,), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n * k // 32, generator=g) * 0.02 + 0.001).half()
    low = (torch.rand(n * k // 32, generator=g) * 0.2 - 0.1).half() if mins else None
    return w, scales, low


def time_shape(lib: ctypes.CDLL, n: int, k: int, bits: int, repeats: int,
               threads: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(0)
    w, scales, mins = random_weights(n, k, bits, g)
    x = torch.randn(8, k, generator=g)
    y = torch.empty(8, n)
    us = []
    for m in range(1, 9):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            rc = lib.loom_linear_q8_vnni(x.data_ptr(), m, k, k, w.data_ptr(), scales.data_ptr(),
                                         mins.data_ptr(), None, n, y.data_ptr(), n, bits,
                                         threads)
            best = min(best, time.thread_time() - t0)
            assert rc == 0, rc
        us.append(best * 1e6)
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200, help="calls a shape and row count")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument("--smoke", action="store_true", help="3 calls each, no head")
    args = ap.parse_args()
    from loom.kernels import cpu_kernels, kernel_choice

    lib = cpu_kernels()
    if lib is None or not lib.loom_vnni_available():
        sys.exit("no VNNI kernel in this process's build (needs AVX512-VNNI or AVX2)")
    shapes = SHAPES[:-1] if args.smoke else SHAPES
    repeats = 3 if args.smoke else args.repeats
    results = {}
    for name, n, k, bits in shapes:
        us = time_shape(lib, n, k, bits, repeats if name != "head" else max(repeats // 10, 3),
                        args.threads)
        extra = [(us[m] - us[0]) / m / us[0] for m in range(1, 8)]
        results[name] = {"N": n, "K": k, "bits": bits, "us": [round(t, 1) for t in us],
                         "extra_row_cost": round(sum(extra) / len(extra), 3)}
        print(f"{name:>9} {n:5d}x{k:<5d} {bits}-bit  us at 1..8 rows: "
              + " ".join(f"{t:.0f}" for t in us)
              + f"  extra row ~{results[name]['extra_row_cost']:.2f} of one")
    dump(args.out, {"machine": machine(), "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d"), "build": str(kernel_choice()),
                    "threads": args.threads, "shapes": results})


if __name__ == "__main__":
    main()
