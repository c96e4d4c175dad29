/* Quantized linears on CPU, loaded by worker/model/native_quant.py.
 *
 * Weights stay in llama.cpp's block formats, repacked at load into three runtime
 * formats (worker/model/quant.py): rows of 32-weight blocks, the 4-bit or 8-bit
 * values of a row contiguous, the block scales beside them as fp16, as in the file:
 *   q4 (Q4_1, and Q4_0 as Q4_1 with m = -8 d): w = d * u + m, u in [0, 15]; a
 *      block is 16 bytes, byte j holding u_j (low nibble) and u_{j+16} (high);
 *   q8 (Q8_0): w = d * q, q in [-128, 127], 32 bytes a block;
 *   q4p, q8p: q4's and q8's blocks in panels of 16 rows, interleaved for the SIMD tiles
 *      (quant.h has the layout, quant_panel.h the reason, quant_panel8.h the 256-bit tiles).
 * Activations are quantized once per input row into blocks of 32 as llama.cpp's q8_0/q8_1
 * do, but to 16-bit integers: a = da * qa with da = max|x| / 32767 and qa = rint(x / da),
 * plus the block's integer sum sa. A block's contribution to an output is then integer
 * maths and two scales:
 *   q4: dw * da * sum(u * qa) + mw * (da * sa)        q8: dw * da * sum(q * qa)
 * Why 16 bits and not llama.cpp's 8: with int8 activations, SmolLM2's greedy tokens over
 * 8 prompts x 64 steps (teacher-forced on the fp32 path's) differed at 11 of 512 steps,
 * 8 of them where fp32's top-2 logit margin was 0.11-0.31, not a near-tie; the error is
 * spread over every layer's linears (no single one made it go away). With int16 none
 * differ and perplexity matches to 1e-4 (tests/test_quant_parity.py). On AVX2 it costs
 * nothing measurable: one input row, SmolLM2's gate/up, 1 thread: 0.28 ms int16 vs 0.24
 * int8; 16 rows 2.0 vs 1.7 ms; down (576 x 1536): 0.11 vs 0.13 and 0.62 vs 0.71 ms.
 * (vpmaddwd takes s16 pairs as vpmaddubsw + vpmaddwd take u8 x s8 quads; the weights are
 * widened once per block and shared by every input row.)
 *
 * The integer dot products come from one of four instruction sets, chosen at run time
 * (quant_isa_supported): AMX int8 tiles (quant_amx.h: prefill-sized steps on Sapphire Rapids
 * and later), AVX-512 VNNI / AVX-VNNI `vpdpwssd` (s16 x s16 pairs accumulated into s32 in one
 * instruction; with AVX-512, steps of 9 or more rows run quant_vnni.h's GEMM tile), AVX2
 * `vpmaddwd` + `vpaddd`, and portable C. Every path sums each block's 32
 * products into one int32 (exact: |u| <= 15, q8 128, times |qa| <= 32767, 32 per block, is
 * below 2^31) and then does the same float operations in the same order: per (weight row,
 * input row) one fma chain over the blocks, acc = fma(dot_b, dw_b * da_b, acc), then the Q4
 * offset term's own chain. So every path, every tile shape and the C code give the same bits
 * (tested), and AMX can take the steps it is fast at without changing an answer. (Until
 * 2026-12-06 each SIMD lane kept its own chain and the lanes were summed at the end, 10-18%
 * less work at batch 1, but no other tile shape, AMX's included, could give those floats.)
 *
 * Tiling: a task owns 16 output rows and up to 64 input rows (AMX, AVX-512 VNNI: 256, which
 * repack their 16 weight rows once per task). Otherwise its input rows go
 * in groups of up to 8 (9 rows: 5 + 4), each group one pass over the task's weight rows
 * (quant_simd.h has the tiles and their measurements); one input row (decode at batch 1) runs
 * 8 weight rows at a time, one lane each. A task's 16 weight rows (~5 KB for SmolLM2) stay in
 * L1 while all its input rows pass: a batched decode reads each weight from memory once per
 * step for all rows. A row's result does not depend on the others in its call (a speculative
 * step's verify rows, a prompt chunk's tokens) nor on the path that computed it.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "quant.h"

#define QBLOCK 32
#define TASK_ROWS_OUT 16
#define TASK_ROWS_IN 64
#define TASK_ROWS_IN_REPACKED 256

/* ---- activations ----------------------------------------------------------------------- */

void quantize_rows_body(const float *x, int64_t x_stride, int64_t T, int64_t C, q16_act a) {
    const int64_t nb = C / QBLOCK;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < T * nb; ++i) {
        const int64_t t = i / nb, b = i % nb;
        quantize_block(x + t * x_stride + b * QBLOCK, a.qs + t * C + b * QBLOCK, a.d + i, a.s + i, a.ds + i);
    }
}

/* ---- the three instruction sets ---------------------------------------------------------- */

#define SUFFIX scalar
#include "quant_simd.h"
#undef SUFFIX

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_X86_VARIANTS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define SUFFIX avx2
#define DOT_S16(acc, w, a) _mm256_add_epi32(acc, _mm256_madd_epi16(w, a))
#include "quant_simd.h"
#include "quant_panel8.h"
#include "quant_gemm8.h"
#undef SUFFIX
#undef DOT_S16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define SUFFIX avxvnni
#define DOT_S16(acc, w, a) _mm256_dpwssd_avx_epi32(acc, w, a)
#include "quant_simd.h"
#include "quant_panel8.h"
#undef SUFFIX
#undef DOT_S16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define SUFFIX avx512vnni
#define DOT_S16(acc, w, a) _mm256_dpwssd_epi32(acc, w, a)
#include "quant_simd.h"
#undef SUFFIX
#undef DOT_S16
/* fewer input rows than the GEMM tile takes: quant_panel.h's panel tiles, or quant_simd.h's */
static void vnni_small_task(quant_weight w, q16_act a, int64_t n0, int64_t n1, int64_t t0, int64_t t1, float *out,
                            int64_t out_stride, const float *bias, int mode);
#include "quant_vnni.h"
#include "quant_panel.h"
#pragma GCC pop_options

/* AMX needs GCC 12's intrinsics and __builtin_cpu_supports names (an older GCC builds the rest
 * and never offers "amx"; a build error would have cost every kernel). */
#if __GNUC__ >= 12
#define HAVE_AMX 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#include "quant_amx.h"
#pragma GCC pop_options

/* Linux gives a process AMX's 8 KiB of tile state only once asked (arch_prctl), for all its
 * threads; 1 when it did. */
static int amx_permitted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
#else
    return 0;
#endif
}
#endif
#endif

/* ---- the machine's int16 dot-product peak (bench-kernel-limits' yardstick) ---------------------
 * PEAK_ACC independent accumulators on registers only, so the loop is bound by the dot
 * instruction's throughput: vpdpwssd on zmm (AVX-512 VNNI), on ymm (AVX-VNNI), vpmaddwd +
 * vpaddd (AVX2). Returns the multiply-adds one thread did. */
#define PEAK_ACC 12
#ifdef HAVE_X86_VARIANTS
/* Twelve named accumulators, each an operand of the empty asm: held in an array, GCC kept them
 * on the stack and the loop ran at the store-to-load latency (until 2026-12-06 this peak read
 * 105 GOP/s on a Zen 4 whose linears ran at 272). */
#define PEAK_LOOP(vec, zero, set1, dot, add, lanes)                                              \
    vec a0 = zero(), a1 = zero(), a2 = zero(), a3 = zero(), a4 = zero(), a5 = zero();        \
    vec a6 = zero(), a7 = zero(), a8 = zero(), a9 = zero(), a10 = zero(), a11 = zero();      \
    const vec w = set1(3), x = set1(5);                                                      \
    for (int64_t i = 0; i < iters; ++i) {                                                    \
        a0 = dot(a0, w, x), a1 = dot(a1, w, x), a2 = dot(a2, w, x), a3 = dot(a3, w, x);      \
        a4 = dot(a4, w, x), a5 = dot(a5, w, x), a6 = dot(a6, w, x), a7 = dot(a7, w, x);      \
        a8 = dot(a8, w, x), a9 = dot(a9, w, x), a10 = dot(a10, w, x), a11 = dot(a11, w, x);  \
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),   \
                         "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));      \
    }                                                                                        \
    a0 = add(add(add(a0, a1), add(a2, a3)), add(add(a4, a5), add(a6, a7)));                  \
    a0 = add(a0, add(add(a8, a9), add(a10, a11)));                                           \
    int32_t sink[lanes];                                                                     \
    memcpy(sink, &a0, sizeof sink);                                                          \
    return sink[0] == 42 ? 0 : iters * PEAK_ACC * 2 * lanes;

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
static int64_t peak_avx512vnni(int64_t iters) {
    PEAK_LOOP(__m512i, _mm512_setzero_si512, _mm512_set1_epi16, _mm512_dpwssd_epi32, _mm512_add_epi32, 16)
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
static int64_t peak_avxvnni(int64_t iters) {
    PEAK_LOOP(__m256i, _mm256_setzero_si256, _mm256_set1_epi16, _mm256_dpwssd_avx_epi32, _mm256_add_epi32, 8)
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
/* The product takes the accumulator for its weights (the values do not matter): madd(w, a) of
 * two constants would be hoisted out of the loop, leaving only the adds (which read 472 GOP/s on
 * one Zen 4 core). */
static inline __m256i madd_add(__m256i acc, __m256i w, __m256i a) {
    (void)w;
    return _mm256_add_epi32(acc, _mm256_madd_epi16(acc, a));
}
static int64_t peak_avx2(int64_t iters) {
    PEAK_LOOP(__m256i, _mm256_setzero_si256, _mm256_set1_epi16, madd_add, _mm256_add_epi32, 8)
}
#pragma GCC pop_options
#undef PEAK_LOOP
#endif

/* Multiply-adds done by all num_threads threads, each running `iters` rounds on `isa`
 * (0 for the portable C path, which has no peak to speak of, or an ISA this CPU lacks). */
int64_t quant_int16_peak(int isa, int64_t iters, int num_threads) {
    if (!quant_isa_supported(isa)) return 0;
    int64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        switch (isa) {
#ifdef HAVE_X86_VARIANTS
        case QUANT_ISA_AVX512VNNI: total += peak_avx512vnni(iters); break;
        case QUANT_ISA_AVXVNNI: total += peak_avxvnni(iters); break;
        case QUANT_ISA_AVX2: total += peak_avx2(iters); break;
#endif
        default: break;
        }
    }
    return total;
}

int quant_isa_supported(int isa) {
    switch (isa) {
    case QUANT_ISA_SCALAR:
        return 1;
#ifdef HAVE_X86_VARIANTS
    case QUANT_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case QUANT_ISA_AVXVNNI:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avxvnni");
    case QUANT_ISA_AVX512VNNI:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
               __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#ifdef HAVE_AMX
    case QUANT_ISA_AMX:
        return quant_isa_supported(QUANT_ISA_AVX512VNNI) && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
#endif
#endif
    default:
        return 0;
    }
}

/* ---- matmuls ------------------------------------------------------------------------------ */

/* out[t, n] (row stride out_stride) for every input row t and output row n, written as
 * `mode` says: QUANT_STORE, QUANT_ADD (out += the result: a residual), or QUANT_SILU_MUL
 * (weight rows 2i and 2i + 1 are gate_i and up_i; out[t, i] = silu(gate) * up).
 * bias (N,) or NULL is added to the result first. A worksharing loop: call it inside a
 * parallel region. */
void quant_matmul_body(int isa, quant_weight w, q16_act a, int64_t T, float *out, int64_t out_stride,
                       const float *bias, int mode) {
    /* an AMX or AVX-512 VNNI task repacks its weight rows once for all its input rows
     * (quant_amx.h, quant_vnni.h); AVX2's GEMM tile (quant_gemm8.h) repacks per task of
     * TASK_ROWS_IN (~3% of its work; 256 there not measured) */
#ifdef HAVE_X86_VARIANTS
    if (isa == QUANT_ISA_AVX512VNNI && quant_is_panel(w.format) && T < VNNI_MIN_ROWS) {
        /* few input rows: each thread one run of panels in one call. At batch 1 a 16-row task
         * is ~0.2 us of weights, and the call per task (struct copies, dispatch) took ~8% of
         * the fused layers' samples (perf, 2-core Zen 4, 2026-12-07) */
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num(), panels = w.N / VNNI_ROWS;
        const int64_t p0 = panels * me / nt, p1 = panels * (me + 1) / nt;
        if (p1 > p0) vnni_small_task(w, a, p0 * VNNI_ROWS, p1 * VNNI_ROWS, 0, T, out, out_stride, bias, mode);
#pragma omp barrier
        return;
    }
#endif
    const int64_t rows_in = isa == QUANT_ISA_AMX || isa == QUANT_ISA_AVX512VNNI ? TASK_ROWS_IN_REPACKED : TASK_ROWS_IN;
    const int64_t n_tasks = (w.N + TASK_ROWS_OUT - 1) / TASK_ROWS_OUT;
    const int64_t t_tasks = (T + rows_in - 1) / rows_in;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < n_tasks * t_tasks; ++task) {
        const int64_t t0 = (task / n_tasks) * rows_in, n0 = (task % n_tasks) * TASK_ROWS_OUT;
        const int64_t t1 = t0 + rows_in < T ? t0 + rows_in : T;
        const int64_t n1 = n0 + TASK_ROWS_OUT < w.N ? n0 + TASK_ROWS_OUT : w.N;
        switch (isa) {
#ifdef HAVE_X86_VARIANTS
        case QUANT_ISA_AVX2:
            g8_task_avx2(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
            break;
        case QUANT_ISA_AVXVNNI:
            small_task_avxvnni(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
            break;
        case QUANT_ISA_AVX512VNNI:
            vnni_task(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
            break;
#ifdef HAVE_AMX
        case QUANT_ISA_AMX:
            amx_task(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
            break;
#endif
#endif
        default:
            quant_task_scalar(w, a, n0, n1, t0, t1, out, out_stride, bias, mode);
        }
    }
}

/* The entry points (ctypes): one call quantizes x (T, C), row stride x_stride, into the
 * caller's activation buffers and multiplies. Returns -1 for an instruction set this CPU
 * lacks (nothing is computed), else 0. */
int quant_linear(int isa, const void *w_qs, const uint16_t *w_d, const uint16_t *w_m, int64_t N, int64_t C,
                 int format, const float *x, int64_t x_stride, int64_t T, int16_t *a_qs, float *a_d,
                 int32_t *a_s, float *a_ds, float *out, int64_t out_stride, const float *bias, int mode,
                 int num_threads) {
    if (!quant_isa_supported(isa)) return -1;
    const quant_weight w = {w_qs, w_d, w_m, N, C, format};
    const q16_act a = {a_qs, a_d, a_s, a_ds, C};
#pragma omp parallel num_threads(num_threads)
    {
        quantize_rows_body(x, x_stride, T, C, a);
        /* the implicit barrier after quantize's loop: every row is quantized before any is read */
        quant_matmul_body(isa, w, a, T, out, out_stride, bias, mode);
    }
    return 0;
}

/* Activation quantization alone (the tests compare it with a NumPy reference). */
void quantize_rows(const float *x, int64_t x_stride, int64_t T, int64_t C, int16_t *a_qs, float *a_d,
                   int32_t *a_s, float *a_ds) {
    const q16_act a = {a_qs, a_d, a_s, a_ds, C};
    quantize_rows_body(x, x_stride, T, C, a);
}

/* Rows `ids` of a weight as fp32: embedding lookups on a quantized table, and whole
 * weights for prefill-sized matmuls (native_quant.py says why). */
void quant_dequantize_rows(const void *w_qs, const uint16_t *w_d, const uint16_t *w_m, int64_t C, int format,
                           const int64_t *ids, int64_t n, float *out, int num_threads) {
    const int64_t nb = C / QBLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 64)
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = ids[i];
        float *o = out + i * C;
        for (int64_t b = 0; b < nb; ++b) {
            const float d = half_to_float(w_d[r * nb + b]);
            if (quant_is_panel(format)) {
                const quant_weight w = {w_qs, w_d, w_m, (r / 16 + 1) * 16, C, format};
                const int64_t at = quant_scale_index(w, r, b);
                const float pd = half_to_float(w_d[at]), pm = format == QUANT_Q4P ? half_to_float(w_m[at]) : 0.0f;
                for (int j = 0; j < QBLOCK; ++j) {
                    const float v = pd * (float)quant_int(w, r, b * QBLOCK + j);
                    o[b * QBLOCK + j] = format == QUANT_Q4P ? v + pm : v; /* q8: no + 0.0f (-0.0 stays) */
                }
            } else if (format == QUANT_Q4) {
                const uint8_t *q = (const uint8_t *)w_qs + r * (C / 2) + b * (QBLOCK / 2);
                const float m = half_to_float(w_m[r * nb + b]);
                for (int j = 0; j < QBLOCK / 2; ++j) {
                    o[b * QBLOCK + j] = d * (float)(q[j] & 0x0F) + m;
                    o[b * QBLOCK + j + QBLOCK / 2] = d * (float)(q[j] >> 4) + m;
                }
            } else {
                const int8_t *q = (const int8_t *)w_qs + r * C + b * QBLOCK;
                for (int j = 0; j < QBLOCK; ++j) o[b * QBLOCK + j] = d * (float)q[j];
            }
        }
    }
}
