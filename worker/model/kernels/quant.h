/* Shared by quant.c (the quantized linears) and layer.c (a whole decode layer). */
#ifndef TOKENRELAY_QUANT_H
#define TOKENRELAY_QUANT_H
#include <stdint.h>
#include <string.h>

#include "half.h"

enum { QUANT_ISA_SCALAR = 0, QUANT_ISA_AVX2 = 1, QUANT_ISA_AVXVNNI = 2, QUANT_ISA_AVX512VNNI = 3, QUANT_ISA_AMX = 4 };
enum { QUANT_Q4 = 0, QUANT_Q8 = 1, QUANT_Q4P = 2, QUANT_Q8P = 3 }; /* runtime weight formats */
enum { QUANT_STORE = 0, QUANT_ADD = 1, QUANT_SILU_MUL = 2 }; /* how a matmul writes out */

/* A weight (N, C) in blocks of 32 along C: qs q4 (N, C / 2) uint8 or q8 (N, C) int8;
 * d and m (N, C / 32) fp16 bits, as the GGUF file has them (m only for q4).
 * q4p and q8p, the same blocks in panels of 16 rows (worker/model/quant.py `panels`, for the
 * SIMD kernels: quant_panel.h says why), d and m (N / 16, C / 32, 16):
 *   q4p: qs (N / 16, C / 32, 4, 16, 2) uint16 words, word [p, b, s, r, e] holding weights
 *        32 b + 8 s + 2 j + e of row 16 p + r in its nibbles j = 0..3 (bits 4 j);
 *   q8p: qs (N / 16, C / 32, 16, 16, 2) int8, [p, b, k, r, e] = weight 32 b + 2 k + e of row
 *        16 p + r. */
typedef struct {
    const void *qs;
    const uint16_t *d, *m;
    int64_t N, C;
    int format;
} quant_weight;

static inline int quant_is_panel(int format) { return format == QUANT_Q4P || format == QUANT_Q8P; }

/* The body of a panel tile's task, for every SIMD width (quant_panel.h, quant_panel8.h): the panels
 * of output rows [n0, n1) against input rows [t0, t1), each panel in passes of at most 8 input
 * rows, as equal as they can be (9 rows: 5 + 4). TILE(RA) runs the panel at n against the RA
 * rows from t, RA a compile-time constant. */
#define PANEL_PASSES(TILE)                                                                 \
    for (int64_t n = n0; n < n1; n += 16)                                                  \
        for (int64_t g = 0, groups = (t1 - t0 + 7) / 8, t = t0; g < groups; ++g) {         \
            const int64_t t_next = t0 + (t1 - t0) * (g + 1) / groups;                      \
            switch (t_next - t) {                                                          \
            case 1: TILE(1); break;                                                        \
            case 2: TILE(2); break;                                                        \
            case 3: TILE(3); break;                                                        \
            case 4: TILE(4); break;                                                        \
            case 5: TILE(5); break;                                                        \
            case 6: TILE(6); break;                                                        \
            case 7: TILE(7); break;                                                        \
            case 8: TILE(8); break;                                                        \
            }                                                                              \
            t = t_next;                                                                    \
        }
/* Q4 blocks have an offset m (w = d * u + m), Q8 blocks none. */
static inline int quant_has_offset(int format) { return format == QUANT_Q4 || format == QUANT_Q4P; }

/* Where row n's block b keeps its scale (and offset) in d (and m), for every format. */
static inline int64_t quant_scale_index(quant_weight w, int64_t n, int64_t b) {
    const int64_t nb = w.C / 32;
    return quant_is_panel(w.format) ? ((n / 16) * nb + b) * 16 + n % 16 : n * nb + b;
}

/* Weight k of row n as its integer: u in [0, 15] for q4 and q4p, q in [-128, 127] for q8 and
 * q8p (the portable C path; the SIMD ones read whole blocks). */
static inline int32_t quant_int(quant_weight w, int64_t n, int64_t k) {
    const int64_t nb = w.C / 32, b = k / 32, i = k % 32;
    if (w.format == QUANT_Q8) return ((const int8_t *)w.qs)[n * w.C + k];
    if (w.format == QUANT_Q4) {
        const uint8_t q = ((const uint8_t *)w.qs)[n * (w.C / 2) + b * 16 + i % 16];
        return i < 16 ? q & 0x0F : q >> 4;
    }
    if (w.format == QUANT_Q8P)
        return ((const int8_t *)w.qs)[(((n / 16) * nb + b) * 16 + i / 2) * 32 + (n % 16) * 2 + i % 2];
    const uint16_t word = ((const uint16_t *)w.qs)[(((n / 16) * nb + b) * 4 + i / 8) * 32 + (n % 16) * 2 + i % 2];
    return (word >> (4 * ((i % 8) / 2))) & 0x0F;
}

/* Input rows quantized to 16-bit blocks: qs (T, C) int16; d, s, ds (T, C / 32): scale,
 * integer sum, scale * sum. */
typedef struct {
    int16_t *qs;
    float *d;
    int32_t *s;
    float *ds;
    int64_t C;
} q16_act;

/* One block of 32 inputs as 16-bit integers: d = max|x| / 32767, q = rint(x * (1 / d)) (ties
 * to even, as numpy's rint), s = sum(q) exactly, ds = d * s. */
static inline void quantize_block(const float *x, int16_t *q, float *d, int32_t *s, float *ds) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) {
        const float v = x[j] < 0 ? -x[j] : x[j];
        amax = v > amax ? v : amax;
    }
    const float scale = amax / 32767.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < 32; ++j) {
        const int32_t v = (int32_t)__builtin_rintf(x[j] * inv);
        q[j] = (int16_t)v;
        sum += v;
    }
    *d = scale;
    *s = sum;
    *ds = scale * (float)sum;
}

/* silu(g) * u = g / (1 + e^-g) * u, e^x from Cephes' expf polynomial (~1 ulp) in explicit
 * fmas: the same bits whether GCC vectorises a loop of it or not, so every path's SwiGLU
 * agrees (libm's expf, called per element, cost ~0.4 ms of a 6.5 ms SmolLM2 batch-1 step:
 * 30 layers x 1,536 calls). x is clamped to [-87, 88], where 2^n stays a normal float.
 * always_inline: as a call (GCC's choice in a large caller) the silu loop stayed scalar. */
static inline __attribute__((always_inline)) float silu_mul(float g, float u) {
    float x = -g;
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693359375f, x); /* x - n ln 2, in two parts */
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    const float r2 = r * r;
    p = __builtin_fmaf(p, r2, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return g / __builtin_fmaf(p, two_n, 1.0f) * u; /* the fma GCC contracted 1 + p * 2^n to: now spelt out */
}

int quant_isa_supported(int isa);
/* Worksharing loops (omp for): call them inside a parallel region. */
void quantize_rows_body(const float *x, int64_t x_stride, int64_t T, int64_t C, q16_act a);
void quant_matmul_body(int isa, quant_weight w, q16_act a, int64_t T, float *out, int64_t out_stride,
                       const float *bias, int mode);
#endif
