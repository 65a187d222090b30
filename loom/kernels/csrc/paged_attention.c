// Paged attention for the CPU in fp32, over an fp32, fp16 or int8 cache: reads K and V where they
// lie in Loom's paged cache (no gather, no padded copy) with an online softmax, for any mix of
// prefills and decodes.
//
// Work is split into tiles run in parallel by OpenMP. A tile is up to `ntok` consecutive query
// tokens of one request, all heads: its rows (token x head) read each key and value row of the
// cache once, whole (all kv heads side by side, kv_heads * D floats), from L1. Reading one head's
// D floats per row instead, in a tile per kv head, measured 2x slower: the hardware prefetcher
// follows that strided pattern poorly. Where there are fewer tiles than two a thread (one
// stream's decode: one tile), each is cut by kv head instead (tile_parts), so the threads share
// it: a one-stream decode's barrier waits 7.8% -> 3.9% of its samples (int8 cache, 3 kv heads
// on 2 threads).
//
// A token at absolute position p attends keys max(0, p - window + 1) .. p of its own request,
// so each token's result depends only on its own query and context: the same bits alone as in
// any batch. A soft cap c > 0 (Gemma 2's attn_logit_softcapping) turns each scaled score s into
// c * tanh(s / c) before the softmax; 0 leaves the scores as they are (the same arithmetic as
// without the cap).
//
// Built with -ffast-math (loom/kernels/build.py): the dot products and expf (glibc's libmvec)
// vectorize. No infinity is ever produced: a row's running maximum starts from the first key it
// sees.

#include <stdint.h>
#include <math.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "half.h"
#include "loom.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "lane_sums.h"
#define I8_VEC 1  // attend_tile_i8 below
#endif

#define KEY_CHUNK 16
// Runs of keys ahead whose K and V rows are prefetched into L2 (the next run also into L1).
// One run ahead into L1 alone left a 32-stream decode step waiting on memory: a run of a
// one-token tile computes in less than a memory round trip. 3 runs into L2 measured 0.85-0.90x
// the attention's time there (int8 cache, 32 streams x 214 keys and 4 x 1000, 30 layers).
#define PF_RUNS 3
enum { KV_F32 = LOOM_KV_F32, KV_F16 = LOOM_KV_F16, KV_INT8 = LOOM_KV_INT8 };  // loom.h

// n fp16 values -> fp32 (the cache in fp16: --kv-cache-dtype float16).
static inline void f16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = loom_f16_to_f32(src[i]);
}

// n int8 cache rows (KV_INT8: each kv head's D uint8 values, then D / 32 fp32 scales and D / 32
// fp32 minimums, D + D / 4 bytes, so the floats are aligned; rows row_bytes apart), kv heads
// h0 .. h1 - 1 of each -> fp32 rows of (h1 - h0) * D: value * scale + minimum (layer_ops.c
// writes them).
static inline void i8_to_f32(const char *src, int64_t n, int64_t row_bytes, int64_t h0,
                             int64_t h1, int D, float *dst)
{
    for (int64_t j = 0; j < n; j++)
        for (int64_t h = h0; h < h1; h++) {
            const uint8_t *qv = (const uint8_t *)(src + j * row_bytes + h * (D + D / 4));
            const float *sc = (const float *)(qv + D), *mn = sc + D / 32;
            float *o = dst + (j * (h1 - h0) + h - h0) * D;
            for (int g = 0; g < D / 32; g++) {
#ifdef __AVX512F__
                // gcc's own vectorization of the loop below took 8 lanes and two widenings
                const __m512 s = _mm512_set1_ps(sc[g]), m = _mm512_set1_ps(mn[g]);
                for (int i = 0; i < 32; i += 16)
                    _mm512_storeu_ps(o + g * 32 + i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qv + g * 32 + i)))),
                        s, m));
#elif defined(__AVX2__) && defined(__FMA__)
                const __m256 s = _mm256_set1_ps(sc[g]), m = _mm256_set1_ps(mn[g]);
                for (int i = 0; i < 32; i += 8)
                    _mm256_storeu_ps(o + g * 32 + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qv + g * 32 + i)))),
                        s, m));
#else
                for (int i = 0; i < 32; i++)
                    o[g * 32 + i] = (float)qv[g * 32 + i] * sc[g] + mn[g];
#endif
            }
        }
}

// Every 64-byte line of [p, p + len) into L1 (l1) or L2.
static inline __attribute__((always_inline)) void prefetch_lines(const char *p, int64_t len,
                                                                 const int l1)
{
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)(p + len); a += 64) {
        if (l1)
            __builtin_prefetch((const char *)a, 0, 3);
        else
            __builtin_prefetch((const char *)a, 0, 2);
    }
}

// A tile's rows (token t, query head h: row t * (head1 - head0) + h - head0) before its runs:
// the queries times `scale` into qs, the sums zeroed, each token's keys lo[t] .. hi[t].
static inline __attribute__((always_inline)) void tile_begin(
    const float *q, int64_t q_tok_stride, const int64_t *positions, int64_t tok0, int64_t ntok,
    int64_t head0, int64_t head1, int64_t window, float scale, float *qs, float *acc, float *m,
    float *l, int64_t *lo, int64_t *hi, const int D)
{
    const int64_t hp = head1 - head0;
    for (int64_t t = 0; t < ntok; t++) {
        hi[t] = positions[tok0 + t];
        lo[t] = window > 0 && hi[t] - window + 1 > 0 ? hi[t] - window + 1 : 0;
        for (int64_t head = head0; head < head1; head++) {
            const int64_t i = t * hp + head - head0;
            const float *src = q + (tok0 + t) * q_tok_stride + head * D;
            for (int d = 0; d < D; d++) { qs[i * D + d] = src[d] * scale; acc[i * D + d] = 0.0f; }
            m[i] = 0.0f;
            l[i] = 0.0f;
        }
    }
}

// After the runs: each row's output, its sums over the softmax's denominator.
static inline __attribute__((always_inline)) void tile_end(
    const float *acc, const float *l, int64_t tok0, int64_t ntok, int64_t num_heads,
    int64_t head0, int64_t head1, float *out, const int D)
{
    const int64_t hp = head1 - head0;
    for (int64_t t = 0; t < ntok; t++)
        for (int64_t head = head0; head < head1; head++) {
            const int64_t i = t * hp + head - head0;
            float *dst = out + ((tok0 + t) * num_heads + head) * D;
            const float inv = 1.0f / l[i];
            for (int d = 0; d < D; d++) dst[d] = acc[i * D + d] * inv;
        }
}

// The run of keys from j0 (<= khi) inside one cache block, at most KEY_CHUNK: returns its end
// j1 and its K and V rows (row_bytes apart) in *kraw, *vraw. Prefetches while the run computes
// (without it, loads and arithmetic took turns: one thread, 23 ms for 86 MB of context, 5.7 ms
// of it arithmetic): the next run into L1, the run PF_RUNS ahead into L2 (at the first run, klo,
// every run up to it); of each key's row the bytes of kv heads h0 .. h1 - 1 (head_bytes each).
static inline __attribute__((always_inline)) int64_t key_run(
    const void *k_cache, const void *v_cache, const int64_t *block_table, int64_t block_size,
    int64_t row_bytes, int64_t head_bytes, int64_t h0, int64_t h1, int64_t j0, int64_t klo,
    int64_t khi, const char **kraw, const char **vraw)
{
    const int64_t blk = block_table[j0 / block_size];
    const int64_t in_blk = j0 % block_size;
    int64_t j1 = j0 + (block_size - in_blk);
    if (j1 > khi + 1) j1 = khi + 1;
    if (j1 > j0 + KEY_CHUNK) j1 = j0 + KEY_CHUNK;
    *kraw = (const char *)k_cache + (blk * block_size + in_blk) * row_bytes;
    *vraw = (const char *)v_cache + (blk * block_size + in_blk) * row_bytes;
    for (int64_t r = 1, pj = j1; r <= PF_RUNS && pj <= khi; r++) {
        const int64_t nblk = block_table[pj / block_size], nin = pj % block_size;
        int64_t nn = block_size - nin;
        if (nn > KEY_CHUNK) nn = KEY_CHUNK;
        if (nn > khi + 1 - pj) nn = khi + 1 - pj;
        const char *nk = (const char *)k_cache + (nblk * block_size + nin) * row_bytes;
        const char *nv = (const char *)v_cache + (nblk * block_size + nin) * row_bytes;
        // the part's bytes of each key's row; one span for the run where it holds every head
        const int64_t span = (h1 - h0) * head_bytes, whole = span == row_bytes;
        for (int64_t jr = 0; jr < (whole ? 1 : nn); jr++) {
            const int64_t at = jr * row_bytes + h0 * head_bytes, len = whole ? nn * span : span;
            if (r == 1) {
                prefetch_lines(nk + at, len, 1);
                prefetch_lines(nv + at, len, 1);
            }
            if (r == PF_RUNS || j0 == klo) {
                prefetch_lines(nk + at, len, 0);
                prefetch_lines(nv + at, len, 0);
            }
        }
        pj += nn;
    }
    return j1;
}

// One row's online softmax over a run's n scores s (scaled; Gemma 2's soft cap c > 0 applied
// here): s becomes e^(s - m), the row's running maximum *m and denominator *l take the run in;
// returns the factor the row's earlier sums are rescaled by. A row's first run sets *m.
static inline __attribute__((always_inline)) float softmax_run(float *s, int64_t n, float softcap,
                                                               float *m, float *l)
{
    int64_t j;
    if (softcap > 0.0f)
        for (j = 0; j < n; j++) s[j] = tanhf(s[j] / softcap) * softcap;
    float mx = s[0];
    for (j = 1; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    float corr = 1.0f;
    if (*l == 0.0f) {
        *m = mx;
    } else if (mx > *m) {
        corr = expf(*m - mx);
        *m = mx;
    }
    const float mi = *m;
    float sum = 0.0f;
    for (j = 0; j < n; j++) { s[j] = expf(s[j] - mi); sum += s[j]; }
    *l = *l * corr + sum;
    return corr;
}

static inline __attribute__((always_inline)) void attend_tile(
    const float *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_table, const int64_t *positions, int64_t tok0, int64_t ntok,
    int64_t num_heads, int64_t kv_heads, int64_t head0, int64_t head1, int64_t block_size,
    int64_t window, float scale, float softcap, float *out,
    const int D, const int KT)  // KT: the cache's type, KV_F32 / KV_F16 / KV_INT8
{
    if (ntok < 1) return;
    const int64_t group = num_heads / kv_heads;
    const int64_t h0 = head0 / group, h1 = (head1 - 1) / group + 1;  // their kv heads
    const int64_t hp = head1 - head0, rows = ntok * hp;  // row = token * hp + head - head0
    const int64_t kv_stride = kv_heads * D;    // floats between consecutive keys of a block
    float qs[rows][D] __attribute__((aligned(32)));
    float acc[rows][D] __attribute__((aligned(32)));
    float m[rows], l[rows];
    int64_t lo[ntok], hi[ntok];
    float s[KEY_CHUNK];
    // Bytes of one kv head in a key's row, and between consecutive keys in the cache.
    const int64_t head_bytes = KT == KV_INT8 ? D + D / 4 : D * (KT ? 2 : 4);
    const int64_t row_bytes = kv_heads * head_bytes;
    // An fp16 or int8 cache: each run of keys converted once, for every token and head of the
    // tile, into rows of the part's kv heads alone (cs floats apart: rows of the whole cache row
    // 8 KiB apart, each part's 256 bytes of them, fell in the same few L1 sets).
    const int64_t cs = (h1 - h0) * D;
    const int64_t ks = KT ? cs : kv_stride;  // floats between keys where a run's rows are read
    float kconv[KT ? KEY_CHUNK * cs : 1] __attribute__((aligned(32)));
    float vconv[KT ? KEY_CHUNK * cs : 1] __attribute__((aligned(32)));

    tile_begin(q, q_tok_stride, positions, tok0, ntok, head0, head1, window, scale, &qs[0][0],
               &acc[0][0], m, l, lo, hi, D);
    const int64_t klo = lo[0], khi = hi[ntok - 1];

    for (int64_t j0 = klo; j0 <= khi; ) {
        // A run of keys inside one cache block: rows kv_stride floats apart.
        const char *kraw, *vraw;
        const int64_t j1 = key_run(k_cache, v_cache, block_table, block_size, row_bytes,
                                   head_bytes, h0, h1, j0, klo, khi, &kraw, &vraw);

        if (KT == KV_F16) {
            for (int64_t j = 0; j < j1 - j0; j++) {
                const int64_t at = j * kv_stride + h0 * D;
                f16_to_f32((const uint16_t *)kraw + at, cs, kconv + j * cs);
                f16_to_f32((const uint16_t *)vraw + at, cs, vconv + j * cs);
            }
        } else if (KT == KV_INT8) {
            i8_to_f32(kraw, j1 - j0, row_bytes, h0, h1, D, kconv);
            i8_to_f32(vraw, j1 - j0, row_bytes, h0, h1, D, vconv);
        }
        // the part's first kv head of the run's first key: converted, or the fp32 cache in place
        const float *kbase = KT ? kconv : (const float *)kraw + h0 * D;
        const float *vbase = KT ? vconv : (const float *)vraw + h0 * D;

        for (int64_t t = 0; t < ntok; t++) {
            const int64_t a = j0 > lo[t] ? j0 : lo[t];
            const int64_t b = j1 < hi[t] + 1 ? j1 : hi[t] + 1;
            if (a >= b) continue;
            const int64_t n = b - a, off = a - j0;
            for (int64_t head = head0; head < head1; head++) {
                const int64_t i = t * hp + head - head0, h = head / group;
                const float *kb = kbase + off * ks + (h - h0) * D;
                const float *vb = vbase + off * ks + (h - h0) * D;
                const float *qi = qs[i];
                // Four keys at a time: four independent sums, not one long dependent chain.
                int64_t j = 0;
                for (; j + 4 <= n; j += 4) {
                    const float *k0 = kb + j * ks, *k1 = k0 + ks;
                    const float *k2 = k1 + ks, *k3 = k2 + ks;
                    float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
                    for (int d = 0; d < D; d++) {
                        d0 += qi[d] * k0[d];
                        d1 += qi[d] * k1[d];
                        d2 += qi[d] * k2[d];
                        d3 += qi[d] * k3[d];
                    }
                    s[j] = d0; s[j + 1] = d1; s[j + 2] = d2; s[j + 3] = d3;
                }
                for (; j < n; j++) {
                    const float *kr = kb + j * ks;
                    float dot = 0.0f;
                    for (int d = 0; d < D; d++) dot += qi[d] * kr[d];
                    s[j] = dot;
                }
                const float corr = softmax_run(s, n, softcap, &m[i], &l[i]);
                float *ai = acc[i];
                if (corr != 1.0f)
                    for (int d = 0; d < D; d++) ai[d] *= corr;
                for (j = 0; j + 2 <= n; j += 2) {
                    const float *v0 = vb + j * ks, *v1 = v0 + ks;
                    const float p0 = s[j], p1 = s[j + 1];
                    for (int d = 0; d < D; d++) ai[d] += p0 * v0[d] + p1 * v1[d];
                }
                if (j < n) {
                    const float *vr = vb + j * ks;
                    const float p = s[j];
                    for (int d = 0; d < D; d++) ai[d] += p * vr[d];
                }
            }
        }
        j0 = j1;
    }

    tile_end(&acc[0][0], l, tok0, ntok, num_heads, head0, head1, out, D);
}

#ifdef I8_VEC
#ifdef __AVX512F__
#define VL 16
typedef __m512 vf;
#define VF_LOAD _mm512_load_ps
#define VF_STORE _mm512_store_ps
#define VF_SET1 _mm512_set1_ps
#define VF_FMA _mm512_fmadd_ps
#define VF_MUL _mm512_mul_ps
#define VF_ZERO _mm512_setzero_ps
// 16 cache bytes -> value * scale + minimum, as i8_to_f32
#define VF_DEQ(p, s, m) _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32( \
    _mm_loadu_si128((const __m128i *)(p)))), s, m)
#else
#define VL 8
typedef __m256 vf;
#define VF_LOAD _mm256_load_ps
#define VF_STORE _mm256_store_ps
#define VF_SET1 _mm256_set1_ps
#define VF_FMA _mm256_fmadd_ps
#define VF_MUL _mm256_mul_ps
#define VF_ZERO _mm256_setzero_ps
#define VF_DEQ(p, s, m) _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32( \
    _mm_loadl_epi64((const __m128i *)(p)))), s, m)
#endif

// A key's or value's D values in vectors, from its int8 cache row (the values i8_to_f32 gives).
static inline __attribute__((always_inline)) void row_vecs(const char *row, vf *out, const int D)
{
    const uint8_t *b = (const uint8_t *)row;
    const float *sc = (const float *)(b + D), *mn = sc + D / 32;
    for (int v = 0; v < D / VL; v++)
        out[v] = VF_DEQ(b + v * VL, VF_SET1(sc[v * VL / 32]), VF_SET1(mn[v * VL / 32]));
}

// Rows i0 .. i0 + R - 1 (R <= 4: one token's query heads of one kv head) over `cnt` keys of a
// run (the int8 rows at kq, vq, row_bytes apart): each key's K and V converted once, in
// registers, for all R rows; a row's D products a key summed in VL lanes, then all the run's
// keys' lanes at once (lane_sums.h), the softmax as attend_tile's, and p * v added to the rows'
// accumulators, held in registers across the run. A row's arithmetic depends on its own query
// and context only: the same bits in any tile and part.
static inline __attribute__((always_inline)) void rows_i8(
    const float *qs, float *acc, float *m, float *l, int64_t i0, const int R, const char *kq,
    const char *vq, int64_t row_bytes, int64_t cnt, float softcap, const int D)
{
    const int NV = D / VL;
    vf dots[4][KEY_CHUNK];  // [row][key]; heads of at most 128 floats
    float s[4][KEY_CHUNK] __attribute__((aligned(64)));
    for (int64_t j = 0; j < KEY_CHUNK; j++) {
        if (j >= cnt) {  // lanes summed but not read
            if (j % 8 == 0) break;
            for (int r = 0; r < R; r++) dots[r][j] = VF_ZERO();
            continue;
        }
        vf k[128 / VL];
        row_vecs(kq + j * row_bytes, k, D);
        for (int r = 0; r < R; r++) {
            const float *qi = qs + (i0 + r) * D;
            vf d = VF_MUL(VF_LOAD(qi), k[0]);
            for (int v = 1; v < NV; v++) d = VF_FMA(VF_LOAD(qi + v * VL), k[v], d);
            dots[r][j] = d;
        }
    }
    float corr[4];
    for (int r = 0; r < R; r++) {
        const int64_t i = i0 + r;
        float *sr = s[r];
        // a vector's sum does not depend on the others summed with it: as few as hold the keys
#ifdef __AVX512F__
        if (cnt <= 4)
            sum_lanes(dots[r], 4, sr);
        else if (cnt <= 8)
            sum_lanes(dots[r], 8, sr);
        else
            sum_lanes(dots[r], KEY_CHUNK, sr);
#else
        for (int j = 0; j < cnt; j += 8) sum_lanes8(dots[r] + j, sr + j);
#endif
        corr[r] = softmax_run(sr, cnt, softcap, &m[i], &l[i]);
    }
    vf av[4][128 / VL];
    for (int r = 0; r < R; r++) {
        const float *ai = acc + (i0 + r) * D;
        for (int v = 0; v < NV; v++) av[r][v] = VF_MUL(VF_LOAD(ai + v * VL), VF_SET1(corr[r]));
    }
    for (int64_t j = 0; j < cnt; j++) {
        vf vv[128 / VL];
        row_vecs(vq + j * row_bytes, vv, D);
        for (int r = 0; r < R; r++) {
            const vf p = VF_SET1(s[r][j]);
            for (int v = 0; v < NV; v++) av[r][v] = VF_FMA(p, vv[v], av[r][v]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *ai = acc + (i0 + r) * D;
        for (int v = 0; v < NV; v++) VF_STORE(ai + v * VL, av[r][v]);
    }
}

// attend_tile over an int8 cache with SIMD (AVX-512 or AVX2), heads of at most 128 floats: each
// token's query heads of a kv head in passes of up to 4 rows (rows_i8). Each token of a tile (a
// prompt's, a speculative draft's) converts the keys it reads itself: converted once for the
// tile into a buffer and read there, the tokens ran 1.13-1.19x attend_tile's time, against
// 1.06-1.13x. The runs of keys and the softmax are attend_tile's, and a row's arithmetic is the
// same whatever the tile and part (a draft's rows compute the bits their decodes would).
static inline __attribute__((always_inline)) void attend_tile_i8(
    const float *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_table, const int64_t *positions, int64_t tok0, int64_t ntok,
    int64_t num_heads, int64_t kv_heads, int64_t head0, int64_t head1, int64_t block_size,
    int64_t window, float scale, float softcap, float *out, const int D)
{
    if (ntok < 1) return;
    const int64_t group = num_heads / kv_heads;
    const int64_t h0 = head0 / group, h1 = (head1 - 1) / group + 1;
    const int64_t hp = head1 - head0, rows = ntok * hp;  // row = token * hp + head - head0
    const int64_t head_bytes = D + D / 4, row_bytes = kv_heads * head_bytes;
    float qs[rows][D] __attribute__((aligned(64)));
    float acc[rows][D] __attribute__((aligned(64)));
    float m[rows], l[rows];
    int64_t lo[ntok], hi[ntok];
    tile_begin(q, q_tok_stride, positions, tok0, ntok, head0, head1, window, scale, &qs[0][0],
               &acc[0][0], m, l, lo, hi, D);
    const int64_t klo = lo[0], khi = hi[ntok - 1];
    for (int64_t j0 = klo, j1; j0 <= khi; j0 = j1) {
        const char *kraw, *vraw;
        j1 = key_run(k_cache, v_cache, block_table, block_size, row_bytes, head_bytes, h0, h1, j0,
                     klo, khi, &kraw, &vraw);
        for (int64_t h = h0; h < h1; h++) {
            const int64_t hq0 = head0 > h * group ? head0 : h * group;
            const int64_t hq1 = head1 < (h + 1) * group ? head1 : (h + 1) * group;
            const char *kh = kraw + h * head_bytes, *vh = vraw + h * head_bytes;
            for (int64_t t = 0; t < ntok; t++) {
                const int64_t a = j0 > lo[t] ? j0 : lo[t];
                const int64_t b = j1 < hi[t] + 1 ? j1 : hi[t] + 1;
                if (a >= b) continue;
                const char *kq = kh + (a - j0) * row_bytes, *vq = vh + (a - j0) * row_bytes;
                for (int64_t r0 = hq0; r0 < hq1; r0 += 4) {
                    const int64_t i0 = t * hp + r0 - head0;
#define ROWS(R) rows_i8(&qs[0][0], &acc[0][0], m, l, i0, R, kq, vq, row_bytes, b - a, softcap, D)
                    switch (hq1 - r0) {
                    case 1: ROWS(1); break;
                    case 2: ROWS(2); break;
                    case 3: ROWS(3); break;
                    default: ROWS(4); break;
                    }
#undef ROWS
                }
            }
        }
    }
    tile_end(&acc[0][0], l, tok0, ntok, num_heads, head0, head1, out, D);
}
#endif  // I8_VEC

// Work item `it` of a step whose tiles (rows of `tiles`, below) are each cut into `parts` by
// query head: tile it / parts, query heads [part * num_heads / parts, (part + 1) * num_heads /
// parts) (tile_parts: whole kv heads, or equal shares of one kv head's), for the cache's type
// and head size. A query head's arithmetic is the same in any part: the same bits however a tile
// is cut.
static void attend_one(
    int64_t it, int64_t parts, const float *q, int64_t q_tok_stride, const void *k_cache,
    const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
    const int64_t *positions, const int64_t *tiles, int64_t num_heads, int64_t kv_heads,
    int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
    int kv_type, float *out)
{
    const int64_t *tile = tiles + it / parts * 3, part = it % parts;
    const int64_t *table = block_tables + tile[0] * max_blocks;
    const int64_t head0 = part * num_heads / parts, head1 = (part + 1) * num_heads / parts;
#define ATTEND(D, KT) attend_tile(q, q_tok_stride, k_cache, v_cache, table, positions, tile[1], \
                                  tile[2], num_heads, kv_heads, head0, head1, block_size, window, \
                                  scale, softcap, out, D, KT)
#define TYPES(D) (kv_type == KV_INT8 ? ATTEND(D, KV_INT8) : kv_type == KV_F16 ? ATTEND(D, KV_F16) \
                                                                               : ATTEND(D, KV_F32))
#ifdef I8_VEC
#define ATTEND_I8(D) attend_tile_i8(q, q_tok_stride, k_cache, v_cache, table, positions, tile[1], \
                                    tile[2], num_heads, kv_heads, head0, head1, block_size, \
                                    window, scale, softcap, out, D)
    // Heads whose sums fit the registers: 64 wide, or 128 with AVX-512 (in AVX2's 16 registers
    // 128-wide heads ran 1.08x attend_tile's time, Gemma's 256-wide 1.04x in AVX-512's)
    if (kv_type == KV_INT8 && (head_dim == 64 || (head_dim == 128 && VL == 16))) {
        if (head_dim == 64)
            ATTEND_I8(64);
        else
            ATTEND_I8(128);
        return;
    }
#undef ATTEND_I8
#endif
    if (head_dim == 64)
        TYPES(64);
    else if (head_dim == 128)
        TYPES(128);
    else
        TYPES((int)head_dim);
#undef TYPES
#undef ATTEND
}

// Parts each tile is cut into for `threads` threads: one a kv head where a tile holds several
// tokens (a prompt's: its tokens share each run of one head's converted keys, the rows of a
// part fit L1, and the part reads that head's bytes alone; whole tiles of 2 tokens x 32 heads
// converted every key of every head once per 2 tokens and read the whole context once per 2
// tokens: ~50 cycles a token, head and key) or where there are fewer tiles than two a thread
// (one decode token's attention does not run on one thread while the others wait); else
// (decodes of many streams) whole tiles, each key's row read whole, all kv heads, which the
// hardware prefetcher follows best. Where there are fewer kv heads than threads (Gemma 3's one),
// a few tiles' kv heads are each cut into equal shares of their query heads, enough for the
// threads: each part converts its kv head's keys and values itself, but one decode's attention
// no longer runs on one thread while the others wait at the barrier.
static int64_t tile_parts(const int64_t *tiles, int64_t num_tiles, int64_t num_heads,
                          int64_t kv_heads, int threads)
{
    if (num_tiles < 2 * threads) {
        const int64_t group = num_heads / kv_heads;
        int64_t shares = 1;  // of a kv head's query heads, dividing them evenly
        while (kv_heads * shares < threads && shares < group)
            for (shares++; group % shares; shares++) {}
        return kv_heads * shares;
    }
    for (int64_t it = 0; it < num_tiles; it++)
        if (tiles[it * 3 + 2] > 1) return kv_heads;
    return 1;
}

// Each request's query tokens (query_start_loc [num_reqs + 1]) cut into runs of at most `tokens`:
// rows (request, first token, number of tokens) into tiles, which has room for one a token
// (query_start_loc[num_reqs] rows). Returns the number of tiles, or -1 for a query_start_loc
// that does not start at 0 and grow, or tokens < 1. The one rule for both callers: the stack's
// (decoder_q8.c) and the per-module path's (cpu_kernel.build_tiles).
int64_t loom_attention_tiles(const int64_t *query_start_loc, int64_t num_reqs, int64_t tokens,
                             int64_t *tiles)
{
    if (query_start_loc[0] != 0 || tokens < 1) return -1;
    for (int64_t r = 0; r < num_reqs; r++)
        if (query_start_loc[r + 1] < query_start_loc[r]) return -1;
    int64_t n = 0;
    for (int64_t r = 0; r < num_reqs; r++)
        for (int64_t t0 = query_start_loc[r]; t0 < query_start_loc[r + 1]; t0 += tokens, n++) {
            const int64_t left = query_start_loc[r + 1] - t0;
            tiles[3 * n] = r;
            tiles[3 * n + 1] = t0;
            tiles[3 * n + 2] = left < tokens ? left : tokens;
        }
    return n;
}

// 0 if the kernel can take these tiles and shapes; -1 if a part's scratch (2 x rows x head_dim
// floats, on the stack: a one-token tile's rows are all its heads, a longer tile's one kv head's
// query heads a token, tile_parts) is too big, or the heads or the int8 cache's head size do not
// fit.
int loom_paged_attention_check(const int64_t *tiles, int64_t num_tiles, int64_t num_heads,
                               int64_t kv_heads, int64_t head_dim, int kv_type)
{
    if (kv_type == KV_INT8 && head_dim % 32 != 0) return -1;
    if (kv_heads < 1 || num_heads % kv_heads != 0) return -1;
    for (int64_t it = 0; it < num_tiles; it++) {
        const int64_t ntok = tiles[it * 3 + 2];
        if (ntok * (ntok > 1 ? num_heads / kv_heads : num_heads) * head_dim > 65536) return -1;
    }
    return 0;
}

// tiles: [num_tiles, 3] int64 rows of (request, first token, number of tokens), the tokens of a
// request consecutive in the flat batch. out: [num_tokens, num_heads, head_dim], contiguous.
// kv_type: what the cache holds: KV_F32, KV_F16, or KV_INT8 (head_dim a multiple of 32).
// Returns 0, or -1 as loom_paged_attention_check.
int loom_paged_attention_f32(
    const float *q, int64_t q_tok_stride,      // q[t, head, d] at q + t*q_tok_stride + head*D + d
    const void *k_cache, const void *v_cache,  // [num_blocks, block_size, kv_heads, D] each
    const int64_t *block_tables, int64_t max_blocks,  // [num_reqs, max_blocks]
    const int64_t *positions,                  // [num_tokens] absolute position of each token
    const int64_t *tiles, int64_t num_tiles,
    int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    int64_t window, float scale, float softcap,  // softcap: 0 for none
    int num_threads, int kv_type, float *out)
{
    if (loom_paged_attention_check(tiles, num_tiles, num_heads, kv_heads, head_dim, kv_type))
        return -1;
    const int64_t parts = tile_parts(tiles, num_tiles, num_heads, kv_heads, num_threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_tiles * parts > 1)
    for (int64_t it = 0; it < num_tiles * parts; it++)
        attend_one(it, parts, q, q_tok_stride, k_cache, v_cache, block_tables, max_blocks,
                   positions, tiles, num_heads, kv_heads, head_dim, block_size, window, scale,
                   softcap, kv_type, out);
    return 0;
}

// The same for a thread of an OpenMP team of `team` that is already running (decoder_q8.c):
// every thread calls it with the same arguments (checked beforehand) and `next` zeroed, and
// takes work items one at a time from *next. The caller's barrier ends the op.
void loom_paged_attention_team(
    const float *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *positions,
    const int64_t *tiles, int64_t num_tiles, int64_t num_heads, int64_t kv_heads,
    int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
    int kv_type, float *out, int64_t *next, int team)
{
    const int64_t parts = tile_parts(tiles, num_tiles, num_heads, kv_heads, team);
    for (int64_t it; (it = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < num_tiles * parts;)
        attend_one(it, parts, q, q_tok_stride, k_cache, v_cache, block_tables, max_blocks,
                   positions, tiles, num_heads, kv_heads, head_dim, block_size, window, scale,
                   softcap, kv_type, out);
}
