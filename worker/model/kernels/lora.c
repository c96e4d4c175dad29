/* LoRA updates of one fused matmul for every adapted row of a step, loaded by
 * worker/model/native.py (Python side: native_lora.py; layouts: lora.py).
 *
 * out[t, :] += (x[t, :] @ A^T) @ (scale B)^T with the A and B of the adapter in row t's
 * slot. Why C: the torch path is two one-row bmm calls per matmul, adapter and layer,
 * ~960 calls a step for 16 rows over 4 adapters of SmolLM2, ~19 ms of dispatch for
 * ~65 M multiply-adds; here a matmul's updates are one call.
 *
 * Each adapter keeps, per layer and fused matmul (lora.py's LoraUpdate), a_t (in, m * r),
 * the A^T of its m adapted modules side by side, and b_t (m * r, N), their scale * B^T
 * at each module's output columns and zero elsewhere. This reads only the nonzero
 * blocks: module q's r rows of b_t over its columns [c0, c1).
 *
 * The step's adapted rows come sorted by slot; runs of one slot are cut into chunks of
 * at most CHUNK rows, and a chunk reads its adapter's matrices once for all its rows.
 * Chunks are the parallel tasks. Batch invariance: every value of a row is one chain of
 * fused multiply-adds in a fixed order (over `in` for the shrink, over the m * r ranks
 * for the expand, then one add into out), the same code whatever the chunk's size, the
 * other rows or the threads, so a row's bits do not depend on who shares its step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LORA_GROUPS 4 /* qkv, o, gate_up, down: lora.py's GROUPS, in that order */
#define LORA_MAX_MODULES 3
#define CHUNK 4 /* the code below is written for at most 4 */
#define LANES 16 /* columns a register block computes */

#ifdef __FMA__ /* fmaf is then one instruction, and every copy of a loop rounds alike */
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* One (layer, matmul) of one adapter: 12 int64 in the adapter's (L, 4, 12) table (lora.py). */
typedef struct {
    int64_t a_t, b_t;  /* addresses of a_t (in, m * r) and b_t (m * r, N) fp32; a_t 0: no update */
    int64_t in, N, r, m;
    int64_t cols[2 * LORA_MAX_MODULES]; /* module q's output columns [cols[2q], cols[2q + 1]) */
} lora_entry;

static const lora_entry *entry_of(const int64_t *tables, int64_t slot, int64_t layer, int64_t group) {
    return (const lora_entry *)(intptr_t)tables[slot] + layer * LORA_GROUPS + group;
}

/* LANES floats as one vector (GCC/clang vector extensions: zmm with AVX-512, 2 ymm with AVX2);
 * vfu loads and stores at any float's alignment. */
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef float vfu __attribute__((vector_size(4 * LANES), aligned(4)));

/* s[t, j0:j0 + LANES] = x[rows[t]] @ a_t[:, j0:j0 + LANES] for t < count, each value one chain of
 * multiply-adds over k in order (fused: -march=native contracts them, as fmaf in the tails).
 * Inlined with a constant count, so the sums stay in registers. */
static inline __attribute__((always_inline)) void shrink_block(const float *restrict a, int64_t mr, int64_t in,
                                                               const float *const *xr, int64_t j0, int count,
                                                               float *restrict s) {
    vf acc[CHUNK] = {0};
    for (int64_t k = 0; k < in; ++k) {
        const vf ak = *(const vfu *)(a + k * mr + j0);
        for (int t = 0; t < count; ++t) acc[t] += xr[t][k] * ak;
    }
    for (int t = 0; t < count; ++t) *(vfu *)(s + t * mr + j0) = acc[t];
}

/* The same for the columns [j0, mr) a block does not fill. */
static void shrink_tail(const float *restrict a, int64_t mr, int64_t in, const float *const *xr, int64_t j0,
                        int count, float *restrict s) {
    for (int t = 0; t < count; ++t)
        for (int64_t j = j0; j < mr; ++j) s[t * mr + j] = 0.0f;
    for (int64_t k = 0; k < in; ++k)
        for (int t = 0; t < count; ++t)
            for (int64_t j = j0; j < mr; ++j) s[t * mr + j] = MADD(xr[t][k], a[k * mr + j], s[t * mr + j]);
}

/* out[rows[t], n0:n0 + LANES] += s[t, j0:j1] @ b_t[j0:j1, n0:n0 + LANES]: the update summed over j
 * in order from zero, then added (as torch's path does); inlined like shrink_block. */
static inline __attribute__((always_inline)) void expand_block(const float *restrict b, int64_t N,
                                                               const float *restrict s, int64_t mr, int64_t j0,
                                                               int64_t j1, float *const *orow, int64_t n0,
                                                               int count) {
    vf acc[CHUNK] = {0};
    for (int64_t j = j0; j < j1; ++j) {
        const vf bj = *(const vfu *)(b + j * N + n0);
        for (int t = 0; t < count; ++t) acc[t] += s[t * mr + j] * bj;
    }
    for (int t = 0; t < count; ++t) *(vfu *)(orow[t] + n0) = *(vfu *)(orow[t] + n0) + acc[t];
}

/* The same for the columns [n0, n1) a block does not fill. */
static void expand_tail(const float *restrict b, int64_t N, const float *restrict s, int64_t mr, int64_t j0,
                        int64_t j1, float *const *orow, int64_t n0, int64_t n1, int count) {
    for (int t = 0; t < count; ++t)
        for (int64_t n = n0; n < n1; ++n) {
            float acc = 0.0f;
            for (int64_t j = j0; j < j1; ++j) acc = MADD(s[t * mr + j], b[j * N + n], acc);
            orow[t][n] += acc;
        }
}

/* One chunk of `count` rows of one adapter: s (count, m * r) scratch. */
static void chunk_update(const lora_entry *e, const float *x, int64_t x_stride, float *out, int64_t out_stride,
                         const int64_t *rows, int count, float *restrict s) {
    const int64_t mr = e->m * e->r;
    const float *a = (const float *)(intptr_t)e->a_t, *b = (const float *)(intptr_t)e->b_t;
    const float *xr[CHUNK];
    float *orow[CHUNK];
    for (int t = 0; t < count; ++t) xr[t] = x + rows[t] * x_stride, orow[t] = out + rows[t] * out_stride;
    int64_t j0 = 0;
    for (; j0 + LANES <= mr; j0 += LANES) switch (count) {
        case 1: shrink_block(a, mr, e->in, xr, j0, 1, s); break;
        case 2: shrink_block(a, mr, e->in, xr, j0, 2, s); break;
        case 3: shrink_block(a, mr, e->in, xr, j0, 3, s); break;
        default: shrink_block(a, mr, e->in, xr, j0, 4, s); break;
    }
    if (j0 < mr) shrink_tail(a, mr, e->in, xr, j0, count, s);
    for (int64_t q = 0; q < e->m; ++q) { /* module q: ranks [q r, (q + 1) r), its columns only */
        const int64_t r0 = q * e->r, r1 = r0 + e->r, c1 = e->cols[2 * q + 1];
        int64_t n0 = e->cols[2 * q];
        for (; n0 + LANES <= c1; n0 += LANES) switch (count) {
            case 1: expand_block(b, e->N, s, mr, r0, r1, orow, n0, 1); break;
            case 2: expand_block(b, e->N, s, mr, r0, r1, orow, n0, 2); break;
            case 3: expand_block(b, e->N, s, mr, r0, r1, orow, n0, 3); break;
            default: expand_block(b, e->N, s, mr, r0, r1, orow, n0, 4); break;
        }
        if (n0 < c1) expand_tail(b, e->N, s, mr, r0, r1, orow, n0, c1, count);
    }
}

/* The entry point (ctypes). tables (S,): each slot's (L, 4, 12) int64 table address; rows (n,):
 * the adapted rows of x (T, in) and out (T, N), sorted by slot; row_slots (n,): their slots.
 * Returns 0; -2 for a slot outside [0, S), a row outside [0, T) or an update whose shapes are not (in, N) (nothing
 * is computed then); -1 when out of memory (rows may be partly updated). */
int lora_add(const int64_t *tables, int64_t num_slots, int64_t layer, int64_t group, const float *x,
             int64_t x_stride, int64_t in, float *out, int64_t out_stride, int64_t N, const int64_t *rows,
             const int64_t *row_slots, int64_t n, int64_t T, int num_threads) {
    int64_t max_mr = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = row_slots[i];
        if (slot < 0 || slot >= num_slots || rows[i] < 0 || rows[i] >= T) return -2;
        const lora_entry *e = entry_of(tables, slot, layer, group);
        if (!e->a_t) continue;
        if (e->in != in || e->N != N || e->r < 1 || e->m < 1 || e->m > LORA_MAX_MODULES) return -2;
        for (int64_t q = 0; q < e->m; ++q)
            if (e->cols[2 * q] < 0 || e->cols[2 * q] > e->cols[2 * q + 1] || e->cols[2 * q + 1] > N) return -2;
        max_mr = e->m * e->r > max_mr ? e->m * e->r : max_mr;
    }
    if (!max_mr) return 0; /* no row's adapter updates this matmul */
    int64_t *starts = malloc((size_t)(n + 1) * sizeof(int64_t)); /* chunk c: rows [starts[c], starts[c + 1]) */
    if (!starts) return -1;
    int64_t num_chunks = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t c = num_chunks ? starts[num_chunks - 1] : -1;
        if (c < 0 || row_slots[i] != row_slots[c] || i - c == CHUNK) starts[num_chunks++] = i;
    }
    starts[num_chunks] = n;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *s = malloc((size_t)(CHUNK * max_mr) * sizeof(float));
        failed |= !s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; ++c) {
            const lora_entry *e = entry_of(tables, row_slots[starts[c]], layer, group);
            if (!s || !e->a_t) continue;
            chunk_update(e, x, x_stride, out, out_stride, rows + starts[c], (int)(starts[c + 1] - starts[c]), s);
        }
        free(s);
    }
    free(starts);
    return failed ? -1 : 0;
}
