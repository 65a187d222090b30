"""Q4_K and Q6_K blocks of real weights, for tests (the `gguf` package has no K-quant quantizer).
A plain min / max (Q4_K) and absmax (Q6_K) fit per sub-block, not llama-quantize's search: the
weights' error is of Q4_K's / Q6_K's size, and the blocks are valid for every reader (checked
against the `gguf` package's dequantizer in tests/model/test_kquant.py). Used by
benchmarks/bench_kquant_digits.py."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K a multiple of 256) -> Q4_K blocks, uint8 [rows * K / 256, 144]."""
    sb = w.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32
    lo = np.minimum(sb.min(-1), 0.0)
    hi = np.maximum(sb.max(-1), 0.0)
    scale, mins = (hi - lo) / 15.0, -lo  # [B, 8]
    d = _f16(scale.max(-1) / 63.0)
    dmin = _f16(mins.max(-1) / 63.0)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmf > 0, np.rint(mins / dmf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sb + (dmf * m)[..., None]) / step), 0)
    q = q.clip(0, 15).astype(np.uint8)  # [B, 8, 32]
    out = np.zeros((sb.shape[0], 144), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    s = out[:, 4:16]  # ggml's get_scale_min_k4 layout
    s[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    s[:, 4:8] = m[:, 0:4] | (m[:, 4:8] >> 4) << 6
    s[:, 8:12] = (sc[:, 4:8] & 15) | (m[:, 4:8] & 15) << 4
    for j in range(4):  # bytes 32j..: sub-block 2j in the low nibbles, 2j + 1 in the high
        out[:, 16 + 32 * j:48 + 32 * j] = q[:, 2 * j] | q[:, 2 * j + 1] << 4
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w [rows, K] (K a multiple of 256) -> Q6_K blocks, uint8 [rows * K / 256, 210]."""
    sb = w.astype(np.float32).reshape(-1, 16, 16)  # super-blocks of 16 runs of 16
    amax = np.abs(sb).max(-1)  # [B, 16]
    scale = amax / 31.0
    d = _f16(scale.max(-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.rint(sb / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    out = np.zeros((sb.shape[0], 210), np.uint8)
    for c in range(2):  # halves of 128: ql 64c + l holds 128c + l and 128c + 64 + l
        q1, q2, q3, q4 = (q[:, 128 * c + 32 * t:128 * c + 32 * t + 32] for t in range(4))
        out[:, 64 * c:64 * c + 32] = (q1 & 15) | (q3 & 15) << 4
        out[:, 64 * c + 32:64 * c + 64] = (q2 & 15) | (q4 & 15) << 4
        high = q1 >> 4 | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6  # bits 4-5 of each
        out[:, 128 + 32 * c:160 + 32 * c] = high
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.view(np.uint8).reshape(-1, 2)
    return out


QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}
