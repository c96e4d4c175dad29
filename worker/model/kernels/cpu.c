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
 * Measured, one thread, batch 16, SmolLM2 (H 9, KH 3, D 64, 30 layers), ~400
 * cached tokens per row in blocks of 16 scattered at random, ms per step for all
 * 30 layers: fp32 cache 47, fp16 34, bf16 35.5; the slot-contiguous fp32 kernel
 * this replaced took 34 in the same run. fp16 halves the bytes read and is then
 * bound by the maths (~30 ms with the cache in L2); fp32 pays for reading 4 KB
 * pieces (one block of one kv head): with blocks of 512 it also takes ~34.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#define MAX_SPAN 32      /* positions converted at a time: 32 * D fp32 values of scratch */
#define PREFETCH_SPANS 2 /* spans asked for ahead of the one computed */

/* e^x for x <= 0 (softmax arguments after subtracting the max), written so the
 * compiler vectorises it: Cephes' expf polynomial, ~1 ulp. NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* e^-87 ~ 1.6e-38: the weight is 0 to fp32 sums anyway */
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f; /* x - n ln 2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float float_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bits_from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE half to float, exact for every input, written with selects on integers
 * (no branches) so the loop using it vectorises where there is no F16C. */
static inline float half_to_float(uint16_t h) {
    const uint32_t em = h & 0x7fffu; /* exponent and mantissa */
    const uint32_t rebias = (em >= 0x7c00u ? 255u - 31u : 127u - 15u) << 23; /* inf/nan: all ones */
    const uint32_t normal = (em << 13) + rebias;
    const uint32_t small = bits_from_float((float)(int32_t)em * 0x1p-24f); /* zero, subnormals */
    const uint32_t is_small = 0u - (uint32_t)(em < 0x0400u);                  /* all ones or 0 */
    return float_from_bits(((small & is_small) | (normal & ~is_small)) | (uint32_t)(h & 0x8000u) << 16);
}

/* A cache's values [index, index + count) as fp32: the cache itself for fp32,
 * else converted into scratch (count <= MAX_SPAN * D). */
typedef const float *(*load_span_fn)(const void *cache, int64_t index, int64_t count, float *scratch);

static const float *load_f32(const void *cache, int64_t index, int64_t count, float *scratch) {
    (void)count, (void)scratch;
    return (const float *)cache + index;
}

static const float *load_f16(const void *cache, int64_t index, int64_t count, float *scratch) {
    const uint16_t *src = (const uint16_t *)cache + index;
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(scratch + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < count; ++i) scratch[i] = half_to_float(src[i]);
    return scratch;
}

static const float *load_bf16(const void *cache, int64_t index, int64_t count, float *scratch) {
    const uint16_t *src = (const uint16_t *)cache + index;
    for (int64_t i = 0; i < count; ++i)
        scratch[i] = float_from_bits((uint32_t)src[i] << 16); /* bf16 is the top half of an fp32 */
    return scratch;
}

/* How one cache dtype is read: its loader (called once per span, so through a
 * pointer: the call is nothing next to the span's maths), the bytes of one value,
 * and whether spans are converted (then a task needs MAX_SPAN * D floats of scratch). */
typedef struct {
    load_span_fn load;
    int64_t value_bytes;
    int is_converted;
} cache_format;

static const cache_format F32 = {load_f32, 4, 0}, F16 = {load_f16, 2, 1}, BF16 = {load_bf16, 2, 1};

/* Where row b's cache lives for one kv head: its block ids, and each block's
 * first value of that head at blocks[i] * block_values + head_offset. */
typedef struct {
    const int32_t *blocks;
    int64_t block_size, block_values, head_offset;
} row_pages;

/* A span: positions [i, i + m) of [0, n), all in the row's block number `block` from
 * `offset` on, at most MAX_SPAN of them; m == 0 past the end. Stepping from span to
 * span without dividing positions by block_size made a step ~5% faster. */
typedef struct {
    int64_t i, m, block, offset;
} span;

static inline span span_from(row_pages pages, int64_t i, int64_t block, int64_t offset, int64_t n) {
    int64_t m = pages.block_size - offset;
    m = m < MAX_SPAN ? m : MAX_SPAN;
    m = m < n - i ? m : n - i;
    return (span){i, m, block, offset};
}

static inline span next_span(row_pages pages, span s, int64_t n) {
    const int is_block_done = s.offset + s.m == pages.block_size;
    return span_from(pages, s.i + s.m, s.block + is_block_done, is_block_done ? 0 : s.offset + s.m, n);
}

/* The index of the span's first value in the cache. */
static inline int64_t span_index(row_pages pages, span s, int64_t D) {
    return pages.blocks[s.block] * pages.block_values + pages.head_offset + s.offset * D;
}

/* Asks for those of the PREFETCH_SPANS spans after s that start a block while s is
 * computed: blocks are not adjacent, so the hardware prefetcher does not see them
 * coming. Measured (one thread, 400 tokens in blocks of 16): without this a step took
 * ~10% (fp32) to ~35% (fp16) longer, two spans ahead beat one by ~5%, and also asking
 * for spans inside a block made blocks of 512 ~20% slower. */
static inline void prefetch_after(const void *cache, cache_format format, row_pages pages, span s,
                                  int64_t n, int64_t D) {
    s = next_span(pages, s, n);
    for (int k = 0; k < PREFETCH_SPANS && s.m > 0; ++k, s = next_span(pages, s, n)) {
        if (s.offset != 0) continue; /* inside a block: the hardware prefetcher follows it */
        const char *first = (const char *)cache + span_index(pages, s, D) * format.value_bytes;
        for (int64_t b = 0; b < s.m * D * format.value_bytes; b += 64) /* one cache line each */
            __builtin_prefetch(first + b);
    }
}

/* One (row, kv head): the G query heads sharing kv head over n keys.
 * Inlined with a constant D below so the loops over D unroll into registers. */
static inline __attribute__((always_inline)) void attend(
    const float *qg, const void *k_cache, const void *v_cache, cache_format format, row_pages pages,
    float *o, float *scores, float *scratch, int64_t n, int64_t G, int64_t D, float scale) {
    for (span s = span_from(pages, 0, 0, 0, n); s.m > 0; s = next_span(pages, s, n)) {
        prefetch_after(k_cache, format, pages, s, n, D); /* scores (G, n): each key read once */
        const float *keys = format.load(k_cache, span_index(pages, s, D), s.m * D, scratch);
        for (int64_t l = 0; l < s.m; ++l) {
            const float *key = keys + l * D;
            for (int64_t g = 0; g < G; ++g) {
                const float *qv = qg + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qv[d] * key[d];
                scores[g * n + s.i + l] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) { /* softmax per query head */
        float *s = scores + g * n, max = s[0], sum = 0.0f;
        for (int64_t l = 1; l < n; ++l) max = s[l] > max ? s[l] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < n; ++l) {
            s[l] = exp_nonpositive(s[l] - max);
            sum += s[l];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t l = 0; l < n; ++l) s[l] *= inv;
    }
    memset(o, 0, (size_t)(G * D) * sizeof(float)); /* o (G, D) = scores @ values: each value read once */
    for (span s = span_from(pages, 0, 0, 0, n); s.m > 0; s = next_span(pages, s, n)) {
        prefetch_after(v_cache, format, pages, s, n, D);
        const float *values = format.load(v_cache, span_index(pages, s, D), s.m * D, scratch);
        for (int64_t l = 0; l < s.m; ++l) {
            const float *value = values + l * D;
            for (int64_t g = 0; g < G; ++g) {
                const float w = scores[g * n + s.i + l];
                float *og = o + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) og[d] += w * value[d];
            }
        }
    }
}

enum { FAILED_NO_MEMORY = 1, FAILED_BAD_LENGTH = 2, FAILED_BAD_BLOCK = 4 };

/* Row b's length and the block ids it uses, checked before a single value is read. */
static int check_row(const int32_t *blocks, int64_t n, int64_t max_blocks, int64_t block_size,
                     int64_t num_blocks) {
    if (n < 1 || n > max_blocks * block_size) return FAILED_BAD_LENGTH;
    int bad = 0;
    for (int64_t i = 0; i < (n + block_size - 1) / block_size; ++i)
        bad |= blocks[i] < 0 || blocks[i] >= num_blocks;
    return bad ? FAILED_BAD_BLOCK : 0;
}

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
        const float *qg = q + b * q_row_stride + kv * G * D; /* (G, D) */
        float *o = out + (b * H + kv * G) * D;              /* (G, D) */
        const int64_t span_scratch = format.is_converted ? MAX_SPAN * D : 0;
        float *scores = malloc((size_t)(G * n + span_scratch) * sizeof(float)); /* (G, n), then a span */
        if (scores == NULL) {
            failed |= FAILED_NO_MEMORY;
            continue;
        }
        float *scratch = scores + G * n;
        if (D == 64)
            attend(qg, k_cache, v_cache, format, pages, o, scores, scratch, n, G, 64, scale);
        else if (D == 128)
            attend(qg, k_cache, v_cache, format, pages, o, scores, scratch, n, G, 128, scale);
        else
            attend(qg, k_cache, v_cache, format, pages, o, scores, scratch, n, G, D, scale);
        free(scores);
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
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        float *o = out + r * cols;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cols; ++c) sum += xr[c] * xr[c];
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)cols + eps);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) o[c] = xr[c] * inv * weight[c];
    }
}
