/* Every decoder layer of one step in one call, on quantized weights, each new token a decode
 * row (a prompt chunk's tokens too: worker/model/llama.py _rows_as_decodes says why) (loaded by
 * worker/model/native_layers.py).
 *
 * A decode step of SmolLM2 at batch 1 has ~210 matmuls and, through torch, ~14 ops per
 * layer around them; at a few microseconds of dispatch each, the ops alone took longer
 * than the quantized matmuls (measured on the AVX2 EPYC, 2 threads: 30 layers of per-op
 * calls ~9 ms per step, of which the matmuls ~3 ms). Here the whole stack runs in one
 * OpenMP region on torch's thread pool, its steps separated by the barriers of worksharing
 * loops, as ggml runs a graph:
 *   RMSNorm + quantize -> QKV (+bias) -> RoPE, K/V into the paged cache -> attention
 *   -> quantize -> O (+bias) added to x -> RMSNorm + quantize -> gate/up with SiLU * up
 *   -> quantize -> down added to x.
 * Every piece is the one the per-op path calls (quant_matmul_body, attend_task,
 * rms_norm_row) and RoPE is computed without fused multiply-adds, as torch does, so this
 * gives bit for bit what that path gives (tests/test_native_layers.py holds it to that).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "quant.h"

typedef struct {
    quant_weight wqkv, wo, wgu, wdown; /* wgu: rows gate_i, up_i interleaved */
    const float *bqkv, *bo;             /* NULL without attention bias */
    const float *attn_norm, *mlp_norm;  /* (C,) */
} decode_layer_weights;

typedef struct {
    float *x; /* (B, C): the residual stream, updated in place */
    int64_t B, C, H, KH, D, F;
    float eps, scale;
    const float *cos, *sin; /* (num_positions, D): rope.py's tables (sin signed: -sin | sin) */
    int64_t num_positions;
    const int64_t *positions;    /* (B,) */
    const int64_t *slot_mapping; /* (B,): block * block_size + offset of each new K/V */
    const int32_t *block_tables; /* (B, max_blocks) at block_table_stride */
    int64_t block_table_stride, max_blocks;
    const int32_t *lens;      /* (B,): cached positions + this token */
    char *k_cache, *v_cache;  /* layer 0's (KH, num_blocks, block_size, D); layer l at + l * layer_bytes */
    int64_t layer_bytes, num_blocks, block_size;
    int cache_dtype; /* 0 fp32, 1 fp16, 2 bf16 */
} decode_step;

enum { FAILED_BAD_POSITION = 8 };

/* fp32 -> IEEE half, round to nearest even (as torch's .to(float16)); NaN stays NaN. */
static inline uint16_t half_from_float(float f) {
    const uint32_t x = bits_from_float(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);                /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);               /* rounds to inf */
    if (ax < 0x38800000u)                                                    /* half subnormal or 0 */
        return (uint16_t)(sign | (uint32_t)__builtin_rintf(float_from_bits(ax) * 0x1p24f));
    return (uint16_t)(sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13));
}

/* fp32 -> bfloat16, round to nearest even (as torch's .to(bfloat16)); NaN stays NaN. */
static inline uint16_t bf16_from_float(float f) {
    const uint32_t x = bits_from_float(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static void store_kv(char *cache, int dtype, int64_t index, const float *v, int64_t D) {
    if (dtype == 0) {
        memcpy((float *)cache + index, v, (size_t)D * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)cache + index;
        for (int64_t d = 0; d < D; ++d) dst[d] = dtype == 1 ? half_from_float(v[d]) : bf16_from_float(v[d]);
    }
}

/* x (D,) rotated in place: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] with rope.py's
 * tables. No fused multiply-add, so it rounds as torch's x * cos + swapped * sin does. */
__attribute__((optimize("fp-contract=off"))) static void rope(float *x, const float *cos,
                                                              const float *sin, int64_t D) {
    float y[512];
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; ++d) {
        const float a = x[d] * cos[d], b = x[d < half ? d + half : d - half] * sin[d];
        y[d] = a + b;
    }
    memcpy(x, y, (size_t)D * sizeof(float));
}

static int check_step(const decode_step *st) {
    int failed = 0;
    for (int64_t b = 0; b < st->B; ++b) {
        failed |= check_row(st->block_tables + b * st->block_table_stride, st->lens[b], st->max_blocks,
                            st->block_size, st->num_blocks);
        const int64_t slot = st->slot_mapping[b];
        failed |= st->positions[b] < 0 || st->positions[b] >= st->num_positions || slot < 0 ||
                          slot >= st->num_blocks * st->block_size
                      ? FAILED_BAD_POSITION
                      : 0;
    }
    return failed;
}

/* RMSNorm of each row of x (B, C) into h, then h quantized into a (a worksharing loop). */
static void norm_quantize(const float *x, const float *weight, int64_t B, int64_t C, float eps, float *h,
                          q16_act a) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
        rms_norm_row(x + b * C, weight, h + b * C, C, eps);
        for (int64_t k = 0; k < C / 32; ++k) {
            const int64_t i = b * (C / 32) + k;
            quantize_block(h + b * C + k * 32, a.qs + b * C + k * 32, a.d + i, a.s + i, a.ds + i);
        }
    }
}

/* Consecutive rows of one sequence (a verify step's rows, a prompt chunk's tokens: each one
 * position further, the same blocks) attend as one task per kv head, so the keys and values
 * they share are loaded once for all of them (at ~500 fp32 positions a row's K/V are 768 KB a
 * layer for SmolLM2). Measured, 30 layers at ~500 positions, 2 threads, old and new kernels
 * alternated in one process, medians of 10: 5 verify rows 21.9 -> 20.8 ms, 1 row 9.8 both.
 * Groups are cut at `cap` rows; row groups[g] .. groups[g + 1] - 1 form group g. */
static int64_t group_rows(const decode_step *st, int64_t cap, int64_t *groups) {
    int64_t num = 0;
    groups[0] = 0;
    for (int64_t b = 1; b < st->B; ++b) {
        const int32_t *prev = st->block_tables + (b - 1) * st->block_table_stride;
        const int64_t used = (st->lens[b - 1] + st->block_size - 1) / st->block_size;
        const int joins = b - groups[num] < cap && st->lens[b] == st->lens[b - 1] + 1 &&
                          memcmp(prev, prev + st->block_table_stride, (size_t)used * sizeof(int32_t)) == 0;
        if (!joins) groups[++num] = b;
    }
    groups[++num] = st->B;
    return num;
}

/* Groups of at most 8 rows, smaller where that leaves fewer than two tasks per thread (one
 * sequence verifying 4 proposals with 3 kv heads: 3 tasks for 2 threads, one thread idle a
 * third of the time, against 6 in groups of 3 and 2). */
static int64_t plan_groups(const decode_step *st, int num_threads, int64_t *groups) {
    int64_t num = group_rows(st, 8, groups);
    const int64_t min_groups = (2 * num_threads + st->KH - 1) / st->KH;
    if (num < min_groups && num < st->B) num = group_rows(st, (st->B + min_groups - 1) / min_groups, groups);
    return num;
}

/* One layer; called by every thread of the region. */
static void layer(int isa, const decode_layer_weights *w, const decode_step *st, int64_t l, float *h,
                  float *qkv, float *attn, float *act, q16_act a, const int64_t *groups, int64_t num_groups,
                  int *failed) {
    const int64_t B = st->B, C = st->C, H = st->H, KH = st->KH, D = st->D, G = H / KH;
    const int64_t QKV = (H + 2 * KH) * D;
    char *k_cache = st->k_cache + l * st->layer_bytes, *v_cache = st->v_cache + l * st->layer_bytes;
    const int64_t head_values = st->num_blocks * st->block_size * D; /* one kv head of one layer */
    const cache_format format = st->cache_dtype == 0 ? F32 : st->cache_dtype == 1 ? F16 : BF16;
    a.C = C;
    norm_quantize(st->x, w->attn_norm, B, C, st->eps, h, a);
    quant_matmul_body(isa, w->wqkv, a, B, qkv, QKV, w->bqkv, QUANT_STORE);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * (H + 2 * KH); ++i) { /* rotate q and k heads, store k and v */
        const int64_t b = i / (H + 2 * KH), head = i % (H + 2 * KH), p = st->positions[b];
        float *x = qkv + b * QKV + head * D;
        if (head < H + KH) rope(x, st->cos + p * D, st->sin + p * D, D);
        if (head >= H) {
            const int64_t kv = head < H + KH ? head - H : head - H - KH, slot = st->slot_mapping[b];
            const int64_t index = kv * head_values + slot * D; /* slot = block * block_size + offset */
            store_kv(head < H + KH ? k_cache : v_cache, st->cache_dtype, index, x, D);
        }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_groups * KH; ++task) {
        const int64_t b = groups[task / KH], R = groups[task / KH + 1] - b, kv = task % KH;
        const row_pages pages = {st->block_tables + (b + R - 1) * st->block_table_stride, st->block_size,
                                 st->block_size * D, kv * head_values}; /* the longest row's covers all */
        const attend_rows rows = {qkv + b * QKV + kv * G * D, attn + (b * H + kv * G) * D, st->lens + b, R, QKV,
                                  H * D};
        const int bad = attend_task(rows, k_cache, v_cache, format, pages, G, D, st->scale);
        if (bad) __atomic_or_fetch(failed, bad, __ATOMIC_RELAXED);
    }
    a.C = H * D;
    quantize_rows_body(attn, H * D, B, H * D, a);
    quant_matmul_body(isa, w->wo, a, B, st->x, C, w->bo, QUANT_ADD);
    a.C = C;
    norm_quantize(st->x, w->mlp_norm, B, C, st->eps, h, a);
    quant_matmul_body(isa, w->wgu, a, B, act, st->F, NULL, QUANT_SILU_MUL);
    a.C = st->F;
    quantize_rows_body(act, st->F, B, st->F, a);
    quant_matmul_body(isa, w->wdown, a, B, st->x, C, NULL, QUANT_ADD);
}

/* Returns 0; -1 for an instruction set this CPU lacks or no memory; -2 when a length is out
 * of range; -3 when a used block id is outside [0, num_blocks); -4 for a position outside
 * the rope tables or a slot outside the cache. Nothing is computed when a check fails. */
int decode_layers(int isa, const decode_layer_weights *layers, int64_t num_layers, const decode_step *st,
                  int num_threads) {
    if (!quant_isa_supported(isa)) return -1;
    const int bad = check_step(st);
    if (bad) return bad & FAILED_BAD_LENGTH ? -2 : bad & FAILED_BAD_BLOCK ? -3 : -4;
    const int64_t B = st->B, W = st->F > st->C ? (st->F > st->H * st->D ? st->F : st->H * st->D)
                                               : (st->C > st->H * st->D ? st->C : st->H * st->D);
    const int64_t nb = B * W / 32, floats = B * (st->C + (st->H + 2 * st->KH) * st->D + st->H * st->D + st->F);
    float *h = malloc((size_t)(floats + 2 * nb) * sizeof(float) + (size_t)nb * sizeof(int32_t) + (size_t)(B * W) * sizeof(int16_t));
    int64_t *groups = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (h == NULL || groups == NULL) {
        free(h);
        free(groups);
        return -1;
    }
    const int64_t num_groups = plan_groups(st, num_threads, groups);
    float *qkv = h + B * st->C, *attn = qkv + B * (st->H + 2 * st->KH) * st->D, *act = attn + B * st->H * st->D;
    float *ad = act + B * st->F, *ads = ad + nb;
    int32_t *as = (int32_t *)(ads + nb);
    const q16_act a = {(int16_t *)(as + nb), ad, as, ads, st->C}; /* sized for the widest input, W */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    for (int64_t l = 0; l < num_layers; ++l)
        layer(isa, layers + l, st, l, h, qkv, attn, act, a, groups, num_groups, &failed);
    free(h);
    free(groups);
    return failed ? -1 : 0;
}
