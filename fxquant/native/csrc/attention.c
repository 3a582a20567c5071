/* causal_attention_f32: softmax(q k^T * scale, causal) v in float32 on AVX-512, for a decoder's prefill (the
 * converted transformers models' attention, fxquant/runtime/hf_attention.py).
 *
 * One pass in the manner of FlashAttention: each work item (a head and a block of QROWS query rows) walks the keys
 * a block of KEYS at a time, up to its last row's position, keeping each row's running maximum m, running sum l and
 * unnormalized output acc; a block's scores raise m where they exceed it and rescale l and acc by 2^(m_old - m_new).
 * The scores are taken in base 2 (each query row is multiplied by scale * log2(e) once), so a probability is one
 * exp2; the output is acc / l. Keys are read transposed (dim, tokens), copied once per call, so a key block is
 * KEYS lanes of one vector; values are read in place, row by row. The sums run with fused multiply-adds in 16 lanes
 * (explicit intrinsics), so they round differently from torch's kernels: the tests compare both with a float64
 * reference. The score matrix is never stored. Items are dealt to torch's threads round robin (row blocks further
 * down cost more), each writing its own output rows: the result does not depend on the thread count. Grouped-query
 * attention reads head h's keys and values from kv head h / (heads / kv_heads). Arguments arrive checked
 * (module_rows.c); runs without the GIL, only where fxq_attention_usable().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "exp2.h"

#define QROWS 8 /* query rows of one work item: their scores of a key block stay in registers */
#define KEYS 16 /* keys per block: one vector of scores per row */

/* The running state of one item's rows. */
typedef struct {
    float q[QROWS][FXQ_ATTENTION_MAX_DIM]; /* the query rows times scale * log2(e) */
    float acc[QROWS][FXQ_ATTENTION_MAX_DIM];
    float p[QROWS][KEYS]; /* one key block's probabilities, unnormalized */
    float m[QROWS], l[QROWS];
} RowState;

/* Key block kb (kt: transposed keys of this kv head, (dim, tokens_pad)) against `rows` rows from r0. */
__attribute__((target("avx512f"), always_inline)) static inline void key_block(
    const CausalAttention *p, RowState *st, const float *kt, const int64_t tokens_pad, const float *v,
    const int64_t r0, const int rows, const int64_t kb) {
    const int64_t dim = p->dim, keys = p->tokens - kb < KEYS ? p->tokens - kb : KEYS;
    __m512 s[QROWS];
    for (int r = 0; r < rows; r++)
        s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        const __m512 k = _mm512_loadu_ps(kt + d * tokens_pad + kb);
        for (int r = 0; r < rows; r++)
            s[r] = _mm512_fmadd_ps(_mm512_set1_ps(st->q[r][d]), k, s[r]);
    }
    float alpha[QROWS];
    for (int r = 0; r < rows; r++) {
        const int64_t seen = r0 + r - kb + 1; /* keys kb .. r0 + r of this block: the row's causal window */
        const __mmask16 mask = seen >= KEYS ? (__mmask16)0xFFFF : seen <= 0 ? 0 : (__mmask16)((1u << seen) - 1);
        if (mask == 0) {
            alpha[r] = 1.0f;
            _mm512_storeu_ps(st->p[r], _mm512_setzero_ps());
            continue;
        }
        const float top = _mm512_mask_reduce_max_ps(mask, s[r]);
        const float m_new = top > st->m[r] ? top : st->m[r];
        const __m512 prob = _mm512_maskz_mov_ps(mask, exp2_ps(_mm512_sub_ps(s[r], _mm512_set1_ps(m_new))));
        alpha[r] = top > st->m[r] ? exp2f(st->m[r] - top) : 1.0f; /* 0 on the first block (m = -inf) */
        st->l[r] = st->l[r] * alpha[r] + _mm512_reduce_add_ps(prob);
        st->m[r] = m_new;
        _mm512_storeu_ps(st->p[r], prob);
    }
    for (int64_t c = 0; c < dim; c += 16) {
        __m512 a[QROWS];
        for (int r = 0; r < rows; r++)
            a[r] = _mm512_mul_ps(_mm512_loadu_ps(st->acc[r] + c), _mm512_set1_ps(alpha[r]));
        for (int64_t j = 0; j < keys; j++) {
            const __m512 vj = _mm512_loadu_ps(v + (kb + j) * p->v_strides[2] + c);
            for (int r = 0; r < rows; r++)
                a[r] = _mm512_fmadd_ps(_mm512_set1_ps(st->p[r][j]), vj, a[r]);
        }
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(st->acc[r] + c, a[r]);
    }
}

/* Item (b, h, rows r0 .. r0 + rows): every key block up to the last row, then acc / l into out. */
__attribute__((target("avx512f"), always_inline)) static inline void item(
    const CausalAttention *p, const float *kt, const int64_t tokens_pad, const int64_t b, const int64_t h,
    const int64_t r0, const int rows) {
    RowState st;
    const int64_t dim = p->dim, kvh = h / (p->heads / p->kv_heads);
    const float *q = p->q + b * p->q_strides[0] + h * p->q_strides[1];
    const float *v = p->v + b * p->v_strides[0] + kvh * p->v_strides[1];
    const float to_base2 = p->scale * 1.44269504089f;
    for (int r = 0; r < rows; r++) {
        for (int64_t d = 0; d < dim; d++) {
            st.q[r][d] = q[(r0 + r) * p->q_strides[2] + d] * to_base2;
            st.acc[r][d] = 0.0f;
        }
        st.m[r] = -INFINITY;
        st.l[r] = 0.0f;
    }
    for (int64_t kb = 0; kb <= r0 + rows - 1; kb += KEYS)
        key_block(p, &st, kt, tokens_pad, v, r0, rows, kb);
    float *out = p->out + b * p->out_strides[0] + h * p->out_strides[1];
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / st.l[r]);
        float *row = out + (r0 + r) * p->out_strides[2];
        for (int64_t c = 0; c < dim; c += 16)
            _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(st.acc[r] + c), inv));
    }
}

__attribute__((target("avx512f"))) static void attention_avx512(const CausalAttention *p, float *kt,
                                                                 const int64_t tokens_pad) {
    const int64_t blocks = (p->tokens + QROWS - 1) / QROWS, items = p->batch * p->heads * blocks;
    const int64_t work = p->batch * p->heads * p->tokens * p->tokens * p->dim / 2;
    (void)work; /* read only by the OpenMP pragmas */
    FXQ_PARALLEL_FOR(work >= FXQ_PARALLEL_WORK)
    for (int64_t i = 0; i < p->batch * p->kv_heads; i++) { /* keys transposed, zero past the last token */
        const float *k = p->k + i / p->kv_heads * p->k_strides[0] + i % p->kv_heads * p->k_strides[1];
        float *dst = kt + i * p->dim * tokens_pad;
        for (int64_t d = 0; d < p->dim; d++)
            for (int64_t t = 0; t < tokens_pad; t++)
                dst[d * tokens_pad + t] = t < p->tokens ? k[t * p->k_strides[2] + d] : 0.0f;
    }
    FXQ_PARALLEL_FOR_DEALT(work >= FXQ_PARALLEL_WORK)
    for (int64_t i = 0; i < items; i++) { /* round robin: a thread's items span the rows' growing costs */
        const int64_t b = i / (p->heads * blocks), h = i / blocks % p->heads, r0 = i % blocks * QROWS;
        const float *kh = kt + (b * p->kv_heads + h / (p->heads / p->kv_heads)) * p->dim * tokens_pad;
        const int rows = p->tokens - r0 < QROWS ? (int)(p->tokens - r0) : QROWS;
        if (rows == QROWS) /* a constant row count, so the full items unroll; the last item of a head may not */
            item(p, kh, tokens_pad, b, h, r0, QROWS);
        else
            item(p, kh, tokens_pad, b, h, r0, rows);
    }
}

int fxq_attention_usable(void) { return fxq_isa_cap >= ISA_AVX512 && __builtin_cpu_supports("avx512f"); }

int fxq_causal_attention_f32(const CausalAttention *p) {
    const int64_t tokens_pad = (p->tokens + KEYS - 1) / KEYS * KEYS;
    float *kt = (float *)malloc((size_t)(p->batch * p->kv_heads * p->dim * tokens_pad) * sizeof(float) + 1);
    if (kt == NULL)
        return -1;
    attention_avx512(p, kt, tokens_pad);
    free(kt);
    return 0;
}

#else /* no x86-64 GNU C: module_rows.c asks fxq_attention_usable() first and never calls the kernel */

int fxq_attention_usable(void) { return 0; }

int fxq_causal_attention_f32(const CausalAttention *p) {
    (void)p;
    return 0;
}

#endif
