// LFM2's short convolution's decode step (loom/layers/recurrent.py: ShortConv with
// causal_conv for one-token rows), any number of tokens for each of `reqs` requests (one
// each, a verify step's rows, a prompt: one after another), in place on their window slots:
// in_proj's row [b | c | h] (H each) gives out = c * (conv(b * h) + bias), conv the causal
// depthwise convolution over the channel's last width - 1 inputs (the window, oldest first)
// and this one (weight[:, width - 1] its multiplier). The torch path runs it as a handful of
// small ops a layer over every request's window gathered and scattered back; here each window
// is read and written once, in place. One parallel phase by request and channel block, 16
// channels at a time across vector lanes. loom_shortconv_decode_team runs it inside a
// caller's team (its items split statically, the caller's barrier after it);
// loom_shortconv_decode_f32 is that in an OpenMP region of its own, so both give the same
// bits.

#include <omp.h>
#include <stdint.h>
#include "loom.h"
#include "mixer_team.h"

// Channels [c0, c0 + n) (n <= LANES) over rows [i0, i1): their windows and weights transposed
// into lanes (window j of each channel side by side) so each row's products run across the
// channels at once; each channel's sum in the order of the one-row loop it replaced (the
// window oldest first, then this row's input, then the bias): the same bits. A dry request's
// windows are not written back.
#define LANES 16
static void conv_lanes(const float *proj, int64_t proj_ld, int64_t i0, int64_t i1, float *win,
                       const float *conv_w, const float *conv_b, int64_t H, int64_t past,
                       int64_t width, int64_t c0, int64_t n, int dry, float *out)
{
    float w[past > 0 ? past : 1][LANES], k[width][LANES], bias[LANES];
    for (int64_t l = 0; l < LANES; l++) {
        const int64_t c = c0 + (l < n ? l : 0);  // (lanes past n: channel c0 again, unused)
        for (int64_t j = 0; j < past; j++)
            w[j][l] = win[c * past + j];
        for (int64_t j = 0; j < width; j++)
            k[j][l] = conv_w[c * width + j];
        bias[l] = conv_b ? conv_b[c] : 0.0f;
    }
    for (int64_t row = i0; row < i1; row++) {
        const float *b = proj + row * proj_ld + c0, *cg = b + H, *h = b + 2 * H;
        float bx[LANES], acc[LANES];
        for (int64_t l = 0; l < LANES; l++) {
            bx[l] = b[l < n ? l : 0] * h[l < n ? l : 0];  // the convolution's input
            acc[l] = 0.0f;
        }
        for (int64_t j = 0; j < past; j++)
            for (int64_t l = 0; l < LANES; l++)
                acc[l] += w[j][l] * k[j][l];
        for (int64_t l = 0; l < LANES; l++)
            acc[l] += bx[l] * k[past][l];
        if (conv_b)
            for (int64_t l = 0; l < LANES; l++)
                acc[l] += bias[l];
        for (int64_t j = 0; j + 1 < past; j++)
            for (int64_t l = 0; l < LANES; l++)
                w[j][l] = w[j + 1][l];
        if (past > 0)
            for (int64_t l = 0; l < LANES; l++)
                w[past - 1][l] = bx[l];
        if (out)
            for (int64_t l = 0; l < n; l++)
                out[row * H + c0 + l] = cg[l] * acc[l];
    }
    if (!dry)
        for (int64_t l = 0; l < n; l++)
            for (int64_t j = 0; j < past; j++)
                win[(c0 + l) * past + j] = w[j][l];
}

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
        const int64_t r = t / blocks;
        int64_t i0, i1;
        request_rows(starts, r, &i0, &i1);
        float *win = window_state + slots[r] * H * past;
        for (int64_t c0 = (t % blocks) * block, end = c0 + block < H ? c0 + block : H; c0 < end;
             c0 += LANES)
            conv_lanes(proj, proj_ld, i0, i1, win, conv_w, conv_b, H, past, width, c0,
                       end - c0 < LANES ? end - c0 : LANES, dry && dry[r], out);
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
