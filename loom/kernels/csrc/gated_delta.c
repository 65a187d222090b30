// Gated DeltaNet's decode step (loom/layers/gated_delta.py: recurrent_step and what surrounds
// it), any number of tokens for each of `reqs` requests (one each, a speculative verify step's
// rows, or a prompt's, one after another), in place on their state slots: the causal
// depthwise convolution and SiLU over q, k, v, the L2 norms of q and k, the decayed delta-rule
// update of each value head's [dk, dv] state and its read by q, and the gated RMSNorm of the
// result. The torch path runs the same steps as a dozen small ops a layer, each over every
// request's state gathered and scattered back; here each state is read and written twice a
// token, in place. Two parallel phases: the convolution by request and channel block (each
// channel's window is updated once), then the heads by request and value head.
// loom_gdn_decode_team runs them inside a caller's team (a phase's items split statically, the
// caller's barrier between the phases and after the last); loom_gdn_decode_f32 is that in an
// OpenMP region of its own, so both give the same bits.
//
// `chunked`: a request's run of CHUNK_MIN or more rows that are neither dry nor a commit (a
// prompt's) goes CHUNK rows at a time through the chunkwise form (gdn_chunk below): the
// state is read twice and written once a chunk rather than a token, in register-blocked
// products that keep the multiply units busy where the token-by-token form waits on the
// cache (the state of a 128 x 128 head is 64 KB: L2, not L1). The same outputs up to rounding
// (the torch path's chunked form is the same algebra, 64 rows a chunk); its bits depend on
// where a chunk starts, so a verify step, its commit and batch-invariant runs (chunked 0)
// take the token-by-token form, whose bits a one-row step shares.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "loom.h"
#include "loom_omp.h"
#include "mixer_team.h"

// x * rsqrt(sum(x^2) + eps) times `scale`, into out (the FLA library's L2 norm)
static void l2norm(const float *x, int64_t n, float scale, float *out)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++)
        ss += x[i] * x[i];
    const float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * r;
}

// A head's output o [dv] -> norm_w * RMSNorm(o) * SiLU(z), into dst
static void gated_norm(const float *o, const float *z, const float *norm_w, int64_t dv,
                       float eps, float *dst)
{
    const float rn = 1.0f / sqrtf(dot(o, o, dv) / (float)dv + eps);
    silu_rows(z, dv, dst);
    for (int64_t j = 0; j < dv; j++)
        dst[j] = norm_w[j] * (o[j] * rn) * dst[j];
}

// What a head's rows read: the convolution's output y [rows, conv_dim] (q, k, v), in_proj's
// rows (z, b, a), and the head's place in them
typedef struct {
    const float *y, *proj;
    int64_t conv_dim, proj_ld, key_dim, value_dim, value_heads, dk, dv, kh, h;
    float a_exp, dt_bias, eps;  // exp(A_log[h]), dt_bias[h], the norm's
    const float *norm_w;
} Head;

// Row `row`'s q and k for the head (L2-normed, q also scaled by dk^-1/2) and its write
// strength beta; returns its log decay g <= 0 (both forms read a row so)
static float gdn_row(const Head *hd, int64_t row, float *q, float *k, float *beta)
{
    const float *yr = hd->y + row * hd->conv_dim;
    const float *ba = hd->proj + row * hd->proj_ld + hd->conv_dim + hd->value_dim;  // b, a
    l2norm(yr + hd->kh * hd->dk, hd->dk, 1.0f / sqrtf((float)hd->dk), q);
    l2norm(yr + hd->key_dim + hd->kh * hd->dk, hd->dk, 1.0f, k);
    *beta = 1.0f / (1.0f + expf(-ba[hd->h]));
    return -hd->a_exp * softplus(ba[hd->value_heads + hd->h] + hd->dt_bias);
}

// The chunkwise form for rows [c0, c0 + n) (n <= CHUNK) of a head on its state S. With g_t the
// log decays, cum_t their running sum over the chunk and G_ts = exp(cum_t - cum_s) (t >= s),
// the recurrence's writes are
//     d_t = beta_t (v_t - exp(cum_t) S_0^T k_t - sum_{s<t} G_ts (k_s . k_t) d_s),
// its reads o_t = exp(cum_t) S_0^T q_t + sum_{s<=t} G_ts (k_s . q_t) d_s, and the state after
// S = exp(cum_n) S_0 + sum_s G_ns k_s d_s^T: S_0 read for k's and q's rows, then written once.
static void gdn_chunk(const Head *hd, int64_t c0, int n, float *S, float *out)
{
    const int64_t dk = hd->dk, dv = hd->dv, cd = hd->conv_dim, vd = hd->value_dim;
    float Q[CHUNK * dk], K[CHUNK * dk], P[CHUNK * dv], R[CHUNK * dv], D[CHUNK * dv];
    float cum[CHUNK] = {0}, beta[CHUNK] = {0}, c = 0.0f;
    memset(Q, 0, sizeof Q);  // rows past n stay zero: they add nothing
    memset(K, 0, sizeof K);
    memset(D, 0, sizeof D);
    for (int t = 0; t < n; t++) {
        c += gdn_row(hd, c0 + t, Q + t * dk, K + t * dk, beta + t);
        cum[t] = c;
    }
    rows_times_state(K, S, dk, dv, P);
    rows_times_state(Q, S, dk, dv, R);
    for (int t = 0; t < n; t++) {
        const float *v = hd->y + (c0 + t) * cd + 2 * hd->key_dim + hd->h * dv;
        const float g = expf(cum[t]);
        float *d = D + t * dv;
        for (int64_t j = 0; j < dv; j++)
            d[j] = v[j] - g * P[t * dv + j];
        for (int s = 0; s < t; s++) {
            const float f = expf(cum[t] - cum[s]) * dot(K + s * dk, K + t * dk, dk);
            for (int64_t j = 0; j < dv; j++)
                d[j] -= f * D[s * dv + j];
        }
        for (int64_t j = 0; j < dv; j++)
            d[j] *= beta[t];
    }
    for (int t = 0; t < n; t++) {
        const float g = expf(cum[t]);
        float *o = R + t * dv;
        for (int64_t j = 0; j < dv; j++)
            o[j] *= g;
        for (int s = 0; s <= t; s++) {
            const float f = expf(cum[t] - cum[s]) * dot(K + s * dk, Q + t * dk, dk);
            for (int64_t j = 0; j < dv; j++)
                o[j] += f * D[s * dv + j];
        }
        const int64_t row = c0 + t;
        gated_norm(o, hd->proj + row * hd->proj_ld + cd + hd->h * dv, hd->norm_w, dv, hd->eps,
                   out + row * vd + hd->h * dv);
    }
    for (int t = 0; t < n; t++) {  // K's rows become G_nt k_t
        const float f = expf(cum[n - 1] - cum[t]);
        for (int64_t i = 0; i < dk; i++)
            K[t * dk + i] *= f;
    }
    update_state(S, expf(cum[n - 1]), K, D, dk, dv);
}

// 0, or -1 where a head is wider than 1024 (the heads' stack arrays) or the dims do not fit
static int gdn_check(int64_t key_heads, int64_t value_heads, int64_t dk, int64_t dv,
                     int64_t width)
{
    if (dk <= 0 || dv <= 0 || dk > 1024 || dv > 1024 || width < 1)
        return -1;
    if (key_heads <= 0 || value_heads <= 0 || value_heads % key_heads)
        return -1;
    return 0;
}

// the convolution's output [rows, conv_dim]
int64_t loom_gdn_scratch_floats(int64_t rows, int64_t key_heads, int64_t value_heads,
                                int64_t dk, int64_t dv)
{
    return rows > 0 ? rows * (2 * key_heads * dk + value_heads * dv) : 0;
}

int loom_gdn_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                         int64_t reqs, const int64_t *starts, const int8_t *dry,
                         float *conv_state, const float *conv_w, float *ssm_state,
                         const float *a_log, const float *dt_bias, const float *norm_w,
                         int64_t key_heads, int64_t value_heads, int64_t dk, int64_t dv,
                         int64_t width, int tiled, int chunked, float eps, float *out,
                         float *scratch, int tid, int team, LoomSync sync, void *sync_arg)
{
    if (gdn_check(key_heads, value_heads, dk, dv, width)
        || (dry && dk * dv > LOOM_MIXER_DRY_FLOATS))
        return -1;
    if (reqs <= 0)
        return 0;
    const int64_t key_dim = key_heads * dk, value_dim = value_heads * dv;
    const int64_t conv_dim = 2 * key_dim + value_dim, past = width - 1;
    // proj's row: [q k v (conv_dim) | z (value_dim) | b (value_heads) | a (value_heads)]
    float *y = scratch;
    const int64_t block = 256;  // channels a task
    const int64_t blocks = (conv_dim + block - 1) / block;
    const int64_t group = value_heads / key_heads;
    int64_t lo, hi;
    share(reqs * blocks, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const int64_t r = t / blocks, c0 = (t % blocks) * block;
        const int64_t c1 = c0 + block < conv_dim ? c0 + block : conv_dim;
        int64_t i0, i1;
        request_rows(starts, r, &i0, &i1);
        float *win = conv_state + slots[r] * conv_dim * past;
        for (int64_t c = c0; c < c1; c += MIX_LANES)
            conv_silu_lanes(proj, proj_ld, i0, i1, win, past, conv_w, NULL, c,
                            c1 - c < MIX_LANES ? c1 - c : MIX_LANES, dry && dry[r], y, conv_dim);
    }
    sync(sync_arg);
    share(reqs * value_heads, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        float q[dk], k[dk], pred[dv], o[dv];
        const int64_t r = t / value_heads, h = t % value_heads;
        const int64_t kh = tiled ? h % key_heads : h / group;
        int64_t i0, i1;
        request_rows(starts, r, &i0, &i1);
        const int d = dry && dry[r];
        float own[d ? dk * dv : 1];  // a dry request's state, the slot's untouched
        float *s = mixer_state(ssm_state + (slots[r] * value_heads + h) * dk * dv, dk * dv, d,
                               own);
        const Head hd = {y, proj, conv_dim, proj_ld, key_dim, value_dim, value_heads, dk, dv,
                         kh, h, expf(a_log[h]), dt_bias[h], eps, norm_w};
        if (chunked && !d && out && i1 - i0 >= CHUNK_MIN) {
            for (int64_t c0 = i0; c0 < i1; c0 += CHUNK)
                gdn_chunk(&hd, c0, i1 - c0 < CHUNK ? (int)(i1 - c0) : CHUNK, s, out);
            continue;
        }
        for (int64_t row = i0; row < i1; row++) {
            float beta;
            const float decay = expf(gdn_row(&hd, row, q, k, &beta));
            const float *v = y + row * conv_dim + 2 * key_dim + h * dv;
            const float *z = proj + row * proj_ld + conv_dim + h * dv;
            for (int64_t j = 0; j < dv; j++)
                pred[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {  // S *= decay; pred = S^T k
                float *si = s + i * dv;
                const float ki = k[i];
                for (int64_t j = 0; j < dv; j++) {
                    si[j] *= decay;
                    pred[j] += si[j] * ki;
                }
            }
            for (int64_t j = 0; j < dv; j++) {
                pred[j] = (v[j] - pred[j]) * beta;  // the delta written
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {  // S += k delta^T; o = S^T q
                float *si = s + i * dv;
                const float ki = k[i], qi = q[i];
                for (int64_t j = 0; j < dv; j++) {
                    si[j] += ki * pred[j];
                    o[j] += si[j] * qi;
                }
            }
            if (out)
                gated_norm(o, z, norm_w, dv, eps, out + row * value_dim + h * dv);
        }
    }
    sync(sync_arg);
    return 0;
}

// Returns 0, or -1 (nothing written) where its scratch cannot be allocated, a head is wider
// than 1024, or a dry request's head state is larger than LOOM_MIXER_DRY_FLOATS.
int loom_gdn_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots, int64_t reqs,
                        const int64_t *starts, const int8_t *dry, float *conv_state,
                        const float *conv_w, float *ssm_state, const float *a_log,
                        const float *dt_bias, const float *norm_w, int64_t key_heads,
                        int64_t value_heads, int64_t dk, int64_t dv, int64_t width, int tiled,
                        int chunked, float eps, float *out, int num_threads)
{
    if (gdn_check(key_heads, value_heads, dk, dv, width)
        || (dry && dk * dv > LOOM_MIXER_DRY_FLOATS))
        return -1;
    if (reqs <= 0)
        return 0;
    const int64_t rows = step_rows(starts, reqs);
    float *scratch = malloc(sizeof(float) * (size_t)loom_gdn_scratch_floats(
        rows, key_heads, value_heads, dk, dv));
    if (!scratch)
        return -1;
#pragma omp parallel num_threads(num_threads)
    loom_gdn_decode_team(proj, proj_ld, slots, reqs, starts, dry, conv_state, conv_w,
                         ssm_state, a_log, dt_bias, norm_w, key_heads, value_heads, dk, dv,
                         width, tiled, chunked, eps, out, scratch, omp_get_thread_num(),
                         omp_get_num_threads(), omp_sync, NULL);
    free(scratch);
    return 0;
}
