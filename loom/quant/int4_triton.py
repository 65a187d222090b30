"""The INT4 weight-only GEMM in Triton: out = x @ dequant(W) with W's 4-bit values unpacked and
scaled tile by tile in registers (never expanded in memory).

W is in Loom's canonical layout (loom/quant/gptq.py): qweight [K / 8, N] int32, eight 4-bit
values of consecutive input rows k per word (row k in bits 4 * (k % 8)), and per group of
GROUP input rows a scale and a zero point [K / GROUP, N]: w[k, n] = (q[k, n] - zero) * scale.
Imported only where Triton is installed; the tests run it in Triton's interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int4_matmul_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr, M, N,
    stride_xm, stride_qk, stride_sg, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out; BLOCK_K divides GROUP, so a K step has one group."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    shift = ((rk % 8) * 4)[:, None]  # [BK, 1]: row k's bits in its word
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
        packed = tl.load(qw_ptr + (k // 8)[:, None] * stride_qk + rn[None, :],
                         mask=n_ok[None, :], other=0)  # [BK, BN] int32
        q = ((packed >> shift) & 0xF).to(tl.float32)
        g = k0 // GROUP
        scale = tl.load(scales_ptr + g * stride_sg + rn, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + g * stride_sg + rn, mask=n_ok, other=0.0).to(tl.float32)
        w = (q - zero[None, :]) * scale[None, :]  # [BK, BN]
        if UPCAST:  # the interpreter's dot cannot multiply bf16: the same products in fp32
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
