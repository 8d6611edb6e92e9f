/* One decode step of paged attention for one layer, on the CPU.
 *
 * Each row stores its newest token's K/V at the last position of its block
 * table, then its queries attend to every cached token of its own blocks,
 * read where they lie in the pool. The torch fallback
 * (model_runner.PagedDecodeAttention) needs a dozen small ops per layer around
 * batched per-block matmuls; here every K/V byte is read once, in one pass.
 *
 * Grouped-query attention: query head h uses KV head h / group, where
 * group = heads / kv_heads (transformers' layout). Each KV head's keys and
 * values are read from memory once for the whole group of query heads that
 * share it: the group is looped inside the pass over a block's tokens (16 keys,
 * 4 KiB at head_dim 64, stay in L1 while each head of the group scores them;
 * each value is weighed into every head of the group as it is read), not the
 * tokens once per query head.
 *
 * The pool holds K/V as float32 or as bfloat16 (`pool_bf16`): a bfloat16 model's K/V
 * are bfloat16 values already, so its pool stores them exactly in half the bytes, and
 * decode attention reads half as many. The arithmetic is float32 either way (a
 * bfloat16 value is the upper half of a float32's bits).
 *
 * Layouts (contiguous unless a stride is given):
 *   q                float32 [batch, heads, head_dim], rows `q_stride` floats apart
 *   k_new, v_new     the pool's type [batch, kv_heads, head_dim], rows `kv_stride` apart
 *   k_pool, v_pool   the pool's type [num_blocks, kv_heads, block_size, head_dim] (one layer)
 *   tables           [batch, width] block ids; lengths [batch] tokens incl. the new one
 *   out              float32 [batch, heads, head_dim]
 * Rows are shared among up to `threads` threads of the caller's OpenMP team where the
 * library is built with OpenMP (else, and for a small step, they run on the caller).
 * Returns 0, or -1 when the scratch for the attention weights cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LANES = 16 }; /* partial sums per dot product: one vector register wide */
/* cached tokens in a step below which its rows stay on the calling thread */
enum { MIN_PARALLEL_TOKENS = 256 };
_Static_assert(LANES == 16, "sum_lanes() pairs up 16 vectors of 16 lanes");

/* e^x for the scores less their maximum (x <= 0), in a form the compiler vectorizes
 * (libm's expf is a call per element): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
 * Taylor polynomial to r^6, 2^n from the exponent bits. Relative error under 3e-7;
 * below -87 the result (1.6e-38) stands for 0. */
static inline float exp_nonpositive(float x)
{
    x = x > -87.0f ? x : -87.0f;
    const float shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504f + shift) - shift;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

typedef struct {
    const void *k_pool, *v_pool; /* float32, or bfloat16 where attend's `bf16` is set */
    const int64_t *table;
    int64_t len, block_size, head_stride, block_stride, kv_heads, group;
    float scale;
} Context;

/* GCC's and clang's vector extensions: each target of target_clones lowers them to
 * its own registers (one AVX-512 register, two AVX2 ones, four SSE ones). */
typedef float v16 __attribute__((vector_size(4 * LANES)));
typedef int32_t i16 __attribute__((vector_size(4 * LANES)));
typedef uint32_t u32x16 __attribute__((vector_size(4 * LANES)));
typedef uint16_t u16x16 __attribute__((vector_size(2 * LANES)));
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
/* vectors pass only between static functions, all inlined: no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Element i of a pool, as float32 (`bf16` is a constant wherever this is inlined). */
static inline __attribute__((always_inline)) float pool_at(const void *pool, int64_t i, int bf16)
{
    if (!bf16) return ((const float *)pool)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)pool)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Elements [i, i + LANES) of a pool, as float32. */
static inline __attribute__((always_inline)) v16 pool16(const void *pool, int64_t i, int bf16)
{
    if (!bf16) return load16((const float *)pool + i);
    u16x16 half;
    memcpy(&half, (const uint16_t *)pool + i, sizeof half);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    v16 value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The dot product of a[0, n) and pool[at, at + n), its partial sums, LANES of them,
 * before they are added up. */
static inline __attribute__((always_inline)) v16 partial_dot(const float *a, const void *pool,
                                                             int64_t at, int64_t n, int bf16)
{
    v16 part = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) part += load16(a + d) * pool16(pool, at + d, bf16);
    for (; d < n; d++) part[0] += a[d] * pool_at(pool, at + d, bf16);
    return part;
}

/* Lane t of the result is the sum of p[t]'s lanes: 16 dot products finished with
 * 15 vector adds and 30 shuffles (each halving pairs up two vectors' halves), not
 * 16 reductions across one register's lanes. */
static inline __attribute__((always_inline)) v16 sum_lanes(const v16 p[LANES])
{
    v16 r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; i++)
        r8[i] = SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                        21, 22, 23) +
                SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                        27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r4[i] = SHUFFLE(r8[2 * i], r8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                        24, 25, 26, 27) +
                SHUFFLE(r8[2 * i], r8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                        28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r2[i] = SHUFFLE(r4[2 * i], r4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24,
                        25, 28, 29) +
                SHUFFLE(r4[2 * i], r4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23,
                        26, 27, 30, 31);
    return SHUFFLE(r2[0], r2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(r2[0], r2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* One row: every query head against the row's cached tokens. Block by block, each
 * block's K (then V) for all KV heads is read in one sweep of contiguous memory, and
 * each KV head's part once for the `group` query heads that share it (query head h
 * reads KV head h / group). `weights` holds [heads, len] scores. Always inlined, so
 * a call with a constant head_dim gets fixed-length loops, and one with a constant
 * `bf16` (the pool's type) reads it without a branch. */
static inline __attribute__((always_inline)) void attend(const Context *c, const float *query,
                                                         int64_t head_dim, int bf16,
                                                         float *weights, float *mixed)
{
    const int64_t group = c->group, heads = c->kv_heads * group, len = c->len;
    float top[heads];
    for (int64_t h = 0; h < heads; h++) top[h] = -INFINITY;
    /* block by block (no division per token), LANES tokens at a time */
    for (int64_t start = 0, block = 0; start < len; start += c->block_size, block++) {
        int64_t keys = c->table[block] * c->block_stride; /* in elements of the pool */
        const int64_t end = start + c->block_size < len ? start + c->block_size : len;
        for (int64_t kv = 0; kv < c->kv_heads; kv++, keys += c->head_stride) {
            for (int64_t tile = start; tile < end; tile += LANES) {
                const int64_t count = end - tile < LANES ? end - tile : LANES;
                const int64_t key = keys + (tile - start) * head_dim;
                for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                    v16 parts[LANES] = {{0}};
                    for (int64_t t = 0; t < count; t++)
                        parts[t] = partial_dot(query + h * head_dim, c->k_pool,
                                               key + t * head_dim, head_dim, bf16);
                    const v16 scores = sum_lanes(parts) * c->scale;
                    float *row = weights + h * len + tile;
                    for (int64_t t = 0; t < count; t++) {
                        row[t] = scores[t];
                        top[h] = scores[t] > top[h] ? scores[t] : top[h];
                    }
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *row = weights + h * len, total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            row[t] = exp_nonpositive(row[t] - top[h]);
            total += row[t];
        }
        const float norm = 1.0f / total;
        for (int64_t t = 0; t < len; t++) row[t] *= norm;
    }
    for (int64_t d = 0; d < heads * head_dim; d++) mixed[d] = 0.0f;
    for (int64_t start = 0, block = 0; start < len; start += c->block_size, block++) {
        int64_t values = c->table[block] * c->block_stride;
        const int64_t end = start + c->block_size < len ? start + c->block_size : len;
        for (int64_t kv = 0; kv < c->kv_heads; kv++, values += c->head_stride) {
            int64_t value = values;
            for (int64_t t = start; t < end; t++, value += head_dim) {
                for (int64_t h = kv * group; h < (kv + 1) * group; h++) {
                    const float w = weights[h * len + t];
                    float *acc = mixed + h * head_dim;
                    for (int64_t d = 0; d < head_dim; d++)
                        acc[d] += w * pool_at(c->v_pool, value + d, bf16);
                }
            }
        }
    }
}

/* Row b: store its newest token's K/V in its last slot, then attend over its blocks. */
static inline __attribute__((always_inline)) void row(
    const void *k_new, const void *v_new, int64_t kv_stride, void *k_pool, void *v_pool,
    int64_t pool_bf16, const int64_t *table, int64_t len, int64_t b, int64_t heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, const float *query,
    float *mixed, float *weights)
{
    const size_t element = pool_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t head_stride = block_size * head_dim;
    const int64_t block_stride = kv_heads * head_stride;
    const int64_t slot =
        table[(len - 1) / block_size] * block_stride + ((len - 1) % block_size) * head_dim;
    for (int64_t kv = 0; kv < kv_heads; kv++) {
        const int64_t from = b * kv_stride + kv * head_dim;
        const size_t to = (size_t)(slot + kv * head_stride) * element;
        memcpy((char *)k_pool + to, (const char *)k_new + from * element, head_dim * element);
        memcpy((char *)v_pool + to, (const char *)v_new + from * element, head_dim * element);
    }
    const Context c = {k_pool,      v_pool,       table,    len,  block_size,
                       head_stride, block_stride, kv_heads, heads / kv_heads, scale};
    if (pool_bf16) {
        if (head_dim == 64)
            attend(&c, query, 64, 1, weights, mixed);
        else if (head_dim == 128)
            attend(&c, query, 128, 1, weights, mixed);
        else
            attend(&c, query, head_dim, 1, weights, mixed);
    } else if (head_dim == 64)
        attend(&c, query, 64, 0, weights, mixed);
    else if (head_dim == 128)
        attend(&c, query, 128, 0, weights, mixed);
    else
        attend(&c, query, head_dim, 0, weights, mixed);
}

/* One build serves every x86-64 CPU: the loader picks the widest vector unit. */
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int64_t paged_decode_attention(const float *q, const void *k_new, const void *v_new,
                               int64_t q_stride, int64_t kv_stride, void *k_pool, void *v_pool,
                               int64_t pool_bf16, const int64_t *tables, int64_t width,
                               const int64_t *lengths, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, float *out, int64_t threads)
{
    int64_t longest = 0, total = 0;
    for (int64_t b = 0; b < batch; b++) {
        longest = lengths[b] > longest ? lengths[b] : longest;
        total += lengths[b];
    }
    int failed = 0;
    /* Rows are shared among the calling thread's OpenMP team: the engine thread's, as
     * this library links the libgomp torch loaded (one team of workers, already
     * spinning between torch's own parallel ops). A step too small to pay for the
     * fork runs on the calling thread alone. */
#pragma omp parallel num_threads(threads) if (batch > 1 && total >= MIN_PARALLEL_TOKENS) \
    reduction(| : failed)
    {
        /* the heap, not the stack: a long context times a large group outgrows a
         * worker thread's stack */
        float *weights = malloc((size_t)(heads * longest) * sizeof(float));
        failed |= weights == NULL;
        /* every thread meets the loop (a work-sharing construct must be), and one
         * without scratch does no row */
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < batch; b++) {
            if (weights == NULL) continue;
            row(k_new, v_new, kv_stride, k_pool, v_pool, pool_bf16, tables + b * width,
                lengths[b], b, heads, kv_heads, head_dim, block_size, scale,
                q + b * q_stride, out + b * heads * head_dim, weights);
        }
        free(weights);
    }
    return failed ? -1 : 0;
}
