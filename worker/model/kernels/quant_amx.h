/* The AMX tile of the quantized matmul (Intel Sapphire Rapids and later), included by quant.c
 * after the AVX-512 VNNI variant, whose tiles it uses for the rows that do not fill its own.
 *
 * AMX multiplies 8-bit integers only, and the activations are 16-bit (quant.c says why). A
 * 16-bit q is hi * 256 + lo with lo = q & 0xFF (unsigned) and hi = q >> 8 (signed), and in
 * memory a block of 32 q is 64 bytes, lo and hi interleaved (little-endian). So a block of 16
 * input rows is one A tile loaded as it is (16 rows x 64 bytes, no copy), and two B tiles hold
 * each weight w twice, as the 16-bit words w << 8 (bytes 0, w) and w & 0xFF (bytes w, 0):
 *     C_hi += A . B_hi  (TDPBSSD: the lo bytes meet 0s, the hi bytes their w)   = sum w * hi
 *     C_lo += A . B_lo  (TDPBUSD: A unsigned: each lo byte meets its w)          = sum w * lo
 * and 256 * C_hi + C_lo is each (input row, weight row)'s whole integer dot of the block, exact
 * (|sum| <= 32 * 128 * 32767 < 2^31). The floats that follow are those of every other path
 * (quant_simd.h): per pair, fma(dot, dw * da, acc) in block order, then the Q4 offset term.
 * So a row's result does not depend on whether AMX, AVX-512, AVX2 or C computed it.
 *
 * B tiles are VNNI-ordered (B[k][4n + j] = byte j of weight row n's dword k): a task repacks
 * its 16 weight rows once, all blocks, and every 16 input rows of the task reuse them. */

#define AMX_ROWS 16 /* a tile's rows: input rows (A, C) and weight rows (B's columns) */
/* Fewer input rows go to the VNNI tiles: the repack costs about one 16-row tile (2-core Xeon,
 * 2 threads, us, VNNI then AMX: SmolLM2's gate/up at 16 rows 442 vs 492, 32 rows 862 vs 715, 64
 * rows 1,719 vs 1,228, 512 rows 13,437 vs 8,078; down 220/233, 418/384, 825/597, 6,136/3,555). */
#define AMX_MIN_ROWS 32

/* Tiles 0 (A), 1-2 (B hi, lo), 3-4 and 5-6 (two blocks' C hi, lo), all 16 rows of 64 bytes. */
static void amx_configure(void) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg = {0};
    cfg.palette_id = 1;
    for (int i = 0; i < 7; ++i) cfg.colsb[i] = 64, cfg.rows[i] = AMX_ROWS;
    _tile_loadconfig(&cfg);
}

/* Weight rows n0.. n0 + 15 as B tiles, two per block (hi then lo, 1 KiB each), and their scales
 * (and Q4 offsets) transposed to (nb, 16) fp32: quant_vnni.h's repack, each word split in two. */
static void amx_repack(quant_weight w, int64_t n0, const int FMT, int32_t *b_tiles, float *dw_t, float *m_t) {
    for (int64_t b = 0; b < w.C / 32; ++b) {
        __m512i x[AMX_ROWS]; /* x[k] = dword k of every row: B[k][n] */
        repack16_block(w, n0, b, FMT, x, dw_t + b * AMX_ROWS, m_t + b * AMX_ROWS);
        for (int k = 0; k < 16; ++k) {
            _mm512_store_si512(b_tiles + b * 512 + k * 16, _mm512_slli_epi16(x[k], 8));
            _mm512_store_si512(b_tiles + b * 512 + 256 + k * 16, _mm512_and_si512(x[k], _mm512_set1_epi16(0xFF)));
        }
    }
}

/* acc[c] = fma(dot, dw * da[c * nb], acc[c]) for one block, dot = 256 * c_hi + c_lo (exact). */
static inline __attribute__((always_inline)) void amx_scale_into(__m512 *acc, const int32_t *c_hi, const int32_t *c_lo,
                                                                 const float *dw_b, const float *da_b, int64_t nb) {
    const __m512 dw = _mm512_loadu_ps(dw_b);
    #pragma GCC unroll 16
    for (int c = 0; c < AMX_ROWS; ++c) {
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c_hi + c * AMX_ROWS), 8),
                                             _mm512_load_si512(c_lo + c * AMX_ROWS));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(da_b[c * nb])), acc[c]);
    }
}

/* Weight rows n0.. n0 + 15 . input rows t.. t + 15, as the other tiles compute them, written to out
 * as `mode` says (as write_tile does). */
static inline __attribute__((always_inline)) void amx_tile(quant_weight w, q16_act a, const int32_t *b_tiles,
                                                           const float *dw_t, const float *m_t, int64_t n0,
                                                           int64_t t, const int FMT, float *out, int64_t out_stride,
                                                           const float *bias, int mode) {
    const int64_t nb = w.C / 32;
    int32_t c_hi[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64))), c_lo[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS]; /* acc[c]: lane r */
    #pragma GCC unroll 16
    for (int c = 0; c < AMX_ROWS; ++c) acc[c] = _mm512_setzero_ps();
    const float *da = a.d + t * nb;
    /* Block b's products go to tiles 3-4 (b even) or 5-6 (b odd), and block b - 1's are drained
     * (stored, then scaled into acc) while the tile unit computes block b's: done one after the
     * other, the vector code waited on each tilestored (perf: ~40% of the task's samples on the
     * stores and the loads after them). */
#define AMX_BLOCK(b, CHI, CLO)                                                   \
    do {                                                                         \
        _tile_loadd(0, a.qs + t * a.C + (b) * 32, a.C * 2);                      \
        _tile_loadd(1, b_tiles + (b) * 512, 64);                                 \
        _tile_loadd(2, b_tiles + (b) * 512 + 256, 64);                           \
        _tile_zero(CHI);                                                         \
        _tile_zero(CLO);                                                         \
        _tile_dpbssd(CHI, 0, 1);                                                 \
        _tile_dpbusd(CLO, 0, 2);                                                 \
    } while (0)
#define AMX_DRAIN(b, CHI, CLO)                                                   \
    do {                                                                         \
        _tile_stored(CHI, c_hi, 64);                                             \
        _tile_stored(CLO, c_lo, 64);                                             \
        amx_scale_into(acc, c_hi, c_lo, dw_t + (b) * AMX_ROWS, da + (b), nb);    \
    } while (0)
    int64_t b = 1;
    AMX_BLOCK(0, 3, 4);
    for (; b + 1 < nb; b += 2) {
        AMX_BLOCK(b, 5, 6);
        AMX_DRAIN(b - 1, 3, 4);
        AMX_BLOCK(b + 1, 3, 4);
        AMX_DRAIN(b, 5, 6);
    }
    if (b < nb) {
        AMX_BLOCK(b, 5, 6);
        AMX_DRAIN(b - 1, 3, 4);
        AMX_DRAIN(b, 5, 6);
    } else {
        AMX_DRAIN(b - 1, 3, 4);
    }
#undef AMX_BLOCK
#undef AMX_DRAIN
    write16(acc, m_t, a, nb, n0, t, FMT, AMX_ROWS, out, out_stride, bias, mode);
}

/* A task of quant_matmul_body: output rows [n0, n1) x input rows [t0, t1). Full blocks of 16 x 16
 * on AMX, the rest on the AVX-512 VNNI tiles (the same floats). */
static void amx_task(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
                     int64_t out_stride, const float *bias, int mode) {
    const int64_t t_amx = t0 + (t1 - t0) / AMX_ROWS * AMX_ROWS;
    if (n1 - n0 != AMX_ROWS || t_amx - t0 < AMX_MIN_ROWS) {
        vnni_small_task(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    const int64_t nb = w.C / 32;
    int32_t *b_tiles = aligned_alloc(64, (size_t)nb * 512 * sizeof(int32_t));
    float *dw_t = aligned_alloc(64, (size_t)nb * AMX_ROWS * sizeof(float) * 2), *m_t = dw_t + nb * AMX_ROWS;
    if (b_tiles == NULL || dw_t == NULL) { /* no memory for the repack: the VNNI tiles need none */
        free(b_tiles), free(dw_t);
        vnni_small_task(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        return;
    }
    const int FMT = w.format;
    amx_repack(w, n0, FMT, b_tiles, dw_t, m_t);
    amx_configure();
    for (int64_t t = t0; t < t_amx; t += AMX_ROWS) {
        if (quant_has_offset(FMT)) amx_tile(w, a, b_tiles, dw_t, m_t, n0, t, QUANT_Q4, out, out_stride, bias, mode);
        else amx_tile(w, a, b_tiles, dw_t, m_t, n0, t, QUANT_Q8, out, out_stride, bias, mode);
    }
    _tile_release();
    free(b_tiles), free(dw_t);
    if (t_amx < t1) vnni_small_task(w, a, n0, n1, t_amx, t1, out, out_stride, bias, mode);
}
