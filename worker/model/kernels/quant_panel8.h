/* quant_panel.h's tiles on 256-bit vectors (AVX2, AVX-VNNI), included by quant.c after
 * quant_simd.h with SUFFIX and DOT_S16 set: a panel's 16 rows are two vectors of 8 lanes (rows
 * 0-7 and 8-15 are the two 32-byte halves of each 64-byte chunk), and DOT_S16 is vpmaddwd +
 * vpaddd or vpdpwssd. Steps of up to PANEL8_MAX_RA input rows are one pass over a panel; more
 * rows take more passes (the panel stays in L1/L2) until the AVX2 GEMM tile takes over
 * (quant_gemm8.h, which repacks panels with no transpose). The floats are every other path's.
 * Measured with the AVX2 build on the 2-core AMD EPYC Zen 4 (TOKENRELAY_KERNEL_ISA=avx2, in-process
 * A/B against row-major weights, both in huge pages, 2026-12-07): SmolLM2's fused decode layers
 * 1.3-1.5x at 1 row, 1.35x at 4, 0.97-0.99x at 8 and 16, 1.16x at 32 (the GEMM tile). */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define PANEL8_MAX_RA 8 /* input rows a pass (PANEL_PASSES); a half's 8 integer dots, 4 weight vectors, a mask, a broadcast: 14 ymm */

/* Half h (rows 8 h .. 8 h + 7) of a q4p chunk: x[j] = pair 4 s + j of those rows. */
static inline __attribute__((always_inline)) void CAT(panel8_q4, SUFFIX)(const uint8_t *half, __m256i *x) {
    const __m256i words = _mm256_loadu_si256((const __m256i *)half), nibble = _mm256_set1_epi16(0x0F);
    x[0] = _mm256_and_si256(words, nibble);
    x[1] = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);
    x[2] = _mm256_and_si256(_mm256_srli_epi16(words, 8), nibble);
    x[3] = _mm256_srli_epi16(words, 12);
}

/* Weight rows n0.. n0 + 15 (one panel, FMT q4p or q8p) . input rows t.. t + RA - 1. */
static inline __attribute__((always_inline)) void CAT(panel8_tile, SUFFIX)(
    quant_weight w, q16_act a, int64_t n0, int64_t t, const int FMT, const int RA, float *out, int64_t out_stride,
    const float *bias, int mode) {
    const int64_t nb = w.C / 32, at = (n0 / 16) * nb, block_bytes = FMT == QUANT_Q4P ? 256 : 512;
    const uint8_t *qs = (const uint8_t *)w.qs + at * block_bytes;
    const int P = RA == 1 ? 2 : 1; /* independent chains per (row, half) */
    const int16_t *aq = a.qs + t * a.C;
    const float *da = a.d + t * nb;
    float acc[2][PANEL8_MAX_RA][8] __attribute__((aligned(32))); /* floats in L1: registers hold the dots */
    float m_t[FMT == QUANT_Q4P ? nb * 16 : 1] __attribute__((aligned(32)));
    int32_t ab[PANEL8_MAX_RA * 16] __attribute__((aligned(32)));
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < RA; ++c) _mm256_store_ps(acc[h][c], _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; ++b) {
        for (int64_t l = 0; l < block_bytes; l += 64)
            _mm_prefetch((const char *)(qs + (b + 8) * block_bytes + l), _MM_HINT_T0);
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c) {
            const int16_t *p = aq + c * a.C + b * 32;
            _mm256_store_si256((__m256i *)(ab + c * 16), _mm256_loadu_si256((const __m256i *)p));
            _mm256_store_si256((__m256i *)(ab + c * 16 + 8), _mm256_loadu_si256((const __m256i *)(p + 16)));
        }
        __asm__ volatile("" : : "r"(ab) : "memory"); /* the pairs: one base register + constants */
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            __m256i dot[PANEL8_MAX_RA]; /* this half's: RA x P <= 8 */
            #pragma GCC unroll 8
            for (int i = 0; i < RA * P; ++i) dot[i] = _mm256_setzero_si256();
            #pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) {
                __m256i x[4];
                if (FMT == QUANT_Q4P) {
                    CAT(panel8_q4, SUFFIX)(qs + b * 256 + s * 64 + h * 32, x);
                } else {
                    #pragma GCC unroll 4
                    for (int j = 0; j < 4; ++j)
                        x[j] = _mm256_cvtepi8_epi16(
                            _mm_loadu_si128((const __m128i *)(qs + b * 512 + (4 * s + j) * 32 + h * 16)));
                }
                #pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    #pragma GCC unroll 8
                    for (int c = 0; c < RA; ++c) {
                        __m256i *d = dot + c * P + (4 * s + j) % P;
                        *d = DOT_S16(*d, x[j], _mm256_set1_epi32(ab[c * 16 + 4 * s + j]));
                        __asm__("" : "+x"(*d)); /* one chain each (quant_gemm8.h says why) */
                    }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.d + (at + b) * 16 + h * 8)));
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) {
                const __m256i sum = P == 2 ? _mm256_add_epi32(dot[c * P], dot[c * P + 1]) : dot[c * P];
                _mm256_store_ps(acc[h][c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                                           _mm256_mul_ps(dw, _mm256_set1_ps(da[c * nb + b])),
                                                           _mm256_load_ps(acc[h][c])));
            }
        }
        if (FMT == QUANT_Q4P)
            _mm256_store_ps(m_t + b * 16, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.m + (at + b) * 16)))),
            _mm256_store_ps(m_t + b * 16 + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.m + (at + b) * 16 + 8))));
    }
    float res[16 * PANEL8_MAX_RA];
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < RA; ++c) {
            __m256 v = _mm256_load_ps(acc[h][c]);
            if (FMT == QUANT_Q4P) { /* the offset chain, in block order, then added (write16's order) */
                __m256 sum = _mm256_setzero_ps();
                for (int64_t b = 0; b < nb; ++b)
                    sum = _mm256_fmadd_ps(_mm256_load_ps(m_t + b * 16 + h * 8), _mm256_set1_ps(a.ds[(t + c) * nb + b]),
                                          sum);
                v = _mm256_add_ps(v, sum);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, v);
            for (int r = 0; r < 8; ++r) res[(h * 8 + r) * RA + c] = lanes[r];
        }
    CAT(write_tile, SUFFIX)(res, 16, RA, n0, t, out, out_stride, bias, mode);
}

/* One panel at n . the RA input rows from t (PANEL_PASSES). */
#define PANEL8_TILE(RA)                                                                                     \
    (w.format == QUANT_Q4P ? CAT(panel8_tile, SUFFIX)(w, a, n, t, QUANT_Q4P, RA, out, out_stride, bias, mode)  \
                           : CAT(panel8_tile, SUFFIX)(w, a, n, t, QUANT_Q8P, RA, out, out_stride, bias, mode))

/* Rows too few for a GEMM tile: a panel weight panel by panel (PANEL_PASSES); a row-major weight
 * on quant_simd.h's tiles. */
static void CAT(small_task, SUFFIX)(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1,
                                    float *out, int64_t out_stride, const float *bias, int mode) {
    if (!quant_is_panel(w.format)) {
        CAT(quant_task, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    PANEL_PASSES(PANEL8_TILE)
}
#undef PANEL8_TILE
#undef CAT
#undef CAT_
