// Gated DeltaNet's decode step (loom/layers/gated_delta.py: recurrent_step and what surrounds
// it), a few tokens for each of `reqs` requests (one each, or a speculative verify step's
// rows, one after another), in place on their state slots: the causal
// depthwise convolution and SiLU over q, k, v, the L2 norms of q and k, the decayed delta-rule
// update of each value head's [dk, dv] state and its read by q, and the gated RMSNorm of the
// result. The torch path runs the same steps as a dozen small ops a layer, each over every
// request's state gathered and scattered back; here each state is read and written twice, in
// place. Two parallel phases: the convolution by request and channel block (each channel's
// window is updated once), then the heads by request and value head. loom_gdn_decode_team
// runs them inside a caller's team (a phase's items split statically, the caller's barrier
// between the phases and after the last); loom_gdn_decode_f32 is that in an OpenMP region of
// its own, so both give the same bits.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include "loom.h"
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
                         int64_t width, int tiled, float eps, float *out, float *scratch,
                         int tid, int team, LoomSync sync, void *sync_arg)
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
        for (int64_t c = c0; c < c1; c++) {
            float own[past > 0 ? past : 1];  // a dry request's window, the state's untouched
            float *w = mixer_state(win + c * past, past, dry && dry[r], own);
            const float *k = conv_w + c * width;
            for (int64_t i = i0; i < i1; i++) {
                const float xc = proj[i * proj_ld + c];
                float acc = xc * k[past];
                for (int64_t j = 0; j < past; j++)
                    acc += w[j] * k[j];
                for (int64_t j = 0; j + 1 < past; j++)
                    w[j] = w[j + 1];
                if (past > 0)
                    w[past - 1] = xc;
                y[i * conv_dim + c] = silu(acc);
            }
        }
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
        for (int64_t row = i0; row < i1; row++) {
            const float *yr = y + row * conv_dim;
            const float *pr = proj + row * proj_ld;
            l2norm(yr + kh * dk, dk, 1.0f / sqrtf((float)dk), q);
            l2norm(yr + key_dim + kh * dk, dk, 1.0f, k);
            const float *v = yr + 2 * key_dim + h * dv;
            const float *z = pr + conv_dim + h * dv;
            const float b = pr[conv_dim + value_dim + h];
            const float a = pr[conv_dim + value_dim + value_heads + h];
            const float decay = expf(-expf(a_log[h]) * softplus(a + dt_bias[h]));
            const float beta = 1.0f / (1.0f + expf(-b));
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
            if (!out)
                continue;
            float ss = 0.0f;  // the gated RMSNorm
            for (int64_t j = 0; j < dv; j++)
                ss += o[j] * o[j];
            const float rn = 1.0f / sqrtf(ss / (float)dv + eps);
            float *dst = out + row * value_dim + h * dv;
            for (int64_t j = 0; j < dv; j++)
                dst[j] = norm_w[j] * (o[j] * rn) * silu(z[j]);
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
                        float eps, float *out, int num_threads)
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
                         width, tiled, eps, out, scratch, omp_get_thread_num(),
                         omp_get_num_threads(), omp_sync, NULL);
    free(scratch);
    return 0;
}
