/* The AVX2 GEMM tile of the quantized matmul, for steps of 24 or more input rows (prefill chunks,
 * large batches), included by quant.c after quant_simd.h's AVX2 variant (SUFFIX, DOT_S16 as
 * there). quant_vnni.h is the same idea on zmm for AVX-512 VNNI hosts.
 *
 * quant_simd.h's group tiles hold a block's 32 products of one (weight row, input row) pair
 * across a vector's lanes, so each block ends in a horizontal sum (reduce8). Here a task's weight
 * rows are repacked once, 8 at a time, as 16-bit words transposed so that dword k of a ymm holds
 * weights 2k, 2k + 1 of each of the 8 rows (lane = weight row); vpmaddwd with the input row's pair
 * of words broadcast, plus vpaddd, adds both products to every row's lane, and 16 of them leave
 * each lane holding the block's whole integer dot: no horizontal sum. A pass runs 16 weight rows
 * (two repacks) against up to G8_MAX_RA = 6 input rows, so each broadcast pair feeds two vpmaddwd
 * and each weight vector read from L1 six. The floats are every other path's (quant_simd.h: per
 * pair fma(dot, dw * da, acc) in block order, then the Q4 offset chain), so the bits are those of
 * the SIMD tiles, AVX-512's, AMX's and portable C's.
 * Measured (2-core AMD EPYC Zen 3, AVX2 only, 2026-12-06, SmolLM2's linears, A/B alternating in
 * one process, 5 rounds, this tile over quant_simd.h's): 8 weight rows x 12 input rows, one
 * vpmaddwd per broadcast, 1.1-1.2x at 64-512 rows; 16 x 6, 1.23-1.33x; with the offset chains
 * interleaved and SwiGLU in 8 lanes (g8_write), 1.37-1.75x; 9-24 rows 1.01-1.21x, 5-8 rows
 * 0.82-0.96x. Inside a step the repack costs more: the fused decode layers at 16 rows ran 0.955x
 * and the LM head (30 MB streamed) 0.765x, at 24 rows 1.14x and 1.02x, at 32 1.15x and 1.10x; so
 * steps of fewer than 24 rows keep quant_simd.h's tiles. */

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define G8_ROWS 8     /* weight rows a repack holds: one per lane of a ymm */
#define G8_MAX_RA 6   /* input rows a pass: 2 x 6 integer dots, 2 weight vectors, a broadcast: 15 ymm */
#ifndef G8_MIN_ROWS
#define G8_MIN_ROWS 24 /* fewer input rows go to quant_panel8.h's or quant_simd.h's tiles (above) */
#endif

/* r[k] = column k of the 8 x 8 dwords r[0..7] (rows in, columns out): 24 shuffles. */
static inline __attribute__((always_inline)) void CAT(transpose8, SUFFIX)(__m256i *r) {
    __m256i a[8], b[8];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) { /* per 128-bit lane: [x0 y0 x1 y1], [x2 y2 x3 y3] of rows 2i, 2i + 1 */
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    #pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) { /* b[4i + c], lane L: column 4L + c of rows 4i..4i + 3 */
        b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
        r[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
    }
}

/* Weight rows n0.. n0 + 7, every block: words (nb, 16, 8) int32, dword k of block b of row r at
 * [b][k][r]; their scales (and Q4 offsets) as fp32, dw_t (nb, 8) (m_t (nb, 8)). */
static void CAT(repack8, SUFFIX)(quant_weight w, int64_t n0, int32_t *words, float *dw_t, float *m_t) {
    const int64_t nb = w.C / 32, row_bytes = w.format == QUANT_Q4 ? w.C / 2 : w.C;
    const int64_t block_bytes = w.format == QUANT_Q4 ? 16 : 32;
    if (quant_is_panel(w.format)) { /* a panel half holds these words as they are (quant_panel8.h) */
        const int64_t at = (n0 / 16) * nb, h = (n0 % 16) / G8_ROWS;
        for (int64_t b = 0; b < nb; ++b) {
            for (int s = 0; s < 4; ++s) {
                __m256i x[4];
                if (w.format == QUANT_Q4P)
                    CAT(panel8_q4, SUFFIX)((const uint8_t *)w.qs + (at + b) * 256 + s * 64 + h * 32, x);
                else
                    for (int j = 0; j < 4; ++j)
                        x[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                            (const __m128i *)((const uint8_t *)w.qs + (at + b) * 512 + (4 * s + j) * 32 + h * 16)));
                for (int j = 0; j < 4; ++j)
                    _mm256_store_si256((__m256i *)(words + (b * 16 + 4 * s + j) * G8_ROWS), x[j]);
            }
            for (int r = 0; r < G8_ROWS; ++r) {
                dw_t[b * G8_ROWS + r] = half_to_float(w.d[(at + b) * 16 + h * G8_ROWS + r]);
                if (w.format == QUANT_Q4P) m_t[b * G8_ROWS + r] = half_to_float(w.m[(at + b) * 16 + h * G8_ROWS + r]);
            }
        }
        return;
    }
    for (int64_t b = 0; b < nb; ++b) {
        __m256i x[2 * G8_ROWS]; /* x[r]: dwords 0..7 of row r, x[8 + r]: dwords 8..15 */
        for (int r = 0; r < G8_ROWS; ++r) {
            const uint8_t *p = (const uint8_t *)w.qs + (n0 + r) * row_bytes + b * block_bytes;
            if (w.format == QUANT_Q4) { /* byte j = u_j | u_{j+16} << 4 */
                const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
                x[r] = _mm256_and_si256(u, _mm256_set1_epi16(0x0F));
                x[G8_ROWS + r] = _mm256_srli_epi16(u, 4);
            } else {
                x[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
                x[G8_ROWS + r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
            }
        }
        CAT(transpose8, SUFFIX)(x);
        CAT(transpose8, SUFFIX)(x + G8_ROWS);
        for (int k = 0; k < 16; ++k) _mm256_store_si256((__m256i *)(words + (b * 16 + k) * G8_ROWS), x[k]);
        for (int r = 0; r < G8_ROWS; ++r) {
            dw_t[b * G8_ROWS + r] = half_to_float(w.d[(n0 + r) * nb + b]);
            if (w.format == QUANT_Q4) m_t[b * G8_ROWS + r] = half_to_float(w.m[(n0 + r) * nb + b]);
        }
    }
}

/* acc (RA, 8): input row c's dots with weight rows n0.. n0 + 7 (repacked: m_t); for Q4 the offset
 * chains are added (quant_simd.h's order; the RA chains interleaved: one after another they waited
 * on the fma's latency), then each is written as write_tile would: + bias (0 without), then
 * stored, added, or for QUANT_SILU_MUL the 4 (gate, up) pairs of lanes through silu_mul8. */
static inline __attribute__((always_inline)) void CAT(g8_write, SUFFIX)(
    float *acc, const float *m_t, q16_act a, int64_t nb, int64_t n0, int64_t t, const int FMT, const int RA,
    float *out, int64_t out_stride, const float *bias, int mode) {
    if (FMT == QUANT_Q4) {
        const float *ds = a.ds + t * nb;
        __m256 sum[G8_MAX_RA];
        #pragma GCC unroll 12
        for (int c = 0; c < RA; ++c) sum[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const __m256 m = _mm256_load_ps(m_t + b * G8_ROWS);
            #pragma GCC unroll 12
            for (int c = 0; c < RA; ++c) sum[c] = _mm256_fmadd_ps(m, _mm256_set1_ps(ds[c * nb + b]), sum[c]);
        }
        #pragma GCC unroll 12
        for (int c = 0; c < RA; ++c)
            _mm256_store_ps(acc + c * G8_ROWS, _mm256_add_ps(_mm256_load_ps(acc + c * G8_ROWS), sum[c]));
    }
    const __m256 bv = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    if (mode != QUANT_SILU_MUL) { /* input row c's 8 outputs are adjacent */
        #pragma GCC unroll 12
        for (int c = 0; c < RA; ++c) {
            float *o = out + (t + c) * out_stride + n0;
            const __m256 v = _mm256_add_ps(_mm256_load_ps(acc + c * G8_ROWS), bv);
            _mm256_storeu_ps(o, mode == QUANT_ADD ? _mm256_add_ps(_mm256_loadu_ps(o), v) : v);
        }
        return;
    }
    /* lanes 2i, 2i + 1 are gate_i, up_i: two input rows' 4 pairs in one silu_mul8 */
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    #pragma GCC unroll 6
    for (int c = 0; c < RA; c += 2) {
        const int c1 = c + 1 < RA ? c + 1 : c; /* an odd last row pairs with itself */
        const __m256 v0 = _mm256_add_ps(_mm256_load_ps(acc + c * G8_ROWS), bv);
        const __m256 v1 = _mm256_add_ps(_mm256_load_ps(acc + c1 * G8_ROWS), bv);
        /* [g0 g1 of c, g0 g1 of c1 | g2 g3 of c, g2 g3 of c1], u likewise */
        const __m256 s = _mm256_permutevar8x32_ps(
            CAT(silu_mul8, SUFFIX)(_mm256_shuffle_ps(v0, v1, 0x88), _mm256_shuffle_ps(v0, v1, 0xDD)), order);
        _mm_storeu_ps(out + (t + c) * out_stride + n0 / 2, _mm256_castps256_ps128(s));
        if (c1 != c) _mm_storeu_ps(out + (t + c1) * out_stride + n0 / 2, _mm256_extractf128_ps(s, 1));
    }
}

/* 16 repacked weight rows n0.. (repack g = 0, 1 at words + g * nb * 128, dw_t and m_t + g * nb * 8)
 * . input rows t.. t + RA - 1, RA <= 6: each broadcast pair feeds both repacks' vectors. */
static inline __attribute__((always_inline)) void CAT(g8_tile, SUFFIX)(
    q16_act a, const int32_t *words, const float *dw_t, const float *m_t, int64_t nb, int64_t n0, int64_t t,
    const int FMT, const int RA, float *out, int64_t out_stride, const float *bias, int mode) {
    const int16_t *aq = a.qs + t * a.C;
    const float *da = a.d + t * nb;
    const int64_t stride = nb * 16 * G8_ROWS; /* one repack's words */
    /* the float accumulators live in L1: the 16 registers hold the integer dots */
    float acc[2][G8_MAX_RA * G8_ROWS] __attribute__((aligned(32)));
    int32_t ab[G8_MAX_RA * 16] __attribute__((aligned(32))); /* the group's block b, rows adjacent */
    #pragma GCC unroll 6
    for (int c = 0; c < RA; ++c)
        for (int g = 0; g < 2; ++g) _mm256_store_ps(acc[g] + c * G8_ROWS, _mm256_setzero_ps());
    for (int64_t b = 0; b < nb; ++b) {
        __m256i dot[2][G8_MAX_RA];
        #pragma GCC unroll 6
        for (int c = 0; c < RA; ++c) {
            const int16_t *p = aq + c * a.C + b * 32;
            _mm256_store_si256((__m256i *)(ab + c * 16), _mm256_loadu_si256((const __m256i *)p));
            _mm256_store_si256((__m256i *)(ab + c * 16 + 8), _mm256_loadu_si256((const __m256i *)(p + 16)));
            dot[0][c] = dot[1][c] = _mm256_setzero_si256();
        }
        __asm__ volatile("" : : "r"(ab) : "memory"); /* the pairs below: one base register + constants */
        #pragma GCC unroll 16
        for (int k = 0; k < 16; ++k) {
            const __m256i w0 = _mm256_load_si256((const __m256i *)(words + (b * 16 + k) * G8_ROWS));
            const __m256i w1 = _mm256_load_si256((const __m256i *)(words + stride + (b * 16 + k) * G8_ROWS));
            #pragma GCC unroll 6
            for (int c = 0; c < RA; ++c) { /* input row c's words 2k, 2k + 1 of the block */
                const __m256i pair = _mm256_set1_epi32(ab[c * 16 + k]);
                dot[0][c] = DOT_S16(dot[0][c], w0, pair);
                dot[1][c] = DOT_S16(dot[1][c], w1, pair);
                /* one chain per dot, in registers: GCC otherwise reassociates the 16 integer adds
                 * into a tree, computing every product first and spilling them to the stack */
                __asm__("" : "+x"(dot[0][c]), "+x"(dot[1][c]));
            }
        }
        for (int g = 0; g < 2; ++g) {
            const __m256 dw = _mm256_load_ps(dw_t + (g * nb + b) * G8_ROWS);
            #pragma GCC unroll 6
            for (int c = 0; c < RA; ++c)
                _mm256_store_ps(acc[g] + c * G8_ROWS,
                                _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[g][c]),
                                                _mm256_mul_ps(dw, _mm256_set1_ps(da[c * nb + b])),
                                                _mm256_load_ps(acc[g] + c * G8_ROWS)));
        }
        __asm__ volatile("" : : "r"(acc) : "memory"); /* keep them there */
    }
    for (int g = 0; g < 2; ++g)
        CAT(g8_write, SUFFIX)(acc[g], m_t + g * nb * G8_ROWS, a, nb, n0 + g * G8_ROWS, t, FMT, RA, out, out_stride,
                              bias, mode);
}

#define G8_GROUP(RA)                                                                                          \
    case RA:                                                                                                  \
        if (quant_has_offset(FMT))                                                                            \
            CAT(g8_tile, SUFFIX)(a, words, dw_t, m_t, nb, n, t, QUANT_Q4, RA, out, out_stride, bias, mode);   \
        else                                                                                                  \
            CAT(g8_tile, SUFFIX)(a, words, dw_t, m_t, nb, n, t, QUANT_Q8, RA, out, out_stride, bias, mode);   \
        break;

/* A task of quant_matmul_body: output rows [n0, n1) x input rows [t0, t1). With G8_MIN_ROWS or more
 * input rows, each whole 16 weight rows are repacked and run here in groups of up to 6 input rows,
 * as equal as they can be; the rest (fewer rows, or a task's last 1-15 weight rows: rare, as
 * models' widths are multiples of 16) goes to quant_simd.h's tiles, which give the same floats. */
static void CAT(g8_task, SUFFIX)(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1,
                                 float *out, int64_t out_stride, const float *bias, int mode) {
    const int64_t nb = w.C / 32, whole = n0 + (n1 - n0) / (2 * G8_ROWS) * (2 * G8_ROWS);
    int32_t *words = t1 - t0 >= G8_MIN_ROWS && whole > n0 ? aligned_alloc(32, (size_t)nb * 16 * G8_ROWS * 4 * 2) : NULL;
    float *dw_t = words ? aligned_alloc(32, (size_t)nb * G8_ROWS * sizeof(float) * 4) : NULL;
    if (dw_t == NULL) { /* too few rows, or no memory for the repack: the simd tiles need none */
        free(words);
        CAT(small_task, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    const int FMT = w.format;
    float *m_t = dw_t + 2 * nb * G8_ROWS;
    const int64_t groups = (t1 - t0 + G8_MAX_RA - 1) / G8_MAX_RA;
    for (int64_t n = n0; n < whole; n += 2 * G8_ROWS) {
        for (int g = 0; g < 2; ++g)
            CAT(repack8, SUFFIX)(w, n + g * G8_ROWS, words + g * nb * 16 * G8_ROWS, dw_t + g * nb * G8_ROWS,
                                 m_t + g * nb * G8_ROWS);
        for (int64_t g = 0, t = t0; g < groups; ++g) {
            const int64_t t_next = t0 + (t1 - t0) * (g + 1) / groups;
            switch (t_next - t) { /* 24 or more rows in groups of at most 6: 4 to 6 each */
                G8_GROUP(4) G8_GROUP(5) G8_GROUP(6)
                default: CAT(small_task, SUFFIX)(w, a, n, n + 2 * G8_ROWS, t, t_next, out, out_stride, bias, mode);
            }
            t = t_next;
        }
    }
    if (whole < n1) CAT(small_task, SUFFIX)(w, a, whole, n1, t0, t1, out, out_stride, bias, mode);
    free(words), free(dw_t);
}
#undef G8_GROUP
#undef CAT
#undef CAT_
