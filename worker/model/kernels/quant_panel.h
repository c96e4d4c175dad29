/* The AVX-512 VNNI tiles of Q4 weights stored in panels (q4p, quant.h's layout), for steps of
 * fewer rows than the GEMM tile takes (quant_vnni.h): batch-1 and small-batch decode. Included by
 * quant.c after quant_vnni.h, whose transposed words a panel holds as stored.
 *
 * Why panels: row-major Q4 blocks put one (weight row, input row) pair's 32 products across a
 * vector's lanes, and every block then needs a horizontal sum (quant_simd.h's reduce8) plus a
 * widening and two masks per row. At batch 1 on a 2-core AMD EPYC Zen 4 that ran at ~5 cycles a
 * block, compute-bound: the fused layers read their weights at ~9 GB/s a core, far below the
 * machine's bandwidth. A panel keeps 16 rows' weights interleaved so that one 64-byte load,
 * masked and shifted (panel_chunk: 7 ops), gives four vectors whose lane r holds row r's next
 * pair of weights; one vpdpwssd per vector with the input's pair broadcast adds them to each
 * row's lane. No horizontal sum, no shuffle, and each vector serves every input row of the tile.
 * A standalone test (SmolLM2's gate/up, 3072 x 576, one input row, 2026-12-07, this Zen 4): 2.6x
 * the row-major tile in cache, 1.7-2.2x from memory, the same bits. The floats are every other
 * path's: per pair fma(dot, dw * da, acc) in block order, then the offset chain (write16). */

#define PANEL_MAX_RA 8       /* input rows a pass: up to 8 int + 8 float accumulators */
#define PANEL_PREFETCH 8     /* blocks ahead: SmolLM2's batch-1 layers 1.06x faster than with 4 (16: no
                              * better; in-process A/B, 2-core Zen 4, 2026-12-07) */

/* Weight rows n0.. n0 + 15 (one panel, FMT q4p or q8p) . input rows t.. t + RA - 1, written as
 * `mode` says. */
static inline __attribute__((always_inline)) void panel_tile(quant_weight w, q16_act a, int64_t n0, int64_t t,
                                                             const int FMT, const int RA, float *out,
                                                             int64_t out_stride, const float *bias, int mode) {
    const int64_t nb = w.C / 32, at = (n0 / VNNI_ROWS) * nb, block_bytes = FMT == QUANT_Q4P ? 256 : 512;
    const uint8_t *qs = (const uint8_t *)w.qs + at * block_bytes;
    const uint16_t *d = w.d + at * VNNI_ROWS, *m = FMT == QUANT_Q4P ? w.m + at * VNNI_ROWS : NULL;
    /* independent vpdpwssd chains per input row: one chain of 16 per block waited on its latency */
    const int P = RA == 1 ? 4 : RA == 2 ? 2 : 1;
    const int16_t *aq = a.qs + t * a.C;
    const float *da = a.d + t * nb;
    float m_t[FMT == QUANT_Q4P ? nb * VNNI_ROWS : 1] __attribute__((aligned(64))); /* offsets as fp32 */
    int32_t ab[PANEL_MAX_RA * 16] __attribute__((aligned(64))); /* the rows' block b, adjacent (vnni_tile) */
    __m512 acc[PANEL_MAX_RA];
    #pragma GCC unroll 8
    for (int c = 0; c < RA; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        #pragma GCC unroll 8
        for (int64_t l = 0; l < block_bytes; l += 64)
            _mm_prefetch((const char *)(qs + (b + PANEL_PREFETCH) * block_bytes + l), _MM_HINT_T0);
        const int32_t *pairs = (const int32_t *)(aq + b * 32);
        if (RA > 1) {
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) _mm512_store_si512(ab + c * 16, _mm512_loadu_si512(aq + c * a.C + b * 32));
            __asm__ volatile("" : : "r"(ab) : "memory"); /* else GCC reads the pairs from each row again */
            pairs = ab;
        }
        __m512i dot[PANEL_MAX_RA * 4];
        #pragma GCC unroll 8
        for (int i = 0; i < RA * P; ++i) dot[i] = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
            __m512i x[4]; /* x[j]: pair 4 s + j of the 16 rows */
            if (FMT == QUANT_Q4P) {
                panel_chunk(qs + b * 256 + s * 64, x);
            } else {
                #pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    x[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + b * 512 + (4 * s + j) * 32)));
            }
            #pragma GCC unroll 4
            for (int j = 0; j < 4; ++j)
                #pragma GCC unroll 8
                for (int c = 0; c < RA; ++c) /* input row c's words 8 s + 2 j, + 1 of the block */
                    dot[c * P + (4 * s + j) % P] =
                        _mm512_dpwssd_epi32(dot[c * P + (4 * s + j) % P], x[j], _mm512_set1_epi32(pairs[c * 16 + 4 * s + j]));
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * VNNI_ROWS)));
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c) {
            __m512i sum = dot[c * P]; /* integer: exact in any order */
            #pragma GCC unroll 4
            for (int i = 1; i < P; ++i) sum = _mm512_add_epi32(sum, dot[c * P + i]);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(da[c * nb + b])), acc[c]);
        }
        if (FMT == QUANT_Q4P)
            _mm512_store_ps(m_t + b * VNNI_ROWS, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * VNNI_ROWS))));
    }
    write16(acc, m_t, a, nb, n0, t, FMT == QUANT_Q4P ? QUANT_Q4 : QUANT_Q8, RA, out, out_stride, bias, mode);
}

#define PANEL_GROUP(RA)                                                                   \
    case RA:                                                                              \
        if (w.format == QUANT_Q4P) panel_tile(w, a, n0, t, QUANT_Q4P, RA, out, out_stride, bias, mode); \
        else panel_tile(w, a, n0, t, QUANT_Q8P, RA, out, out_stride, bias, mode);                      \
        break;

/* Output rows [n0, n1) x input rows [t0, t1) with fewer rows than the GEMM tile takes (or no
 * memory for its repack): a q4p or q8p weight's panel in groups of up to PANEL_MAX_RA rows, as equal as
 * they can be, each one pass; a row-major weight on quant_simd.h's tiles. */
static void vnni_small_task(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
                            int64_t out_stride, const float *bias, int mode) {
    if (!quant_is_panel(w.format)) {
        quant_task_avx512vnni(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    const int64_t groups = (t1 - t0 + PANEL_MAX_RA - 1) / PANEL_MAX_RA;
    for (int64_t g = 0, t = t0; g < groups; ++g) {
        const int64_t t_next = t0 + (t1 - t0) * (g + 1) / groups;
        switch (t_next - t) {
            PANEL_GROUP(1) PANEL_GROUP(2) PANEL_GROUP(3) PANEL_GROUP(4)
            PANEL_GROUP(5) PANEL_GROUP(6) PANEL_GROUP(7) PANEL_GROUP(8)
        }
        t = t_next;
    }
}
#undef PANEL_GROUP
