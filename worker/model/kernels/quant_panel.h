/* The AVX-512 VNNI tiles of Q4 weights stored in panels (q4p, quant.h's layout), for steps of
 * fewer rows than the GEMM tile takes (quant_vnni.h): batch-1 and small-batch decode. Included by
 * quant.c after quant_vnni.h, whose transposed words a panel holds as stored.
 *
 * Why panels: row-major Q4 blocks put one (weight row, input row) pair's 32 products across a
 * vector's lanes, and every block then needs a horizontal sum (quant_simd.h's reduce8) plus a
 * widening and two masks per row. At batch 1 on a 2-core AMD EPYC Zen 4 that ran at ~5 cycles a
 * block, compute-bound: the fused layers read their weights at ~9 GB/s a core, far below the
 * machine's bandwidth. A panel keeps 16 rows' weights interleaved so that one 64-byte load,
 * masked and shifted, gives vectors whose lane r holds row r's next weights; one dot
 * instruction per vector with the input's matching weights broadcast adds them to each row's
 * lane. No horizontal sum, and each vector serves every input row of the tile. q4p runs on
 * bytes (vpdpbusd, 3 ops a chunk: panel_byte_order says how), q8p on 16-bit words (vpdpwssd).
 * A standalone test (SmolLM2's gate/up, 3072 x 576, one input row, 2026-12-07, this Zen 4): 2.6x
 * the row-major tile in cache, 1.7-2.2x from memory, the same bits. The floats are every other
 * path's: per pair fma(dot, dw * da, acc) in block order, then the offset chain (write16). */

#define PANEL_MAX_RA 8       /* input rows a pass (PANEL_PASSES): up to 8 int + 8 float accumulators */
#define PANEL_PREFETCH 8     /* blocks ahead: SmolLM2's batch-1 layers 1.06x faster than with 4 (16: no
                              * better; in-process A/B, 2-core Zen 4, 2026-12-07) */

/* q4p with bytes, not words: a chunk's dword in lane r holds row r's weights 8 s .. 8 s + 7
 * (quant.h), so its low nibbles are the bytes (w0, w4, w1, w5) and its high nibbles (w2, w6, w3,
 * w7): two ANDs and a shift where words took seven ops. vpdpbusd multiplies bytes, so each
 * 16-bit input a = 256 ah + al is split in its signed high byte ah and unsigned low byte al:
 * dot(w, a) = 256 dot(w, ah) + dot(w, al), both integer and exact, so the block's sum (and
 * every float after it) is the one vpdpwssd gave. panel_byte_order() puts a chunk's 16 input
 * bytes (a 128-bit lane of the block: al0 ah0 .. al7 ah7) in the dwords the nibbles need:
 * (ah0 ah4 ah1 ah5), (al0 al4 al1 al5), (ah2 ah6 ah3 ah7), (al2 al6 al3 al7).
 * Measured with quant.c's one run of panels a thread, against words and a call per panel: the
 * fused layers at batch 1 1.15x (medians of 15 alternating rounds, each round 0.93-1.23x), 2-8
 * rows 1.06-1.13x, 16 rows 1.04x (in-process A/B, SmolLM2 Q4_1, 2-core Zen 4, 2026-12-07). */
static inline __m512i panel_byte_order(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(1, 9, 3, 11, 0, 8, 2, 10, 5, 13, 7, 15, 4, 12, 6, 14));
}

/* Weight rows n0.. n0 + 15 (one panel, FMT q4p or q8p) . input rows t.. t + RA - 1, written as
 * `mode` says. */
static inline __attribute__((always_inline)) void panel_tile(quant_weight w, q16_act a, int64_t n0, int64_t t,
                                                             const int FMT, const int RA, float *out,
                                                             int64_t out_stride, const float *bias, int mode) {
    const int64_t nb = w.C / 32, at = (n0 / VNNI_ROWS) * nb, block_bytes = FMT == QUANT_Q4P ? 256 : 512;
    const uint8_t *qs = (const uint8_t *)w.qs + at * block_bytes;
    const uint16_t *d = w.d + at * VNNI_ROWS, *m = FMT == QUANT_Q4P ? w.m + at * VNNI_ROWS : NULL;
    /* independent dot chains per input row: one chain a block waited on its latency */
    const int P = RA == 1 ? 4 : RA == 2 ? 2 : 1;
    const int16_t *aq = a.qs + t * a.C;
    const float *da = a.d + t * nb;
    float m_t[FMT == QUANT_Q4P ? nb * VNNI_ROWS : 1] __attribute__((aligned(64))); /* offsets as fp32 */
    int32_t ab[PANEL_MAX_RA * 16] __attribute__((aligned(64))); /* the rows' block b, adjacent (vnni_tile) */
    const __m512i order = panel_byte_order(), nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[PANEL_MAX_RA];
    #pragma GCC unroll 8
    for (int c = 0; c < RA; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        #pragma GCC unroll 8
        for (int64_t l = 0; l < block_bytes; l += 64)
            _mm_prefetch((const char *)(qs + (b + PANEL_PREFETCH) * block_bytes + l), _MM_HINT_T0);
        const int32_t *pairs = (const int32_t *)(aq + b * 32);
        if (FMT == QUANT_Q4P || RA > 1) {
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) {
                const __m512i row = _mm512_loadu_si512(aq + c * a.C + b * 32);
                _mm512_store_si512(ab + c * 16, FMT == QUANT_Q4P ? _mm512_shuffle_epi8(row, order) : row);
            }
            __asm__ volatile("" : : "r"(ab) : "memory"); /* else GCC reads the pairs from each row again */
            pairs = ab;
        }
        __m512i dot[PANEL_MAX_RA * 4], sums[PANEL_MAX_RA]; /* sums[c]: input row c's block dot products */
        if (FMT == QUANT_Q4P) {
            /* input row c's products with its high bytes in dot[c HALF + i] (times 256 below),
             * with its low bytes in lo[c HALF + i]: HALF independent chains of each */
            const int HALF = P > 1 ? P / 2 : 1;
            __m512i lo[PANEL_MAX_RA * 2];
            #pragma GCC unroll 8
            for (int i = 0; i < RA * HALF; ++i) dot[i] = lo[i] = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) {
                const __m512i words = _mm512_loadu_si512(qs + b * 256 + s * 64);
                const __m512i x0 = _mm512_and_si512(words, nibble);
                const __m512i x1 = _mm512_and_si512(_mm512_srli_epi16(words, 4), nibble);
                #pragma GCC unroll 8
                for (int c = 0; c < RA; ++c) {
                    const int i = c * HALF + s % HALF;
                    const int32_t *g = pairs + c * 16 + 4 * s;
                    dot[i] = _mm512_dpbusd_epi32(dot[i], x0, _mm512_set1_epi32(g[0]));
                    lo[i] = _mm512_dpbusd_epi32(lo[i], _mm512_set1_epi32(g[1]), x0);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], x1, _mm512_set1_epi32(g[2]));
                    lo[i] = _mm512_dpbusd_epi32(lo[i], _mm512_set1_epi32(g[3]), x1);
                }
            }
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) {
                __m512i high = dot[c * HALF], low = lo[c * HALF];
                #pragma GCC unroll 4
                for (int i = 1; i < HALF; ++i) {
                    high = _mm512_add_epi32(high, dot[c * HALF + i]);
                    low = _mm512_add_epi32(low, lo[c * HALF + i]);
                }
                sums[c] = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
            }
        } else {
            #pragma GCC unroll 8
            for (int i = 0; i < RA * P; ++i) dot[i] = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int s = 0; s < 4; ++s) {
                __m512i x[4]; /* x[j]: pair 4 s + j of the 16 rows */
                #pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    x[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qs + b * 512 + (4 * s + j) * 32)));
                #pragma GCC unroll 4
                for (int j = 0; j < 4; ++j)
                    #pragma GCC unroll 8
                    for (int c = 0; c < RA; ++c) /* input row c's words 8 s + 2 j, + 1 of the block */
                        dot[c * P + (4 * s + j) % P] =
                            _mm512_dpwssd_epi32(dot[c * P + (4 * s + j) % P], x[j], _mm512_set1_epi32(pairs[c * 16 + 4 * s + j]));
            }
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) {
                sums[c] = dot[c * P]; /* integer: exact in any order */
                #pragma GCC unroll 4
                for (int i = 1; i < P; ++i) sums[c] = _mm512_add_epi32(sums[c], dot[c * P + i]);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * VNNI_ROWS)));
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c)
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[c]), _mm512_mul_ps(dw, _mm512_set1_ps(da[c * nb + b])), acc[c]);
        if (FMT == QUANT_Q4P)
            _mm512_store_ps(m_t + b * VNNI_ROWS, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + b * VNNI_ROWS))));
    }
    write16(acc, m_t, a, nb, n0, t, FMT == QUANT_Q4P ? QUANT_Q4 : QUANT_Q8, RA, out, out_stride, bias, mode);
}

/* One panel at n . the RA input rows from t (PANEL_PASSES). */
#define PANEL_TILE(RA)                                                                             \
    (w.format == QUANT_Q4P ? panel_tile(w, a, n, t, QUANT_Q4P, RA, out, out_stride, bias, mode)      \
                           : panel_tile(w, a, n, t, QUANT_Q8P, RA, out, out_stride, bias, mode))

/* Output rows [n0, n1) x input rows [t0, t1) with fewer rows than the GEMM tile takes (or no
 * memory for its repack): a q4p or q8p weight panel by panel (PANEL_PASSES); a row-major weight
 * on quant_simd.h's tiles. */
static void vnni_small_task(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
                            int64_t out_stride, const float *bias, int mode) {
    if (!quant_is_panel(w.format)) {
        quant_task_avx512vnni(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    PANEL_PASSES(PANEL_TILE)
}
#undef PANEL_TILE
