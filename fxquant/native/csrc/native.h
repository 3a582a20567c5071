/* fxquant.native._native: what the kernel files share with module.c.
 *
 * module.c parses and checks every entry point's arguments into the structs below, and holds the GIL; the kernel
 * files compute on checked arguments without Python (and with the GIL released):
 *   histogram.c   scan_f32, the histogram observers' counting (fxquant/observers/counting.py)
 *   elementwise.c quantize_f32, mean_u8, mul_u8, lookup_u8, copy_rows, quantize_rows_s8, rescale_rows
 *                 (fxquant/native/elementwise.py, fxquant/native/per_token.py)
 *   amx_gemm.c    conv_u8, linear_rows_u8: int8 GEMMs on AMX and AVX512-VNNI (fxquant/native/amx_gemm.py)
 *   rows_avx2.c   linear_rows_u8 on AVX2 alone (CPUs without VNNI; the same wrapper), and linear_rows_onednn
 *   patches.c     patches_u8: a kernel == stride transposed conv on AVX512-VNNI and AMX (the same wrappers)
 *   weight_only.c weight_only_f32: a few-row float32 Linear on int8 weights (fxquant/native/weight_only.py)
 *   int8_rows.c   int8_rows_f32: a few-row per-token INT8 Linear on AVX512-VNNI (fxquant/native/per_token.py)
 *   int8_groups.c int8_groups_f32: a per-group dynamic INT8 Linear on AVX512-VNNI (fxquant/native/per_group.py)
 *   attention.c   causal_attention_f32: a decoder's causal attention in float32 (fxquant/native/attention.py)
 *   full_attention.c full_attention_f32: attention over every key, with a mask, in float32 (the same wrapper)
 *   pool.c        max_pool_u8: a 2-d max pool of channels-last uint8 activations (fxquant/native/elementwise.py)
 *   layer_norm.c  add_layer_norm_f32: LayerNorm(a + b) over rows of float32 (fxquant/native/layer_norm.py)
 *   winograd_avx2.c, depthwise_avx2.c: the onednn backend's AVX2 conv loops, declared in avx2_convs.h
 * (gemm.h: the VNNI sums and AMX tile configuration that amx_gemm.c and patches.c share; exp2.h: the attention
 * loops' 2^x; onednn_requant.h: oneDNN's requantization, for rows_avx2.c and the AVX2 conv loops)
 * Each struct is one Python tuple of the same fields in the same order (fxquant/native/_native.pyi), and each kernel
 * gives the bytes of the torch or engine path it replaces (the tests compare them with torch.equal). setup.py
 * builds with -ffp-contract=off: no fused multiply-adds, so each float operation rounds where torch's does.
 */
#ifndef FXQUANT_NATIVE_H
#define FXQUANT_NATIVE_H

#include <stdint.h>

#if defined(__GNUC__)
#define FXQ_INTERNAL __attribute__((visibility("hidden"))) /* shared between the files, not exported by the .so */
#else
#define FXQ_INTERNAL
#endif

/* The hot element-wise loops get AVX2 and AVX-512 clones, one chosen at load for this CPU (the default clone runs
 * anywhere): the same operations, each rounded the same way, so results do not depend on the clone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* A loop split over the calling thread's OpenMP team (torch's intra-op threads, whose number torch.set_num_threads
 * sets: setup.py links the runtime torch loaded) where the extension is built with OpenMP and cond says the work
 * is worth waking the team; a plain loop elsewhere. Each iteration writes outputs of its own with the arithmetic of
 * one thread, so results do not depend on the thread count. */
#define FXQ_PRAGMA(text) _Pragma(#text)
#ifdef _OPENMP
#define FXQ_PARALLEL_FOR(cond) FXQ_PRAGMA(omp parallel for schedule(static) if (cond))
#define FXQ_PARALLEL_FOR_DEALT(cond) FXQ_PRAGMA(omp parallel for schedule(static, 1) if (cond)) /* round robin */
#else
#define FXQ_PARALLEL_FOR(cond)
#define FXQ_PARALLEL_FOR_DEALT(cond)
#endif
#define FXQ_PARALLEL_WORK ((int64_t)1 << 16) /* weights (or values) below which one thread finishes first */
/* The team a parallel loop would split over, and this thread's place in it, for loops that size scratch per thread */
#ifdef _OPENMP
#include <omp.h>
#define FXQ_THREADS() omp_get_max_threads()
#define FXQ_THREAD() omp_get_thread_num()
#else
#define FXQ_THREADS() 1
#define FXQ_THREAD() 0
#endif

/* The instruction sets the loops may use, capped by FXQUANT_ISA (fxquant.native.isa, set once by fxquant.native
 * through set_isa_cap): 0 AVX2, 1 AVX512, 2 AVX512-VNNI, 3 AMX. A loop runs where both the cap and the CPU allow
 * it. Defined in module.c. */
enum { ISA_AVX2, ISA_AVX512, ISA_VNNI, ISA_AMX };
FXQ_INTERNAL extern int fxq_isa_cap;

/* ---- pool.c ---- */

/* A channels-last uint8 input (batch, height, width, channels), dense, and its output's positions. */
typedef struct {
    int64_t batch, height, width, channels, out_h, out_w;
} PoolShape;

/* A pooling window: size, stride, padding (before each dimension) and dilation; at most FXQ_POOL_MAX_KERNEL rows. */
#define FXQ_POOL_MAX_KERNEL 64
typedef struct {
    int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
} PoolWindow;

/* out (batch, out_h, out_w, channels), dense: each position the byte-wise max of its window's in-bounds taps. */
FXQ_INTERNAL void fxq_max_pool_u8(const uint8_t *x, uint8_t *out, const PoolShape *shape, const PoolWindow *window);

/* ---- histogram.c ---- */

/* bins bins of equal power-of-two width from start to top, both exact in float32. */
typedef struct {
    double start, top;
    int64_t bins;
} HistogramGrid;

/* The min and max of the values (NaN if any is NaN) and whether every value lies on the grid. */
typedef struct {
    float lo, hi;
    int on_grid;
} ScanResult;

/* 0, or -1 where the sub-histograms could not be allocated (nothing written). */
FXQ_INTERNAL int fxq_scan_f32(const float *x, int64_t n, const HistogramGrid *grid, double *counts, ScanResult *result);

/* ---- elementwise.c ---- */

/* A tensor walked as (outer, channels, inner): NCHW has outer N and inner H * W. */
typedef struct {
    int64_t outer, channels, inner;
} Planes;

/* The element strides of Planes' three dimensions. */
typedef struct {
    int64_t outer, channel, inner;
} PlaneStrides;

/* q = clamp(round(x / scale) + zero_point, qmin, qmax). */
typedef struct {
    double scale;
    int64_t zero_point, qmin, qmax;
} QuantizeParams;

/* A uint8 grid: its zero point and the range results are clamped to. */
typedef struct {
    int64_t zero_point, qmin, qmax;
} ByteLevels;

/* A uint8 tensor of three dimensions: element [i, j, k] at data[i * stride[0] + j * stride[1] + k * stride[2]]. */
typedef struct {
    uint8_t *data;
    int64_t stride[3];
} Bytes3;

/* out = clamp(rint((a - za) * ((b - zb) * factor)) + zo, qmin, qmax) in float32, or float64 if wide. */
typedef struct {
    int64_t za, zb, zo, qmin, qmax;
    double factor;
    int wide;
} MulRequant;

/* Rows of bytes, stride bytes apart. */
typedef struct {
    uint8_t *data;
    int64_t stride;
} ByteRows;

FXQ_INTERNAL void fxq_quantize_f32(const float *x, void *out, const Planes *shape, const QuantizeParams *q,
                                   int to_nhwc);
/* 0, or -1 where the per-channel sums could not be allocated (nothing written). */
FXQ_INTERNAL int fxq_mean_u8(const uint8_t *x, uint8_t *out, const Planes *shape, const PlaneStrides *strides,
                             const ByteLevels *levels);
FXQ_INTERNAL void fxq_mul_u8(const int64_t shape[3], const Bytes3 *a, const Bytes3 *b, const Bytes3 *out,
                             const MulRequant *requant);
FXQ_INTERNAL void fxq_lookup_u8(const uint8_t *src, uint8_t *dst, int64_t n, const uint8_t *table);
FXQ_INTERNAL void fxq_copy_rows(const ByteRows *src, const ByteRows *dst, int64_t rows, int64_t width);
/* Dynamic per-token INT8: rows x width float32 (x_stride apart), each times input_scale (width factors; NULL: none),
 * -> dense int8 and a float32 scale per row. */
FXQ_INTERNAL void fxq_quantize_rows_s8(const float *x, int64_t rows, int64_t width, int64_t x_stride,
                                       const float *input_scale, int8_t *q, float *scale);
/* The same per group of `group` values of each row, stored as level + offset (0 or 128) laid out (groups, rows,
 * group) with scales (groups, rows): the per-group dynamic INT8 Linear's quantize (int8_groups.c). */
FXQ_INTERNAL void fxq_quantize_groups(const float *x, int64_t rows, int64_t width, int64_t x_stride,
                                      const float *input_scale, int64_t group, int offset, uint8_t *q, float *scale);
/* Dense int32 sums -> dense float32: times a per-row and a per-column scale, plus an optional bias (NULL). */
FXQ_INTERNAL void fxq_rescale_rows(const int32_t *acc, int64_t rows, int64_t width, const float *row_scale,
                                   const float *col_scale, const float *bias, float *out);

/* ---- amx_gemm.c, rows_avx2.c and patches.c ---- */

/* Whether the cap and the CPU allow the AVX512-VNNI loops (linear_rows_u8, patches_u8), and AMX tiles (conv_u8; the
 * tiled part of patches_u8). amx_usable asks Linux for the tile state on its first call: call both with the GIL. */
FXQ_INTERNAL int fxq_vnni_usable(void);
FXQ_INTERNAL int fxq_amx_usable(void);

/* Packed int8 weights with their per-output-channel terms: colsum, each column's weight sum (times the input zero
 * point, subtracted from the sums); ibias, qnnpack's int32 bias (else 0); bias, fbgemm's bias / (s_x * s_w) (else 0);
 * mult, s_x * s_w / s_out. in_channels inputs, n_pad (a multiple of 16) packed columns, out_channels real ones. */
typedef struct {
    const int8_t *w;
    const int32_t *colsum, *ibias;
    const float *bias, *mult;
    int64_t in_channels, n_pad, out_channels;
} GemmWeights;

/* The input and output zero points, a fused ReLU (a clamp at zo), and the top of the output's range (255; 127 for
 * 7-bit activations): the outputs saturate to [relu ? zo : 0, qmax]. */
typedef struct {
    int64_t zx, zo;
    int relu;
    int64_t qmax;
} Requant;

/* oneDNN's requantization of a Linear's sums (its matmul primitive's, on fxquant's onednn backend): f = float(sum -
 * zx * colsum) * mult + bias (mult: s_x * s_w in float32, bias: float), then max(f, 0) with relu; float_out keeps
 * f (float32 outputs), else the output is rint(f * dst_inv + zo) saturated to [0, qmax] (dst_inv: 1 / s_out). */
typedef struct {
    int64_t zx, zo;
    int relu, float_out;
    int64_t qmax;
    float dst_inv;
} OnednnRequant;

/* oneDNN's sum post-op: the destination's bytes before the layer, times scale after the zero point's removal, join
 * the float result before the ReLU (a conv + add fused). */
typedef struct {
    float scale;
    int64_t zero_point;
} OnednnSum;

/* (N, D, H, W, C) bytes, channels at stride 1: strides of the (N, D, H, W) dimensions in bytes. */
typedef struct {
    const uint8_t *data;
    int64_t dims[5], strides[4];
} ConvInput;

/* Kernel, stride and padding over (depth, height, width). */
typedef struct {
    int64_t kernel[3], stride[3], padding[3];
} ConvWindow;

/* (N, Do, Ho, Wo, C_out) bytes: size (Do, Ho, Wo), strides of the (N, Do, Ho, Wo) dimensions in bytes. */
typedef struct {
    uint8_t *data;
    int64_t size[3], strides[4];
} ConvOutput;

/* (N, H, W, K) bytes, channels at stride 1: strides of the (N, H, W) dimensions in bytes. */
typedef struct {
    const uint8_t *data;
    int64_t dims[3], strides[3];
} PatchInput;

/* (ceil(K / 4), n_pad, 4) int8 weights, colsum and float bias per packed column; K = in_channels. */
typedef struct {
    const int8_t *w;
    const int32_t *colsum;
    const float *bias;
    int64_t in_channels, n_pad, out_channels;
} PatchWeights;

/* fbgemm's float-bias requantization: fma(bias, rcp, float(acc)) * multiplier, plus the zero points. */
typedef struct {
    double rcp, multiplier;
    int64_t zx, zo;
} PatchRequant;

/* (N, H * kh, W * kw, C_out) bytes: strides of the (N, OH, OW) dimensions in bytes. */
typedef struct {
    uint8_t *data;
    int64_t strides[3];
} PatchOutput;

/* 0, or -1 where the padded input could not be allocated (nothing written). Only where fxq_amx_usable(). */
FXQ_INTERNAL int fxq_conv_u8(const ConvInput *x, const ConvWindow *window, const GemmWeights *weights,
                             const Requant *requant, const ConvOutput *out);
/* Only where fxq_vnni_usable(). */
FXQ_INTERNAL void fxq_linear_rows_u8(const ByteRows *x, int64_t rows, const GemmWeights *weights,
                                     const Requant *requant, const ByteRows *out);
/* The same on AVX2 alone (rows_avx2.c): exact on 7-bit inputs, fbgemm's pairwise saturation on 8-bit ones. Only
 * where fxq_avx2_usable(). */
FXQ_INTERNAL int fxq_avx2_usable(void);
FXQ_INTERNAL void fxq_linear_rows_u8_avx2(const ByteRows *x, int64_t rows, const GemmWeights *weights,
                                          const Requant *requant, const ByteRows *out);
/* The same sums with oneDNN's requantization (exact on 7-bit inputs, as oneDNN's own AVX2 kernel is); out's stride
 * in bytes, float32 outputs with float_out. Only where fxq_avx2_usable(). */
FXQ_INTERNAL void fxq_linear_rows_onednn_avx2(const ByteRows *x, int64_t rows, const GemmWeights *weights,
                                             const OnednnRequant *requant, const ByteRows *out);

/* (winograd_avx2.c and depthwise_avx2.c: avx2_convs.h) */

/* Only where fxq_vnni_usable(); amx: fxq_amx_usable(), read with the GIL. */
FXQ_INTERNAL void fxq_patches_u8(const PatchInput *x, const PatchWeights *weights, const PatchRequant *requant,
                                 const PatchOutput *out, const int64_t kernel[2], int amx);

/* ---- weight_only.c ---- */

/* rows x in_features float32 inputs (x_stride floats apart), each times input_scale (in_features factors; NULL:
 * none) first, out_features x in_features int8 weights (dense) with a dense float32 scale per group of `group`
 * inputs of each output (out_features x in_features / group; group divides in_features and is a multiple of 16, or
 * equals in_features), an optional bias (NULL) per output, rows x out_features float32 outputs (out_stride apart). */
typedef struct {
    const float *x, *input_scale;
    int64_t rows, x_stride;
    const int8_t *w;
    const float *scale, *bias;
    int64_t in_features, out_features, group;
    float *out;
    int64_t out_stride;
} WeightOnlyRows;

/* 0, or -1 where the scaled inputs could not be allocated (nothing written). */
FXQ_INTERNAL int fxq_weight_only_f32(const WeightOnlyRows *p);

/* ---- int8_rows.c ---- */

/* rows x in_features float32 rows (x_stride floats apart), each times input_scale (in_features factors; NULL:
 * none) before it is quantized; out_features x in_features dense int8 weights with their int32 row sums, a float32
 * scale and optional bias (NULL) per output; rows x out_features dense float32 outputs. */
typedef struct {
    const float *x, *input_scale;
    int64_t rows, x_stride;
    const int8_t *w;
    const int32_t *weight_sums;
    const float *col_scale, *bias;
    int64_t in_features, out_features;
    float *out;
} Int8Rows;

/* 0, or -1 where the quantized rows could not be allocated (nothing written). Only where fxq_vnni_usable(). */
FXQ_INTERNAL int fxq_int8_rows_f32(const Int8Rows *p);

/* ---- int8_groups.c ---- */

/* rows x in_features float32 rows (x_stride floats apart), each times input_scale (NULL: none) before each group of
 * `group` inputs is quantized; packed int8 weights (n_pad / 32, in_features / 4, 32, 4) with group_sums
 * (in_features / group, n_pad) int32, 128 times the sum of each group's weights of each output; a float32 scale and
 * optional bias (NULL) per output; rows x out_features dense float32 outputs. group divides in_features and is a
 * multiple of 4; n_pad a multiple of 32, at least out_features, the weights beyond out_features zero. */
typedef struct {
    const float *x, *input_scale;
    int64_t rows, x_stride;
    const int8_t *w;
    const int32_t *group_sums;
    const float *col_scale, *bias;
    int64_t in_features, out_features, n_pad, group;
    float *out;
} Int8Groups;

/* 0, or -1 where the quantized rows could not be allocated (nothing written). Only where fxq_vnni_usable(). */
FXQ_INTERNAL int fxq_int8_groups_f32(const Int8Groups *p);

/* ---- attention.c ---- */

#define FXQ_ATTENTION_MAX_DIM 256 /* head dims the loop takes: multiples of 16 up to this */

/* q (batch, heads, tokens, dim), k and v (batch, kv_heads, tokens, dim), out (batch, heads, tokens, dim), each
 * float32 with unit stride along dim and the given strides (in floats) of its first three dims; heads a multiple of
 * kv_heads; dim a multiple of 16, at most FXQ_ATTENTION_MAX_DIM. out = softmax(q k^T * scale + causal mask) v, the
 * mask aligned top-left (query t sees keys 0 .. t). */
typedef struct {
    const float *q, *k, *v;
    int64_t q_strides[3], k_strides[3], v_strides[3];
    float *out;
    int64_t out_strides[3];
    int64_t batch, heads, kv_heads, tokens, dim;
    float scale;
} CausalAttention;

/* Whether the cap and the CPU allow the loop (AVX-512F). */
FXQ_INTERNAL int fxq_attention_usable(void);
/* 0, or -1 where the transposed keys could not be allocated (nothing written). Only where fxq_attention_usable(). */
FXQ_INTERNAL int fxq_causal_attention_f32(const CausalAttention *p);

/* ---- full_attention.c ---- */

enum { FXQ_MASK_NONE, FXQ_MASK_ADD, FXQ_MASK_KEEP }; /* no mask; float32 added to the scores; bytes, nonzero kept */

/* q (batch, heads, q_tokens, dim), k and v (batch, kv_heads, kv_tokens, dim), out like q, as CausalAttention's;
 * mask (batch, heads, q_tokens, kv_tokens) with the given strides of its first three dims (0 where it broadcasts)
 * and unit stride along the keys. out = softmax(q k^T * scale + mask) v over every key; a row whose every key is
 * masked out gets zeros, as torch's CPU kernel gives. */
typedef struct {
    const float *q, *k, *v;
    int64_t q_strides[3], k_strides[3], v_strides[3];
    float *out;
    int64_t out_strides[3];
    const void *mask;
    int64_t mask_kind, mask_strides[3];
    int64_t batch, heads, kv_heads, q_tokens, kv_tokens, dim;
    float scale;
} FullAttention;

/* 0, or -1 where the transposed keys or a work item's scores could not be allocated (the output is then
 * incomplete). Only where fxq_attention_usable(). */
FXQ_INTERNAL int fxq_full_attention_f32(const FullAttention *p);

/* ---- layer_norm.c ---- */

/* y = LayerNorm(a + b) over each of rows rows of width dense floats, b's b_rows rows repeating (a broadcast add:
 * row r adds b's row r % b_rows); gamma, beta: NULL or width floats (beta only with gamma); y overlaps neither a nor
 * b. */
typedef struct {
    const float *a, *b, *gamma, *beta;
    float *y;
    int64_t rows, b_rows, width;
    float eps;
} AddLayerNorm;

FXQ_INTERNAL void fxq_add_layer_norm_f32(const AddLayerNorm *p);

#endif
