/* One decode step of paged attention for one layer, on the CPU.
 *
 * Each row stores its newest token's K/V at the last position of its block
 * table, then its one query attends to every cached token of its own blocks,
 * read where they lie in the pool. The torch fallback
 * (model_runner.PagedDecodeAttention) needs a dozen small ops per layer around
 * batched per-block matmuls; here every K/V byte is read once, in one pass.
 *
 * Layouts (float32, contiguous unless a stride is given):
 *   q, k_new, v_new  [batch, heads, head_dim], rows `row_stride` floats apart
 *   k_pool, v_pool   [num_blocks, heads, block_size, head_dim] (one layer)
 *   tables           [batch, width] block ids; lengths [batch] tokens incl. the new one
 *   out              [batch, heads, head_dim]
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { LANES = 16 }; /* partial sums per dot product: one vector register wide */

typedef struct {
    const float *k_pool, *v_pool;
    const int64_t *table;
    int64_t len, block_size, head_stride, block_stride;
    float scale;
} Context;

/* Always inlined, so a call with a constant head_dim gets fixed-length loops whose
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const Context *c, const float *query,
                                                         int64_t h, int64_t head_dim,
                                                         float *weights, float *mixed)
{
    float top = -INFINITY;
    /* block by block: no division per token */
    for (int64_t start = 0, block = 0; start < c->len; start += c->block_size, block++) {
        const float *key = c->k_pool + c->table[block] * c->block_stride + h * c->head_stride;
        const int64_t end = start + c->block_size < c->len ? start + c->block_size : c->len;
        for (int64_t t = start; t < end; t++, key += head_dim) {
            float part[LANES] = {0};
            int64_t d = 0;
            for (; d + LANES <= head_dim; d += LANES)
                for (int j = 0; j < LANES; j++) part[j] += query[d + j] * key[d + j];
            for (; d < head_dim; d++) part[0] += query[d] * key[d];
            /* pairwise, not lane after lane: vector shuffles, not a chain of 16 adds */
            for (int width = LANES / 2; width > 0; width /= 2)
                for (int j = 0; j < width; j++) part[j] += part[j + width];
            const float dot = part[0];
            weights[t] = dot * c->scale;
            top = weights[t] > top ? weights[t] : top;
        }
    }
    float total = 0.0f;
    for (int64_t t = 0; t < c->len; t++) {
        weights[t] = expf(weights[t] - top);
        total += weights[t];
    }
    const float norm = 1.0f / total;
    float sum[head_dim]; /* a local, not `mixed`: it may stay in registers */
    for (int64_t d = 0; d < head_dim; d++) sum[d] = 0.0f;
    for (int64_t start = 0, block = 0; start < c->len; start += c->block_size, block++) {
        const float *value = c->v_pool + c->table[block] * c->block_stride + h * c->head_stride;
        const int64_t end = start + c->block_size < c->len ? start + c->block_size : c->len;
        for (int64_t t = start; t < end; t++, value += head_dim) {
            const float w = weights[t] * norm;
            for (int64_t d = 0; d < head_dim; d++) sum[d] += w * value[d];
        }
    }
    memcpy(mixed, sum, head_dim * sizeof(float));
}

/* One build serves every x86-64 CPU: the loader picks the widest vector unit. */
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void paged_decode_attention(const float *q, const float *k_new, const float *v_new,
                            int64_t row_stride, float *k_pool, float *v_pool,
                            const int64_t *tables, int64_t width, const int64_t *lengths,
                            int64_t batch, int64_t heads, int64_t head_dim,
                            int64_t block_size, float scale, float *out)
{
    const int64_t head_stride = block_size * head_dim;
    const int64_t block_stride = heads * head_stride;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = lengths[b];
        const int64_t *table = tables + b * width;
        const int64_t slot =
            table[(len - 1) / block_size] * block_stride + ((len - 1) % block_size) * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t from = b * row_stride + h * head_dim;
            memcpy(k_pool + slot + h * head_stride, k_new + from, head_dim * sizeof(float));
            memcpy(v_pool + slot + h * head_stride, v_new + from, head_dim * sizeof(float));
        }
        const Context c = {k_pool, v_pool, table, len, block_size, head_stride, block_stride,
                           scale};
        float weights[len];
        for (int64_t h = 0; h < heads; h++) {
            const float *query = q + b * row_stride + h * head_dim;
            float *mixed = out + (b * heads + h) * head_dim;
            if (head_dim == 64)
                attend(&c, query, h, 64, weights, mixed);
            else
                attend(&c, query, h, head_dim, weights, mixed);
        }
    }
}
