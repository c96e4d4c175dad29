/* CPU kernels, loaded by worker/model/native.py.
 *
 * Paged decode attention: one new query token per row over that row's own cached
 * keys and values, read through the row's block table. Queries, output and all
 * arithmetic are fp32; the cache is fp32, fp16 or bf16 (one entry point each).
 *
 * Why a hand kernel: torch's batched matmuls must read every row's cache up to
 * the longest row of the batch, and for these shapes (a few query heads per kv
 * head) they stream it at ~11 GB/s, while the step is bound by reading the cache
 * (~26 GB/s on our CPUs). This reads exactly positions [0, lens[b]) of each row,
 * once, split over (row, kv head) tasks with torch's own OpenMP runtime (the
 * libgomp.so.1 torch has loaded). Measured at batch 16, SmolLM2, ~360 cached
 * tokens per row: 17 ms per step for all 30 layers vs 39 ms with bmm.
 *
 * Block table: position p of row b lives in physical block
 * block_tables[b * block_table_stride + p / block_size] at offset p % block_size,
 * and a cache is (KH, num_blocks, block_size, D) contiguous: one block of one kv
 * head is block_size * D consecutive values, and blocks with consecutive ids are
 * adjacent, so a sequence whose blocks were allocated together (a prompt) reads
 * one contiguous stretch per kv head, as a slot-per-sequence cache did. A (row, kv head) walks its
 * positions in spans that stay inside one block (at most MAX_SPAN positions): an
 * fp32 span is read in place, an fp16/bf16 span is first converted into a small
 * fp32 scratch that stays in L1 and is then read once per query head. While a
 * span is computed the next blocks are prefetched (blocks are not adjacent, so
 * the hardware prefetcher cannot). Lengths and the block ids a row uses are
 * checked before that row is read.
 *
 * Each (row, kv head) is computed alone in a fixed order, so a row's result does
 * not depend on which other rows share its batch, and positions are summed in
 * position order whatever blocks hold them: a paged cache gives bit for bit what
 * the same values laid out contiguously give.
 *
 * Measured before attention.h's SIMD spans (a further ~30% off: attention.h has the
 * numbers), one thread, batch 16, SmolLM2 (H 9, KH 3, D 64, 30 layers), ~400
 * cached tokens per row in blocks of 16 scattered at random, ms per step for all
 * 30 layers: fp32 cache 47, fp16 34, bf16 35.5; the slot-contiguous fp32 kernel
 * this replaced took 34 in the same run. fp16 halves the bytes read and is then
 * bound by the maths (~30 ms with the cache in L2); fp32 pays for reading 4 KB
 * pieces (one block of one kv head): with blocks of 512 it also takes ~34.
 */
#include "attention.h"

/* q: row b, query head h at q + b * q_row_stride + h * D; heads kv * G .. kv * G + G - 1
 *    share kv head kv (G = H / KH).
 * k_cache, v_cache: (KH, num_blocks, block_size, D) contiguous.
 * block_tables: row b's max_blocks block ids at block_tables + b * block_table_stride.
 * lens: row b reads positions [0, lens[b]); 1 <= lens[b] <= max_blocks * block_size.
 * out: (B, H, D) contiguous.
 * Returns 0; -1 when scratch memory could not be allocated; -2 when a length is out
 * of range; -3 when a used block id is outside [0, num_blocks) (such a row is not read). */
static int paged_decode_attention(
    const float *q, const void *k_cache, const void *v_cache, cache_format format, float *out,
    const int32_t *block_tables, const int32_t *lens, int64_t B, int64_t H, int64_t KH,
    int64_t D, int64_t q_row_stride, int64_t block_table_stride, int64_t max_blocks,
    int64_t block_size, int64_t num_blocks, float scale, int num_threads) {
    const int64_t G = H / KH;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
    for (int64_t task = 0; task < B * KH; ++task) {
        const int64_t b = task / KH, kv = task % KH, n = lens[b];
        const row_pages pages = {block_tables + b * block_table_stride, block_size, block_size * D,
                                 kv * num_blocks * block_size * D};
        const int bad = check_row(pages.blocks, n, max_blocks, block_size, num_blocks);
        if (bad) {
            failed |= bad;
            continue;
        }
        const attend_rows rows = {q + b * q_row_stride + kv * G * D, out + (b * H + kv * G) * D, lens + b, 1, 0, 0};
        failed |= attend_task(rows, k_cache, v_cache, format, pages, G, D, scale);
    }
    return failed & FAILED_BAD_LENGTH ? -2 : failed & FAILED_BAD_BLOCK ? -3 : failed ? -1 : 0;
}

/* The entry points, one per cache dtype; arguments as for paged_decode_attention. */
#define PAGED_DECODE_ATTENTION(name, cache_type, format)                                             \
    int name(const float *q, const cache_type *k_cache, const cache_type *v_cache, float *out,       \
             const int32_t *block_tables, const int32_t *lens, int64_t B, int64_t H, int64_t KH,     \
             int64_t D, int64_t q_row_stride, int64_t block_table_stride, int64_t max_blocks,        \
             int64_t block_size, int64_t num_blocks, float scale, int num_threads) {                 \
        return paged_decode_attention(q, k_cache, v_cache, format, out, block_tables, lens, B, H, KH, \
                                      D, q_row_stride, block_table_stride, max_blocks, block_size,   \
                                      num_blocks, scale, num_threads);                               \
    }

PAGED_DECODE_ATTENTION(paged_decode_attention_f32, float, F32)
PAGED_DECODE_ATTENTION(paged_decode_attention_f16, uint16_t, F16) /* IEEE half bits */
PAGED_DECODE_ATTENTION(paged_decode_attention_bf16, uint16_t, BF16) /* bfloat16 bits */

/* RMSNorm of each row, fp32: out = x / sqrt(mean(x^2) + eps) * weight, the sum of
 * squares accumulated in fp32 in a fixed order. torch's CPU rms_norm is ~6 small
 * ops; on a decode step's few rows their dispatch costs ~70 us per call. */
void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t cols,
                  float eps) {
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * cols, weight, out + r * cols, cols, eps);
}

/* Greedy sampling of rows of logits (B, V), row stride `stride`: ids[b] is the first index of
 * the row's maximum, as torch.argmax gives, and is_finite[b] whether the row has no NaN or
 * +inf and not only -inf (a row that is not gets id 0, as the sampler's zeroed row would).
 * Two short passes over the row in place of the sampler's three (a sum for the finite check, isfinite,
 * argmax): ~0.14 ms of a batch-1 step over SmolLM2's 49152 logits. */
void greedy_argmax_f32(const float *logits, int64_t B, int64_t V, int64_t stride, int64_t *ids,
                       uint8_t *is_finite) {
    for (int64_t b = 0; b < B; ++b) {
        const float *x = logits + b * stride;
        float best = -__builtin_inff();
        int bad = 0;
        /* the maximum and the finite check in one vectorised pass, then the first index of that
         * maximum (NaN never compares greater, and a row with one is not used) */
#pragma omp simd reduction(max : best) reduction(| : bad)
        for (int64_t v = 0; v < V; ++v) {
            const float value = x[v];
            bad |= (value != value) | (value == __builtin_inff());
            best = value > best ? value : best;
        }
        int64_t id = 0;
        while (id < V && !(x[id] == best)) ++id;
        const int finite = !bad && best > -__builtin_inff();
        ids[b] = finite ? id : 0;
        is_finite[b] = (uint8_t)finite;
    }
}
