// Loom's C kernel ABI: every function the shared object exports and the structs the sources
// and the Python ctypes bindings (loom/kernels/__init__.py SIGNATURES, loom/models/q8_decoder.py)
// share. Every csrc/*.c includes it, so a prototype that drifts from its definition is a
// compile error. Conventions: row-major fp32 activations, int64_t sizes and strides, `nt` /
// `num_threads` the OpenMP team size; a `*_team` form runs inside a caller's parallel region
// and takes its work from the shared counter `next` (one counter an op, zeroed by the caller).
// Return codes: 0 done, negative an error (nothing written unless said otherwise).

#ifndef LOOM_H
#define LOOM_H

#include <stddef.h>
#include <stdint.h>

// What a KV cache holds (loom/worker/kv_cache.py; loom.kernels.KV_TYPES): fp32, fp16, or int8
// rows of each head's D uint8 values then D / 32 fp32 scales and D / 32 fp32 minimums.
enum { LOOM_KV_F32 = 0, LOOM_KV_F16 = 1, LOOM_KV_INT8 = 2 };

// ---- paged attention (paged_attention.c) -------------------------------------------------

// Cuts each request's query tokens (query_start_loc [num_reqs + 1]) into runs of at most
// `tokens`: tiles [n, 3] (request, first token, number of tokens). Returns n, or -1.
int64_t loom_attention_tiles(const int64_t *query_start_loc, int64_t num_reqs, int64_t tokens,
                             int64_t *tiles);
int loom_paged_attention_check(const int64_t *tiles, int64_t num_tiles, int64_t num_heads,
                               int64_t kv_heads, int64_t head_dim, int kv_type);
// q[t, head, d] at q + t * q_tok_stride + head * D + d; caches [num_blocks, block_size,
// kv_heads, D] each; block_tables [num_reqs, max_blocks]; positions [num_tokens]; window 0 for
// none; softcap: scores s -> softcap * tanh(s / softcap) before the softmax, 0 for none.
int loom_paged_attention_f32(const float *q, int64_t q_tok_stride, const void *k_cache,
                             const void *v_cache, const int64_t *block_tables, int64_t max_blocks,
                             const int64_t *positions, const int64_t *tiles, int64_t num_tiles,
                             int64_t num_heads, int64_t kv_heads, int64_t head_dim,
                             int64_t block_size, int64_t window, float scale, float softcap,
                             int num_threads, int kv_type, float *out);
void loom_paged_attention_team(const float *q, int64_t q_tok_stride, const void *k_cache,
                               const void *v_cache, const int64_t *block_tables,
                               int64_t max_blocks, const int64_t *positions,
                               const int64_t *tiles, int64_t num_tiles, int64_t num_heads,
                               int64_t kv_heads, int64_t head_dim, int64_t block_size,
                               int64_t window, float scale, float softcap, int kv_type,
                               float *out, int64_t *next, int team);

// ---- elementwise layer ops (layer_ops.c) -------------------------------------------------

// x = rms_norm(x + residual) * weight, residual = x + residual (residual NULL: norm alone; weight
// NULL: no norm, x = x + residual), in place over n rows of d.
void loom_add_rms_norm_f32(float *x, float *residual, const float *weight, int64_t n, int64_t d,
                           float eps, int num_threads);
// out [n, d] = silu(gate) * up of gate_up [n, 2 d].
void loom_silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d, int num_threads);
// x [n, d] *= sigmoid(g [n, d]), elementwise.
void loom_sigmoid_mul_f32(float *x, const float *g, int64_t n, int64_t d, int num_threads);
// Rotates q and k in place in qkv [n, stride] (heads side by side: num_heads q, kv_heads k,
// kv_heads v, each D wide) by table rows [positions] ([cos, cos, -sin, sin] each D / 2), then
// writes k and v to the caches at `slots`.
void loom_rope_write_kv_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads,
                            int64_t kv_heads, int64_t D, const float *table,
                            const int64_t *positions, const int64_t *slots, void *k_cache,
                            void *v_cache, int num_threads, int kv_type);

// ---- elementwise ops of other architectures (norm_act.c) ------------------------------------

// In place: each head of q and k in qkv [n, stride] (num_heads q then kv_heads k heads, each D
// wide) = rms_norm(head) * q_weight or k_weight [D].
void loom_qk_norm_f32(float *qkv, int64_t stride, int64_t n, int64_t num_heads, int64_t kv_heads,
                      int64_t D, const float *q_weight, const float *k_weight, float eps,
                      int num_threads);
// out [n, d] = gelu_tanh(gate) * up of gate_up [n, 2 d].
void loom_gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t n, int64_t d,
                            int num_threads);

// ---- greedy argmax (argmax.c) -------------------------------------------------------------

void loom_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out,
                      int num_threads);

// ---- recurrent mixers' decode steps (gated_delta.c, mamba2.c, shortconv.c) ---------------
// Each runs `reqs` requests' rows one after another on their state slots: request r's rows
// [starts[r], starts[r + 1]) of proj and out (starts NULL: row r alone, a decode step).
// `dry` [reqs] (NULL: none): a nonzero request's states are read, never written (a speculative
// verify step's: its rows run on a copy, and a later call with its kept rows commits them);
// a dry request's head state may hold at most LOOM_MIXER_DRY_FLOATS floats (a stack array).
// `out` NULL: the states alone move (no outputs computed).
// Each `*_team` form is called by every thread of a caller's team with the same arguments
// (tid 0..team-1): each phase's items split statically (items [n tid / team, n (tid + 1) /
// team)), `sync(sync_arg)` (the caller's barrier) called by every thread between dependent
// phases and once at the end. A failed check returns the same value in every thread before
// any sync. `scratch` holds the `*_scratch_floats` floats for the call's rows (caller-provided,
// shared by the team). The `*_f32` forms allocate that scratch and run the team form in an
// OpenMP region.
typedef void (*LoomSync)(void *arg);
#define LOOM_MIXER_DRY_FLOATS 65536

// Gated DeltaNet's decode step, in place on the requests' state slots (gated_delta.c); out
// [rows, value_heads * dv]. 0, or -1 with nothing written.
int loom_gdn_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots, int64_t reqs,
                        const int64_t *starts, const int8_t *dry, float *conv_state,
                        const float *conv_w, float *ssm_state, const float *a_log,
                        const float *dt_bias, const float *norm_w, int64_t key_heads,
                        int64_t value_heads, int64_t dk, int64_t dv, int64_t width, int tiled,
                        int chunked, float eps, float *out, int num_threads);
int64_t loom_gdn_scratch_floats(int64_t rows, int64_t key_heads, int64_t value_heads,
                                int64_t dk, int64_t dv);
int loom_gdn_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                         int64_t reqs, const int64_t *starts, const int8_t *dry,
                         float *conv_state, const float *conv_w, float *ssm_state,
                         const float *a_log, const float *dt_bias, const float *norm_w,
                         int64_t key_heads, int64_t value_heads, int64_t dk, int64_t dv,
                         int64_t width, int tiled, int chunked, float eps, float *out,
                         float *scratch, int tid, int team, LoomSync sync, void *sync_arg);
// Mamba2's decode step, in place on the requests' state slots (mamba2.c): proj rows [z | x B C
// | dt], conv_b NULL for none, dt clamped to [dt_min, dt_max] (dt_max may be +inf), a head's
// state [state_size, head_dim], `chunked` as Gated DeltaNet's; out [rows, heads * head_dim].
// 0, or -1 with nothing written.
int loom_mamba2_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots,
                           int64_t reqs, const int64_t *starts, const int8_t *dry,
                           float *conv_state, const float *conv_w, const float *conv_b,
                           float *ssm_state, const float *dt_bias, const float *a_log,
                           const float *d, const float *norm_w, int64_t heads,
                           int64_t head_dim, int64_t groups, int64_t state_size, int64_t width,
                           int64_t norm_groups, int chunked, float eps, float dt_min,
                           float dt_max, float *out, int num_threads);
int64_t loom_mamba2_scratch_floats(int64_t rows, int64_t heads, int64_t head_dim,
                                   int64_t groups, int64_t state_size);
int loom_mamba2_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                            int64_t reqs, const int64_t *starts, const int8_t *dry,
                            float *conv_state, const float *conv_w, const float *conv_b,
                            float *ssm_state, const float *dt_bias, const float *a_log,
                            const float *d, const float *norm_w, int64_t heads,
                            int64_t head_dim, int64_t groups, int64_t state_size, int64_t width,
                            int64_t norm_groups, int chunked, float eps, float dt_min,
                            float dt_max, float *out, float *scratch, int tid, int team,
                            LoomSync sync, void *sync_arg);
// LFM2's short convolution's decode step (shortconv.c): proj rows [b | c | h] (H each),
// window_state [slots, H, width - 1] (oldest first), conv_w [H, width], conv_b [H] or NULL;
// out [rows, H] = c * (conv(b * h) + conv_b). No scratch. 0, or -1 with nothing written.
int loom_shortconv_decode_f32(const float *proj, int64_t proj_ld, const int64_t *slots,
                              int64_t reqs, const int64_t *starts, const int8_t *dry,
                              float *window_state, const float *conv_w, const float *conv_b,
                              int64_t H, int64_t width, float *out, int num_threads);
int loom_shortconv_decode_team(const float *proj, int64_t proj_ld, const int64_t *slots,
                               int64_t reqs, const int64_t *starts, const int8_t *dry,
                               float *window_state, const float *conv_w, const float *conv_b,
                               int64_t H, int64_t width, float *out, int tid, int team,
                               LoomSync sync, void *sync_arg);

// ---- int8-grid linears: y [M, N] = x [M, K] W^T (+ bias) ------------------------------------
// W on an 8-bit grid in groups of 32 along K, each group's fp32 scale and minimum ([N, K / 32]):
// w = q * scale + min; `bits` 8 (a byte a weight) or 4 (two a byte, GGUF's nibble order), or
// 4 | LOOM_Q8_LEVELS: two a byte, each nibble i standing for q = loom_iq4_q[i] (IQ4_NL's 16
// levels + 128: IQ4_NL and IQ4_XS files at 4 bits a weight, their minimums -128 scale), then
// as an 8-bit q in every kernel; or 5 (LOOM_Q8_Q5: Q5_0 and Q5_1 files, q 0..31): a row is K / 2
// bytes of its values' low nibbles as `bits` 4 holds them, then K / 8 bytes of fifth bits,
// group g's a little-endian 32-bit word at K / 2 + 4 g whose bit j adds 16 to value j (GGUF's
// qh as stored; loom_q5_high).
#define LOOM_Q8_LEVELS 0x100
#define LOOM_Q8_Q5 5
#define LOOM_Q8_WIDTH(bits) ((bits) & 0xFF)  // bits a stored weight: 8, 5 or 4
static const uint8_t loom_iq4_q[16] = {1,   24,  45,  63,  79,  93,  106, 118,  // ggml's
                                       129, 141, 153, 166, 181, 197, 217, 241};  // + 128
// The zero point of symmetric groups of `bits` (a file's Q4_0, Q5_0 and Q8_0 blocks, IQ4_NL
// and IQ4_XS, whose every minimum is -zero x its scale): 8 at bits 4, 16 at LOOM_Q8_Q5, 128 at
// 8 and for the IQ4 levels (Python's loom.quant.int8.ZERO).
static inline int loom_q8_zero(int bits) { return bits == 4 ? 8 : bits == LOOM_Q8_Q5 ? 16 : 128; }

// Group `at`'s minimum: mins[at], or with mins NULL (symmetric groups: the loader keeps no fp32
// minimums for them) -zero x scales[at], the float loom_q8_blocks_grid would have stored.
static inline float loom_q8_min(const float *mins, const float *scales, int64_t at, int bits)
{
    return mins ? mins[at] : -(float)loom_q8_zero(bits) * scales[at];
}

// The fifth bits of group g of a LOOM_Q8_Q5 row q of K weights.
static inline uint32_t loom_q5_high(const uint8_t *q, int64_t K, int64_t g)
{
    uint32_t h;
    __builtin_memcpy(&h, q + K / 2 + 4 * g, 4);
    return h;
}

extern const int loom_linear_q8_direct_rows;  // the most rows the direct (decode) path takes
int loom_linear_q8_check(int64_t K, int bits);
int loom_linear_q8_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads);
void loom_linear_q8_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         const float *scales, const float *mins, const float *bias, int64_t N,
                         float *y, int64_t ldy, int bits, int64_t *next, int team);
// Past 8 rows on AVX2 int16 dot products (linear_kq_gemm.c: each super-block of 256 weights
// rounded to 13-bit integers once a call, x to 15 bits a super-block; loom_linear_q8_f32 up
// to 8 rows): loom_linear_q8_f32's arguments and returns, -3 in builds without it
// (loom_i16_available). A row's bits do not depend on its batch, but differ from the fp32 ones.
int loom_linear_q8_i16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads);
int loom_i16_available(void);
// The quantizer: each group of 32 of w [N, K] -> q, scale, min (torch's Q8Groups, same bytes).
void loom_quantize_q8_group(const float *src, uint8_t *q, float *scale, float *min);
void loom_quantize_q8(const float *w, int64_t N, int64_t K, uint8_t *q, float *scales,
                      float *mins, int num_threads);
// GGUF's 32-wide block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and IQ4_XS (ggml's type
// ids) onto the grid exactly, a group of 32 a block or sub-block; Q5_0 / Q5_1 in rows of
// row_groups groups, LOOM_Q8_Q5 (row_groups 0: a byte a weight); -1 for another type.
int loom_q8_blocks_grid(const uint8_t *blocks, int64_t n, int type, uint8_t *q, float *scales,
                        float *mins, int64_t row_groups, int num_threads);

// AMX tiles (linear_amx.c); 1 if this process can run them.
int loom_amx_available(void);
int loom_linear_q8_amx(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                       const float *scales, const float *mins, const float *bias, int64_t N,
                       float *y, int64_t ldy, int bits, int num_threads);

// AVX512-BF16 dot products (linear_bf16.c): x rounded to bf16 once (loom_bf16_rows_team into
// a shared xb [M, K]), each thread's block buffer reserved before a team runs.
int loom_bf16_available(void);
int loom_linear_q8_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        const float *scales, const float *mins, const float *bias, int64_t N,
                        float *y, int64_t ldy, int bits, int num_threads);
int loom_linear_q8_bf16_reserve(int64_t K_max);
void loom_bf16_rows_team(const float *x, int64_t M, int64_t K, int64_t ldx, uint16_t *xb,
                         int tid, int team);
void loom_linear_q8_bf16_team(const uint16_t *xb, int64_t M, int64_t K, const uint8_t *w,
                              const float *scales, const float *mins, const float *bias,
                              int64_t N, float *y, int64_t ldy, int bits, int64_t *next,
                              int team);

// Integer dot products (linear_vnni.c: AVX512-VNNI, AVX2 or AArch64 NEON), up to
// loom_linear_q8_direct_rows rows (any number on AArch64, in chunks): scales and minimums as
// fp16 copies (minimums NULL: -8 (4-bit values) or -128 (8-bit, IQ4) times each scale); each
// thread's x buffer reserved before a team runs.
int loom_vnni_available(void);
int loom_linear_q8_vnni(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        const uint16_t *scales, const uint16_t *mins, const float *bias,
                        int64_t N, float *y, int64_t ldy, int bits, int num_threads);
int loom_linear_q8_vnni_reserve(int64_t K);
void loom_linear_q8_vnni_team(const float *x, int64_t M, int64_t K, int64_t ldx,
                              const uint8_t *w, const uint16_t *scales, const uint16_t *mins,
                              const float *bias, int64_t N, float *y, int64_t ldy, int bits,
                              int64_t *next, int team);

// Shared between the linear sources (not called from Python).
int loom_linear_q8_front(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         const float *scales, const float *mins, const float *bias, int64_t N,
                         float *y, int64_t ldy, int bits, int num_threads);
void *loom_scratch(int which, size_t bytes);
int64_t loom_weight_blocks(int64_t N, int64_t most, int64_t unit, int num_threads, int64_t *rows);
int loom_take_units(int64_t *next, int64_t units, int64_t least, int team, int64_t *u0,
                    int64_t *u1);

// ---- K-quant linears (linear_kquant.c): y [M, N] = x [M, K] W^T (+ bias) -------------------
// W's rows as GGUF stores them: K / 256 super-blocks of `fmt` (ggml's type ids: 10 Q2_K, 11
// Q3_K, 12 Q4_K, 13 Q5_K, 14 Q6_K), rows contiguous. x is quantized once a call (two int8
// digits a run of 16); a row's bits do not depend on the other rows of the call.

// A format or'ed with LOOM_KQ_ONE_DIGIT: x in one int8 digit a run of 16, not two (llama.cpp's
// activations, with a scale a run): fewer instructions, 256 times coarser; below the accuracy
// bar on a real model (docs/kquants.md), so no default runs it. loom_linear_kq's alone: the
// GEMM and the stack refuse it (loom_kq_check takes a format alone).
#define LOOM_KQ_ONE_DIGIT 0x100
// Q4_K | LOOM_KQ_R16: Q4_K rows interleaved 16 at a time (loom_kq_r16_pack; the layout:
// linear_kquant.c), for builds where loom_kq_r16_available(): their integer kernel reads each
// 64 bytes as 8 weights of 16 rows (about half the instructions a weight past one x row); the
// GEMM past LOOM_KQ_R16_INT_ROWS and loom_kq_dequant take them too (the blocks back, the same
// bits). N a multiple of 16.
#define LOOM_KQ_R16 0x200
#define LOOM_KQ_R16_BYTES 2304  // a group's super-block: 16 x 144
// Interleaved Q4_K runs its integer kernel up to this many rows, the GEMM past them (at 16 rows
// the integer kernel took 0.73x the GEMM's time, at 32 0.92x: the GEMM unpacks groups back to
// blocks). loom_linear_kq_reserve reserves this many rows.
#define LOOM_KQ_R16_INT_ROWS 32
static inline int loom_kq_int_rows(int fmt, int64_t M)  // M rows of fmt on the integer kernel
{
    return M <= 8 || ((fmt & LOOM_KQ_R16) && M <= LOOM_KQ_R16_INT_ROWS);
}
int loom_kq_r16_available(void);
void loom_kq_r16_pack(const uint8_t *w, int64_t K, int64_t g0, int64_t g1, uint8_t *out,
                      int num_threads);
void loom_kq_r16_row(const uint8_t *w, int64_t K, int64_t n, int64_t s0, int64_t s1,
                     uint8_t *blocks);
void loom_kq_r16_group(const uint8_t *w, int64_t K, int64_t g, int64_t s0, int64_t s1,
                       uint8_t *out);
int loom_kq_block_bytes(int fmt);  // 0 for a format it does not run
int loom_kq_isa(void);             // 4 AVX512-VNNI, 3 AVX-512 BW, 2 AVX2, 1 NEON dotprod, 0 C
int loom_kq_check(int64_t K, int fmt);
// Rows [n0, n1) as fp32 at out (ldo floats apart): the `gguf` package's values bit for bit.
void loom_kq_dequant(const uint8_t *w, int fmt, int64_t K, int64_t n0, int64_t n1, float *out,
                     int64_t ldo);
// 0; -1 bad K or fmt; -2 no memory for the quantized x.
int loom_linear_kq(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w, int fmt,
                   const float *bias, int64_t N, float *y, int64_t ldy, int num_threads);
int loom_linear_kq_reserve(int64_t K_max);  // in each thread of a team, before the team form
// Up to 8 rows in a thread of a running team (every thread, `next` zeroed): the same bits.
void loom_linear_kq_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                         int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                         int64_t *next, int team);

// Past 8 rows (linear_kq_gemm.c): panels of weight rows unpacked once a call (bf16 with
// AVX512-BF16, int16 with the sub-block scales applied and x in int16 with AVX2, else fp32)
// against all rows; loom_linear_kq's arguments and returns, which it runs up to 8 rows. A row's
// bits do not depend on its batch, but differ from loom_linear_kq's.
int loom_kq_gemm_isa(void);  // 2 AVX512-BF16, 1 AVX2 int16, 0 portable fp32
int loom_linear_kq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                        int fmt, const float *bias, int64_t N, float *y, int64_t ldy,
                        int num_threads);
// The same in a thread of a running team (every thread, `next` zeroed, after the reserve in
// each): x as the tiles read it (loom_kq_gemm_x_team's [M, K] where loom_kq_gemm_x_bytes is not
// 0, a barrier after it; else x), the same bits.
int loom_linear_kq_gemm_reserve(void);
int64_t loom_kq_gemm_x_bytes(int64_t M, int64_t K);
void loom_kq_gemm_x_team(const float *x, int64_t M, int64_t K, int64_t ldx, void *xp, int tid,
                         int team);
void loom_linear_kq_gemm_team(const void *xp, int64_t ldp, int64_t M, int64_t K,
                              const uint8_t *w, int fmt, const float *bias, int64_t N, float *y,
                              int64_t ldy, int64_t *next, int team);

// ---- the decoder stack in one call (decoder_q8.c) ----------------------------------------
// The stack runs a description of the model that the Python model definition builds
// (loom/models/q8_decoder.py from each layer's `stack_parts`): per layer, which optional parts
// it has (NULL: absent) and each part's weights. The C side knows kernels, not architectures.

// What a linear's weights are (the `kind` of LoomLinearQ8); decoder_q8.c's `linear` runs each.
// LOOM_LINEAR_PARTS: a fused linear (qkv, gate_up) whose checkpoint tensors keep different
// formats (a Q4_K_M file's Q4_K q and k beside a Q6_K v): its parts run one after the other,
// each into its own output columns, as loom/quant/kquant.py's KQuantLinear runs them.
// LOOM_LINEAR_F32: fp32 weights as they are (w: float [N, K]; a mixture of experts' router and
// shared-expert gate, which GGUF files keep in F32), on loom_linear_f32.
enum { LOOM_LINEAR_Q8 = 0, LOOM_LINEAR_KQ = 1, LOOM_LINEAR_PARTS = 2, LOOM_LINEAR_F32 = 3 };

// One linear's weights: for LOOM_LINEAR_Q8 the int8 grid, fp32 scales and minimums, and their
// fp16 copies for the VNNI kernel (NULL where unused); for LOOM_LINEAR_KQ the K-quant
// super-blocks as stored (w) and their format in `bits`; for LOOM_LINEAR_PARTS `parts`.
typedef struct LoomLinearQ8 {
    const uint8_t *w;
    const float *s, *m;
    const uint16_t *s16, *m16;  // fp16 copies for the VNNI kernel; m16 NULL: symmetric groups
    int64_t bits;  // Q8: 8, 5, 4 or 4 | LOOM_Q8_LEVELS (above); KQ: the ggml format 10 to 14
    int64_t kind;  // LOOM_LINEAR_*
    // LOOM_LINEAR_PARTS: num_parts parts (each LOOM_LINEAR_Q8 or LOOM_LINEAR_KQ), part i writing
    // output columns [parts[i].n0, parts[i].n0 + parts[i].n) (a bias: the KQ kernel adds its
    // columns' share, a Q8 part's is added after its product, as KQuantLinear.forward does)
    const struct LoomLinearQ8 *parts;
    int64_t num_parts, n0, n;
} LoomLinearQ8;

// The token embeddings, looked up in the call: table [vocab, H] on the int8 grid, then times
// `scale` (1 for none; Gemma's sqrt(H)) as a separate fp32 multiply.
typedef struct {
    LoomLinearQ8 table;
    int64_t vocab;
    const int64_t *ids;  // [M]
    float scale;
} LoomEmbedQ8;

// The output projection of `num_rows` of the M final hidden states, in the same call:
// logits [num_rows, N] = head(final_hidden[rows]).
typedef struct {
    LoomLinearQ8 w;
    int64_t N, num_rows, kernel;  // kernel: the stack's `kernel` code, for this linear
    const int64_t *rows;          // [num_rows], each below M
    float *x;                     // scratch [num_rows, H]: the rows gathered
    float *logits;
} LoomHeadQ8;

// act(gate) * up; LOOM_ACT_RELU2: relu(up)^2, no gate (Nemotron's MLP: gu holds up alone)
enum { LOOM_ACT_SILU = 0, LOOM_ACT_GELU_TANH = 1, LOOM_ACT_RELU2 = 2 };
// A layer's blocks: attention (or a mixer) then an MLP, each after its norm (the others');
// attention or a mixer alone; an MLP alone on the input norm's output (Nemotron-H's)
enum { LOOM_BLOCK_BOTH = 0, LOOM_BLOCK_MIX = 1, LOOM_BLOCK_MLP = 2 };

// A mixture-of-experts MLP (loom/models/moe.py's SparseMoeBlock), in place of a layer's dense
// one: r = softmax(h Wr^T); each token's top_k experts by r (ties: the lower index), their
// weights renormalised to sum 1 where norm_topk; the (token, expert) pairs sorted by expert
// (loom_moe_route_f32); each active expert's gated MLP (the layer's act) over its tokens' rows,
// one product pair an expert; then loom_moe_combine_f32: each token's weighted sum over its
// experts in ascending order, plus sigmoid(h Wsg^T) * the shared expert's MLP where shared_inter.
typedef struct LoomMoeQ8 {
    LoomLinearQ8 router;                     // [num_experts, H]
    const LoomLinearQ8 *gu, *d;              // [num_experts] each: [2 inter, H], [H, inter]
    int64_t num_experts, top_k, norm_topk, inter;
    // [2 shared_inter, H], [H, ..], [1, H] (shared_gate.w NULL: ungated, Granite's)
    LoomLinearQ8 shared_gu, shared_d, shared_gate;
    int64_t shared_inter;                    // 0: no shared expert
    // scratch for up to max_rows tokens, loom_moe_scratch_bytes(max_rows, ...) bytes, 64-aligned
    void *buf;
    int64_t max_rows;
    const float *bias;  // [num_experts]: a sigmoid router's choice bias (LFM2-MoE's); NULL: softmax
    float scale;        // the weights' factor (routed_scaling_factor; 1 for softmax routers)
} LoomMoeQ8;

// A hybrid layer's token mixer with a state per request, run in place of attention on steps
// of a few tokens a request (decode and verify steps; loom/layers/recurrent.py):
//   p = h Win^T (+ in_b);  y = the mixer's decode step (p; each request's rows one after
//   another on its state slot, updated);  a = y Wout^T (+ out_b)
// kind LOOM_MIXER_GDN (Gated DeltaNet: key_heads, value_heads, dk, dv, tiled, conv_w, a_log,
// dt_bias, norm_w), LOOM_MIXER_MAMBA2 (heads = value_heads, head_dim = dv, groups = key_heads,
// state = dk, norm_groups, conv_w, conv_b, dt_bias, a_log, d, norm_w, dt_min, dt_max) or
// LOOM_MIXER_SHORTCONV (conv_w, conv_b). states: [slots, ...] each, as the module keeps them.
// A speculative verify step's: `dry` [requests] (NULL: none) the requests whose states are read
// only, and `record` [record_rows >= M, proj_n] (NULL: none) where p is written and kept for
// the commit.
enum { LOOM_MIXER_GDN = 1, LOOM_MIXER_MAMBA2 = 2, LOOM_MIXER_SHORTCONV = 3 };
typedef struct {
    LoomLinearQ8 in_proj, out_proj;
    const float *in_b, *out_b;    // their biases, or NULL
    int64_t kind, proj_n, out_k;  // in_proj's outputs, out_proj's inputs
    float *conv_state, *ssm_state;
    const float *conv_w, *conv_b, *a_log, *dt_bias, *d, *norm_w;
    int64_t key_heads, value_heads, dk, dv, width, norm_groups, tiled;
    int64_t chunked;  // GDN, Mamba2: prompts' runs of rows in the chunkwise form
    float eps, dt_min, dt_max;
    float *scratch;  // the step's (the *_scratch_floats of its kind, for max_rows rows)
    int64_t max_rows;
    const int8_t *dry;
    float *record;
    int64_t record_rows;
} LoomMixerQ8;

// One decoder layer, in the order it runs:
//   h = in_norm(hidden (+= last output));  qkv = h Wqkv^T (+ qkv_b);
//   [q, k heads = q_norm, k_norm (each head)];  rotate q, k by rope_table; write k, v;
//   a = attention(q; window, scale, softcap) Wo^T;  [a = attn_out_norm(a)];
//   h = mlp_norm(hidden += a);  m = (act(h Wg^T) * h Wu^T) Wd^T;  [m = mlp_out_norm(m)]
// and m is the next layer's (or the final norm's) `last output`. A NULL in_norm or mlp_norm
// is no norm (h = hidden: OLMo 2's layers). A hybrid's layer may run its `mixer` in place of
// qkv .. Wo (decode steps), and `block` may keep one of the two blocks alone (Nemotron-H's:
// attention or the mixer, its output the `last output`; or the MLP on in_norm's h).
typedef struct {
    const float *in_norm, *mlp_norm;            // [H] or NULL
    const float *q_norm, *k_norm;               // [D] each (qk_norm_full: all of q, of k), or NULL
    const float *attn_out_norm, *mlp_out_norm;  // [H] or NULL
    const float *qkv_b;                         // NULL without bias
    const float *rope_table;  // [rope_rows, 2 D]: rows [cos, cos, -sin, sin] (layer_ops.c)
    int64_t rope_rows;
    void *k_cache, *v_cache;
    LoomLinearQ8 qkv, o, gu, d;
    int64_t window;  // sliding window, 0 for none
    float scale;     // of q.k
    float softcap;   // of the scaled scores (cap * tanh(s / cap)), 0 for none
    int32_t act;     // LOOM_ACT_*
    int32_t qk_norm_full;  // q_norm over all of q ([num_heads D]), k_norm all of k (OLMo 2)
    int32_t block;         // LOOM_BLOCK_*
    const LoomMoeQ8 *moe;  // NULL: the dense MLP (gu, d); else this instead
    // attention's output times sigmoid(h Wgate^T) before Wo (Qwen3.5's), or NULL
    const LoomLinearQ8 *gate;
    const LoomMixerQ8 *mixer;  // a hybrid's mixer in place of attention (qkv .. o), or NULL
} LoomLayerQ8;

// Router logits [M, E] (overwritten by the softmax's probabilities; with `bias`, a sigmoid
// router's: by the sigmoid's scores, the top_k chosen by score + bias, LFM2-MoE's) -> each
// token's top_k experts and weights (renormalised where norm_topk: over their sum, + 1e-6 for
// a sigmoid router; times `scale`) as the (token, expert) pairs sorted by expert, tokens
// ascending within one: counts [E], pair_token [M top_k], pair_weight [M top_k], and
// token_pairs [M, top_k] (each token's pairs' positions, ascending: its experts in ascending
// order). Returns 0; -1 for top_k outside 1..E.
int loom_moe_route_f32(float *logits, int64_t M, int64_t E, int64_t top_k, int norm_topk,
                       const float *bias, float scale, int64_t *counts, int64_t *pair_token,
                       float *pair_weight, int64_t *token_pairs);
// out [M, H] = for each token the sum over its pairs p (token_pairs' order) of pair_weight[p]
// * y[p] (y [M top_k, H], a product then a sum each, from 0), then + sigmoid(shared_gate[t])
// (1 where shared_gate is NULL) * shared[t] where shared [M, H] is given.
void loom_moe_combine_f32(const float *y, const float *pair_weight, const int64_t *token_pairs,
                          int64_t M, int64_t top_k, int64_t H, const float *shared,
                          const float *shared_gate, float *out, int num_threads);
// y [M, N] (ldy apart) = x [M, K] W^T for fp32 W [N, K] (few outputs: a router): each output a
// sum over K in 16 lanes, then the lanes in a fixed order: the same bits for a row whatever the
// batch and the threads.
void loom_linear_f32(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y,
                     int64_t ldy, int num_threads);
// The bytes of a LoomMoeQ8's scratch for M tokens (inter: the larger of its experts' and its
// shared expert's widths).
int64_t loom_moe_scratch_bytes(int64_t M, int64_t H, int64_t E, int64_t top_k, int64_t inter);

int loom_decoder_forward_q8(
    const LoomLayerQ8 *layers, int64_t num_layers, const float *final_norm, int64_t H, int64_t I,
    int64_t num_heads, int64_t kv_heads, int64_t D, int64_t block_size, float eps,
    const LoomEmbedQ8 *embed, int64_t M, float *hidden, const int64_t *positions,
    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
    const int64_t *query_start_loc, int64_t num_reqs, int64_t tile_tokens, float *buf_h,
    float *buf_qkv, float *buf_attn, float *buf_gu, float *buf_act, const LoomHeadQ8 *head,
    const int64_t *keep, int64_t num_keep, const int64_t *state_slots, int nt, int kv_type,
    int kernel);

#endif  // LOOM_H
