// A whole decoder stack in one call, for int8-grid or K-quant weights on the CPU in fp32. It
// walks the layers as the Python model definition describes them (loom.h's LoomLayerQ8: which
// optional norms, q/k norms, rotary table, attention window and scale, activation each layer
// has), running the same kernels in the same order as the per-module torch path
// (loom/models/llama.py), so the bits are the same; what goes is Python's dispatch between ~10
// kernels in each of ~30 layers (at one stream, most of a step's time outside the matmuls). No
// architecture is named here.

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#include "loom.h"
#include "loom_omp.h"

// A barrier for the threads of one region. A waiter spins up to SPIN_NS (the ops between two
// barriers of a step are microseconds apart), then sleeps on a futex: a thread whose partner
// the OS has lent to someone else (the server's event loop, a client) gives its core back
// instead of spinning it away. OpenMP's own barrier under the passive policy Loom sets sleeps
// at once, and each wake-up cost ~15 us here (measured): ~10 a layer made it ~2 ms a token.
#define SPIN_NS 100000

typedef struct {
    int arrived, gen, sleepers;
} Barrier;

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void barrier_wait(Barrier *b, int team)
{
    if (team == 1) return;
    const int gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->arrived, 1, __ATOMIC_ACQ_REL) == team) {  // the last one in
        __atomic_store_n(&b->arrived, 0, __ATOMIC_RELAXED);
        __atomic_add_fetch(&b->gen, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&b->sleepers, __ATOMIC_SEQ_CST)) {
            __atomic_store_n(&b->sleepers, 0, __ATOMIC_RELAXED);
#ifdef __linux__
            syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#endif
        }
        return;
    }
    const int64_t until = now_ns() + SPIN_NS;
    for (int i = 1;; i++) {
        if (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) != gen) return;
        CPU_RELAX();
        if (i % 64 == 0 && now_ns() > until) break;
    }
    while (__atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) == gen) {
        __atomic_store_n(&b->sleepers, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&b->gen, __ATOMIC_SEQ_CST) != gen) break;
#ifdef __linux__
        syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
}

// One step's arguments (loom_decoder_forward_q8's), for the layer loop below.
typedef struct {
    const LoomLayerQ8 *layers;
    int64_t num_layers, H, I, num_heads, kv_heads, D, block_size, M, max_blocks, num_tiles;
    int64_t qkv_n, q_n;
    float eps;
    float *hidden, *buf_h, *buf_qkv, *buf_attn, *buf_gu, *buf_act;
    uint16_t *buf_xb;  // a team's x rows past 8 rows (bf16, or as the K-quant GEMM reads them)
    const int64_t *positions, *slots, *block_tables, *tiles;
    const int64_t *keep;  // NULL, or the rows the last layer's MLP runs on (ascending)
    int64_t num_keep;
    const int64_t *state_slots;  // [num_reqs]: each request's state slot (a hybrid's mixers)
    const int64_t *query_starts;  // [num_reqs + 1]: each request's rows
    int64_t num_reqs;
    int nt, kv_type, kernel;  // linears past 8 rows: 0 AVX, 1 AMX, 2 bf16, 3 int16 (batch_kernel);
                              // + 4: up to 8 rows on VNNI (decode_kernel), else AVX;
                              // + KQ_GEMM: K-quant ones past 8 rows on linear_kq_gemm.c;
                              // + VNNI_ALL (with 4): past 8 rows on VNNI too (AArch64 builds)
} Step;
#define KQ_GEMM 8  // q8_decoder.py's
#define VNNI_ALL 16

// A thread of the one region a step runs in (NULL: op by op, each op its own region). `next`
// walks the step's work counters, one an op, the same way in every thread.
typedef struct {
    int tid, team;
    Barrier *bar;
    int64_t *next;
} Team;

// An op all threads share: in a team each takes its part of the work, and the barrier ends it.
static void sync_team(Team *t)
{
    if (t) barrier_wait(t->bar, t->team);
}

// The rows [*r0, *r1) of a small elementwise op (the norms, rope, silu) this thread runs, and
// on how many threads (0: none here). Op by op: all rows on nt threads. In a team: at few rows
// all on thread 0 (the per-op path runs them serially too), past that each thread its share.
#define SPLIT_ROWS 16
static int small_op_rows(const Step *s, const Team *t, int64_t *r0, int64_t *r1)
{
    *r0 = 0;
    *r1 = s->M;
    if (!t) return s->nt;
    if (s->M < SPLIT_ROWS) return t->tid == 0;
    *r0 = s->M * t->tid / t->team;
    *r1 = s->M * (t->tid + 1) / t->team;
    return *r1 > *r0;
}

// Outputs [n0, n1) of loom_linear_f32's product.
static void f32_cols(const float *x, int64_t M, int64_t K, const float *w, int64_t n0,
                     int64_t n1, float *y, int64_t ldy)
{
    enum { L = 16 };
    const int64_t body = K / L * L;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float *a = x + m * K, *b = w + n * K;
            float acc[L] = {0};
            for (int64_t k = 0; k < body; k += L)
                for (int j = 0; j < L; j++) acc[j] += a[k + j] * b[k + j];
            for (int64_t k = body; k < K; k++) acc[k - body] += a[k] * b[k];
            float sum = 0.0f;
            for (int j = 0; j < L; j++) sum += acc[j];
            y[m * ldy + n] = sum;
        }
}

void loom_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y,
                     int64_t ldy, int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        f32_cols(x, M, K, w, N * t / nt, N * (t + 1) / nt, y, ldy);
    }
}

// Whether K-quant linear W runs the GEMM's team form at this step's rows (else the integer
// kernel's: up to 8 rows, interleaved Q4_K up to LOOM_KQ_R16_INT_ROWS).
static inline int kq_gemm(const Step *s, const LoomLinearQ8 *W)
{
    return W->kind == LOOM_LINEAR_KQ && !loom_kq_int_rows((int)W->bits, s->M);
}

// y [M, N] (rows ldy apart) = x W^T (+ bias) for a linear of one format (Q8, KQ or F32).
// join: end with the team's barrier; without it (a K-quant part before another part of the same
// linear: it reads x and writes its own columns, as the next does) a thread goes on to the next
// part's rows at once instead of waiting out the other's last chunk. Past 8 rows a K-quant part
// ends with the barrier unless the next part is a K-quant one too (next_kq: it reads the same
// prepared x; another kind would rewrite buf_xb); prepared: the part before was (x is in
// buf_xb as the GEMM reads it).
static int linear_one(const Step *s, Team *t, const float *x, int64_t K, const LoomLinearQ8 *W,
                      const float *bias, int64_t N, float *y, int64_t ldy, int join,
                      int next_kq, int prepared)
{
    const int vnni = (s->kernel & 4) &&
                     (s->M <= loom_linear_q8_direct_rows || (s->kernel & VNNI_ALL));
    const int batch = s->kernel & 3;
    const int bits = (int)W->bits;
    if (W->kind == LOOM_LINEAR_F32) {  // no bias (a router): each thread its share of outputs
        if (!t) loom_linear_f32(x, s->M, K, (const float *)W->w, N, y, ldy, s->nt);
        else f32_cols(x, s->M, K, (const float *)W->w, N * t->tid / t->team,
                      N * (t->tid + 1) / t->team, y, ldy);
        sync_team(t);
        return 0;
    }
    if (W->kind == LOOM_LINEAR_KQ) {  // in a team past 8 rows only with KQ_GEMM (run_step)
        if (!t)  // past 8 rows on linear_kq_gemm.c's kernel with KQ_GEMM
            return (s->kernel & KQ_GEMM ? loom_linear_kq_gemm : loom_linear_kq)(
                x, s->M, K, K, W->w, bits, bias, N, y, ldy, s->nt);
        if (kq_gemm(s, W)) {  // x as the GEMM's tiles read it
            const int xb = loom_kq_gemm_x_bytes(s->M, K) > 0;
            if (xb && !prepared) {
                loom_kq_gemm_x_team(x, s->M, K, K, s->buf_xb, t->tid, t->team);
                sync_team(t);
            }
            loom_linear_kq_gemm_team(xb ? (const void *)s->buf_xb : (const void *)x, K, s->M, K,
                                     W->w, bits, bias, N, y, ldy, t->next++, t->team);
            if (!next_kq) sync_team(t);  // (the last part has none after it)
            return 0;
        }
        loom_linear_kq_team(x, s->M, K, K, W->w, bits, bias, N, y, ldy, t->next++, t->team);
        if (join) sync_team(t);
        return 0;
    }
    if (!t) {
        if (vnni)
            return loom_linear_q8_vnni(x, s->M, K, K, W->w, W->s16, W->m16, bias, N, y, ldy,
                                       bits, s->nt);
        return (batch == 1   ? loom_linear_q8_amx
                : batch == 2 ? loom_linear_q8_bf16
                : batch == 3 ? loom_linear_q8_i16
                             : loom_linear_q8_f32)(x, s->M, K, K, W->w, W->s, W->m, bias, N, y,
                                                   ldy, bits, s->nt);
    }
    if (vnni) {
        loom_linear_q8_vnni_team(x, s->M, K, K, W->w, W->s16, W->m16, bias, N, y, ldy, bits,
                                 t->next++, t->team);
    } else if (s->M > loom_linear_q8_direct_rows) {  // the bf16 kernel (run_step's condition)
        loom_bf16_rows_team(x, s->M, K, K, s->buf_xb, t->tid, t->team);
        sync_team(t);
        loom_linear_q8_bf16_team(s->buf_xb, s->M, K, W->w, W->s, W->m, bias, N, y, ldy, bits,
                                 t->next++, t->team);
    } else
        loom_linear_q8_team(x, s->M, K, K, W->w, W->s, W->m, bias, N, y, ldy, bits, t->next++,
                            t->team);
    sync_team(t);
    return 0;
}

// y = x W^T (+ bias) for one of a layer's linears.
// The one call site of every linear of the stack (the head's too): a new weight format is a
// `kind` (loom.h) and a branch in linear_one (and in check_linear).
static int linear(const Step *s, Team *t, const float *x, int64_t K, const LoomLinearQ8 *W,
                  const float *bias, int64_t N, float *y)
{
    if (W->kind != LOOM_LINEAR_PARTS) return linear_one(s, t, x, K, W, bias, N, y, N, 1, 0, 0);
    for (int64_t i = 0; i < W->num_parts; i++) {  // KQuantLinear.forward's order
        const LoomLinearQ8 *P = &W->parts[i];
        const int kq = P->kind == LOOM_LINEAR_KQ;
        // K-quant parts in a row on the GEMM: one prepared x and one barrier at their end
        const int next_kq = i + 1 < W->num_parts && kq_gemm(s, &W->parts[i + 1]);
        const int prev_kq = i > 0 && kq_gemm(s, &W->parts[i - 1]);
        int rc = linear_one(s, t, x, K, P, bias && kq ? bias + P->n0 : NULL, P->n, y + P->n0, N,
                            i == W->num_parts - 1, next_kq, prev_kq);
        if (rc) return rc;
        if (bias && !kq) {  // the Q8 part's product, then its bias (torch's `part + bias`)
            int64_t r0, r1;
            if (small_op_rows(s, t, &r0, &r1))
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t n = 0; n < P->n; n++) y[r * N + P->n0 + n] += bias[P->n0 + n];
            sync_team(t);
        }
    }
    return 0;
}

static int attention(const Step *s, Team *t, const LoomLayerQ8 *L)
{
    if (!t)
        return loom_paged_attention_f32(s->buf_qkv, s->qkv_n, L->k_cache, L->v_cache,
                                        s->block_tables, s->max_blocks, s->positions, s->tiles,
                                        s->num_tiles, s->num_heads, s->kv_heads, s->D,
                                        s->block_size, L->window, L->scale, L->softcap, s->nt,
                                        s->kv_type, s->buf_attn);
    loom_paged_attention_team(s->buf_qkv, s->qkv_n, L->k_cache, L->v_cache, s->block_tables,
                              s->max_blocks, s->positions, s->tiles, s->num_tiles, s->num_heads,
                              s->kv_heads, s->D, s->block_size, L->window, L->scale, L->softcap,
                              s->kv_type, s->buf_attn, t->next++, t->team);
    sync_team(t);
    return 0;
}

// ---- mixtures of experts: the router's choice, the experts over their tokens' rows, the
// weighted sum (loom.h's LoomMoeQ8). The route and the sum are the module path's too
// (loom/models/moe.py calls the exported forms), so both give the same bits.

int loom_moe_route_f32(float *logits, int64_t M, int64_t E, int64_t top_k, int norm_topk,
                       const float *bias, float scale, int64_t *counts, int64_t *pair_token,
                       float *pair_weight, int64_t *token_pairs)
{
    if (top_k < 1 || top_k > E) return -1;
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t t = 0; t < M; t++) {  // scores in place, the top_k into token_pairs' row
        float *p = logits + t * E;
        int64_t *chosen = token_pairs + t * top_k;
        if (bias) {  // sigmoid scores, chosen by score + bias
            for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
        } else {  // softmax
            float mx = p[0], sum = 0.0f;
            for (int64_t e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
            for (int64_t e = 0; e < E; e++) p[e] /= sum;
        }
        for (int64_t j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
                const float c = bias ? p[e] + bias[e] : p[e];
                if (!taken && (best < 0 || c > (bias ? p[best] + bias[best] : p[best])))
                    best = e;
            }
            int64_t i = j;  // kept in ascending expert order
            for (; i > 0 && chosen[i - 1] > best; i--) chosen[i] = chosen[i - 1];
            chosen[i] = best;
            counts[best]++;
        }
    }
    for (int64_t e = 0, start = 0; e < E; e++) {  // counts -> each expert's first position
        const int64_t n = counts[e];
        counts[e] = start;
        start += n;
    }
    for (int64_t t = 0; t < M; t++) {  // each pair to its expert's next position
        const float *p = logits + t * E;
        int64_t *chosen = token_pairs + t * top_k;
        float sum = 0.0f;
        for (int64_t j = 0; j < top_k; j++) sum += p[chosen[j]];
        if (bias) sum += 1e-6f;  // (LFM2-MoE's floor)
        for (int64_t j = 0; j < top_k; j++) {
            const int64_t pos = counts[chosen[j]]++;
            pair_token[pos] = t;
            pair_weight[pos] = (norm_topk ? p[chosen[j]] / sum : p[chosen[j]]) * scale;
            chosen[j] = pos;
        }
    }
    for (int64_t e = E - 1; e > 0; e--) counts[e] -= counts[e - 1];  // ends -> counts
    return 0;
}

static void moe_combine_rows(const float *y, const float *pair_weight,
                             const int64_t *token_pairs, int64_t top_k, int64_t H,
                             const float *shared, const float *shared_gate, float *out,
                             int64_t r0, int64_t r1)
{
    for (int64_t t = r0; t < r1; t++) {
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int64_t j = 0; j < top_k; j++) {
            const int64_t p = token_pairs[t * top_k + j];
            const float w = pair_weight[p], *yp = y + p * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * yp[h];
        }
        if (!shared) continue;
        const float g = shared_gate ? 1.0f / (1.0f + expf(-shared_gate[t])) : 1.0f;
        for (int64_t h = 0; h < H; h++) o[h] += g * shared[t * H + h];
    }
}

void loom_moe_combine_f32(const float *y, const float *pair_weight, const int64_t *token_pairs,
                          int64_t M, int64_t top_k, int64_t H, const float *shared,
                          const float *shared_gate, float *out, int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        moe_combine_rows(y, pair_weight, token_pairs, top_k, H, shared, shared_gate, out,
                         M * i / n, M * (i + 1) / n);
    }
}

// The scratch's parts, in order: int64 counts [E], pair_token [P], token_pairs [P]; fp32
// pair_weight [P], logits [M, E], rows [P, H] (each pair's row, then its expert's output in its
// place), gu [M, 2 I], act [M, I], shared [M, H], gate [M] (P = M top_k pairs; I the wider of
// the expert's and the shared one's).
typedef struct {
    int64_t *counts, *pair_token, *token_pairs;
    float *pair_weight, *logits, *rows, *gu, *act, *shared, *gate;
} MoeBufs;

static int64_t moe_bufs(void *buf, int64_t M, int64_t H, int64_t E, int64_t k, int64_t I,
                        MoeBufs *b)
{
    const int64_t P = M * k, rows = P + M * E, gu = rows + P * H, act = gu + 2 * M * I;
    const int64_t shared = act + M * I, gate = shared + M * H;  // fp32 offsets
    if (b) {
        int64_t *i64 = buf;
        float *f = (float *)(i64 + E + 2 * P);
        *b = (MoeBufs){i64, i64 + E, i64 + E + P, f, f + P, f + rows, f + gu, f + act,
                       f + shared, f + gate};
    }
    return (E + 2 * P) * (int64_t)sizeof(int64_t) + (gate + M) * (int64_t)sizeof(float);
}

int64_t loom_moe_scratch_bytes(int64_t M, int64_t H, int64_t E, int64_t top_k, int64_t inter)
{
    return moe_bufs(NULL, M, H, E, top_k, inter, NULL);
}

static int64_t moe_inter(const LoomMoeQ8 *X)
{
    return X->inter > X->shared_inter ? X->inter : X->shared_inter;
}

// act(gate) * up of gu [rows, 2 I] into act [rows, I] (LOOM_ACT_RELU2: relu(up)^2 of gu
// [rows, I], as torch's relu then square): a small op over s->M rows.
static void gated(const Step *s, Team *t, int act, const float *gu, float *out, int64_t I)
{
    int64_t r0, r1;
    const int nt = small_op_rows(s, t, &r0, &r1);
    if (nt && act == LOOM_ACT_RELU2) {
        for (int64_t i = r0 * I; i < r1 * I; i++) {
            const float v = gu[i] > 0.0f ? gu[i] : 0.0f;
            out[i] = v * v;
        }
    } else if (nt)
        (act == LOOM_ACT_GELU_TANH ? loom_gelu_tanh_mul_f32 : loom_silu_mul_f32)(
            gu + r0 * 2 * I, out + r0 * I, r1 - r0, I, nt);
    sync_team(t);
}

// A gated MLP over s->M rows of x: y = (act(x Wg^T) * x Wu^T) Wd^T (LlamaMLP.forward); with
// LOOM_ACT_RELU2 y = relu(x Wu^T)^2 Wd^T (Nemotron's).
static int gated_mlp(const Step *s, Team *t, int act, const float *x, int64_t H, int64_t I,
                     const LoomLinearQ8 *gu, const LoomLinearQ8 *d, float *buf_gu,
                     float *buf_act, float *y)
{
    int rc;
    if ((rc = linear(s, t, x, H, gu, NULL, act == LOOM_ACT_RELU2 ? I : 2 * I, buf_gu)))
        return rc;
    gated(s, t, act, buf_gu, buf_act, I);
    return linear(s, t, buf_act, I, d, NULL, H, y);
}

// buf_h [M, H] (the MLP norm's output) -> buf_h = the layer's mixture of experts
// (SparseMoeBlock.forward's order of kernels, on the same rows).
static int moe(const Step *s, Team *t, const LoomLayerQ8 *L)
{
    const LoomMoeQ8 *X = L->moe;
    const int64_t M = s->M, H = s->H, E = X->num_experts, k = X->top_k, P = M * k;
    MoeBufs b;
    moe_bufs(X->buf, M, H, E, k, moe_inter(X), &b);
    int rc;
    if ((rc = linear(s, t, s->buf_h, H, &X->router, NULL, E, b.logits))) return rc;
    if (!t || t->tid == 0)
        loom_moe_route_f32(b.logits, M, E, k, (int)X->norm_topk, X->bias, X->scale, b.counts,
                           b.pair_token, b.pair_weight, b.token_pairs);
    sync_team(t);
    const int64_t p0 = t ? P * t->tid / t->team : 0, p1 = t ? P * (t->tid + 1) / t->team : P;
#pragma omp parallel for num_threads(s->nt) if (!t)  // op by op: on the step's threads
    for (int64_t p = p0; p < p1; p++)  // each pair's row, grouped by expert
        memcpy(b.rows + p * H, s->buf_h + b.pair_token[p] * H, (size_t)H * sizeof(float));
    sync_team(t);
    Step es = *s;  // an expert's rows as a step of their own (its linears' kernels by count)
    for (int64_t e = 0, start = 0; e < E; e++) {  // its output in its rows' place
        if (!(es.M = b.counts[e])) continue;
        if ((rc = gated_mlp(&es, t, L->act, b.rows + start * H, H, X->inter, &X->gu[e],
                            &X->d[e], b.gu, b.act, b.rows + start * H)))
            return rc;
        start += es.M;
    }
    const int gated = X->shared_inter && X->shared_gate.w;  // (Granite's is ungated)
    if (X->shared_inter) {
        if ((rc = gated_mlp(s, t, L->act, s->buf_h, H, X->shared_inter, &X->shared_gu,
                            &X->shared_d, b.gu, b.act, b.shared)) ||
            (gated && (rc = linear(s, t, s->buf_h, H, &X->shared_gate, NULL, 1, b.gate))))
            return rc;
    }
    const float *shared = X->shared_inter ? b.shared : NULL;
    const float *gate = gated ? b.gate : NULL;
    int64_t r0, r1;
    if (!t)  // op by op: every row on the step's threads
        loom_moe_combine_f32(b.rows, b.pair_weight, b.token_pairs, M, k, H, shared, gate,
                             s->buf_h, s->nt);
    else if (small_op_rows(s, t, &r0, &r1))
        moe_combine_rows(b.rows, b.pair_weight, b.token_pairs, k, H, shared, gate, s->buf_h, r0,
                         r1);
    sync_team(t);
    return 0;
}

// The rest of a layer once attention's output projection is in buf_h: [buf_h =
// attn_out_norm(buf_h)], hidden += buf_h, buf_h = mlp_norm(hidden), then the MLP and
// [mlp_out_norm] (its output in buf_h). A small op's rows are the same thread's from one op to
// the next, so only the linears' inputs need a barrier before them.
static int mlp(const Step *s, Team *t, const LoomLayerQ8 *L)
{
    const int64_t H = s->H, I = s->I;
    int64_t r0, r1;  // the rows of a small op here
    const int nt = small_op_rows(s, t, &r0, &r1);
    int rc;
    if (nt && L->attn_out_norm)
        loom_add_rms_norm_f32(s->buf_h + r0 * H, NULL, L->attn_out_norm, r1 - r0, H, s->eps, nt);
    if (nt)
        loom_add_rms_norm_f32(s->buf_h + r0 * H, s->hidden + r0 * H, L->mlp_norm, r1 - r0, H,
                              s->eps, nt);
    sync_team(t);
    if ((rc = L->moe ? moe(s, t, L)
                     : gated_mlp(s, t, L->act, s->buf_h, H, I, &L->gu, &L->d, s->buf_gu,
                                 s->buf_act, s->buf_h)))
        return rc;
    if (nt && L->mlp_out_norm)
        loom_add_rms_norm_f32(s->buf_h + r0 * H, NULL, L->mlp_out_norm, r1 - r0, H, s->eps, nt);
    return 0;
}

// ---- a hybrid's mixers (loom.h's LoomMixerQ8), on steps of a few tokens a request (decode
// and verify steps): in_proj into buf_qkv (or the mixer's `record`), the mixer's decode step
// over each request's rows into buf_attn, out_proj into buf_h. In a team the kernels' team
// forms (their phases split between the threads, the team's barrier between them); op by op
// their OpenMP forms, which run the team forms: the same bits either way, and the module
// path's (loom/layers/recurrent.py: RecurrentMixer.mix_rows).

static void team_barrier(void *arg)
{
    sync_team((Team *)arg);
}

static int mixer(const Step *s, Team *t, const LoomMixerQ8 *X)
{
    int rc;
    float *p = X->record ? X->record : s->buf_qkv;  // (a verify step's: kept for its commit)
    if ((rc = linear(s, t, s->buf_h, s->H, &X->in_proj, X->in_b, X->proj_n, p)))
        return rc;
    const int64_t *slots = s->state_slots, *starts = s->query_starts, R = s->num_reqs;
    const int8_t *dry = X->dry;
    float *y = s->buf_attn;
    const int tid = t ? t->tid : 0, team = t ? t->team : 1;
    if (X->kind == LOOM_MIXER_GDN)
        rc = t ? loom_gdn_decode_team(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                      X->conv_w, X->ssm_state, X->a_log, X->dt_bias, X->norm_w,
                                      X->key_heads, X->value_heads, X->dk, X->dv, X->width,
                                      (int)X->tiled, (int)X->chunked, X->eps, y, X->scratch,
                                      tid, team, team_barrier, t)
               : loom_gdn_decode_f32(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                     X->conv_w, X->ssm_state, X->a_log, X->dt_bias, X->norm_w,
                                     X->key_heads, X->value_heads, X->dk, X->dv, X->width,
                                     (int)X->tiled, (int)X->chunked, X->eps, y, s->nt);
    else if (X->kind == LOOM_MIXER_MAMBA2)
        rc = t ? loom_mamba2_decode_team(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                         X->conv_w, X->conv_b, X->ssm_state, X->dt_bias,
                                         X->a_log, X->d, X->norm_w, X->value_heads, X->dv,
                                         X->key_heads, X->dk, X->width, X->norm_groups,
                                         (int)X->chunked, X->eps, X->dt_min, X->dt_max, y,
                                         X->scratch, tid, team, team_barrier, t)
               : loom_mamba2_decode_f32(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                        X->conv_w, X->conv_b, X->ssm_state, X->dt_bias,
                                        X->a_log, X->d, X->norm_w, X->value_heads, X->dv,
                                        X->key_heads, X->dk, X->width, X->norm_groups,
                                        (int)X->chunked, X->eps, X->dt_min, X->dt_max, y, s->nt);
    else if (X->kind == LOOM_MIXER_SHORTCONV)
        rc = t ? loom_shortconv_decode_team(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                            X->conv_w, X->conv_b, s->H, X->width, y, tid, team,
                                            team_barrier, t)
               : loom_shortconv_decode_f32(p, X->proj_n, slots, R, starts, dry, X->conv_state,
                                           X->conv_w, X->conv_b, s->H, X->width, y, s->nt);
    else
        rc = -1;
    if (rc) return rc;
    return linear(s, t, s->buf_attn, X->out_k, &X->out_proj, X->out_b, s->H, s->buf_h);
}

// The last layer's rows that go on past attention (s->keep; the rest feed nothing but their
// own K and V, written by then): row keep[r] of buf_h and of hidden moved to row r, and the
// step's rows cut to them. Rows only move up (keep ascends), on thread 0.
static void keep_rows(Step *s, Team *t)
{
    if (!t || t->tid == 0)
        for (int64_t r = 0; r < s->num_keep; r++)
            if (s->keep[r] != r) {
                memcpy(s->buf_h + r * s->H, s->buf_h + s->keep[r] * s->H,
                       (size_t)s->H * sizeof(float));
                memcpy(s->hidden + r * s->H, s->hidden + s->keep[r] * s->H,
                       (size_t)s->H * sizeof(float));
            }
    sync_team(t);
    s->M = s->num_keep;
}

// The layers, in the module path's order. In a team no op fails (the step was checked before
// the region), so every thread meets every barrier. With s->keep, the last layer's MLP (and
// the final norm and head after it) runs on those rows only, and s->M is their number after.
static int run_layers(Step *s, Team *t)
{
    const int64_t H = s->H;
    int64_t r0, r1;  // the rows of a small op here
    const int nt = small_op_rows(s, t, &r0, &r1);
    const int64_t n = r1 - r0;
    int rc;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const LoomLayerQ8 *L = &s->layers[l];
        const int last = l == s->num_layers - 1;
        if (l > 0) {  // hidden += the last MLP's output; buf_h = norm(hidden)
            if (nt)
                loom_add_rms_norm_f32(s->buf_h + r0 * H, s->hidden + r0 * H, L->in_norm, n, H,
                                      s->eps, nt);
            sync_team(t);
        }
        if (L->block == LOOM_BLOCK_MLP) {  // an MLP alone, on the input norm's output
            if (last && s->keep && s->num_keep == 0) {
                s->M = 0;
                return 0;
            }
            if (last && s->keep) keep_rows(s, t);
            if ((rc = L->moe ? moe(s, t, L)
                             : gated_mlp(s, t, L->act, s->buf_h, H, s->I, &L->gu, &L->d,
                                         s->buf_gu, s->buf_act, s->buf_h)))
                return rc;
            continue;
        }
        if (L->mixer) {  // a hybrid's mixer: every row's state moves, then as below
            if ((rc = mixer(s, t, L->mixer))) return rc;
            if (last && s->keep && s->num_keep == 0) {
                s->M = 0;
                return 0;
            }
            if (last && s->keep) keep_rows(s, t);
            if (L->block == LOOM_BLOCK_BOTH && (rc = mlp(s, t, L))) return rc;
            continue;
        }
        if ((rc = linear(s, t, s->buf_h, H, &L->qkv, L->qkv_b, s->qkv_n, s->buf_qkv)))
            return rc;
        if (L->gate && (rc = linear(s, t, s->buf_h, H, L->gate, NULL, s->q_n, s->buf_gu)))
            return rc;  // (buf_gu is free until the MLP)
        if (nt && L->q_norm && L->qk_norm_full) {  // all of q, then all of k, as one row each
            loom_qk_norm_f32(s->buf_qkv + r0 * s->qkv_n, s->qkv_n, n, 1, 0, s->q_n, L->q_norm,
                             L->k_norm, s->eps, nt);
            loom_qk_norm_f32(s->buf_qkv + r0 * s->qkv_n + s->q_n, s->qkv_n, n, 0, 1,
                             s->kv_heads * s->D, L->q_norm, L->k_norm, s->eps, nt);
        } else if (nt && L->q_norm)
            loom_qk_norm_f32(s->buf_qkv + r0 * s->qkv_n, s->qkv_n, n, s->num_heads, s->kv_heads,
                             s->D, L->q_norm, L->k_norm, s->eps, nt);
        if (nt)
            loom_rope_write_kv_f32(s->buf_qkv + r0 * s->qkv_n, s->qkv_n, n, s->num_heads,
                                   s->kv_heads, s->D, L->rope_table, s->positions + r0,
                                   s->slots + r0, L->k_cache, L->v_cache, nt, s->kv_type);
        sync_team(t);
        if (last && s->keep && s->num_keep == 0) {  // no row goes on: K and V were all
            s->M = 0;
            return 0;
        }
        if ((rc = attention(s, t, L))) return rc;
        if (L->gate) {  // attention's output times sigmoid of the gate's
            if (nt)
                loom_sigmoid_mul_f32(s->buf_attn + r0 * s->q_n, s->buf_gu + r0 * s->q_n, n,
                                     s->q_n, nt);
            sync_team(t);
        }
        if ((rc = linear(s, t, s->buf_attn, s->q_n, &L->o, NULL, H, s->buf_h))) return rc;
        if (last && s->keep) keep_rows(s, t);
        if (L->block == LOOM_BLOCK_BOTH && (rc = mlp(s, t, L))) return rc;
    }
    return 0;
}

// out[t] = the embedding of ids[t], q * scale + min rounded twice as Q8Groups.dequantize does,
// then times E->scale as the model's `embed` multiplies
// (torch's mul_ then add_: no fused multiply-add; loom/kernels/build.py compiles this file
// without contraction). 4-bit rows hold a group's values j and j + 16 in byte j's low and high
// nibbles.
static void embed_rows(const LoomEmbedQ8 *E, int64_t M, int64_t H, float *out)
{
    const int code = (int)E->table.bits, lv = code & LOOM_Q8_LEVELS;
    const int64_t groups = H / 32, row_bytes = H * LOOM_Q8_WIDTH(code) / 8;
    for (int64_t t = 0; t < M; t++) {
        const uint8_t *q = E->table.w + E->ids[t] * row_bytes;
        const float *sc = E->table.s + E->ids[t] * groups;
        const float *mn = E->table.m ? E->table.m + E->ids[t] * groups : NULL;
        float *o = out + t * H;
        for (int64_t g = 0; g < groups; g++)
            for (int j = 0; j < 32; j++) {
                const int n = code == 8 ? q[g * 32 + j]
                              : j < 16  ? q[g * 16 + j] & 15
                                        : q[g * 16 + j - 16] >> 4;
                const int v = lv ? loom_iq4_q[n]
                              : code == LOOM_Q8_Q5 ? n | (int)(loom_q5_high(q, H, g) >> j & 1) << 4
                                                   : n;
                const float p = (float)v * sc[g];
                o[g * 32 + j] = p + loom_q8_min(mn, sc, g, code);
            }
        if (E->scale != 1.0f)
            for (int64_t i = 0; i < H; i++) o[i] *= E->scale;
    }
}

// The head's arguments as a step of num_rows rows on its own linear's kernel.
static Step head_step(const Step *s, const LoomHeadQ8 *head)
{
    Step hs = *s;
    hs.M = head->num_rows;
    hs.kernel = (int)head->kernel;
    return hs;
}

// The final norm (in place in buf_h, adding the last MLP's output to the residual stream), then
// the head over the rows it wants; in a team each op's part, as run_layers.
static int finish(const Step *s, Team *t, const float *final_norm, const LoomHeadQ8 *head)
{
    int64_t r0, r1;
    const int nt = small_op_rows(s, t, &r0, &r1);
    if (nt) {
        loom_add_rms_norm_f32(s->buf_h + r0 * s->H, s->hidden + r0 * s->H, final_norm, r1 - r0,
                              s->H, s->eps, nt);
        for (int64_t r = 0; head && r < head->num_rows; r++)  // the head's rows normed here
            if (head->rows[r] >= r0 && head->rows[r] < r1)
                memcpy(head->x + r * s->H, s->buf_h + head->rows[r] * s->H,
                       (size_t)s->H * sizeof(float));
    }
    sync_team(t);
    if (!head || head->num_rows == 0) return 0;
    const Step hs = head_step(s, head);
    return linear(&hs, t, head->x, s->H, &head->w, NULL, head->N, head->logits);
}

// What a team's ops would have refused (they do not check): the error the per-op path returns.
static int check_one(const LoomLinearQ8 *W, int64_t K)
{
    if (W->kind == LOOM_LINEAR_F32) return K < 1 || !W->w;
    if (W->kind == LOOM_LINEAR_KQ) return loom_kq_check(K, (int)W->bits);
    return W->kind != LOOM_LINEAR_Q8 || loom_linear_q8_check(K, (int)W->bits);
}

static int check_linear(const LoomLinearQ8 *W, int64_t K)
{
    if (W->kind != LOOM_LINEAR_PARTS) return check_one(W, K);
    if (W->num_parts < 1 || !W->parts) return -1;
    for (int64_t i = 0; i < W->num_parts; i++)
        if (W->parts[i].kind == LOOM_LINEAR_PARTS || check_one(&W->parts[i], K)) return -1;
    return 0;
}

// The work counters (Team.next) a linear takes: one a part.
static int64_t linear_ops(const LoomLinearQ8 *W)
{
    return W->kind == LOOM_LINEAR_PARTS ? W->num_parts : 1;
}

// Whether a linear runs an int8-grid kernel (whose team form past 8 rows is the bf16 one's).
static int has_q8(const LoomLinearQ8 *W)
{
    if (W->kind == LOOM_LINEAR_Q8) return 1;
    for (int64_t i = 0; W->kind == LOOM_LINEAR_PARTS && i < W->num_parts; i++)
        if (W->parts[i].kind == LOOM_LINEAR_Q8) return 1;
    return 0;
}

// Whether a linear runs the K-quant kernel (whose team form past 8 rows is the GEMM's).
static int has_kq(const LoomLinearQ8 *W)
{
    if (W->kind == LOOM_LINEAR_KQ) return 1;
    for (int64_t i = 0; W->kind == LOOM_LINEAR_PARTS && i < W->num_parts; i++)
        if (W->parts[i].kind == LOOM_LINEAR_KQ) return 1;
    return 0;
}

// Whether a team runs linears of these kinds (q8: with int8-grid parts, kq: with K-quant ones)
// past loom_linear_q8_direct_rows rows on `kernel`: int8-grid parts only on the bf16 batch
// kernel, K-quant ones only on linear_kq_gemm.c's (the integer kernel's team form takes up to 8).
static int team_past_few(int q8, int kq, int kernel)
{
    return (!q8 || ((kernel & 3) == 2 && loom_bf16_available())) && (!kq || (kernel & KQ_GEMM));
}

// A layer's linears one by one (i below layer_linears(L)), each with its K: qkv, o (a mixer's
// in_proj, out_proj), then the dense MLP's gate_up and down, or the router, each expert's pair
// and the shared expert's three (gate_up, down, its gate); then attention's output gate.
static int64_t layer_linears(const LoomLayerQ8 *L)
{
    const LoomMoeQ8 *X = L->moe;
    const int64_t shared = !X || !X->shared_inter ? 0 : X->shared_gate.w ? 3 : 2;
    const int64_t mix = L->block == LOOM_BLOCK_MLP ? 0 : 2;
    const int64_t mlp = L->block == LOOM_BLOCK_MIX ? 0 : X ? 1 + 2 * X->num_experts + shared : 2;
    return mix + mlp + (L->gate != NULL);
}

static const LoomLinearQ8 *layer_linear(const Step *s, const LoomLayerQ8 *L, int64_t i,
                                        int64_t *K)
{
    const LoomMoeQ8 *X = L->moe;
    const LoomMixerQ8 *R = L->mixer;
    if (L->gate && i == layer_linears(L) - 1) {
        *K = s->H;
        return L->gate;
    }
    if (L->block == LOOM_BLOCK_MLP) i += 2;  // (no attention, no mixer)
    *K = i == 1 ? (R ? R->out_k : s->q_n) : s->H;
    if (i < 2) return R ? (i == 0 ? &R->in_proj : &R->out_proj) : i == 0 ? &L->qkv : &L->o;
    if (!X) {
        if (i == 3) *K = s->I;
        return i == 2 ? &L->gu : &L->d;
    }
    if (i == 2) return &X->router;
    if ((i -= 3) < 2 * X->num_experts) {
        if (i % 2) *K = X->inter;
        return i % 2 ? &X->d[i / 2] : &X->gu[i / 2];
    }
    i -= 2 * X->num_experts;
    if (i == 1) *K = X->shared_inter;
    return i == 0 ? &X->shared_gu : i == 1 ? &X->shared_d : &X->shared_gate;
}

static int check_step(const Step *s)
{
    for (int64_t l = 0; l < s->num_layers; l++)
        for (int64_t i = 0, K; i < layer_linears(&s->layers[l]); i++) {
            const LoomLinearQ8 *W = layer_linear(s, &s->layers[l], i, &K);  // then K is set
            if (check_linear(W, K)) return -1;
        }
    return loom_paged_attention_check(s->tiles, s->num_tiles, s->num_heads, s->kv_heads, s->D,
                                      s->kv_type);
}

// The step's inputs the kernels read unchecked: -4 for a position past the rotary table, -5
// for a token id outside the embedding table, -6 for kept rows not ascending within the step or
// a head row outside them (the step's rows without `keep`).
static int check_inputs(const Step *s, const LoomEmbedQ8 *embed, const LoomHeadQ8 *head)
{
    int64_t rope_rows = INT64_MAX;  // the shortest of the layers' tables
    for (int64_t l = 0; l < s->num_layers; l++) {
        const LoomMoeQ8 *X = s->layers[l].moe;
        const LoomMixerQ8 *R = s->layers[l].mixer;
        if (s->layers[l].rope_rows < rope_rows) rope_rows = s->layers[l].rope_rows;
        if (X && (!X->buf || s->M > X->max_rows || X->top_k < 1 || X->top_k > X->num_experts))
            return -1;  // its scratch too small, or a bad top_k
        if (R && (!s->state_slots || (R->kind != LOOM_MIXER_SHORTCONV &&
                                      (!R->scratch || s->M > R->max_rows))
                  || (R->record && s->M > R->record_rows)))
            return -1;  // no slots, or its scratch or record too small
    }
    for (int64_t t = 0; t < s->M; t++) {
        if (s->positions[t] < 0 || s->positions[t] >= rope_rows) return -4;
        if (embed && (embed->ids[t] < 0 || embed->ids[t] >= embed->vocab)) return -5;
    }
    for (int64_t r = 0; s->keep && r < s->num_keep; r++)
        if (s->keep[r] < (r ? s->keep[r - 1] + 1 : 0) || s->keep[r] >= s->M) return -6;
    const int64_t rows = s->keep ? s->num_keep : s->M;  // what the head's rows index
    for (int64_t r = 0; head && r < head->num_rows; r++)
        if (head->rows[r] < 0 || head->rows[r] >= rows) return -6;
    if (head && head->num_rows && check_linear(&head->w, s->H)) return -1;
    return 0;
}

// loom_decoder_forward_q8 once its tiles are made.
static int run_step(const Step s, const LoomEmbedQ8 *embed, const float *final_norm,
                    const LoomHeadQ8 *head)
{
    const int64_t M = s.M, H = s.H, I = s.I;
    const int nt = s.nt, kernel = s.kernel;
    int rc;
    if ((rc = check_inputs(&s, embed, head))) return rc;
    if (embed) embed_rows(embed, M, H, s.hidden);
    memcpy(s.buf_h, s.hidden, (size_t)(M * H) * sizeof(float));
    if (s.layers[0].in_norm)  // (none: OLMo 2's layers read the embeddings as they are)
        loom_add_rms_norm_f32(s.buf_h, NULL, s.layers[0].in_norm, M, H, s.eps, nt);
    const int few = loom_linear_q8_direct_rows;
    int64_t ops = 0;  // the team's work counters: one an op (a linear's: one a part)
    int kq = 0, q8 = 0;  // the layers' kinds
    int64_t k_max = H > I ? (H > s.q_n ? H : s.q_n) : (I > s.q_n ? I : s.q_n);
    for (int64_t l = 0; l < s.num_layers; l++) {
        ops += 1;  // attention
        for (int64_t i = 0, K; i < layer_linears(&s.layers[l]); i++) {
            const LoomLinearQ8 *W = layer_linear(&s, &s.layers[l], i, &K);
            ops += linear_ops(W);
            kq |= has_kq(W);
            q8 |= has_q8(W);
            k_max = K > k_max ? K : k_max;
        }
    }
    ops += head ? linear_ops(&head->w) : 1;
    // a team past `few` rows: the layers' linears, and the head's past `few` rows of its own
    const int head_q8 = head && has_q8(&head->w), head_kq = head && has_kq(&head->w);
    const int head_many = head && head->num_rows > few;
    const int many = M > few && team_past_few(q8, kq, kernel) &&
                     (!head_many || team_past_few(head_q8, head_kq, (int)head->kernel));
    const int q8_many = many && (q8 || (head_many && head_q8));  // int8-grid parts past few
    kq |= head_kq;
    if ((M <= few || many) && nt > 1) {
        if ((rc = check_step(&s))) return rc;
        int64_t *next = calloc((size_t)ops, sizeof(int64_t));
        Step shared = s;
        if (many) {  // x in bf16 for int8-grid parts, as the K-quant GEMM reads it for others
            int64_t xb = M * k_max * (int64_t)sizeof(uint16_t);
            if (kq && loom_kq_gemm_x_bytes(M, k_max) > xb) xb = loom_kq_gemm_x_bytes(M, k_max);
            shared.buf_xb = aligned_alloc(64, (size_t)(xb + 63) / 64 * 64);
        }
        if (!next || (many && !shared.buf_xb)) {
            free(next);
            free(shared.buf_xb);
            return -2;
        }
        Barrier bar = {0, 0, 0};
        int no_vnni = 0, no_mem = 0;  // a thread could not reserve its buffers
        const int vnni = (kernel & 4) || (head && (head->kernel & 4));
#pragma omp parallel num_threads(nt)
        {
            Team t = {omp_get_thread_num(), omp_get_num_threads(), &bar, next};
            if (vnni && loom_linear_q8_vnni_reserve(k_max))  // each thread's x buffer
                __atomic_store_n(&no_vnni, 1, __ATOMIC_RELAXED);
            // each thread's block buffer, for int8-grid parts past 8 rows (only the bf16
            // kernel has their team form; K-quant-only steps also run in fp32 builds)
            if (q8_many && loom_linear_q8_bf16_reserve(k_max))
                __atomic_store_n(&no_mem, 1, __ATOMIC_RELAXED);
            if (kq && loom_linear_kq_reserve(k_max))  // each thread's quantized x buffer
                __atomic_store_n(&no_mem, 1, __ATOMIC_RELAXED);
            if (kq && many && loom_linear_kq_gemm_reserve())  // ... and panel buffer
                __atomic_store_n(&no_mem, 1, __ATOMIC_RELAXED);
            Step own = shared;
            LoomHeadQ8 own_head = head ? *head : (LoomHeadQ8){0};
            if (vnni || many || kq) {  // all threads or none
                barrier_wait(&bar, t.team);
                if (__atomic_load_n(&no_vnni, __ATOMIC_RELAXED)) {  // the AVX kernel
                    own.kernel &= ~4;
                    own_head.kernel &= ~4;
                }
            }
            if (!__atomic_load_n(&no_mem, __ATOMIC_RELAXED)) {
                run_layers(&own, &t);
                finish(&own, &t, final_norm, head ? &own_head : NULL);
            }
        }
        free(next);
        free(shared.buf_xb);
        return no_mem ? -2 : 0;
    }
    Step own = s;
    if ((rc = run_layers(&own, NULL))) return rc;
    return finish(&own, NULL, final_norm, head);
}

// hidden [M, H]: the embeddings in (or, with `embed`, looked up here), the residual stream
// after. Returns the final-normed hidden states in buf_h [M, H] and, with `head`, the logits of
// its rows. With `keep` (num_keep ascending rows; NULL: all), the last layer's MLP, the final
// norm and the head run on those rows only (llama.cpp's output rows): buf_h [num_keep, H] holds
// their states and the head's rows index them. Scratch: buf_qkv [M, (heads + 2 kv_heads) D],
// buf_attn [M, heads D], buf_gu [M, 2 I], buf_act [M, I] (a hybrid's: buf_qkv as wide as its
// mixers' in_proj too, buf_attn as their out_proj's inputs, buf_gu as heads D where attention
// has an output gate). kv_type: what the caches hold (0 fp32, 1 fp16, 2 int8). Request r owns
// tokens query_start_loc[r] .. query_start_loc[r + 1] - 1; attention runs in tiles of at most
// tile_tokens of one request's tokens. state_slots [num_reqs]: each request's state slot, for
// layers with a mixer (whose decode steps run each request's rows one after another: steps of
// a few tokens a request). Returns 0; -7 for tokens that do not add up to M, check_inputs'
// errors (nothing written either way); or the first kernel's error.
//
// The whole stack, and the head, runs in one OpenMP region instead of one per op: the linears
// and the attention share their work out from counters (loom_linear_q8_team or
// loom_linear_q8_vnni_team up to loom_linear_q8_direct_rows rows, loom_linear_q8_bf16_team past
// that; K-quant ones loom_linear_kq_team, then loom_linear_kq_gemm_team; and
// loom_paged_attention_team), the small elementwise ops run on thread 0 at few rows and on each
// thread's share of the rows past SPLIT_ROWS, and a barrier separates dependent ops. Past the
// few rows int8-grid linears have a team form only on the bf16 batch kernel and K-quant ones
// only on linear_kq_gemm.c's (team_past_few): otherwise such steps (prompts, many streams) run
// op by op. The same kernels on the same values in the same order: the same bits either way.
int loom_decoder_forward_q8(
    const LoomLayerQ8 *layers, int64_t num_layers, const float *final_norm, int64_t H, int64_t I,
    int64_t num_heads, int64_t kv_heads, int64_t D, int64_t block_size, float eps,
    const LoomEmbedQ8 *embed, int64_t M, float *hidden, const int64_t *positions,
    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
    const int64_t *query_start_loc, int64_t num_reqs, int64_t tile_tokens, float *buf_h,
    float *buf_qkv, float *buf_attn, float *buf_gu, float *buf_act, const LoomHeadQ8 *head,
    const int64_t *keep, int64_t num_keep, const int64_t *state_slots, int nt, int kv_type,
    int kernel)
{
    if (query_start_loc[num_reqs] != M) return -7;
    int64_t *tiles = malloc((size_t)(M > 0 ? M : 1) * 3 * sizeof(int64_t));  // <= a token each
    if (!tiles) return -2;
    const int64_t num_tiles = loom_attention_tiles(query_start_loc, num_reqs, tile_tokens, tiles);
    if (num_tiles < 0) {
        free(tiles);
        return -7;
    }
    const Step s = {
        layers, num_layers, H, I, num_heads, kv_heads, D, block_size, M, max_blocks, num_tiles,
        (num_heads + 2 * kv_heads) * D, num_heads * D, eps,
        hidden, buf_h, buf_qkv, buf_attn, buf_gu, buf_act, NULL, positions, slots, block_tables,
        tiles, keep, num_keep, state_slots, query_start_loc, num_reqs,
        nt, kv_type, kernel,
    };
    const int rc = run_step(s, embed, final_norm, head);
    free(tiles);
    return rc;
}
