// What the recurrent mixers' decode steps share (gated_delta.c, mamba2.c, shortconv.c): the
// activations their torch paths apply, a thread's share of a phase's items in a team, a dry
// request's window, and the barrier their OpenMP forms pass as the team's sync (loom.h's
// LoomSync).
#ifndef LOOM_MIXER_TEAM_H
#define LOOM_MIXER_TEAM_H

#include <math.h>
#include <stdint.h>

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// items [lo, hi) of n for thread tid of team
static inline void share(int64_t n, int tid, int team, int64_t *lo, int64_t *hi)
{
    *lo = n * tid / team;
    *hi = n * (tid + 1) / team;
}

// A channel's convolution window `w` (past floats) as a request's rows read and shift it: in
// place, or for a dry request (`dry`: its states read, never written) a copy in `own`.
static inline float *mixer_window(float *w, int64_t past, int dry, float *own)
{
    if (!dry)
        return w;
    for (int64_t j = 0; j < past; j++)
        own[j] = w[j];
    return own;
}

static inline void omp_sync(void *arg)
{
    (void)arg;
#pragma omp barrier
}

#endif  // LOOM_MIXER_TEAM_H
