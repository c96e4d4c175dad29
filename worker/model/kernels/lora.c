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
#define CHUNK 4

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

/* s (count, m * r) = x[rows] @ a_t: row by row, each value summed over k in order. */
static void shrink(const lora_entry *e, const float *restrict x, int64_t x_stride, const int64_t *rows,
                   int64_t count, float *restrict s) {
    const int64_t mr = e->m * e->r;
    const float *restrict a = (const float *)(intptr_t)e->a_t;
    memset(s, 0, (size_t)(count * mr) * sizeof(float));
    for (int64_t k = 0; k < e->in; ++k) {
        const float *restrict ak = a + k * mr;
        for (int64_t t = 0; t < count; ++t) {
            const float xv = x[rows[t] * x_stride + k];
            float *restrict st = s + t * mr;
            for (int64_t j = 0; j < mr; ++j) st[j] = MADD(xv, ak[j], st[j]);
        }
    }
}

/* out[rows, c0:c1] += s @ b_t[:, c0:c1] for each module's columns; delta (count, N) scratch. */
static void expand(const lora_entry *e, const float *restrict s, float *restrict out, int64_t out_stride,
                   const int64_t *rows, int64_t count, float *restrict delta) {
    const int64_t mr = e->m * e->r, N = e->N;
    const float *restrict b = (const float *)(intptr_t)e->b_t;
    for (int64_t q = 0; q < e->m; ++q) {
        const int64_t c0 = e->cols[2 * q], c1 = e->cols[2 * q + 1];
        for (int64_t t = 0; t < count; ++t) memset(delta + t * N + c0, 0, (size_t)(c1 - c0) * sizeof(float));
        for (int64_t j = q * e->r; j < (q + 1) * e->r; ++j) {
            const float *restrict bj = b + j * N;
            for (int64_t t = 0; t < count; ++t) {
                const float sv = s[t * mr + j];
                float *restrict dt = delta + t * N;
                for (int64_t n = c0; n < c1; ++n) dt[n] = MADD(sv, bj[n], dt[n]);
            }
        }
        for (int64_t t = 0; t < count; ++t) {
            float *restrict ot = out + rows[t] * out_stride;
            const float *restrict dt = delta + t * N;
            for (int64_t n = c0; n < c1; ++n) ot[n] += dt[n];
        }
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
        float *delta = malloc((size_t)(CHUNK * N) * sizeof(float));
        failed |= !s || !delta;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; ++c) {
            const lora_entry *e = entry_of(tables, row_slots[starts[c]], layer, group);
            if (!s || !delta || !e->a_t) continue;
            const int64_t *chunk = rows + starts[c];
            const int64_t count = starts[c + 1] - starts[c];
            shrink(e, x, x_stride, chunk, count, s);
            expand(e, s, out, out_stride, chunk, count, delta);
        }
        free(s);
        free(delta);
    }
    free(starts);
    return failed ? -1 : 0;
}
