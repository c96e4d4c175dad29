/* Paged decode attention's pieces (cpu.c has the why and the measurements), shared by
 * cpu.c's entry points and layer.c's whole decode layer. */
#ifndef TOKENRELAY_ATTENTION_H
#define TOKENRELAY_ATTENTION_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#if defined(__F16C__) || (defined(__AVX2__) && defined(__FMA__))
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

/* sum(v[0..n)) (square: of v^2) in one fixed order: value l into partial sum l % 8, then
 * ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). An `omp simd` reduction's order follows the vector
 * width GCC picks, so an AVX2 host and an AVX-512 host summed a softmax or an RMSNorm into other
 * last bits; this gives every x86 host with FMA the same ones (tests/test_native.py). */
static inline __attribute__((always_inline)) float sum_fixed_of(const float *v, int64_t n, const int square) {
    float acc[8] = {0};
    int64_t l = 0;
    for (; l + 8 <= n; l += 8)
        for (int j = 0; j < 8; ++j) acc[j] += square ? v[l + j] * v[l + j] : v[l + j];
    for (int j = 0; l < n; ++l, ++j) acc[j] += square ? v[l] * v[l] : v[l];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
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

#if defined(__AVX2__) && defined(__FMA__)
#define ATTEND_SIMD 1
#define ATTEND_KEYS 4 /* keys whose dots with one query head are in flight together */

/* The 4 sums of v[0..3]'s lanes, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* scores[g * n + i + l] = scale * q_g . key l for the span's keys (D a multiple of 8). A key's
 * dot is 8 lanes of fmas in d order, then hsum4: the same whichever group of ATTEND_KEYS it
 * falls in (a short last group repeats its last key and drops the extra dots). */
static inline __attribute__((always_inline)) void span_scores(const float *qg, const float *keys, int64_t m,
                                                              int64_t i, float *scores, int64_t n, int64_t G,
                                                              int64_t D, float scale) {
    for (int64_t l = 0; l < m; l += ATTEND_KEYS) {
        const float *key[ATTEND_KEYS];
        for (int k = 0; k < ATTEND_KEYS; ++k) key[k] = keys + (l + k < m ? l + k : m - 1) * D;
        for (int64_t g = 0; g < G; ++g) {
            const float *qv = qg + g * D;
            __m256 acc[ATTEND_KEYS];
            for (int k = 0; k < ATTEND_KEYS; ++k) acc[k] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 q = _mm256_loadu_ps(qv + d);
                for (int k = 0; k < ATTEND_KEYS; ++k) acc[k] = _mm256_fmadd_ps(q, _mm256_loadu_ps(key[k] + d), acc[k]);
            }
            float dots[ATTEND_KEYS];
            _mm_storeu_ps(dots, _mm_mul_ps(hsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
            for (int k = 0; k < ATTEND_KEYS && l + k < m; ++k) scores[g * n + i + l + k] = dots[k];
        }
    }
}

/* og (D,) += sum over the span's values l of w[l] * value l, each lane a chain of fmas in
 * position order: the head's D accumulators stay in registers for the span. */
static inline __attribute__((always_inline)) void span_values(const float *w, const float *values, int64_t m,
                                                              float *og, int64_t D) {
    __m256 acc[16];
    for (int64_t d = 0; d < D; d += 8) acc[d / 8] = _mm256_loadu_ps(og + d);
    for (int64_t l = 0; l < m; ++l) {
        const __m256 wl = _mm256_broadcast_ss(w + l);
        for (int64_t d = 0; d < D; d += 8)
            acc[d / 8] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(values + l * D + d), acc[d / 8]);
    }
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(og + d, acc[d / 8]);
}
#endif

/* Rows that share a block table, each with its own length (a verify step's rows, a prompt
 * chunk's tokens): row r's G query heads at q + r * q_stride, its output (G, D) at
 * o + r * o_stride, over its first lens[r] keys, lens[R - 1] the longest. */
typedef struct {
    const float *q;
    float *o;
    const int32_t *lens;
    int64_t R, q_stride, o_stride;
} attend_rows;

/* How many of a span's keys row r attends: those below its own length. */
static inline int64_t span_keys(span s, int64_t n) { return n - s.i < s.m ? (n > s.i ? n - s.i : 0) : s.m; }

/* The rows' G query heads sharing one kv head. Each span of keys and values is loaded (and
 * for fp16/bf16 converted) once for all rows, and each row computes exactly what it would
 * alone: the same spans from position 0, the same per-key dots, its own softmax and, for
 * each output, the same chain of fmas in position order. Inlined with a constant D below so
 * the loops over D unroll into registers; with AVX2 and FMA, D = 64 and 128 take
 * span_scores and span_values. Measured (AVX2 EPYC, 2 threads, SmolLM2's heads, one layer,
 * ~500 cached fp32 positions in L2, us for 1, 5 and 8 rows, each row its own task): with a
 * dot product per (key, head), each horizontally summed alone, and the output's G * D sums
 * loaded and stored for every key, 85 348 526; with span_scores and span_values 59 233 368. */
static inline __attribute__((always_inline)) void attend(
    attend_rows rows, const void *k_cache, const void *v_cache, cache_format format, row_pages pages,
    float *scores, float *scratch, int64_t G, int64_t D, float scale) {
    const int64_t n = rows.lens[rows.R - 1], R = rows.R; /* scores (R, G, n) */
#ifdef ATTEND_SIMD
    const int is_simd = D == 64 || D == 128;
#endif
    for (span s = span_from(pages, 0, 0, 0, n); s.m > 0; s = next_span(pages, s, n)) {
        prefetch_after(k_cache, format, pages, s, n, D); /* each key read once */
        const float *keys = format.load(k_cache, span_index(pages, s, D), s.m * D, scratch);
        for (int64_t r = 0; r < R; ++r) {
            const float *qg = rows.q + r * rows.q_stride;
            float *sc = scores + r * G * n;
            const int64_t m = span_keys(s, rows.lens[r]);
#ifdef ATTEND_SIMD
            if (is_simd) {
                if (m > 0) span_scores(qg, keys, m, s.i, sc, n, G, D, scale);
                continue;
            }
#endif
            for (int64_t l = 0; l < m; ++l) {
                const float *key = keys + l * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float *qv = qg + g * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; ++d) dot += qv[d] * key[d];
                    sc[g * n + s.i + l] = dot * scale;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) { /* softmax per row and query head, over its own keys */
            const int64_t nr = rows.lens[r];
            float *sc = scores + (r * G + g) * n, max = sc[0];
            for (int64_t l = 1; l < nr; ++l) max = sc[l] > max ? sc[l] : max;
#pragma omp simd
            for (int64_t l = 0; l < nr; ++l) sc[l] = exp_nonpositive(sc[l] - max);
            const float inv = 1.0f / sum_fixed_of(sc, nr, 0);
#pragma omp simd
            for (int64_t l = 0; l < nr; ++l) sc[l] *= inv;
        }
    for (int64_t r = 0; r < R; ++r) /* o (G, D) = scores @ values: each value read once */
        memset(rows.o + r * rows.o_stride, 0, (size_t)(G * D) * sizeof(float));
    for (span s = span_from(pages, 0, 0, 0, n); s.m > 0; s = next_span(pages, s, n)) {
        prefetch_after(v_cache, format, pages, s, n, D);
        const float *values = format.load(v_cache, span_index(pages, s, D), s.m * D, scratch);
        for (int64_t r = 0; r < R; ++r) {
            const int64_t m = span_keys(s, rows.lens[r]);
            const float *sc = scores + r * G * n;
            float *o = rows.o + r * rows.o_stride;
#ifdef ATTEND_SIMD
            if (is_simd) {
                for (int64_t g = 0; g < G && m > 0; ++g) span_values(sc + g * n + s.i, values, m, o + g * D, D);
                continue;
            }
#endif
            for (int64_t l = 0; l < m; ++l) {
                const float *value = values + l * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float w = sc[g * n + s.i + l];
                    float *og = o + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) og[d] += w * value[d];
                }
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

/* One (rows, kv head) task; its scratch taken and given back here. Returns 0 or
 * FAILED_NO_MEMORY. Never inlined nor specialised (noipa): cpu.c's per-op attention (always
 * one row) and layer.c's fused layers then run the same machine code. A copy specialised
 * for one row vectorised the `omp simd` reductions of the generic-D loops differently and
 * gave other last bits (seen with D = 16). */
static __attribute__((noipa)) int attend_task(attend_rows rows, const void *k_cache, const void *v_cache, cache_format format,
                              row_pages pages, int64_t G, int64_t D, float scale) {
    const int64_t span_scratch = format.is_converted ? MAX_SPAN * D : 0, n = rows.lens[rows.R - 1];
    float *scores = malloc((size_t)(rows.R * G * n + span_scratch) * sizeof(float)); /* (R, G, n), a span */
    if (scores == NULL) return FAILED_NO_MEMORY;
    float *scratch = scores + rows.R * G * n;
    if (D == 64)
        attend(rows, k_cache, v_cache, format, pages, scores, scratch, G, 64, scale);
    else if (D == 128)
        attend(rows, k_cache, v_cache, format, pages, scores, scratch, G, 128, scale);
    else
        attend(rows, k_cache, v_cache, format, pages, scores, scratch, G, D, scale);
    free(scores);
    return 0;
}

/* RMSNorm of one row (cpu.c's rms_norm_f32 and layer.c's layers: the same rounding). */
static inline void rms_norm_row(const float *x, const float *weight, float *out, int64_t cols, float eps) {
    const float inv = 1.0f / __builtin_sqrtf(sum_fixed_of(x, cols, 1) / (float)cols + eps);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = x[c] * inv * weight[c];
}

#endif
