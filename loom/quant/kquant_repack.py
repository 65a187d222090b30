"""Q3_K blocks rewritten as Q6_K blocks, exactly, so that Q3_K tensors run on the K-quant kernels.

A Q3_K super-block is d (fp16) times 16 runs of 16 weights, each run a 6-bit scale s (stored
+32) times 3-bit values v in -4..3; a Q6_K super-block is d times 16 runs of 16, each an int8
scale times 6-bit values q - 32 with q in 0..63. So v + 32 and s - 32 are a Q6_K block of the
same d with the same weights, bit for bit (both formats compute (d * scale) * value in fp32).
The cost is bytes: 210 a super-block instead of 110 (6.56 bits a weight instead of 3.44), against
the 32 bits of the fp32 expansion a Q3_K tensor got before; a Q3_K kernel of its own would read
half as much.
"""

from __future__ import annotations

import numpy as np

Q3_K_BYTES = 110  # hmask 32, qs 64, scales 12, d 2
Q6_K_BYTES = 210  # ql 128, qh 64, scales 16, d 2


def q3_k_as_q6_k(raw: np.ndarray) -> np.ndarray:
    """uint8 Q3_K super-blocks [..., n * 110] -> the same weights as Q6_K [..., n * 210]."""
    shape = raw.shape
    blocks = np.ascontiguousarray(raw).reshape(-1, Q3_K_BYTES)
    n = blocks.shape[0]
    hmask, qs, packed, d = np.split(blocks, [32, 96, 108], axis=1)
    # scales: low nibbles in bytes 0-7 (runs 0-7 low, 8-15 high), their top two bits in bytes
    # 8-11 (runs 4k..4k+3 at bits 2k)
    low = (packed[:, None, :8] >> np.array([0, 4], np.uint8)[None, :, None]).reshape(n, 16)
    high = (packed[:, None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int16) - 32  # -32..31
    # values: two low bits from qs (4 a byte, 32 bytes a half), the third from hmask (bit j of
    # byte l: run pair j, position l); a clear hmask bit means -4
    lo = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    hi = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
    q6 = lo.reshape(n, 8, 32) + (hi.reshape(n, 8, 32) << 2) + 28  # v + 32, v = lo + 4 hi - 4
    # Q6_K: 32-weight groups g = 4 h + 2 k + c of half h; ql byte h*64 + c*32 + l holds group
    # (h, k=0, c)'s low nibble and (h, k=1, c)'s as its high one; qh byte h*32 + l the top two
    # bits of groups 4h..4h+3 at bits 0, 2, 4, 6
    nib = (q6 & 0x0F).reshape(n, 2, 2, 2, 32)
    ql = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n, 128)
    top = (q6 >> 4).reshape(n, 2, 4, 32)
    qh = (top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6))
    out = np.concatenate([ql.astype(np.uint8), qh.reshape(n, 64).astype(np.uint8),
                          scales.astype(np.int8).view(np.uint8), d], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // Q3_K_BYTES * Q6_K_BYTES)
