// LFM2's short convolution's decode step (loom/layers/recurrent.py: ShortConv with
// causal_conv for one-token rows), a few tokens for each of `reqs` requests (one each, or a
// verify step's rows, one after another), in place on their window slots: in_proj's row
// [b | c | h] (H each) gives out = c * (conv(b * h) + bias), conv the causal depthwise
// convolution over the channel's last width - 1 inputs (the window, oldest first) and this one
// (weight[:, width - 1] its multiplier). The torch path runs it as a handful of small ops a
// layer over every request's window gathered and scattered back; here each window is read and
// written once, in place. One parallel phase by request and
// channel block. loom_shortconv_decode_team runs it inside a caller's team (its items split
// statically, the caller's barrier after it); loom_shortconv_decode_f32 is that in an OpenMP
// region of its own, so both give the same bits.

#include <omp.h>
#include <stdint.h>
#include "loom.h"
#include "mixer_team.h"

int loom_shortconv_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                               int64_t reqs, const int64_t *starts, const int8_t *dry,
                               float *window_state, const float *conv_w, const float *conv_b,
                               int64_t H, int64_t width, float *out, int tid, int team,
                               LoomSync sync, void *sync_arg)
{
    if (H <= 0 || width < 1)
        return -1;
    if (reqs <= 0)
        return 0;
    const int64_t past = width - 1;
    const int64_t block = 256;  // channels a task
    const int64_t blocks = (H + block - 1) / block;
    const int64_t n = reqs * blocks;
    int64_t lo, hi;
    share(n, tid, team, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const int64_t r = t / blocks, c0 = (t % blocks) * block;
        const int64_t c1 = c0 + block < H ? c0 + block : H;
        const int64_t i0 = starts ? starts[r] : r, i1 = starts ? starts[r + 1] : r + 1;
        float *win = window_state + slots[r] * H * past;
        for (int64_t i = c0; i < c1; i++) {
            float own[past > 0 ? past : 1];  // a dry request's window, the state's untouched
            float *w = mixer_window(win + i * past, past, dry && dry[r], own);
            const float *k = conv_w + i * width;
            for (int64_t row = i0; row < i1; row++) {
                const float *b = proj + row * proj_ld, *c = b + H, *h = b + 2 * H;
                const float bx = b[i] * h[i];  // the convolution's input
                float acc = 0.0f;
                for (int64_t j = 0; j < past; j++)
                    acc += w[j] * k[j];
                acc += bx * k[past];
                for (int64_t j = 0; j + 1 < past; j++)
                    w[j] = w[j + 1];
                if (past > 0)
                    w[past - 1] = bx;
                if (conv_b)
                    acc += conv_b[i];
                if (out)
                    out[row * H + i] = c[i] * acc;
            }
        }
    }
    sync(sync_arg);
    return 0;
}

// Returns 0, or -1 (nothing written) where H or width is not positive.
int loom_shortconv_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots,
                              int64_t reqs, const int64_t *starts, const int8_t *dry,
                              float *window_state, const float *conv_w, const float *conv_b,
                              int64_t H, int64_t width, float *out, int num_threads)
{
    if (H <= 0 || width < 1)
        return -1;
    if (reqs <= 0)
        return 0;
#pragma omp parallel num_threads(num_threads)
    loom_shortconv_decode_team(proj, proj_ld, slots, reqs, starts, dry, window_state, conv_w,
                               conv_b, H, width, out, omp_get_thread_num(),
                               omp_get_num_threads(), omp_sync, NULL);
    return 0;
}
