/* int8_groups_f32: a dynamic per-group INT8 Linear (QuantConfig(scheme="dynamic_group")) on AVX512-VNNI, any
 * number of rows (a prefill's hundreds and a decode step's one), in one call: the whole of
 * fxquant.kernels.per_group.per_group_linear for float32 rows.
 *
 * Each row, times SmoothQuant's input_scale where there is one, is quantized per group of `group` consecutive inputs
 * with fxq_quantize_groups (elementwise.c; each group of a row its own symmetric scale max|x| / 127), into a
 * buffer of this call laid out (groups, rows, group). Then, per output,
 *     out[m, n] = (sum over groups g, in order, of float(S_g[m, n]) * scale[g, m]) * col_scale[n] (+ bias[n])
 * where S_g is the exact int32 sum of one group's products and each step of the float sum is a product rounded
 * then a sum rounded (no fused multiply-add: setup.py builds with -ffp-contract=off), as the torch path rounds it:
 * the same bytes, at any number of rows and threads. vpdpbusd multiplies unsigned by signed bytes, so the quantized
 * rows are offset to unsigned (q + 128, a flip of the sign bit) and 128 times each group's weight sum
 * (group_sums) comes off its int32 sum. The weights are packed (n_pad / 32, in_features / 4, 32, 4): each block of
 * 32 outputs in one run, four consecutive inputs of one output together, sixteen outputs per 64 bytes, so a tile of
 * ROWS rows x BLOCKS * 16 outputs broadcasts four input bytes of a row against 64 weight bytes per block. Work items
 * (a block of outputs against a panel of rows, groups_vnni) are split over torch's threads (FXQ_PARALLEL_FOR).
 * Arguments arrive checked (module_rows.c); runs without the GIL, only where fxq_vnni_usable().
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "gemm.h"

#define ROWS 6
#define BLOCKS 2
#define WIDTH (16 * BLOCKS)  /* outputs of one block */
#define PANEL (16 * ROWS)    /* rows of one work item */
#define CHUNK_BYTES 32768    /* a block's weights read per pass over a panel: they stay in L1 across its tiles */

/* The quantized rows of one call: u8 (groups, rows, group) and their float32 scales (groups, rows). */
typedef struct {
    const uint8_t *q;
    const float *scale;
} GroupedRows;

/* Groups [g0, g1) of `rows` rows from m0 against the block of outputs at n0: the running float sums come from
 * `partial` (rows x WIDTH, none before the first group) and go back there, or, after the last group, out. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void tile_vnni(
    const Int8Groups *p, const GroupedRows *x, const int64_t m0, const int rows, const int64_t n0, const int64_t g0,
    const int64_t g1, float *partial) {
    const int64_t M = p->rows, K = p->in_features, G = K / p->group, np = p->n_pad, steps = p->group / 4;
    __m512 total[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < BLOCKS; c++)
            total[r][c] = g0 ? _mm512_loadu_ps(partial + r * WIDTH + 16 * c) : _mm512_setzero_ps();
    for (int64_t g = g0; g < g1; g++) {
        const int8_t *w = p->w + n0 * K + g * steps * 64 * BLOCKS; /* block n0 / 32, group g */
        const uint8_t *src = x->q + (g * M + m0) * p->group;
        __m512i acc[ROWS][BLOCKS]; /* start at -128 * the group's weight sums: the int32 sums come out exact */
        for (int c = 0; c < BLOCKS; c++) {
            const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),
                                                   _mm512_loadu_si512(p->group_sums + g * np + n0 + 16 * c));
            for (int r = 0; r < rows; r++)
                acc[r][c] = start;
        }
        for (int64_t kk = 0; kk < steps; kk++) {
            __m512i b[BLOCKS];
            for (int c = 0; c < BLOCKS; c++)
                b[c] = _mm512_loadu_si512(w + kk * 64 * BLOCKS + 64 * c);
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, src + r * p->group + 4 * kk, 4);
                const __m512i a = _mm512_set1_epi32(four);
                for (int c = 0; c < BLOCKS; c++)
                    acc[r][c] = fxq_dpbusd(acc[r][c], a, b[c]);
            }
        }
        for (int c = 0; c < BLOCKS; c++) {
            for (int r = 0; r < rows; r++) {
                const __m512 sum = _mm512_cvtepi32_ps(acc[r][c]);
                const __m512 scaled = _mm512_mul_ps(sum, _mm512_set1_ps(x->scale[g * M + m0 + r]));
                total[r][c] = _mm512_add_ps(total[r][c], scaled);
            }
        }
    }
    if (g1 < G) {
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < BLOCKS; c++)
                _mm512_storeu_ps(partial + r * WIDTH + 16 * c, total[r][c]);
        return;
    }
    for (int c = 0; c < BLOCKS; c++) {
        const int64_t n = n0 + 16 * c;
        if (n >= p->out_features)
            break;
        const __mmask16 mask = p->out_features - n >= 16 ? (__mmask16)0xFFFF
                                                          : (__mmask16)((1u << (p->out_features - n)) - 1);
        const __m512 col = _mm512_maskz_loadu_ps(mask, p->col_scale + n);
        const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + n) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_mul_ps(total[r][c], col);
            if (p->bias)
                v = _mm512_add_ps(v, bias);
            _mm512_mask_storeu_ps(p->out + (m0 + r) * p->out_features + n, mask, v);
        }
    }
}

/* Each work item is one block of WIDTH outputs against a panel of up to PANEL rows, the items split over torch's
 * threads (a thread's run of items mostly shares one block). An item takes the groups a chunk at a time (the
 * block's weights of one chunk: CHUNK_BYTES, in L1 while every tile of the panel reads them; the panel's rows of
 * it in L2), keeping the tiles' running sums in `partial` between chunks: each output's float sum still adds the
 * groups one by one, in order. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void groups_vnni(const Int8Groups *p,
                                                                            const GroupedRows *x) {
    const int64_t blocks = (p->out_features + WIDTH - 1) / WIDTH, panels = (p->rows + PANEL - 1) / PANEL;
    const int64_t G = p->in_features / p->group, chunk_bytes = WIDTH * p->group;
    const int64_t chunk = chunk_bytes >= CHUNK_BYTES ? 1 : CHUNK_BYTES / chunk_bytes;
    FXQ_PARALLEL_FOR(p->rows * p->out_features * p->in_features >= FXQ_PARALLEL_WORK)
    for (int64_t i = 0; i < blocks * panels; i++) {
        float partial[PANEL * WIDTH];
        const int64_t n0 = i / panels * WIDTH, p0 = i % panels * PANEL;
        const int64_t p1 = p->rows - p0 < PANEL ? p->rows : p0 + PANEL;
        for (int64_t g0 = 0; g0 < G; g0 += chunk) {
            const int64_t g1 = G - g0 < chunk ? G : g0 + chunk;
            for (int64_t m0 = p0; m0 < p1; m0 += ROWS) {
                float *part = partial + (m0 - p0) * WIDTH;
                switch (p1 - m0 < ROWS ? p1 - m0 : ROWS) { /* constant row counts, so each tile unrolls */
                case 1: tile_vnni(p, x, m0, 1, n0, g0, g1, part); break;
                case 2: tile_vnni(p, x, m0, 2, n0, g0, g1, part); break;
                case 3: tile_vnni(p, x, m0, 3, n0, g0, g1, part); break;
                case 4: tile_vnni(p, x, m0, 4, n0, g0, g1, part); break;
                case 5: tile_vnni(p, x, m0, 5, n0, g0, g1, part); break;
                default: tile_vnni(p, x, m0, ROWS, n0, g0, g1, part); break;
                }
            }
        }
    }
}
#endif

int fxq_int8_groups_f32(const Int8Groups *p) {
#if defined(__x86_64__) && defined(__GNUC__)
    const int64_t M = p->rows, K = p->in_features, G = K / p->group, total = M * K;
    uint8_t *u = (uint8_t *)malloc((size_t)total + 1);
    float *scale = (float *)malloc((size_t)(G * M) * sizeof(float) + 1);
    if (u == NULL || scale == NULL) {
        free(u);
        free(scale);
        return -1;
    }
    fxq_quantize_groups(p->x, M, K, p->x_stride, p->input_scale, p->group, 128, u, scale); /* q + 128 */
    const GroupedRows x = {u, scale};
    groups_vnni(p, &x);
    free(u);
    free(scale);
#else
    (void)p; /* never called: fxq_vnni_usable() is 0 here */
#endif
    return 0;
}
