/* What the VNNI and AMX loops share (amx_gemm.c, patches.c, int8_rows.c, int8_groups.c): vpdpbusd, the VNNI sums of
 * a register tile of rows x output channels, and the AMX tile configuration. Kernel code only (no Python), x86-64 GNU
 * C only. */
#ifndef FXQUANT_GEMM_H
#define FXQUANT_GEMM_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* acc + the dot products of a's unsigned and b's signed bytes, four by four: vpdpbusd. In asm because gcc 12 gives
 * _mm512_dpbusd_epi32 in a loop over an array of accumulators a copy of each accumulator through another register on
 * every call, as many register moves as dot products. */
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline __m512i fxq_dpbusd(__m512i acc, __m512i a,
                                                                                             __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

#define PATCH_ROWS 6
#define PATCH_BLOCKS 4

/* int32 sums of up to 6 rows x 4 blocks of 16 output channels, exact: four inputs per vpdpbusd, the weights of
 * inputs 4 kk .. 4 kk + 3 at w + kk * kstride (64 bytes per block); a row's last inputs (k not a multiple of 4) meet
 * zero weights. The upsampler and few-row Linear loops differ only in where the weights lie and what follows. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void vnni_sums(
    __m512i acc[PATCH_ROWS][PATCH_BLOCKS], const uint8_t *const *src, const int rows, const int blocks,
    const int8_t *w, const int64_t kstride, const int64_t k) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < blocks; c++)
            acc[r][c] = _mm512_setzero_si512();
    const int64_t full = k / 4, tail = k % 4;
    for (int64_t kk = 0; kk < full + (tail != 0); kk++) {
        const int8_t *wk = w + kk * kstride;
        __m512i b[PATCH_BLOCKS];
        for (int c = 0; c < blocks; c++)
            b[c] = _mm512_loadu_si512(wk + 64 * c);
        for (int r = 0; r < rows; r++) {
            int32_t four = 0;
            if (kk < full)
                memcpy(&four, src[r] + 4 * kk, 4);
            else
                for (int64_t j = 0; j < tail; j++)
                    four |= (int32_t)src[r][4 * kk + j] << (8 * j);
            const __m512i a = _mm512_set1_epi32(four);
            for (int c = 0; c < blocks; c++)
                acc[r][c] = fxq_dpbusd(acc[r][c], a, b[c]);
        }
    }
}

/* The AMX tile configuration (palette 1): bytes per row and rows of each of the 16 tiles. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#endif
