/* One instruction set's quantized-matmul task, included by quant.c once per target with
 * SUFFIX set (and DOT_S16(acc, w, a): acc plus the 8 s32 sums of 2 s16 x s16 products each,
 * for the x86 ones). Without DOT_S16 it is portable C. */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

#ifdef DOT_S16
static inline float CAT(hsum, SUFFIX)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* res[r * RA + c] = row n + r of the weight . input row t + c, for r < RW, c < RA. Inlined
 * with constant FMT, RW and RA, so the RW x RA accumulators live in registers. Q4's offset
 * term, sum over blocks of m * (da * sa), is a plain fp32 dot product of two short rows,
 * done after the blocks: in the block loop its scalar maths took ~20% of a tile's time. */
static inline __attribute__((always_inline)) void CAT(tile, SUFFIX)(
    quant_weight w, q16_act a, int64_t n, int64_t t, const int FMT, const int RW, const int RA, float *res) {
    const int64_t nb = w.C / 32;
#ifdef DOT_S16
    /* Rows are adjacent: one base pointer per operand, row r at r * stride. Indexing
     * (n + r) * row bytes + b * 16 in the loop made the 4 x 1 tile 74 instructions a block,
     * a third of them address arithmetic; a pointer per row spilled them to the stack. */
    const int64_t row_bytes = FMT == QUANT_Q4 ? w.C / 2 : w.C, block_bytes = FMT == QUANT_Q4 ? 16 : 32;
    const uint8_t *wq = (const uint8_t *)w.qs + n * row_bytes;
    const float *wd = w.d + n * nb, *ad = a.d + t * nb;
    const int16_t *aq = a.qs + t * a.C;
    __m256 acc[4][4];
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < RA; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i lo[4], hi[4]; /* the block's weights 0..15 and 16..31 as s16 */
        __m256 dw[4];
        for (int r = 0; r < RW; ++r) {
            /* the next tile's rows: ~40% off a one-row LM head (49152 x 576 Q8_0, 5.9 -> 3.5 ms) */
            _mm_prefetch((const char *)(wq + (RW + r) * row_bytes + b * block_bytes), _MM_HINT_T0);
            dw[r] = _mm256_broadcast_ss(wd + r * nb + b);
            const __m128i p = _mm_loadu_si128((const __m128i *)(wq + r * row_bytes + b * block_bytes));
            if (FMT == QUANT_Q4) { /* byte j = u_j | u_{j+16} << 4, zero-extended to 16 bits */
                const __m256i x = _mm256_cvtepu8_epi16(p);
                lo[r] = _mm256_and_si256(x, _mm256_set1_epi16(0x0F));
                hi[r] = _mm256_srli_epi16(x, 4);
            } else {
                lo[r] = _mm256_cvtepi8_epi16(p);
                hi[r] = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wq + r * row_bytes + b * block_bytes + 16)));
            }
        }
        for (int c = 0; c < RA; ++c) {
            const __m256i alo = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32));
            const __m256i ahi = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32 + 16));
            const __m256 da = _mm256_broadcast_ss(ad + c * nb + b);
            for (int r = 0; r < RW; ++r) {
                const __m256i dot = DOT_S16(DOT_S16(_mm256_setzero_si256(), lo[r], alo), hi[r], ahi);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[r], da), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < RA; ++c) res[r * RA + c] = CAT(hsum, SUFFIX)(acc[r][c]);
#else
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < RA; ++c) {
            const int16_t *qa = a.qs + (t + c) * a.C;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                int32_t dot = 0;
                if (FMT == QUANT_Q4) {
                    const uint8_t *q = (const uint8_t *)w.qs + (n + r) * (w.C / 2) + b * 16;
                    for (int j = 0; j < 16; ++j)
                        dot += (q[j] & 0x0F) * qa[b * 32 + j] + (q[j] >> 4) * qa[b * 32 + j + 16];
                } else {
                    const int8_t *q = (const int8_t *)w.qs + (n + r) * w.C + b * 32;
                    for (int j = 0; j < 32; ++j) dot += q[j] * qa[b * 32 + j];
                }
                acc += (float)dot * (w.d[(n + r) * nb + b] * a.d[(t + c) * nb + b]);
            }
            res[r * RA + c] = acc;
        }
#endif
    if (FMT == QUANT_Q4)
        for (int r = 0; r < RW; ++r)
            for (int c = 0; c < RA; ++c) {
                const float *m = w.m + (n + r) * nb, *ds = a.ds + (t + c) * nb;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t b = 0; b < nb; ++b) sum += m[b] * ds[b];
                res[r * RA + c] += sum;
            }
}

/* Writes the tile res (RW x RA) of output rows n.., input rows t.. as `mode` says. */
static inline void CAT(write_tile, SUFFIX)(const float *res, int RW, int RA, int64_t n, int64_t t,
                                           float *out, int64_t out_stride, const float *bias, int mode) {
    for (int r = 0; r < RW; r += mode == QUANT_SILU_MUL ? 2 : 1)
        for (int c = 0; c < RA; ++c) {
            float *o = out + (t + c) * out_stride;
            const float v = res[r * RA + c] + (bias ? bias[n + r] : 0.0f);
            if (mode == QUANT_SILU_MUL) {
                const float up = res[(r + 1) * RA + c] + (bias ? bias[n + r + 1] : 0.0f);
                o[(n + r) / 2] = v / (1.0f + __builtin_expf(-v)) * up;
            } else if (mode == QUANT_ADD) {
                o[n + r] += v;
            } else {
                o[n + r] = v;
            }
        }
}

/* Tiles of RW x RA over output rows [*n, n1) for input rows t.. t + RA - 1, *n advanced
 * past the last whole tile. */
static inline __attribute__((always_inline)) void CAT(tiles, SUFFIX)(
    quant_weight w, q16_act a, int64_t *n, int64_t n1, int64_t t, float *out, int64_t out_stride,
    const float *bias, int mode, const int FMT, const int RW, const int RA) {
    float res[16];
    for (; *n + RW <= n1; *n += RW) {
        CAT(tile, SUFFIX)(w, a, *n, t, FMT, RW, RA, res);
        CAT(write_tile, SUFFIX)(res, RW, RA, *n, t, out, out_stride, bias, mode);
    }
}

/* Output rows [n0, n1) x input rows [t0, t1). n0 is even and, for QUANT_SILU_MUL, so is n1:
 * one input row (decode at batch 1) runs 4 weight rows at a time, more run 2 x 4. */
static inline __attribute__((always_inline)) void CAT(task_fmt, SUFFIX)(
    quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
    int64_t out_stride, const float *bias, int mode, const int FMT) {
    int64_t n, t = t0;
    if (t1 - t0 == 1) {
        n = n0;
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 4, 1);
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 2, 1);
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 1, 1);
        return;
    }
    for (; t + 4 <= t1; t += 4) {
        n = n0;
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 2, 4);
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 1, 4);
    }
    for (; t < t1; ++t) {
        n = n0;
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 2, 1);
        CAT(tiles, SUFFIX)(w, a, &n, n1, t, out, out_stride, bias, mode, FMT, 1, 1);
    }
}

static void CAT(quant_task, SUFFIX)(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0,
                                    int64_t t1, float *out, int64_t out_stride, const float *bias, int mode) {
    if (w.format == QUANT_Q4)
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q4);
    else
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q8);
}
#undef CAT
#undef CAT_
