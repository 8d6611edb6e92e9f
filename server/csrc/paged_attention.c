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
 * values are read once for the whole group of query heads that share it: the
 * group is looped inside the per-token pass, not the tokens per query head.
 *
 * Layouts (float32, contiguous unless a stride is given):
 *   q                [batch, heads, head_dim], rows `q_stride` floats apart
 *   k_new, v_new     [batch, kv_heads, head_dim], rows `kv_stride` floats apart
 *   k_pool, v_pool   [num_blocks, kv_heads, block_size, head_dim] (one layer)
 *   tables           [batch, width] block ids; lengths [batch] tokens incl. the new one
 *   out              [batch, heads, head_dim]
 * Returns 0, or -1 when the scratch for the attention weights cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LANES = 16 }; /* partial sums per dot product: one vector register wide */
_Static_assert(LANES == 16, "dot() halves its partial sums from 16 lanes");

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
    const float *k_pool, *v_pool;
    const int64_t *table;
    int64_t len, block_size, head_stride, block_stride, group;
    float scale;
} Context;

static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                       int64_t n)
{
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    for (; d < n; d++) part[0] += a[d] * b[d];
    /* pairwise, not lane after lane: vector shuffles, not a chain of 16 adds; each
     * halving spelled out, as GCC keeps a loop over the widths in memory */
    for (int j = 0; j < 8; j++) part[j] += part[j + 8];
    for (int j = 0; j < 4; j++) part[j] += part[j + 4];
    for (int j = 0; j < 2; j++) part[j] += part[j + 2];
    return part[0] + part[1];
}

/* The `group` query heads of KV head `kv` (consecutive in `queries` and `mixed`).
 * `weights` holds [group, len] scores. Always inlined, so a call with a constant
 * head_dim gets fixed-length loops whose accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const Context *c, const float *queries,
                                                         int64_t kv, int64_t head_dim,
                                                         float *weights, float *mixed)
{
    const int64_t group = c->group, len = c->len;
    float top[group];
    for (int64_t g = 0; g < group; g++) top[g] = -INFINITY;
    /* block by block: no division per token */
    for (int64_t start = 0, block = 0; start < len; start += c->block_size, block++) {
        const float *key = c->k_pool + c->table[block] * c->block_stride + kv * c->head_stride;
        const int64_t end = start + c->block_size < len ? start + c->block_size : len;
        for (int64_t t = start; t < end; t++, key += head_dim) {
            for (int64_t g = 0; g < group; g++) {
                const float score = dot(queries + g * head_dim, key, head_dim) * c->scale;
                weights[g * len + t] = score;
                top[g] = score > top[g] ? score : top[g];
            }
        }
    }
    float norm[group];
    for (int64_t g = 0; g < group; g++) {
        float *row = weights + g * len, total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            row[t] = exp_nonpositive(row[t] - top[g]);
            total += row[t];
        }
        norm[g] = 1.0f / total;
    }
    float sum[group * head_dim]; /* a local, not `mixed`: it may stay in registers */
    for (int64_t d = 0; d < group * head_dim; d++) sum[d] = 0.0f;
    for (int64_t start = 0, block = 0; start < len; start += c->block_size, block++) {
        const float *value = c->v_pool + c->table[block] * c->block_stride + kv * c->head_stride;
        const int64_t end = start + c->block_size < len ? start + c->block_size : len;
        for (int64_t t = start; t < end; t++, value += head_dim) {
            for (int64_t g = 0; g < group; g++) {
                const float w = weights[g * len + t] * norm[g];
                float *acc = sum + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) acc[d] += w * value[d];
            }
        }
    }
    memcpy(mixed, sum, group * head_dim * sizeof(float));
}

/* One build serves every x86-64 CPU: the loader picks the widest vector unit. */
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
int64_t paged_decode_attention(const float *q, const float *k_new, const float *v_new,
                               int64_t q_stride, int64_t kv_stride, float *k_pool,
                               float *v_pool, const int64_t *tables, int64_t width,
                               const int64_t *lengths, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t block_size,
                               float scale, float *out)
{
    const int64_t head_stride = block_size * head_dim;
    const int64_t block_stride = kv_heads * head_stride;
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    /* the heap, not the stack: a long context times a large group outgrows a
     * worker thread's stack */
    float *weights = malloc((size_t)(group * longest) * sizeof(float));
    if (weights == NULL) return -1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lengths[b];
        const int64_t *table = tables + b * width;
        const int64_t slot =
            table[(len - 1) / block_size] * block_stride + ((len - 1) % block_size) * head_dim;
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            const int64_t from = b * kv_stride + kv * head_dim;
            memcpy(k_pool + slot + kv * head_stride, k_new + from, head_dim * sizeof(float));
            memcpy(v_pool + slot + kv * head_stride, v_new + from, head_dim * sizeof(float));
        }
        const Context c = {k_pool, v_pool,       table, len,  block_size,
                           head_stride, block_stride, group, scale};
        for (int64_t kv = 0; kv < kv_heads; kv++) {
            const float *queries = q + b * q_stride + kv * group * head_dim;
            float *mixed = out + (b * heads + kv * group) * head_dim;
            if (head_dim == 64)
                attend(&c, queries, kv, 64, weights, mixed);
            else if (head_dim == 128)
                attend(&c, queries, kv, 128, weights, mixed);
            else
                attend(&c, queries, kv, head_dim, weights, mixed);
        }
    }
    free(weights);
    return 0;
}
