// A prototype, not a kernel Loom runs: Q4_K decode (up to 8 x rows) with each weight's integer
// times its 6-bit sub-block scale as int16 (vpmaddubsw of the nibbles against the scales laid in
// even or odd bytes) and x as one int16 a super-block (X = x / dx, dx = max |x| / 32767, as the
// int16 GEMM past 8 rows rounds it), so `vpdpwssd` sums a whole super-block of a row in one int32
// lane set and it is converted once: per x row and super-block 8 vpdpwssd, a conversion and an
// fma, where linear_kquant.c's VNNI kernel (two int8 digits a run of 16) takes 2 vpdpbusd, a
// shift, a conversion, an in-lane shuffle and an fma a 64 weights (24). The weights' unpacking
// costs more (~35 ops a super-block against ~15), once for all rows.
// benchmarks/bench_kq_i16_decode.py builds it and times it against loom_linear_kq.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define QK 256

static inline float f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// x row (K values) -> X int16 [K] in the weights' order below, and per super-block: dx and the
// 8 sub-blocks' dx sum X.
static void x_prep(const float *x, int64_t K, int16_t *X, float *dx, float *xsum)
{
    for (int64_t s = 0; s < K / QK; s++) {
        const float *v = x + s * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 32767.0f, id = amax > 0 ? 32767.0f / amax : 0.0f;
        int32_t sums[8] = {0};
        int16_t *o = X + s * QK;
        // vector (c, h, parity) of 32: lane t is byte i = 2t + parity of nibble vector c, whose
        // byte i holds weight 64 j + 32 h + l, j = 2c + (i >= 32), l = i % 32
        for (int c = 0; c < 2; c++)
            for (int h = 0; h < 2; h++)
                for (int par = 0; par < 2; par++)
                    for (int t = 0; t < 32; t++) {
                        const int i = 2 * t + par, j = 2 * c + (i >= 32), l = i % 32;
                        const int w = 64 * j + 32 * h + l;
                        const int q = (int)lrintf(v[w] * id);
                        *o++ = (int16_t)q;
                        sums[w / 32] += q;
                    }
        dx[s] = d;
        for (int k = 0; k < 8; k++) xsum[s * 8 + k] = d * (float)sums[k];
    }
}

#define M_MAX 8

// y[m, n] = x[m] . dequantized row n of w (Q4_K), rows of K; 0, or -1 for bad arguments.
int proto_q4k(const float *x, int M, int64_t K, const uint8_t *w, int64_t N, float *y,
              int threads)
{
    if (M < 1 || M > M_MAX || K % QK) return -1;
    static int16_t X[M_MAX][16384];
    static float DX[M_MAX][64], XS[M_MAX][64 * 8];
    if (K > 16384) return -1;
    for (int m = 0; m < M; m++) x_prep(x + m * K, K, X[m], DX[m], XS[m]);
    const int64_t nsb = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * nsb * 144;
        __m512 accf[M_MAX];
        __m256 accm[M_MAX];
        for (int m = 0; m < M; m++) accf[m] = _mm512_setzero_ps(), accm[m] = _mm256_setzero_ps();
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *blk = row + s * 144;
            __builtin_prefetch(blk + 1024);
            __builtin_prefetch(blk + 1024 + 64);
            __builtin_prefetch(blk + 1024 + 128);
            const float d = f16(blk), dmin = f16(blk + 2);
            uint64_t q, sc, mn;
            uint32_t ww;
            memcpy(&q, blk + 4, 8);
            memcpy(&ww, blk + 12, 4);
            const uint64_t top = (q >> 2) & 0x3030303030303030u;
            sc = (q & 0x3f3f3f3fu) | (uint64_t)((ww & 0x0f0f0f0fu) | (uint32_t)top) << 32;
            mn = ((q >> 32) & 0x3f3f3f3fu) | (uint64_t)(((ww >> 4) & 0x0f0f0f0fu) | (top >> 32))
                 << 32;
            const __m256 dminm = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)mn))),
                _mm256_set1_ps(dmin));
            const __m512i scv = _mm512_broadcast_i32x4(_mm_cvtsi64_si128((int64_t)sc));
            __m512i W[8];
            for (int c = 0; c < 2; c++) {
                const __m512i L = _mm512_loadu_si512(blk + 16 + 64 * c);
                for (int h = 0; h < 2; h++) {
                    const __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(L, 4) : L,
                                                       _mm512_set1_epi8(15));
                    // sub-block k = 2 j + h: 4c + h in the first 32 bytes, 4c + 2 + h after
                    const __m512i idx = _mm512_inserti64x4(
                        _mm512_set1_epi8((char)(4 * c + h)),
                        _mm256_set1_epi8((char)(4 * c + 2 + h)), 1);
                    const __m512i pe = _mm512_maskz_shuffle_epi8(0x5555555555555555ull, scv, idx);
                    const __m512i po = _mm512_maskz_shuffle_epi8(0xAAAAAAAAAAAAAAAAull, scv, idx);
                    W[4 * c + 2 * h] = _mm512_maddubs_epi16(u, pe);
                    W[4 * c + 2 * h + 1] = _mm512_maddubs_epi16(u, po);
                }
            }
            for (int m = 0; m < M; m++) {
                const int16_t *xv = X[m] + s * QK;
                __m512i a = _mm512_setzero_si512();
                for (int v = 0; v < 8; v++)
                    a = _mm512_dpwssd_epi32(a, W[v], _mm512_loadu_si512(xv + 32 * v));
                accf[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(d * DX[m][s]),
                                          accf[m]);
                accm[m] = _mm256_fmadd_ps(dminm, _mm256_loadu_ps(XS[m] + 8 * s), accm[m]);
            }
        }
        for (int m = 0; m < M; m++) {
            const __m256 t = accm[m];
            __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
            r = _mm_hadd_ps(r, r);
            r = _mm_hadd_ps(r, r);
            y[m * N + n] = _mm512_reduce_add_ps(accf[m]) - _mm_cvtss_f32(r);
        }
    }
    return 0;
}
