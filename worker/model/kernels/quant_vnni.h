/* The AVX-512 VNNI GEMM tile of the quantized matmul, for steps with many input rows (prefill
 * chunks, large batches) on CPUs without AMX (AMD Zen 4/5, Ice Lake), included by quant.c after
 * the AVX-512 VNNI variant of quant_simd.h. quant_amx.h shares its repack.
 *
 * quant_simd.h's tiles hold a block's 32 products of one (weight row, input row) pair across a
 * vector's lanes, so every block needs a horizontal sum (reduce8: ~20 shuffles and adds per 16
 * dot instructions). Here a task's 16 weight rows are repacked once, as 16-bit words transposed
 * so that dword k of a zmm holds weights 2k, 2k + 1 of each of the 16 rows (lane = weight row).
 * One vpdpwssd with the input row's pair of words broadcast (vpbroadcastd from L1) then adds
 * those 2 products to each row's lane, and 16 of them leave each lane holding the block's whole
 * integer dot: no horizontal sum at all, the weights read from L1 once for up to VNNI_MAX_RA
 * input rows. The floats that follow are every other path's (quant_simd.h): per pair,
 * fma(dot, dw * da, acc) in block order, then the Q4 offset term's own chain, so the results
 * are bit for bit those of the other tiles, AMX's and the portable C path's.
 * quant_gemm8.h is the AVX2 version (vpmaddwd + vpaddd; GCC must be kept from reassociating
 * those adds: a first try that let it ran 0.72-0.96x the SIMD tiles). */

#define VNNI_ROWS 16   /* weight rows a repacked task holds: one per lane of a zmm */
#define VNNI_MAX_RA 12 /* input rows a pass: 12 int + 12 float accumulators of the 32 zmm */
/* Fewer input rows go to quant_simd.h's tiles: up to 8 are one pass there too, with no repack
 * (2-core AMD EPYC Zen 4, 2 threads, us, SmolLM2's linears, simd tiles then this one: gate/up
 * 8 rows 220 vs 228, 12 rows 358 vs 262, 16 535 vs 428, 64 1,466 vs 886, 512 11,661 vs 6,453;
 * down 8 rows 99 vs 110, 64 675 vs 435, 512 5,259 vs 3,229; wo 512 2,046 vs 1,173). */
#define VNNI_MIN_ROWS 9

/* r[k] = column k of the 16 x 16 dwords r[0..15] (rows in, columns out): 64 shuffles. */
static inline void transpose16(__m512i *r) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; ++i) { /* per 128-bit lane: [x0 y0 x1 y1], [x2 y2 x3 y3] of rows 2i, 2i + 1 */
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) { /* b[4i + c], lane L: column 4L + c of rows 4i..4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; ++c) { /* column 4L + c: lane L of b[c], b[4 + c], b[8 + c], b[12 + c] */
        const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        const __m512i e2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        const __m512i e3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(e0, e2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(e0, e2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(e1, e3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(e1, e3, 0xDD);
    }
}

/* One 64-byte chunk s of a q4p panel's block (quant.h): x[j] = dword 4 s + j of every row (its
 * weights 8 s + 2 j and + 1 as 16-bit words), lane r = the panel's row r. Seven ops, no shuffle. */
static inline __attribute__((always_inline)) void panel_chunk(const void *chunk, __m512i *x) {
    const __m512i words = _mm512_loadu_si512(chunk), nibble = _mm512_set1_epi16(0x0F);
    x[0] = _mm512_and_si512(words, nibble);
    x[1] = _mm512_and_si512(_mm512_srli_epi16(words, 4), nibble);
    x[2] = _mm512_and_si512(_mm512_srli_epi16(words, 8), nibble);
    x[3] = _mm512_srli_epi16(words, 12);
}

/* Block b of weight rows n0.. n0 + 15 as 16-bit words, transposed: x[k] = dword k (weights 2k,
 * 2k + 1) of every row, lane n = row n0 + n. Also the rows' scales (and Q4 offsets) of the
 * block as fp32, dw_b[n] (m_b[n]). A q4p panel holds its words that way already. */
static inline void repack16_block(quant_weight w, int64_t n0, int64_t b, const int FMT, __m512i *x, float *dw_b,
                                  float *m_b) {
    const int64_t nb = w.C / 32, row_bytes = FMT == QUANT_Q4 ? w.C / 2 : w.C;
    if (quant_is_panel(FMT)) {
        const int64_t at = (n0 / VNNI_ROWS) * nb + b;
        if (FMT == QUANT_Q4P)
            for (int s = 0; s < 4; ++s) panel_chunk((const uint8_t *)w.qs + at * 256 + s * 64, x + 4 * s);
        else /* q8p: pair k of the 16 rows is 32 bytes, widened in one op */
            for (int k = 0; k < 16; ++k)
                x[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)w.qs + at * 512 + k * 32)));
        _mm512_storeu_ps(dw_b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w.d + at * VNNI_ROWS))));
        if (FMT == QUANT_Q4P)
            _mm512_storeu_ps(m_b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w.m + at * VNNI_ROWS))));
        return;
    }
    for (int n = 0; n < VNNI_ROWS; ++n) {
        const uint8_t *p = (const uint8_t *)w.qs + (n0 + n) * row_bytes + b * (FMT == QUANT_Q4 ? 16 : 32);
        if (FMT == QUANT_Q4) { /* byte j = u_j | u_{j+16} << 4 */
            const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
            x[n] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(u, _mm256_set1_epi16(0x0F))),
                                      _mm256_srli_epi16(u, 4), 1);
        } else {
            x[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
        }
    }
    transpose16(x);
    for (int n = 0; n < VNNI_ROWS; ++n) {
        dw_b[n] = half_to_float(w.d[(n0 + n) * nb + b]);
        if (FMT == QUANT_Q4) m_b[n] = half_to_float(w.m[(n0 + n) * nb + b]);
    }
}

/* The offset term and the output of a 16-weight-row tile: acc[c] (lane r) is weight row n0 + r
 * . input row t + c; for Q4 its offset chain sum_b m_b * (da * sa)_b is added, then it is written
 * as `mode` says (as write_tile does). */
static inline __attribute__((always_inline)) void write16(__m512 *acc, const float *m_t, q16_act a, int64_t nb,
                                                          int64_t n0, int64_t t, const int FMT, const int RA,
                                                          float *out, int64_t out_stride, const float *bias,
                                                          int mode) {
    if (FMT == QUANT_Q4) {
        const float *ds = a.ds + t * nb;
        #pragma GCC unroll 16
        for (int c = 0; c < RA; ++c) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(m_t + b * VNNI_ROWS), _mm512_set1_ps(ds[c * nb + b]), sum);
            acc[c] = _mm512_add_ps(acc[c], sum);
        }
    }
    if (mode != QUANT_SILU_MUL) { /* input row c's 16 outputs are adjacent: write_tile's adds, 16 at a time */
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int c = 0; c < RA; ++c) {
            float *o = out + (t + c) * out_stride + n0;
            const __m512 v = bias ? _mm512_add_ps(acc[c], bv) : acc[c];
            _mm512_storeu_ps(o, mode == QUANT_ADD ? _mm512_add_ps(_mm512_loadu_ps(o), v) : v);
        }
        return;
    }
    float lanes[VNNI_ROWS][VNNI_ROWS], res[VNNI_ROWS * VNNI_ROWS];
    #pragma GCC unroll 16
    for (int c = 0; c < RA; ++c) _mm512_storeu_ps(lanes[c], acc[c]);
    for (int r = 0; r < VNNI_ROWS; ++r)
        for (int c = 0; c < RA; ++c) res[r * RA + c] = lanes[c][r];
    write_tile_avx512vnni(res, VNNI_ROWS, RA, n0, t, out, out_stride, bias, mode);
}

/* Weight rows n0.. n0 + 15 (repacked: words, dw_t, m_t) . input rows t.. t + RA - 1. */
static inline __attribute__((always_inline)) void vnni_tile(q16_act a, const int32_t *words, const float *dw_t,
                                                            const float *m_t, int64_t nb, int64_t n0, int64_t t,
                                                            const int FMT, const int RA, float *out,
                                                            int64_t out_stride, const float *bias, int mode) {
    const int16_t *aq = a.qs + t * a.C;
    const float *da = a.d + t * nb;
    __m512 acc[VNNI_MAX_RA];
    #pragma GCC unroll 16
    for (int c = 0; c < RA; ++c) acc[c] = _mm512_setzero_ps();
    /* the group's block b, rows adjacent: each pair below is then one base register plus a
     * constant, read by vpdpwssd's own broadcast (with a row pointer each, GCC ran out of
     * registers and kept them on the stack) */
    int32_t ab[VNNI_MAX_RA * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dot[VNNI_MAX_RA];
        const int16_t *p = aq + b * 32;
        #pragma GCC unroll 16
        for (int c = 0; c < RA; ++c, p += a.C) {
            _mm512_store_si512(ab + c * 16, _mm512_loadu_si512(p));
            dot[c] = _mm512_setzero_si512();
        }
        __asm__ volatile("" : : "r"(ab) : "memory"); /* else GCC reads the pairs from p again */
        #pragma GCC unroll 16
        for (int k = 0; k < 16; ++k) {
            const __m512i wk = _mm512_load_si512(words + b * 256 + k * 16);
            #pragma GCC unroll 16
            for (int c = 0; c < RA; ++c) /* input row c's words 2k, 2k + 1 of the block */
                dot[c] = _mm512_dpwssd_epi32(dot[c], wk, _mm512_set1_epi32(ab[c * 16 + k]));
        }
        const __m512 dw = _mm512_loadu_ps(dw_t + b * VNNI_ROWS);
        #pragma GCC unroll 16
        for (int c = 0; c < RA; ++c)
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[c]), _mm512_mul_ps(dw, _mm512_set1_ps(da[c * nb + b])),
                                     acc[c]);
    }
    write16(acc, m_t, a, nb, n0, t, FMT, RA, out, out_stride, bias, mode);
}

/* Input rows t.. t + RA - 1 against the repacked task, RA known at compile time. */
#define VNNI_GROUP(RA)                                                                                        \
    case RA:                                                                                              \
        if (quant_has_offset(FMT)) vnni_tile(a, words, dw_t, m_t, nb, n0, t, QUANT_Q4, RA, out, out_stride, bias, mode); \
        else vnni_tile(a, words, dw_t, m_t, nb, n0, t, QUANT_Q8, RA, out, out_stride, bias, mode);               \
        break;

/* A task of quant_matmul_body: output rows [n0, n1) x input rows [t0, t1). 16 weight rows and at
 * least VNNI_MIN_ROWS input rows are repacked and run here, in groups of up to VNNI_MAX_RA rows
 * as equal as they can be; anything else goes to quant_simd.h's tiles (the same floats). */
static void vnni_task(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
                      int64_t out_stride, const float *bias, int mode) {
    const int64_t nb = w.C / 32;
    int32_t *words = n1 - n0 == VNNI_ROWS && t1 - t0 >= VNNI_MIN_ROWS ? aligned_alloc(64, (size_t)nb * 1024) : NULL;
    float *dw_t = words ? aligned_alloc(64, (size_t)nb * VNNI_ROWS * sizeof(float) * 2) : NULL;
    if (dw_t == NULL) { /* too few rows, or no memory for the repack: the simd tiles need none */
        free(words);
        vnni_small_task(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    const int FMT = w.format;
    float *m_t = dw_t + nb * VNNI_ROWS;
    for (int64_t b = 0; b < nb; ++b) {
        __m512i x[VNNI_ROWS];
        repack16_block(w, n0, b, FMT, x, dw_t + b * VNNI_ROWS, m_t + b * VNNI_ROWS);
        for (int k = 0; k < 16; ++k) _mm512_store_si512(words + b * 256 + k * 16, x[k]);
    }
    const int64_t groups = (t1 - t0 + VNNI_MAX_RA - 1) / VNNI_MAX_RA;
    for (int64_t g = 0, t = t0; g < groups; ++g) {
        const int64_t t_next = t0 + (t1 - t0) * (g + 1) / groups;
        switch (t_next - t) {
            /* 9 or more rows in groups of at most 12, as equal as they can be: 6 to 12 each */
            VNNI_GROUP(6) VNNI_GROUP(7) VNNI_GROUP(8) VNNI_GROUP(9) VNNI_GROUP(10) VNNI_GROUP(11)
            VNNI_GROUP(12)
            default: /* never with VNNI_MIN_ROWS 9; fewer rows would run here */
                vnni_small_task(w, a, n0, n1, t, t_next, out, out_stride, bias, mode);
        }
        t = t_next;
    }
    free(words), free(dw_t);
}
#undef VNNI_GROUP
