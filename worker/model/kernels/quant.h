/* Shared by quant.c (the quantized linears) and layer.c (a whole decode layer). */
#ifndef TOKENRELAY_QUANT_H
#define TOKENRELAY_QUANT_H
#include <stdint.h>

#include "half.h"

enum { QUANT_ISA_SCALAR = 0, QUANT_ISA_AVX2 = 1, QUANT_ISA_AVXVNNI = 2, QUANT_ISA_AVX512VNNI = 3, QUANT_ISA_AMX = 4 };
enum { QUANT_Q4 = 0, QUANT_Q8 = 1 };                       /* runtime weight formats */
enum { QUANT_STORE = 0, QUANT_ADD = 1, QUANT_SILU_MUL = 2 }; /* how a matmul writes out */

/* A weight (N, C) in blocks of 32 along C: qs q4 (N, C / 2) uint8 or q8 (N, C) int8;
 * d and m (N, C / 32) fp16 bits, as the GGUF file has them (m only for q4). */
typedef struct {
    const void *qs;
    const uint16_t *d, *m;
    int64_t N, C;
    int format;
} quant_weight;

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

int quant_isa_supported(int isa);
/* Worksharing loops (omp for): call them inside a parallel region. */
void quantize_rows_body(const float *x, int64_t x_stride, int64_t T, int64_t C, q16_act a);
void quant_matmul_body(int isa, quant_weight w, q16_act a, int64_t T, float *out, int64_t out_stride,
                       const float *bias, int mode);
#endif
