// What the recurrent mixers' decode steps share (gated_delta.c, mamba2.c, shortconv.c): the
// activations their torch paths apply (SiLU across vector lanes), the convolutions' lanes, the
// chunkwise forms' products, a thread's share of a phase's items in a team, a request's rows
// and its states as a dry request reads them, and the barrier their OpenMP forms pass as the
// team's sync (loom.h's LoomSync).
#ifndef LOOM_MIXER_TEAM_H
#define LOOM_MIXER_TEAM_H

#include <math.h>
#include <stdint.h>

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// MIX_LANES floats side by side in one vector register (GCC's and clang's vector extensions:
// AVX-512's 16, AVX's 8, SSE's and NEON's 4: wider generic vectors lower to spills), for the
// convolutions' channels and SiLU's exponentials
#if defined(__AVX512F__)
#define MIX_LANES 16
#elif defined(__AVX__)
#define MIX_LANES 8
#else
#define MIX_LANES 4
#endif
#define MIX_INLINE static inline __attribute__((always_inline))
typedef float mix_vf __attribute__((vector_size(MIX_LANES * 4), aligned(4)));
typedef int32_t mix_vi __attribute__((vector_size(MIX_LANES * 4), aligned(4)));

MIX_INLINE mix_vf splat(float x) { return (mix_vf){0} + x; }

// exp(x) in every lane, within ~2 ulp of expf: n = round(x / ln 2), r = x - n ln 2 (ln 2 in
// two parts), e^r by Cephes' degree-7 polynomial, times 2^n from n's exponent bits; x clamped
// to [-87.3, 88] (no infinities: silu's uses saturate there; NaN stays NaN). libm's expf is a
// call a value the compiler cannot vectorize without fast math.
MIX_INLINE mix_vf vexp(mix_vf x)
{
    const mix_vi hi = x > splat(88.0f), lo = x < splat(-87.3f);
    x = (mix_vf)(((mix_vi)x & ~(hi | lo)) | ((mix_vi)splat(88.0f) & hi)
                 | ((mix_vi)splat(-87.3f) & lo));
    const mix_vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round
    const mix_vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    mix_vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const mix_vi e = (__builtin_convertvector(n, mix_vi) + 127) << 23;
    return p * (mix_vf)e;
}

MIX_INLINE mix_vf vsilu(mix_vf x) { return x / (1.0f + vexp(-x)); }

// lanes [0, n) of p (n <= MIX_LANES; the others 0), and back: a whole vector one unaligned
// load or store (a memcpy through a zeroed vector went through the stack on AVX2)
MIX_INLINE mix_vf load_lanes(const float *p, int64_t n)
{
    if (n == MIX_LANES)
        return *(const mix_vf *)p;
    mix_vf v = {0};
    for (int64_t l = 0; l < n; l++)
        v[l] = p[l];
    return v;
}

MIX_INLINE void store_lanes(mix_vf v, int64_t n, float *p)
{
    if (n == MIX_LANES) {
        *(mix_vf *)p = v;
        return;
    }
    for (int64_t l = 0; l < n; l++)
        p[l] = v[l];
}

// out[j] = SiLU(x[j]) for j < n, MIX_LANES at a time (in place where out is x)
static inline void silu_rows(const float *x, int64_t n, float *out)
{
    for (int64_t j = 0; j < n; j += MIX_LANES) {
        const int64_t m = n - j < MIX_LANES ? n - j : MIX_LANES;
        store_lanes(vsilu(load_lanes(x + j, m)), m, out + j);
    }
}

// Channels [c0, c0 + n)'s windows of `past` inputs (oldest first: win [channels, past]),
// weights (conv_w [channels, past + 1]) and biases (conv_b, NULL: 0) transposed into lanes:
// w[j], k[j] and bias hold channel c0 + l in lane l (lanes past n: channel c0 again, unused)
static inline void lanes_in(const float *win, const float *conv_w, const float *conv_b,
                            int64_t past, int64_t c0, int64_t n, mix_vf *w, mix_vf *k,
                            mix_vf *bias)
{
    for (int64_t l = 0; l < MIX_LANES; l++) {
        const int64_t c = c0 + (l < n ? l : 0);
        for (int64_t j = 0; j < past; j++)
            w[j][l] = win[c * past + j];
        for (int64_t j = 0; j <= past; j++)
            k[j][l] = conv_w[c * (past + 1) + j];
        (*bias)[l] = conv_b ? conv_b[c] : 0.0f;
    }
}

// The windows w (lanes_in's) back into win, channels [c0, c0 + n)
static inline void lanes_out(const mix_vf *w, int64_t past, int64_t c0, int64_t n, float *win)
{
    for (int64_t l = 0; l < n; l++)
        for (int64_t j = 0; j < past; j++)
            win[(c0 + l) * past + j] = w[j][l];
}

// One row of the convolution across lanes: the sum in the order window oldest first, this
// row's input xi times k[past], the bias (NULL: none), the same for every channel whatever its
// lane or its rows' step; the window then shifted to end with xi
MIX_INLINE mix_vf conv_row(mix_vf *w, const mix_vf *k, const mix_vf *bias, int64_t past,
                           mix_vf xi)
{
    mix_vf acc = {0};
    for (int64_t j = 0; j < past; j++)
        acc += w[j] * k[j];
    acc += xi * k[past];
    if (bias)
        acc += *bias;
    for (int64_t j = 0; j + 1 < past; j++)
        w[j] = w[j + 1];
    if (past > 0)
        w[past - 1] = xi;
    return acc;
}

// A request's rows [i0, i1) of channels [c0, c0 + n) (n <= MIX_LANES) of a causal depthwise
// convolution and SiLU (Gated DeltaNet's over q k v, Mamba2's over x B C): row i's input of
// channel c at x[i * x_ld + c], the channel's window of its last `past` inputs (oldest first)
// at win[c * past], weights conv_w [channels, past + 1], conv_b NULL for no bias; out[i *
// out_ld + c] = SiLU(sum) (conv_row's). A dry request's windows are not written back.
static inline void conv_silu_lanes(const float *x, int64_t x_ld, int64_t i0, int64_t i1,
                                   float *win, int64_t past, const float *conv_w,
                                   const float *conv_b, int64_t c0, int64_t n, int dry,
                                   float *out, int64_t out_ld)
{
    mix_vf w[past > 0 ? past : 1], k[past + 1], bias;
    lanes_in(win, conv_w, conv_b, past, c0, n, w, k, &bias);
    for (int64_t i = i0; i < i1; i++) {
        const mix_vf acc = conv_row(w, k, conv_b ? &bias : NULL, past,
                                    load_lanes(x + i * x_ld + c0, n));
        store_lanes(vsilu(acc), n, out + i * out_ld + c0);
    }
    if (!dry)
        lanes_out(w, past, c0, n, win);
}

// items [lo, hi) of n for thread tid of team
static inline void share(int64_t n, int tid, int team, int64_t *lo, int64_t *hi)
{
    *lo = n * tid / team;
    *hi = n * (tid + 1) / team;
}

// A request's rows [*i0, *i1) of a step (starts NULL: row r alone), and the step's rows
static inline void request_rows(const int64_t *starts, int64_t r, int64_t *i0, int64_t *i1)
{
    *i0 = starts ? starts[r] : r;
    *i1 = starts ? starts[r + 1] : r + 1;
}

static inline int64_t step_rows(const int64_t *starts, int64_t reqs)
{
    return starts ? starts[reqs] : reqs;
}

// A request's state of n floats (a channel's convolution window, a head's state) as its rows
// read and write it: in place, or for a dry request (`dry`: its states read, never written) a
// copy in `own`.
static inline float *mixer_state(float *x, int64_t n, int dry, float *own)
{
    if (!dry)
        return x;
    for (int64_t j = 0; j < n; j++)
        own[j] = x[j];
    return own;
}

// sum_i a[i] b[i]: MIX_LANES partial sums (lane l over i = l mod MIX_LANES, in order), then
// halves added pairwise
static inline float dot(const float *a, const float *b, int64_t n)
{
    mix_vf acc = {0};
    for (int64_t i = 0; i < n; i += MIX_LANES) {
        const int64_t m = n - i < MIX_LANES ? n - i : MIX_LANES;
        acc += load_lanes(a + i, m) * load_lanes(b + i, m);
    }
    for (int w = MIX_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

// The chunkwise forms of prompts' runs of rows (gated_delta.c, mamba2.c): CHUNK rows at a time
// against a head's state S [dk, dv] (dv contiguous), which is read twice and written once a
// chunk instead of a token, in register-blocked products.
#define CHUNK 8      // rows a chunk
#define CHUNK_MIN 4  // a request's run of fewer rows goes token by token

// C[t] = S^T A[t] for the CHUNK rows of A [CHUNK, dk] against a state S [dk, dv]: C [CHUNK, dv].
// A vector of S's columns is loaded once for all CHUNK rows, whose sums stay in registers.
static inline void rows_times_state(const float *A, const float *S, int64_t dk, int64_t dv,
                                    float *C)
{
    for (int64_t j = 0; j < dv; j += MIX_LANES) {
        const int64_t m = dv - j < MIX_LANES ? dv - j : MIX_LANES;
        mix_vf acc[CHUNK];
        for (int t = 0; t < CHUNK; t++)
            acc[t] = (mix_vf){0};
        for (int64_t i = 0; i < dk; i++) {
            const mix_vf sv = load_lanes(S + i * dv + j, m);
            for (int t = 0; t < CHUNK; t++)
                acc[t] += A[t * dk + i] * sv;
        }
        for (int t = 0; t < CHUNK; t++)
            store_lanes(acc[t], m, C + t * dv + j);
    }
}

// S = g S + sum_t W[t] D[t]^T: W [CHUNK, dk], D [CHUNK, dv]; a vector of D's rows kept in
// registers for the whole column block
static inline void update_state(float *S, float g, const float *W, const float *D, int64_t dk,
                                int64_t dv)
{
    for (int64_t j = 0; j < dv; j += MIX_LANES) {
        const int64_t m = dv - j < MIX_LANES ? dv - j : MIX_LANES;
        mix_vf d[CHUNK];
        for (int t = 0; t < CHUNK; t++)
            d[t] = load_lanes(D + t * dv + j, m);
        for (int64_t i = 0; i < dk; i++) {
            mix_vf x = load_lanes(S + i * dv + j, m) * g;
            for (int t = 0; t < CHUNK; t++)
                x += W[t * dk + i] * d[t];
            store_lanes(x, m, S + i * dv + j);
        }
    }
}

static inline void omp_sync(void *arg)
{
    (void)arg;
#pragma omp barrier
}

#endif  // LOOM_MIXER_TEAM_H
