// Mamba2's decode step (loom/layers/mamba2.py: Mamba2Mixer._torch for one-token rows), a few
// tokens for each of `reqs` requests (one each, or a verify step's rows, one after another),
// in place on their state slots: the causal depthwise
// convolution (bias, SiLU) over xBC, the time step dt = clamp(softplus(dt + dt_bias)), each
// head's decayed state update S <- exp(dt A) S + dt x B^T and its read y = S C + D x, then
// the gated RMSNorm over groups of the inner channels. The torch path runs these as a dozen
// small ops a layer, each over every request's state gathered and scattered back; here each
// state is read and written once, in place. Three parallel phases: the convolution by request
// and channel block (each channel's window is updated once), the heads by request and head,
// the norm by request and norm group.
// loom_mamba2_decode_team runs them inside a caller's team (a phase's items split statically,
// the caller's barrier between the phases and after the last); loom_mamba2_decode_f32 is that
// in an OpenMP region of its own, so both give the same bits.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include "loom.h"
#include "mixer_team.h"

// 0, or -1 where the groups do not divide the heads (B, C) or the inner channels (the norm)
static int mamba2_check(int64_t heads, int64_t head_dim, int64_t groups, int64_t width,
                        int64_t norm_groups)
{
    if (groups <= 0 || heads % groups || norm_groups <= 0 || (heads * head_dim) % norm_groups
        || width < 1)
        return -1;
    return 0;
}

// the convolution's output [rows, conv_dim], then y [rows, inner]
int64_t loom_mamba2_scratch_floats(int64_t rows, int64_t heads, int64_t head_dim,
                                   int64_t groups, int64_t state_size)
{
    const int64_t inner = heads * head_dim;
    return rows > 0 ? rows * (2 * inner + 2 * groups * state_size) : 0;
}

int loom_mamba2_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                            int64_t reqs, const int64_t *starts, const int8_t *dry,
                            float *conv_state, const float *conv_w, const float *conv_b,
                            float *ssm_state, const float *dt_bias, const float *a_log,
                            const float *d, const float *norm_w, int64_t heads,
                            int64_t head_dim, int64_t groups, int64_t state_size, int64_t width,
                            int64_t norm_groups, float eps, float dt_min, float dt_max,
                            float *out, float *scratch, int tid, int team, LoomSync sync,
                            void *sync_arg)
{
    if (mamba2_check(heads, head_dim, groups, width, norm_groups)
        || (dry && head_dim * state_size > LOOM_MIXER_DRY_FLOATS))
        return -1;
    if (reqs <= 0)
        return 0;
    const int64_t P = head_dim, N = state_size, inner = heads * P;
    const int64_t conv_dim = inner + 2 * groups * N, past = width - 1;
    const int64_t rows = step_rows(starts, reqs);
    // proj's row: [z (inner) | x B C (conv_dim) | dt (heads)]
    float *xbc = scratch, *y = scratch + rows * conv_dim;
    const int64_t block = 256;  // channels a task
    const int64_t blocks = (conv_dim + block - 1) / block;
    const int64_t per_group = heads / groups, norm_size = inner / norm_groups;
    int64_t lo, hi;
    share(reqs * blocks, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const int64_t r = t / blocks, c0 = (t % blocks) * block;
        const int64_t c1 = c0 + block < conv_dim ? c0 + block : conv_dim;
        int64_t i0, i1;
        request_rows(starts, r, &i0, &i1);
        float *win = conv_state + slots[r] * conv_dim * past;
        for (int64_t c = c0; c < c1; c++) {
            float own[past > 0 ? past : 1];  // a dry request's window, the state's untouched
            float *w = mixer_state(win + c * past, past, dry && dry[r], own);
            const float *k = conv_w + c * width;
            for (int64_t i = i0; i < i1; i++) {
                const float xc = proj[i * proj_ld + inner + c];
                float acc = 0.0f;
                for (int64_t j = 0; j < past; j++)
                    acc += w[j] * k[j];
                acc += xc * k[past];
                for (int64_t j = 0; j + 1 < past; j++)
                    w[j] = w[j + 1];
                if (past > 0)
                    w[past - 1] = xc;
                if (conv_b)
                    acc += conv_b[c];
                xbc[i * conv_dim + c] = silu(acc);
            }
        }
    }
    sync(sync_arg);
    share(reqs * heads, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const int64_t r = t / heads, h = t % heads, g = h / per_group;
        int64_t i0, i1;
        request_rows(starts, r, &i0, &i1);
        const int dr = dry && dry[r];
        float own[dr ? P * N : 1];  // a dry request's state, the slot's untouched
        float *s = mixer_state(ssm_state + (slots[r] * heads + h) * P * N, P * N, dr, own);
        for (int64_t i = i0; i < i1; i++) {
            const float *xr = xbc + i * conv_dim;
            const float *x = xr + h * P;
            const float *b = xr + inner + g * N, *c = xr + inner + (groups + g) * N;
            float dt = softplus(proj[i * proj_ld + inner + conv_dim + h] + dt_bias[h]);
            dt = dt < dt_min ? dt_min : dt > dt_max ? dt_max : dt;
            const float decay = expf(dt * -expf(a_log[h]));
            float *yh = y + i * inner + h * P;
            for (int64_t p = 0; p < P; p++) {  // S = decay S + dt x B^T; y = S C + D x
                float *sp = s + p * N;
                const float dx = dt * x[p];
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < N; n++) {
                    const float v = sp[n] * decay + dx * b[n];
                    sp[n] = v;
                    acc += v * c[n];
                }
                yh[p] = acc + d[h] * x[p];
            }
        }
    }
    sync(sync_arg);
    if (!out)
        return 0;  // (the states alone)
    share(rows * norm_groups, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {  // RMSNorm(y * SiLU(z)) a group
        const int64_t i = t / norm_groups, i0 = (t % norm_groups) * norm_size;
        const float *yr = y + i * inner + i0, *z = proj + i * proj_ld + i0;
        float *dst = out + i * inner + i0;
        float ss = 0.0f;
        for (int64_t j = 0; j < norm_size; j++) {
            const float v = yr[j] * silu(z[j]);
            dst[j] = v;
            ss += v * v;
        }
        const float rn = 1.0f / sqrtf(ss / (float)norm_size + eps);
        for (int64_t j = 0; j < norm_size; j++)
            dst[j] = norm_w[i0 + j] * (dst[j] * rn);
    }
    sync(sync_arg);
    return 0;
}

// Returns 0, or -1 (nothing written) where its scratch cannot be allocated, the groups do not
// divide the heads (B, C) or the inner channels (the norm), or a dry request's head state is
// larger than LOOM_MIXER_DRY_FLOATS.
int loom_mamba2_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots,
                           int64_t reqs, const int64_t *starts, const int8_t *dry,
                           float *conv_state, const float *conv_w, const float *conv_b,
                           float *ssm_state, const float *dt_bias, const float *a_log,
                           const float *d, const float *norm_w, int64_t heads,
                           int64_t head_dim, int64_t groups, int64_t state_size, int64_t width,
                           int64_t norm_groups, float eps, float dt_min, float dt_max,
                           float *out, int num_threads)
{
    if (mamba2_check(heads, head_dim, groups, width, norm_groups)
        || (dry && head_dim * state_size > LOOM_MIXER_DRY_FLOATS))
        return -1;
    if (reqs <= 0)
        return 0;
    const int64_t rows = step_rows(starts, reqs);
    float *scratch = malloc(sizeof(float) * (size_t)loom_mamba2_scratch_floats(
        rows, heads, head_dim, groups, state_size));
    if (!scratch)
        return -1;
#pragma omp parallel num_threads(num_threads)
    loom_mamba2_decode_team(proj, proj_ld, slots, reqs, starts, dry, conv_state, conv_w, conv_b,
                            ssm_state, dt_bias, a_log, d, norm_w, heads, head_dim, groups,
                            state_size, width, norm_groups, eps, dt_min, dt_max, out, scratch,
                            omp_get_thread_num(), omp_get_num_threads(), omp_sync, NULL);
    free(scratch);
    return 0;
}
