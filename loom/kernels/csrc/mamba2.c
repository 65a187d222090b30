// Mamba2's decode step (loom/layers/mamba2.py: Mamba2Mixer._torch for one-token rows), a few
// tokens for each of `reqs` requests (one each, or a verify step's rows, one after another),
// in place on their state slots: the causal depthwise
// convolution (bias, SiLU) over xBC, the time step dt = clamp(softplus(dt + dt_bias)), each
// head's decayed state update S <- exp(dt A) S + dt x B^T and its read y = S C + D x (S kept
// [state_size, head_dim]: the head's channels side by side in vector lanes), then
// the gated RMSNorm over groups of the inner channels. The torch path runs these as a dozen
// small ops a layer, each over every request's state gathered and scattered back; here each
// state is read and written once, in place. Three parallel phases: the convolution by request
// and channel block (each channel's window is updated once), the heads by request and head,
// the norm by request and norm group.
// loom_mamba2_decode_team runs them inside a caller's team (a phase's items split statically,
// the caller's barrier between the phases and after the last); loom_mamba2_decode_f32 is that
// in an OpenMP region of its own, so both give the same bits.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "loom.h"
#include "loom_omp.h"
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

// What a head's rows read: the convolution's output xbc [rows, conv_dim] (x, B, C), in_proj's
// rows (dt), and the head's place in them
typedef struct {
    const float *xbc, *proj;
    int64_t conv_dim, proj_ld, inner, groups, P, N, h, g;
    float a, dt_bias, dt_min, dt_max, d;  // -exp(A_log[h]), and the head's others
} Head;

// Row `row`'s time step for the head: softplus(dt + dt_bias), clamped to [dt_min, dt_max]
static float mamba2_dt(const Head *hd, int64_t row)
{
    const float dt = softplus(hd->proj[row * hd->proj_ld + hd->inner + hd->conv_dim + hd->h]
                              + hd->dt_bias);
    return dt < hd->dt_min ? hd->dt_min : dt > hd->dt_max ? hd->dt_max : dt;
}

// The chunkwise form (state space duality) for rows [c0, c0 + n) (n <= CHUNK) of a head on its
// state S [N, P], writing y. With l_t = dt_t A, cum_t their running sum over the chunk and
// G_ts = exp(cum_t - cum_s) (t >= s): y_t = exp(cum_t) S_0^T C_t + sum_{s<=t} G_ts dt_s
// (B_s . C_t) x_s + D x_t, and the state after S = exp(cum_n) S_0 + sum_s G_ns dt_s B_s x_s^T:
// S_0 read once for C's rows, then written once.
static void mamba2_chunk(const Head *hd, int64_t c0, int n, float *S, float *y)
{
    const int64_t P = hd->P, N = hd->N, cd = hd->conv_dim, inner = hd->inner;
    float Cm[CHUNK * N], W[CHUNK * N], X[CHUNK * P], R[CHUNK * P];
    float cum[CHUNK] = {0}, dts[CHUNK] = {0}, c = 0.0f;
    const float *B[CHUNK];
    memset(Cm, 0, sizeof Cm);  // rows past n stay zero: they add nothing
    memset(W, 0, sizeof W);
    memset(X, 0, sizeof X);
    for (int t = 0; t < n; t++) {
        const float *xr = hd->xbc + (c0 + t) * cd, dt = mamba2_dt(hd, c0 + t);
        c += dt * hd->a;
        cum[t] = c;
        dts[t] = dt;
        B[t] = xr + inner + hd->g * N;
        memcpy(Cm + t * N, xr + inner + (hd->groups + hd->g) * N, sizeof(float) * N);
        memcpy(X + t * P, xr + hd->h * P, sizeof(float) * P);
    }
    rows_times_state(Cm, S, N, P, R);
    for (int t = 0; t < n; t++) {
        const float g = expf(cum[t]);
        float *yh = y + (c0 + t) * inner + hd->h * P;
        for (int64_t p = 0; p < P; p++)
            yh[p] = g * R[t * P + p];
        for (int s = 0; s <= t; s++) {
            const float f = expf(cum[t] - cum[s]) * dts[s] * dot(B[s], Cm + t * N, N);
            for (int64_t p = 0; p < P; p++)
                yh[p] += f * X[s * P + p];
        }
        for (int64_t p = 0; p < P; p++)
            yh[p] += hd->d * X[t * P + p];
    }
    for (int s = 0; s < n; s++) {
        const float f = expf(cum[n - 1] - cum[s]) * dts[s];
        for (int64_t i = 0; i < N; i++)
            W[s * N + i] = f * B[s][i];
    }
    update_state(S, expf(cum[n - 1]), W, X, N, P);
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
                            int64_t norm_groups, int chunked, float eps, float dt_min,
                            float dt_max, float *out, float *scratch, int tid, int team,
                            LoomSync sync, void *sync_arg)
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
        for (int64_t c = c0; c < c1; c += MIX_LANES)
            conv_silu_lanes(proj + inner, proj_ld, i0, i1, win, past, conv_w, conv_b, c,
                            c1 - c < MIX_LANES ? c1 - c : MIX_LANES, dry && dry[r], xbc,
                            conv_dim);
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
        const Head hd = {xbc, proj, conv_dim, proj_ld, inner, groups, P, N, h, g,
                         -expf(a_log[h]), dt_bias[h], dt_min, dt_max, d[h]};
        if (chunked && !dr && out && i1 - i0 >= CHUNK_MIN) {
            for (int64_t c0 = i0; c0 < i1; c0 += CHUNK)
                mamba2_chunk(&hd, c0, i1 - c0 < CHUNK ? (int)(i1 - c0) : CHUNK, s, y);
            continue;
        }
        for (int64_t i = i0; i < i1; i++) {
            const float *xr = xbc + i * conv_dim;
            const float *x = xr + h * P;
            const float *b = xr + inner + g * N, *c = xr + inner + (groups + g) * N;
            const float dt = mamba2_dt(&hd, i), decay = expf(dt * hd.a);
            float *yh = y + i * inner + h * P;
            // S = decay S + dt x B^T; y = S C + D x: S stored [N, P], a vector of P's
            // channels at a time, each one's sum over n in order
            for (int64_t p = 0; p < P; p += MIX_LANES) {
                const int64_t m = P - p < MIX_LANES ? P - p : MIX_LANES;
                const mix_vf xp = load_lanes(x + p, m), dx = dt * xp;
                mix_vf acc = {0};
                for (int64_t n = 0; n < N; n++) {
                    float *sp = s + n * P + p;
                    const mix_vf v = load_lanes(sp, m) * decay + dx * b[n];
                    store_lanes(v, m, sp);
                    acc += v * c[n];
                }
                store_lanes(acc + d[h] * xp, m, yh + p);
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
        silu_rows(z, norm_size, dst);
        for (int64_t j = 0; j < norm_size; j++) {
            const float v = yr[j] * dst[j];
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
                           int64_t norm_groups, int chunked, float eps, float dt_min,
                           float dt_max, float *out, int num_threads)
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
                            state_size, width, norm_groups, chunked, eps, dt_min, dt_max, out,
                            scratch, omp_get_thread_num(), omp_get_num_threads(), omp_sync,
                            NULL);
    free(scratch);
    return 0;
}
