/* One instruction set's quantized-matmul task, included by quant.c once per target with
 * SUFFIX set (and DOT_S16(acc, w, a): acc plus the 8 s32 sums of 2 s16 x s16 products each,
 * for the x86 ones). Without DOT_S16 it is portable C. */
/* A tile is RW weight rows x RA input rows; a group of up to TILE_MAX_RA input rows is one
 * pass over a task's weight rows, with RW = TILE_RW(RA): RW x RA accumulators plus one weight
 * row's lo, hi and scale fit the 16 ymm registers (2 x 7 and 2 x 8 measured no faster than
 * 1 x 7 and 1 x 8, and RW must be even or 1 for QUANT_SILU_MUL's row pairs). Measured on the
 * AVX2 EPYC, 2 threads, SmolLM2's gate/up (3072 x 576 Q4), us for 1..8 input rows: 73 119
 * 158 197 244 278 345 412; with groups of 4 run as 2 x 4 tiles and the rest as 2 x 1 tiles
 * row by row (so 5 rows took two passes, 3 rows three) it was 85 182 270 228 319 415 509 456. */
/* With AVX-512 the ymm registers are 32 (ymm16-31 through AVX-512VL), so groups of 4 to 8
 * rows run as 2 weight rows x the group: the group's activations, loaded once per block, serve
 * 2 weight rows instead of 1 (measured on the 2-core AVX-512 Xeon, 2 threads, us, 1 x 8 tiles
 * then 2 x 8: gate/up at 512 rows 13,657 -> 12,705, at 16 rows 440 -> 395; down (576 x 1536)
 * 6,930 -> 6,351 and 220 -> 203; wqkv Q8_0 (960 x 576) 3,898 -> 3,588 and 136 -> 130; 1 row
 * unchanged). 4 x 6 tiles of 6-row groups measured the same as 2 x 8. Each pair's float
 * operations do not depend on the tile, so this changes no result. */
#undef TILE_RW
#ifdef TILE_WIDE_REGS
#define TILE_RW(RA) ((RA) <= 3 ? 4 : 2)
#else
#define TILE_RW(RA) ((RA) <= 3 ? 4 : (RA) <= 6 ? 2 : 1)
#endif
#ifndef TILE_MAX_RA
#define TILE_MAX_RA 8
#define TILE_MAX_RW 4
#endif
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

/* n fp16 scales as fp32: a tile's RW rows of block scales (or offsets) are widened once into
 * L1 before its block loop reads them, rather than converted per block and row. */
static inline void CAT(widen, SUFFIX)(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#ifdef DOT_S16
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

/* res[r * RA + c] = row n + r of the weight . input row t + c, for r < RW, c < RA. Inlined
 * with constant FMT, RW and RA, so the RW x RA accumulators live in registers (the loops over
 * them unrolled early, or GCC keeps the accumulator array in memory: 2 stores a pair a block).
 * Q4's offset term, sum over blocks of m * (da * sa), is done after the blocks (in the block
 * loop its scalar maths took ~20% of a tile's time) as one fma chain per pair in block order,
 * so any tile gives the same floats: vectorised over the group's input rows (ds_t: their
 * da * sa transposed, (nb, TILE_MAX_RA)), or, for one input row, over RW scalar chains. As a
 * dot product vectorised over blocks, one per pair, it took ~30% of an 8-row step (gate/up,
 * 1 thread: 867 us, 613 without it). */
static inline __attribute__((always_inline)) void CAT(tile, SUFFIX)(
    quant_weight w, q16_act a, const float *ds_t, const float *da_t, int64_t n, int64_t t, const int FMT,
    const int RW, const int RA, float *res) {
    const int64_t nb = w.C / 32;
#ifdef DOT_S16
    /* Rows are adjacent: one base pointer per operand, row r at r * stride. Indexing
     * (n + r) * row bytes + b * 16 in the loop made the 4 x 1 tile 74 instructions a block,
     * a third of them address arithmetic; a pointer per row spilled them to the stack. */
    const int64_t row_bytes = FMT == QUANT_Q4 ? w.C / 2 : w.C, block_bytes = FMT == QUANT_Q4 ? 16 : 32;
    const uint8_t *wq = (const uint8_t *)w.qs + n * row_bytes;
    float wd[TILE_MAX_RW * nb], wm[FMT == QUANT_Q4 ? TILE_MAX_RW * nb : 1]; /* rows n.. are adjacent */
    CAT(widen, SUFFIX)(w.d + n * nb, wd, RW * nb);
    if (FMT == QUANT_Q4) CAT(widen, SUFFIX)(w.m + n * nb, wm, RW * nb);
    const float *ad = a.d + t * nb;
    const int16_t *aq = a.qs + t * a.C;
    __m256 acc[TILE_MAX_RW][TILE_MAX_RA];
    #pragma GCC unroll 8
    for (int r = 0; r < RW; ++r)
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        /* one weight row at a time, its block read against every input row straight from L1:
         * only that row's lo, hi and scale take registers, the rest go to accumulators */
        #pragma GCC unroll 8
        for (int r = 0; r < RW; ++r) {
            /* the next tile's rows: ~40% off a one-row LM head (49152 x 576 Q8_0, 5.9 -> 3.5 ms) */
            _mm_prefetch((const char *)(wq + (RW + r) * row_bytes + b * block_bytes), _MM_HINT_T0);
            const __m256 dw = _mm256_broadcast_ss(wd + r * nb + b);
            const __m128i p = _mm_loadu_si128((const __m128i *)(wq + r * row_bytes + b * block_bytes));
            __m256i lo, hi; /* the block's weights 0..15 and 16..31 as s16 */
            if (FMT == QUANT_Q4) { /* byte j = u_j | u_{j+16} << 4, zero-extended to 16 bits */
                const __m256i x = _mm256_cvtepu8_epi16(p);
                lo = _mm256_and_si256(x, _mm256_set1_epi16(0x0F));
                hi = _mm256_srli_epi16(x, 4);
            } else {
                lo = _mm256_cvtepi8_epi16(p);
                hi = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wq + r * row_bytes + b * block_bytes + 16)));
            }
            /* dw * da of every input row in one multiply, then broadcast from L1 per row: the
             * same products as one multiply per row, one vector op instead of RA (an 8-row group
             * does 4 rather than 5 per row and block: 2 dots, convert, fma) */
            float scale[TILE_MAX_RA] __attribute__((aligned(32)));
            if (RA > 1) _mm256_store_ps(scale, _mm256_mul_ps(dw, _mm256_loadu_ps(da_t + b * TILE_MAX_RA)));
            #pragma GCC unroll 8
            for (int c = 0; c < RA; ++c) {
                const __m256i alo = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32));
                const __m256i ahi = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32 + 16));
                const __m256 s = RA > 1 ? _mm256_broadcast_ss(scale + c)
                                        : _mm256_mul_ps(dw, _mm256_broadcast_ss(ad + c * nb + b));
                const __m256i dot = DOT_S16(DOT_S16(_mm256_setzero_si256(), lo, alo), hi, ahi);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][c]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < RW; ++r)
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c) res[r * RA + c] = CAT(hsum, SUFFIX)(acc[r][c]);
    if (FMT == QUANT_Q4) { /* the offset term (above) */
        const float *m = wm;
        if (RA == 1) { /* ds_t is not built for one row: 1 of its 8 lanes would be used */
            float sum[TILE_MAX_RW] = {0};
            const float *ds = a.ds + t * nb;
            for (int64_t b = 0; b < nb; ++b)
                #pragma GCC unroll 8
                for (int r = 0; r < RW; ++r) sum[r] = __builtin_fmaf(m[r * nb + b], ds[b], sum[r]);
            #pragma GCC unroll 8
            for (int r = 0; r < RW; ++r) res[r] += sum[r];
        } else { /* the group's input rows in lanes */
            __m256 sum[TILE_MAX_RW];
            #pragma GCC unroll 8
            for (int r = 0; r < RW; ++r) sum[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                const __m256 ds = _mm256_loadu_ps(ds_t + b * TILE_MAX_RA);
                #pragma GCC unroll 8
                for (int r = 0; r < RW; ++r) sum[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(m + r * nb + b), ds, sum[r]);
            }
            #pragma GCC unroll 8
            for (int r = 0; r < RW; ++r) {
                float lanes[8];
                _mm256_storeu_ps(lanes, sum[r]);
                #pragma GCC unroll 8
                for (int c = 0; c < RA; ++c) res[r * RA + c] += lanes[c];
            }
        }
    }
#else
    (void)ds_t, (void)da_t; /* its offset term is a dot product per pair, as ever (the C path may differ) */
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
                acc += (float)dot * (half_to_float(w.d[(n + r) * nb + b]) * a.d[(t + c) * nb + b]);
            }
            res[r * RA + c] = acc;
        }
    if (FMT == QUANT_Q4)
        for (int r = 0; r < RW; ++r)
            for (int c = 0; c < RA; ++c) {
                const uint16_t *m = w.m + (n + r) * nb;
                const float *ds = a.ds + (t + c) * nb;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t b = 0; b < nb; ++b) sum += half_to_float(m[b]) * ds[b];
                res[r * RA + c] += sum;
            }
#endif
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
 * past the last whole tile. QUANT_SILU_MUL writes rows in (gate, up) pairs, so one-row tiles
 * go two at a time there. */
static inline __attribute__((always_inline)) void CAT(tiles, SUFFIX)(
    quant_weight w, q16_act a, const float *ds_t, const float *da_t, int64_t *n, int64_t n1, int64_t t, float *out,
    int64_t out_stride, const float *bias, int mode, const int FMT, const int RW, const int RA) {
    float res[2 * TILE_MAX_RW * TILE_MAX_RA];
    const int step = mode == QUANT_SILU_MUL && RW == 1 ? 2 : RW;
    for (; *n + step <= n1; *n += step) {
        for (int k = 0; k < step; k += RW) CAT(tile, SUFFIX)(w, a, ds_t, da_t, *n + k, t, FMT, RW, RA, res + k * RA);
        CAT(write_tile, SUFFIX)(res, step, RA, *n, t, out, out_stride, bias, mode);
    }
}

/* Input rows t.. t + RA - 1 against output rows [n0, n1): TILE_RW(RA) weight rows a tile,
 * then 1 for what is left. */
#define TILE_GROUP(RA)                                                                             \
    case RA: {                                                                                     \
        int64_t n = n0;                                                                            \
        CAT(tiles, SUFFIX)(w, a, ds_t, da_t, &n, n1, t, out, out_stride, bias, mode, FMT, TILE_RW(RA), RA); \
        CAT(tiles, SUFFIX)(w, a, ds_t, da_t, &n, n1, t, out, out_stride, bias, mode, FMT, 1, RA);       \
        break;                                                                                     \
    }

/* Output rows [n0, n1) x input rows [t0, t1). n0 is even and, for QUANT_SILU_MUL, so is n1.
 * The input rows go in groups of at most TILE_MAX_RA, as equal as they can be, each group in
 * one pass over the task's weight rows: each weight block is unpacked once per group. */
static inline __attribute__((always_inline)) void CAT(task_fmt, SUFFIX)(
    quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
    int64_t out_stride, const float *bias, int mode, const int FMT) {
    const int64_t groups = (t1 - t0 + TILE_MAX_RA - 1) / TILE_MAX_RA, nb = w.C / 32;
    float ds_t[FMT == QUANT_Q4 ? nb * TILE_MAX_RA : 1]; /* the group's ds, (nb, TILE_MAX_RA) */
    float da_t[nb * TILE_MAX_RA];                       /* the group's d, (nb, TILE_MAX_RA) */
    for (int64_t g = 0, t = t0; g < groups; ++g) {
        const int64_t t_next = t0 + (t1 - t0) * (g + 1) / groups;
        if (t_next - t > 1)
            for (int64_t b = 0; b < nb; ++b)
                for (int c = 0; c < TILE_MAX_RA; ++c) {
                    const int is_row = t + c < t_next;
                    da_t[b * TILE_MAX_RA + c] = is_row ? a.d[(t + c) * nb + b] : 0.0f;
                    if (FMT == QUANT_Q4) ds_t[b * TILE_MAX_RA + c] = is_row ? a.ds[(t + c) * nb + b] : 0.0f;
                }
        switch (t_next - t) {
            TILE_GROUP(1)
            TILE_GROUP(2)
            TILE_GROUP(3)
            TILE_GROUP(4)
            TILE_GROUP(5)
            TILE_GROUP(6)
            TILE_GROUP(7)
            TILE_GROUP(8)
        }
        t = t_next;
    }
}
#undef TILE_GROUP

static void CAT(quant_task, SUFFIX)(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0,
                                    int64_t t1, float *out, int64_t out_stride, const float *bias, int mode) {
    if (w.format == QUANT_Q4)
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q4);
    else
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q8);
}
#undef CAT
#undef CAT_
