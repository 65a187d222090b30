"""Paged attention kernels in Triton: one kernel for prefill, decode and mixed batches.

Imported only where Triton is installed (triton_attn.py imports this module on first use), so
the CPU package never needs it. The tests run these kernels on the CPU in Triton's interpreter
(TRITON_INTERPRET=1, tests/gpu_interp).

Work split. A program takes one *query tile* (up to BLOCK_Q consecutive query tokens of one
request) x one KV head x one KV split. Its rows are the tile's tokens x the GROUP query heads
that share that KV head (row i = token i // GROUP_PAD, head kv_head * GROUP + i % GROUP_PAD),
so each K/V tile loaded serves every query head of the group (grouped-query attention). Keys
are read in place through the block table: key position p of request r lives in slot
block_tables[r, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE. No gather, no padding, no mask
tensor: causality (key <= query position) and the sliding window are compared per element.

Tile numbering needs no host work: request r's tiles start at query_start_loc[r] // BLOCK_Q + r
(a bound that leaves gaps, never overlaps), so the grid is num_tokens // BLOCK_Q + num_reqs
programs and each program finds its request by binary search (as vLLM's unified Triton
attention does); programs in a gap return at once.

Split-K ("flash decoding"): with NUM_SPLITS > 1 each program covers 1/NUM_SPLITS of its tile's
key range and writes an un-normalised partial (acc, running max m, running sum l, in log2
units); `combine_splits` merges them. Empty splits write m = -inf, l = 0.

FP8 (e4m3) caches hold K / k_scale and V / v_scale per KV head; the scales factor out of the
dot products, so the kernel multiplies the scores by k_scale and the output by v_scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose tiles include `tile`: the last r with qsl[r] // BLOCK_Q + r <= tile."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid).to(tl.int32) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with an fp32 accumulator. IEEE: true fp32 products (not tf32) for fp32 models.
    UPCAST (the interpreter, whose dot cannot multiply bf16): the same exact products of the
    bf16 operands, formed in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_keys(
    q, q_pos, m_i, l_i, acc, k_pos, hi, table, head_off, d, d_ok,
    k_cache, v_cache, qk_scale, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One tile of keys (positions k_pos [N]) into the online softmax of the rows (q [M, D] at
    positions q_pos [M]); returns the new (m, l, acc)."""
    k_ok = k_pos < hi
    block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot = block * stride_cb + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
    v = tl.load(v_cache + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # fp8 (scales applied outside) or an fp16 cache under bf16
    v = v.to(q.dtype)
    s = _dot(q, tl.trans(k), IEEE, UPCAST) * qk_scale  # [M, N], log2 units
    if SOFTCAP > 0:  # cap * tanh(score / cap), in natural units
        x = s * (2.0 / (SOFTCAP * 1.4426950408889634))
        s = SOFTCAP * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp(x) + 1.0))
    allowed = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if WINDOW > 0:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
    k_scale, v_scale,
    out_ptr, part_acc, part_m, part_l,
    num_reqs, num_tokens, scale,
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,  # cache strides: block, slot, kv head (head_dim is 1)
    stride_bt,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
    FOR_LOOP: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = _find_request(query_start_loc, tile, num_reqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc + r).to(tl.int32)
    q_len = tl.load(query_start_loc + r + 1).to(tl.int32) - q_begin
    first = (tile - (q_begin // BLOCK_Q + r)) * BLOCK_Q  # first query token of the tile, local
    if first >= q_len:
        return
    context = tl.load(seq_lens + r).to(tl.int32) - q_len  # tokens cached before this step

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = first + rows // GROUP_PAD  # [BLOCK_M] local query token of each row
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = context + tok  # [BLOCK_M] absolute position of each row's token
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(q_ptr + (q_begin + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]

    # The tile's key range [lo, hi): up to its last token, from its first token's window.
    hi = context + tl.minimum(first + BLOCK_Q, q_len)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(context + first - WINDOW + 1, 0)
    lo = lo // BLOCK_N * BLOCK_N
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)

    qk_scale = scale * 1.4426950408889634  # exp2 below
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale + kv_head)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    table = block_tables + r.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    if FOR_LOOP:  # compiled: a for loop, which Triton software-pipelines
        for t in range(t_begin, t_end):
            m_i, l_i, acc = _attend_keys(
                q, q_pos, m_i, l_i, acc, lo + t * BLOCK_N + n, hi, table, head_off, d, d_ok,
                k_cache, v_cache, qk_scale, stride_cb, stride_cs,
                BLOCK_SIZE, WINDOW, SOFTCAP, IEEE, UPCAST)
    else:  # the interpreter (numpy >= 2.4 refuses its range() over a traced bound)
        t = t_begin
        while t < t_end:
            m_i, l_i, acc = _attend_keys(
                q, q_pos, m_i, l_i, acc, lo + t * BLOCK_N + n, hi, table, head_off, d, d_ok,
                k_cache, v_cache, qk_scale, stride_cb, stride_cs,
                BLOCK_SIZE, WINDOW, SOFTCAP, IEEE, UPCAST)
            t += 1
    if FP8:
        acc = acc * tl.load(v_scale + kv_head)

    tok_g = (q_begin + tok).to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok_g[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials [NUM_SPLITS, num_tokens, NUM_HEADS] (+ [HEAD_PAD] for acc), contiguous
        ml = (split * num_tokens + tok_g) * NUM_HEADS + head
        tl.store(part_m + ml, m_i, mask=row_ok)
        tl.store(part_l + ml, l_i, mask=row_ok)
        tl.store(part_acc + ml[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def combine_splits_kernel(
    part_acc, part_m, part_l, out_ptr, num_tokens, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program per (token, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    ml = (s * num_tokens + tok) * NUM_HEADS + head  # [S]
    m = tl.load(part_m + ml, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l + ml, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    d = tl.arange(0, HEAD_PAD)
    acc = tl.load(part_acc + ml[:, None] * HEAD_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_s * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """One program per (token, kv head): copy the K and V rows (already in the cache's dtype)
    into the token's slot; slot -1 is skipped (a padded CUDA-graph row). The cache is viewed
    [num_slots, kv_heads, head_dim]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, HEAD_PAD)
    ok = d < HEAD_DIM
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok), mask=ok)
    tl.store(v_cache + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok), mask=ok)
