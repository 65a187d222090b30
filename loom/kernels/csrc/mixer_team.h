// What the recurrent mixers' decode steps share (gated_delta.c, mamba2.c, shortconv.c): the
// activations their torch paths apply, a thread's share of a phase's items in a team, a
// request's rows and its states as a dry request reads them, and the barrier their OpenMP
// forms pass as the team's sync (loom.h's LoomSync).
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

static inline void omp_sync(void *arg)
{
    (void)arg;
#pragma omp barrier
}

#endif  // LOOM_MIXER_TEAM_H
