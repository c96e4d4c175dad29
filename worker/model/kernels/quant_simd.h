/* One instruction set's quantized-matmul task, included by quant.c once per target with
 * SUFFIX set (and DOT_S16(acc, w, a): acc plus the 8 s32 sums of 2 s16 x s16 products each,
 * for the x86 ones). Without DOT_S16 it is portable C. */
/* A tile is RW weight rows x RA input rows; a group of up to TILE_MAX_RA input rows is one
 * pass over a task's weight rows. One input row: 8 weight rows a tile, their 8 pairs in the 8
 * lanes of one accumulator. A group: 2 weight rows a tile, each with its own accumulator whose
 * lanes are the group's input rows (2 x 8 measured 5-10% faster than 1 x 8 on the AVX-512 Xeon
 * when lanes held partial sums). RW must be even or 1 for QUANT_SILU_MUL's row pairs.
 * Whole-block sums against per-lane chains (2-core Xeon, 2 threads, us, SmolLM2's gate/up,
 * down, wqkv, LM head): 1 row 67 -> 74, 40 -> 46, 31 -> 35, 663 -> 785; 16 rows 467 -> 421,
 * 230 -> 214, 154 -> 139; 512 rows 14,299 -> 12,563, 6,586 -> 5,808, 4,074 -> 3,435 (then AMX:
 * quant_amx.h). */
#undef TILE_RW
#define TILE_RW(RA) ((RA) == 1 ? 8 : 2)
#ifndef TILE_MAX_RA
#define TILE_MAX_RA 8
#define TILE_MAX_RW 8
#define SILU_MAX_PAIRS 128 /* a tile's (gate, up) pairs: 2 x 8 here, 8 x 16 in an AMX tile */
#endif
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

#ifdef DOT_S16
/* Lane i = the sum of d[i]'s 8 lanes: 8 blocks' integer dots, each whole, in one vector (the
 * missing ones zero). always_inline: GCC 12 left it a call from the (already inlined) tile, so
 * the 8 vectors went through memory; forced inline, SmolLM2's one-row linears took 9-11% less
 * (2-core Zen 4; perf showed the call at 12% of a linear's samples). Integer sums: exact, whatever the order. A blend, not a shuffle, where
 * one does: shuffles share one port (10 here; 14 with vphaddd, ~8% slower at batch 1). */
static inline __attribute__((always_inline)) __m256i CAT(reduce8, SUFFIX)(const __m256i *d) {
    __m256i t[4], u[2];
    #pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) /* [d_k's 4 halves summed | d_{k+4}'s] */
        t[k] = _mm256_add_epi32(_mm256_blend_epi32(d[k], d[k + 4], 0xF0), _mm256_permute2x128_si256(d[k], d[k + 4], 0x21));
    #pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) /* per 128-bit half: [t_2k 0+2, t_2k+1 0+2, t_2k 1+3, t_2k+1 1+3] */
        u[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(t[2 * k], t[2 * k + 1]), _mm256_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(u[0], u[1]), _mm256_unpackhi_epi64(u[0], u[1]));
}
#endif

#ifdef DOT_S16
/* quant.h's silu_mul on 8 lanes, operation for operation (min/max keep its clamps' NaN rule:
 * the second operand), so each lane has the scalar's bits. */
static inline __attribute__((always_inline)) __m256 CAT(silu_mul8, SUFFIX)(__m256 g, __m256 u) {
    __m256 x = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_CUR_DIRECTION);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256 two_n = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_fmadd_ps(p, two_n, _mm256_set1_ps(1.0f))), u);
}
#endif

/* n fp16 scales as fp32: a tile's RW rows of block scales (or offsets) are widened once into
 * L1 before its block loop reads them, rather than converted per block and row. */
static inline __attribute__((always_inline)) void CAT(widen, SUFFIX)(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#ifdef DOT_S16
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

/* res[r * RA + c] = row n + r of the weight . input row t + c, for r < RW, c < RA. Every pair's
 * float maths is one fma chain in block order, the same whatever computes it (any tile, any
 * instruction set, the portable C path, a future AMX tile):
 *     acc = fma((float)dot_b, dw_b * da_b, acc)   for each block b, dot_b its whole integer dot
 * then, for Q4, + the offset term sum_b m_b * (da_b * sa_b), its own fma chain in block order
 * (in the block loop its scalar maths took ~20% of a tile's time). The SIMD tiles put pairs in
 * lanes: one input row runs 8 weight rows, lane r = row r; a group of input rows runs each
 * weight row against the whole group, lane c = input row c. A block's 8 (or RA) dot vectors are
 * summed into one vector of whole dots (reduce8), so converts, scales and fmas are one vector op
 * per 8 pairs. (Before, each lane kept its own chain over its 4 products of every block and the
 * lanes were summed at the end: those floats depended on the vector width, so no other tile shape
 * could give the same bits. Measured on the 2-core Xeon: docs/kernels.md.) Inlined with constant
 * FMT, RW and RA, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void CAT(tile, SUFFIX)(
    quant_weight w, q16_act a, const float *ds_t, const float *da_t, int64_t n, int64_t t, const int FMT,
    const int RW, const int RA, float *res) {
    const int64_t nb = w.C / 32;
#ifdef DOT_S16
    /* Rows are adjacent: one base pointer per operand, row r at r * stride. */
    const int64_t row_bytes = FMT == QUANT_Q4 ? w.C / 2 : w.C, block_bytes = FMT == QUANT_Q4 ? 16 : 32;
    const uint8_t *wq = (const uint8_t *)w.qs + n * row_bytes;
    float wd[TILE_MAX_RW * nb], wm[FMT == QUANT_Q4 ? TILE_MAX_RW * nb : 1]; /* rows n.. are adjacent */
    CAT(widen, SUFFIX)(w.d + n * nb, wd, RW * nb);
    if (FMT == QUANT_Q4) CAT(widen, SUFFIX)(w.m + n * nb, wm, RW * nb);
    const float *ad = a.d + t * nb;
    const int16_t *aq = a.qs + t * a.C;
    __m256 acc[TILE_MAX_RW];
    #pragma GCC unroll 8
    for (int r = 0; r < RW; ++r) acc[r] = _mm256_setzero_ps();
    /* one input row: the tile's dw transposed, (nb, 8), so a block's 8 are one load (8 scalar
     * stores and a vector load per block stall store forwarding) */
    float dw_t[RA == 1 ? 8 * nb : 1] __attribute__((aligned(32)));
    if (RA == 1)
        for (int64_t b = 0; b < nb; ++b)
            #pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) dw_t[b * 8 + r] = r < RW ? wd[r * nb + b] : 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i dots[8];
        #pragma GCC unroll 8
        for (int r = 0; r < RW; ++r) {
            /* the next tile's rows: ~40% off a one-row LM head (49152 x 576 Q8_0, 5.9 -> 3.5 ms) */
            _mm_prefetch((const char *)(wq + (RW + r) * row_bytes + b * block_bytes), _MM_HINT_T0);
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
            if (RA == 1) {
                const __m256i alo = _mm256_loadu_si256((const __m256i *)(aq + b * 32));
                const __m256i ahi = _mm256_loadu_si256((const __m256i *)(aq + b * 32 + 16));
                dots[r] = DOT_S16(DOT_S16(_mm256_setzero_si256(), lo, alo), hi, ahi);
                continue;
            }
            #pragma GCC unroll 8
            for (int c = 0; c < 8; ++c) {
                if (c >= RA) { dots[c] = _mm256_setzero_si256(); continue; }
                const __m256i alo = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32));
                const __m256i ahi = _mm256_loadu_si256((const __m256i *)(aq + c * a.C + b * 32 + 16));
                dots[c] = DOT_S16(DOT_S16(_mm256_setzero_si256(), lo, alo), hi, ahi);
            }
            /* dw * da of every input row in one multiply (lanes past RA: da 0) */
            const __m256 scale = _mm256_mul_ps(_mm256_broadcast_ss(wd + r * nb + b),
                                               _mm256_loadu_ps(da_t + b * TILE_MAX_RA));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(CAT(reduce8, SUFFIX)(dots)), scale, acc[r]);
        }
        if (RA == 1) {
            #pragma GCC unroll 8
            for (int r = RW; r < 8; ++r) dots[r] = _mm256_setzero_si256();
            const __m256 scale = _mm256_mul_ps(_mm256_load_ps(dw_t + b * 8), _mm256_broadcast_ss(ad + b));
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(CAT(reduce8, SUFFIX)(dots)), scale, acc[0]);
        }
    }
    float lanes[TILE_MAX_RW][8];
    #pragma GCC unroll 8
    for (int r = 0; r < RW; ++r) _mm256_storeu_ps(lanes[r], acc[r]);
    #pragma GCC unroll 8
    for (int r = 0; r < RW; ++r)
        #pragma GCC unroll 8
        for (int c = 0; c < RA; ++c) res[r * RA + c] = RA == 1 ? lanes[0][r] : lanes[r][c];
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
                _mm256_storeu_ps(lanes[r], sum[r]);
                #pragma GCC unroll 8
                for (int c = 0; c < RA; ++c) res[r * RA + c] += lanes[r][c];
            }
        }
    }
#else
    (void)ds_t, (void)da_t;
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
                } else if (FMT == QUANT_Q8) {
                    const int8_t *q = (const int8_t *)w.qs + (n + r) * w.C + b * 32;
                    for (int j = 0; j < 32; ++j) dot += q[j] * qa[b * 32 + j];
                } else {
                    for (int j = 0; j < 32; ++j) dot += quant_int(w, n + r, b * 32 + j) * qa[b * 32 + j];
                }
                const float scale = half_to_float(w.d[quant_scale_index(w, n + r, b)]) * a.d[(t + c) * nb + b];
                acc = __builtin_fmaf((float)dot, scale, acc);
            }
            if (quant_has_offset(FMT)) {
                const float *ds = a.ds + (t + c) * nb;
                float sum = 0.0f;
                for (int64_t b = 0; b < nb; ++b)
                    sum = __builtin_fmaf(half_to_float(w.m[quant_scale_index(w, n + r, b)]), ds[b], sum);
                acc += sum;
            }
            res[r * RA + c] = acc;
        }
#endif
}

/* Writes the tile res (RW x RA) of output rows n.., input rows t.. as `mode` says. SwiGLU's pairs
 * are gathered first, so the silu loop runs 8 lanes at a time. */
static inline void CAT(write_tile, SUFFIX)(const float *res, int RW, int RA, int64_t n, int64_t t,
                                           float *out, int64_t out_stride, const float *bias, int mode) {
    if (mode == QUANT_SILU_MUL) {
        float g[SILU_MAX_PAIRS], u[SILU_MAX_PAIRS], s[SILU_MAX_PAIRS];
        int k = 0;
        for (int r = 0; r < RW; r += 2)
            for (int c = 0; c < RA; ++c, ++k) {
                g[k] = res[r * RA + c] + (bias ? bias[n + r] : 0.0f);
                u[k] = res[(r + 1) * RA + c] + (bias ? bias[n + r + 1] : 0.0f);
            }
        int i = 0;
#ifdef DOT_S16 /* 8 at a time (GCC left this loop scalar, its clamps as branches); a one-row tile's 4
                * pairs stay scalar: padded to 8 lanes they were no faster (2-core Zen 3) */
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(s + i, CAT(silu_mul8, SUFFIX)(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
        for (; i < k; ++i) s[i] = silu_mul(g[i], u[i]);
        k = 0;
        for (int r = 0; r < RW; r += 2)
            for (int c = 0; c < RA; ++c) out[(t + c) * out_stride + (n + r) / 2] = s[k++];
        return;
    }
    for (int r = 0; r < RW; ++r)
        for (int c = 0; c < RA; ++c) {
            float *o = out + (t + c) * out_stride;
            const float v = res[r * RA + c] + (bias ? bias[n + r] : 0.0f);
            if (mode == QUANT_ADD) {
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
#ifndef DOT_S16 /* the SIMD paths read panels in quant_panel.h and quant_panel8.h */
    else if (w.format == QUANT_Q4P)
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q4P);
    else if (w.format == QUANT_Q8P)
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q8P);
#endif
    else
        CAT(task_fmt, SUFFIX)(w, a, n0, n1, t0, t1, out, out_stride, bias, mode, QUANT_Q8);
}
#undef CAT
#undef CAT_
