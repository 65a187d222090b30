// A whole Llama-family decoder stack in one call, for int8 weights on the CPU in fp32: the
// same kernels, in the same order, as the per-module torch path (loom/models/llama.py), so the
// bits are the same; what goes is Python's dispatch between ~10 kernels in each of ~30 layers
// (at one stream, most of a step's time outside the matmuls).

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

typedef struct {
    const float *in_norm, *post_norm;
    const uint8_t *qkv_w; const float *qkv_s, *qkv_m, *qkv_b;  // qkv_b: NULL without bias
    const uint8_t *o_w; const float *o_s, *o_m;
    const uint8_t *gu_w; const float *gu_s, *gu_m;
    const uint8_t *d_w; const float *d_s, *d_m;
    void *k_cache, *v_cache;
    int64_t window;  // sliding window, 0 for none
    int64_t qkv_bits, o_bits, gu_bits, d_bits;  // bits per stored weight: 8 or 4
} LoomLayerQ8;

int loom_linear_q8_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads);
void loom_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t n, int64_t d,
                           float eps, int num_threads);
void loom_silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d, int num_threads);
void loom_rope_write_kv_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads,
                            int64_t kv_heads, int64_t D, const float *table,
                            const int64_t *positions, const int64_t *slots, void *k_cache,
                            void *v_cache, int num_threads, int kv_type);
void loom_linear_q8_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         const float *scales, const float *mins, const float *bias, int64_t N,
                         float *y, int64_t ldy, int bits, int64_t *next, int team);
extern const int loom_linear_q8_direct_rows;
int loom_paged_attention_check(const int64_t *tiles, int64_t num_tiles, int64_t num_heads,
                               int64_t kv_heads, int64_t head_dim, int kv_type);
void loom_paged_attention_team(
    const float *q, int64_t q_tok_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t max_blocks, const int64_t *positions,
    const int64_t *tiles, int64_t num_tiles, int64_t num_heads, int64_t kv_heads,
    int64_t head_dim, int64_t block_size, int64_t window, float scale, int kv_type, float *out,
    int64_t *next);
int loom_paged_attention_f32(const float *q, int64_t q_tok_stride, const void *k_cache,
                             const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *positions, const int64_t *tiles, int64_t num_tiles,
                             int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t window, float scale, int num_threads,
                             int kv_type, float *out);

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

// Few rows (decode of up to loom_linear_q8_direct_rows streams): one OpenMP region for the
// whole stack instead of one per op. The linears and the attention share their work out from
// counters (loom_linear_q8_team, loom_paged_attention_team), the small elementwise ops (serial
// at this size in the per-op path too) run on thread 0, and a barrier separates dependent ops.
// The same kernels on the same values in the same order: the same bits as the per-op path.
static int forward_team(
    const LoomLayerQ8 *layers, int64_t num_layers, const float *final_norm, int64_t H, int64_t I,
    int64_t num_heads, int64_t kv_heads, int64_t D, int64_t block_size, float eps, float scale,
    const float *rope_table, int64_t M, float *hidden, const int64_t *positions,
    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles,
    int64_t num_tiles, float *buf_h, float *buf_qkv, float *buf_attn, float *buf_gu,
    float *buf_act, int nt, int kv_type)
{
    const int64_t qkv_n = (num_heads + 2 * kv_heads) * D, q_n = num_heads * D;
    if (H % 32 || I % 32 || q_n % 32 || H <= 0 || I <= 0) return -1;  // the linears' K
    for (int64_t l = 0; l < num_layers; l++) {
        const LoomLayerQ8 *L = &layers[l];
        const int64_t bits[4] = {L->qkv_bits, L->o_bits, L->gu_bits, L->d_bits};
        for (int j = 0; j < 4; j++)
            if (bits[j] != 8 && bits[j] != 4) return -1;
    }
    int rc = loom_paged_attention_check(tiles, num_tiles, num_heads, kv_heads, D, kv_type);
    if (rc) return rc;
    int64_t *next = calloc((size_t)num_layers * 5, sizeof(int64_t));  // one counter an op
    if (!next) return -2;
    Barrier bar = {0, 0, 0};
    memcpy(buf_h, hidden, (size_t)(M * H) * sizeof(float));
    loom_add_rms_norm_f32(buf_h, NULL, layers[0].in_norm, M, H, eps, 1);
#pragma omp parallel num_threads(nt)
    {
        const int tid = omp_get_thread_num(), team = omp_get_num_threads();
        for (int64_t l = 0; l < num_layers; l++) {
            const LoomLayerQ8 *L = &layers[l];
            int64_t *at = next + l * 5;
            if (l > 0) {
                if (tid == 0) loom_add_rms_norm_f32(buf_h, hidden, L->in_norm, M, H, eps, 1);
                barrier_wait(&bar, team);
            }
            loom_linear_q8_team(buf_h, M, H, H, L->qkv_w, L->qkv_s, L->qkv_m, L->qkv_b, qkv_n,
                                buf_qkv, qkv_n, (int)L->qkv_bits, at, team);
            barrier_wait(&bar, team);
            if (tid == 0)
                loom_rope_write_kv_f32(buf_qkv, qkv_n, M, num_heads, kv_heads, D, rope_table,
                                       positions, slots, L->k_cache, L->v_cache, 1, kv_type);
            barrier_wait(&bar, team);
            loom_paged_attention_team(buf_qkv, qkv_n, L->k_cache, L->v_cache, block_tables,
                                      max_blocks, positions, tiles, num_tiles, num_heads,
                                      kv_heads, D, block_size, L->window, scale, kv_type,
                                      buf_attn, at + 1);
            barrier_wait(&bar, team);
            loom_linear_q8_team(buf_attn, M, q_n, q_n, L->o_w, L->o_s, L->o_m, NULL, H, buf_h, H,
                                (int)L->o_bits, at + 2, team);
            barrier_wait(&bar, team);
            if (tid == 0) loom_add_rms_norm_f32(buf_h, hidden, L->post_norm, M, H, eps, 1);
            barrier_wait(&bar, team);
            loom_linear_q8_team(buf_h, M, H, H, L->gu_w, L->gu_s, L->gu_m, NULL, 2 * I, buf_gu,
                                2 * I, (int)L->gu_bits, at + 3, team);
            barrier_wait(&bar, team);
            if (tid == 0) loom_silu_mul_f32(buf_gu, buf_act, M, I, 1);
            barrier_wait(&bar, team);
            loom_linear_q8_team(buf_act, M, I, I, L->d_w, L->d_s, L->d_m, NULL, H, buf_h, H,
                                (int)L->d_bits, at + 4, team);
            barrier_wait(&bar, team);
        }
    }
    free(next);
    loom_add_rms_norm_f32(buf_h, hidden, final_norm, M, H, eps, 1);
    return 0;
}

// hidden [M, H]: the embeddings in, the residual stream after. Returns the final-normed hidden
// states in buf_h [M, H]. Scratch: buf_qkv [M, (heads + 2 kv_heads) D], buf_attn [M, heads D],
// buf_gu [M, 2 I], buf_act [M, I]. kv_type: what the caches hold (0 fp32, 1 fp16, 2 int8).
// Returns 0, or the first kernel's error.
int loom_llama_forward_q8(
    const LoomLayerQ8 *layers, int64_t num_layers, const float *final_norm, int64_t H, int64_t I,
    int64_t num_heads, int64_t kv_heads, int64_t D, int64_t block_size, float eps, float scale,
    const float *rope_table, int64_t M, float *hidden, const int64_t *positions,
    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles,
    int64_t num_tiles, float *buf_h, float *buf_qkv, float *buf_attn, float *buf_gu,
    float *buf_act, int nt, int kv_type)
{
    if (M <= loom_linear_q8_direct_rows && nt > 1)
        return forward_team(layers, num_layers, final_norm, H, I, num_heads, kv_heads, D,
                            block_size, eps, scale, rope_table, M, hidden, positions, slots,
                            block_tables, max_blocks, tiles, num_tiles, buf_h, buf_qkv, buf_attn,
                            buf_gu, buf_act, nt, kv_type);
    const int64_t qkv_n = (num_heads + 2 * kv_heads) * D, q_n = num_heads * D;
    int rc;
    memcpy(buf_h, hidden, (size_t)(M * H) * sizeof(float));
    loom_add_rms_norm_f32(buf_h, NULL, layers[0].in_norm, M, H, eps, nt);
    for (int64_t l = 0; l < num_layers; l++) {
        const LoomLayerQ8 *L = &layers[l];
        if (l > 0)  // hidden += the last MLP's output; buf_h = norm(hidden)
            loom_add_rms_norm_f32(buf_h, hidden, L->in_norm, M, H, eps, nt);
        if ((rc = loom_linear_q8_f32(buf_h, M, H, H, L->qkv_w, L->qkv_s, L->qkv_m, L->qkv_b,
                                     qkv_n, buf_qkv, qkv_n, (int)L->qkv_bits, nt)))
            return rc;
        loom_rope_write_kv_f32(buf_qkv, qkv_n, M, num_heads, kv_heads, D, rope_table, positions,
                               slots, L->k_cache, L->v_cache, nt, kv_type);
        if ((rc = loom_paged_attention_f32(buf_qkv, qkv_n, L->k_cache, L->v_cache, block_tables,
                                           max_blocks, positions, tiles, num_tiles, num_heads,
                                           kv_heads, D, block_size, L->window, scale, nt,
                                           kv_type, buf_attn)))
            return rc;
        if ((rc = loom_linear_q8_f32(buf_attn, M, q_n, q_n, L->o_w, L->o_s, L->o_m, NULL, H,
                                     buf_h, H, (int)L->o_bits, nt)))
            return rc;
        loom_add_rms_norm_f32(buf_h, hidden, L->post_norm, M, H, eps, nt);
        if ((rc = loom_linear_q8_f32(buf_h, M, H, H, L->gu_w, L->gu_s, L->gu_m, NULL, 2 * I,
                                     buf_gu, 2 * I, (int)L->gu_bits, nt)))
            return rc;
        loom_silu_mul_f32(buf_gu, buf_act, M, I, nt);
        if ((rc = loom_linear_q8_f32(buf_act, M, I, I, L->d_w, L->d_s, L->d_m, NULL, H, buf_h,
                                     H, (int)L->d_bits, nt)))
            return rc;
    }
    loom_add_rms_norm_f32(buf_h, hidden, final_norm, M, H, eps, nt);
    return 0;
}
