// LFM2's short convolution's decode step (loom/layers/recurrent.py: ShortConv with
// causal_conv for one-token rows), any number of tokens for each of `reqs` requests (one
// each, a verify step's rows, a prompt: one after another), in place on their window slots:
// in_proj's row [b | c | h] (H each) gives out = c * (conv(b * h) + bias), conv the causal
// depthwise convolution over the channel's last width - 1 inputs (the window, oldest first)
// and this one (weight[:, width - 1] its multiplier). The torch path runs it as a handful of
// small ops a layer over every request's window gathered and scattered back; here each window
// is read and written once, in place. One parallel phase by request and channel block,
// MIX_LANES channels at a time across vector lanes. loom_shortconv_decode_team runs it
// inside a caller's team (its items split statically, the caller's barrier after it);
// loom_shortconv_decode_f32 is that in an OpenMP region of its own, so both give the same
// bits.

#include <stdint.h>
#include "loom.h"
#include "loom_omp.h"
#include "mixer_team.h"

// Channels [c0, c0 + n) (n <= MIX_LANES) over rows [i0, i1): their windows and weights
// transposed into lanes (lanes_in: window j of each channel side by side) so each row's
// products run across the channels at once (conv_row). A dry request's windows are not
// written back.
static void conv_lanes(const float *proj, int64_t proj_ld, int64_t i0, int64_t i1, float *win,
                       const float *conv_w, const float *conv_b, int64_t H, int64_t past,
                       int64_t c0, int64_t n, int dry, float *out)
{
    mix_vf w[past > 0 ? past : 1], k[past + 1], bias;
    lanes_in(win, conv_w, conv_b, past, c0, n, w, k, &bias);
    for (int64_t row = i0; row < i1; row++) {
        const float *b = proj + row * proj_ld + c0;
        const mix_vf bx = load_lanes(b, n) * load_lanes(b + 2 * H, n);  // the input: b * h
        const mix_vf acc = conv_row(w, k, conv_b ? &bias : NULL, past, bx);
        if (out)
            store_lanes(load_lanes(b + H, n) * acc, n, out + row * H + c0);
    }
    if (!dry)
        lanes_out(w, past, c0, n, win);
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
             c0 += MIX_LANES)
            conv_lanes(proj, proj_ld, i0, i1, win, conv_w, conv_b, H, past, c0,
                       end - c0 < MIX_LANES ? end - c0 : MIX_LANES, dry && dry[r], out);
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
