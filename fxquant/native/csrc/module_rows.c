/* fxquant.native._native: the entry points of the row loops an LLM's Linears use (weight_only.c, int8_rows.c,
 * int8_groups.c and elementwise.c's per-token quantize and rescale), of attention (attention.c, full_attention.c),
 * of the residual add and LayerNorm (layer_norm.c)
 * and of the Winograd conv (winograd_avx2.c), kept apart from module.c for size; module.c's method table lists them
 * (module_rows.h). The same conventions as module.c: tuples per struct, checked arguments, the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "module_rows.h"
#include "avx2_convs.h"
#include "native.h"

#define PTR(type, addr) ((type *)(uintptr_t)(addr))

/* Runs a kernel call on checked arguments without the GIL and returns from the entry point: MemoryError where the
 * call returned -1 (it could not allocate; nothing written), else `done` (Py_RETURN_TRUE or Py_RETURN_NONE). */
#define RUN_AND_RETURN(call, done)                                                                                   \
    do {                                                                                                               \
        int status_;                                                                                                   \
        Py_BEGIN_ALLOW_THREADS status_ = (call);                                                                       \
        Py_END_ALLOW_THREADS if (status_) return PyErr_NoMemory();                                                     \
        done;                                                                                                          \
    } while (0)

/* quantize_rows_s8((x_ptr, rows, width, x_stride, input_scale_ptr), q_ptr, scale_ptr) -> None; x_stride in floats,
 * input_scale_ptr 0: none. */
PyObject *fxq_py_quantize_rows_s8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, is_addr, q_addr, scale_addr;
    int64_t rows, width, stride;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLLLK)KK", &x_addr, &rows, &width, &stride, &is_addr, &q_addr, &scale_addr))
        return NULL;
    if (rows < 0 || width < 1 || stride < width) {
        PyErr_SetString(PyExc_ValueError, "quantize_rows_s8: bad shape or stride");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fxq_quantize_rows_s8(PTR(const float, x_addr), rows, width, stride, is_addr ? PTR(const float, is_addr) : NULL,
                         PTR(int8_t, q_addr), PTR(float, scale_addr));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rescale_rows((acc_ptr, rows, width), (row_scale_ptr, col_scale_ptr, bias_ptr), out_ptr) -> None; bias_ptr 0: none */
PyObject *fxq_py_rescale_rows(PyObject *self, PyObject *args) {
    unsigned long long acc_addr, rs_addr, cs_addr, bias_addr, out_addr;
    int64_t rows, width;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLL)(KKK)K", &acc_addr, &rows, &width, &rs_addr, &cs_addr, &bias_addr, &out_addr))
        return NULL;
    if (rows < 0 || width < 1) {
        PyErr_SetString(PyExc_ValueError, "rescale_rows: bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fxq_rescale_rows(PTR(const int32_t, acc_addr), rows, width, PTR(const float, rs_addr), PTR(const float, cs_addr),
                     bias_addr ? PTR(const float, bias_addr) : NULL, PTR(float, out_addr));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* int8_rows_f32((x_ptr, input_scale_ptr, rows, x_stride), (w, weight_sums, col_scale, bias, in_features,
 *               out_features), out_ptr) -> bool; x_stride in floats, the rest dense, 0 for no input scale or bias.
 * False (nothing written) without VNNI. */
PyObject *fxq_py_int8_rows_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, is_addr, w_addr, sums_addr, cs_addr, bias_addr, out_addr;
    Int8Rows p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKLL)(KKKKLL)K", &x_addr, &is_addr, &p.rows, &p.x_stride, &w_addr, &sums_addr,
                          &cs_addr, &bias_addr, &p.in_features, &p.out_features, &out_addr))
        return NULL;
    if (p.rows < 0 || p.in_features < 1 || p.out_features < 1 || p.x_stride < p.in_features) {
        PyErr_SetString(PyExc_ValueError, "int8_rows_f32: bad shape or stride");
        return NULL;
    }
    if (!fxq_vnni_usable())
        Py_RETURN_FALSE;
    p.x = PTR(const float, x_addr);
    p.input_scale = is_addr ? PTR(const float, is_addr) : NULL;
    p.w = PTR(const int8_t, w_addr);
    p.weight_sums = PTR(const int32_t, sums_addr);
    p.col_scale = PTR(const float, cs_addr);
    p.bias = bias_addr ? PTR(const float, bias_addr) : NULL;
    p.out = PTR(float, out_addr);
    RUN_AND_RETURN(fxq_int8_rows_f32(&p), Py_RETURN_TRUE);
}

/* int8_groups_f32((x_ptr, input_scale_ptr, rows, x_stride), (w, group_sums, col_scale, bias, in_features,
 *                 out_features, n_pad, group), out_ptr) -> bool; x_stride in floats, the rest dense, 0 for no input
 * scale or bias. False (nothing written) without VNNI. */
PyObject *fxq_py_int8_groups_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, is_addr, w_addr, sums_addr, cs_addr, bias_addr, out_addr;
    Int8Groups p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKLL)(KKKKLLLL)K", &x_addr, &is_addr, &p.rows, &p.x_stride, &w_addr, &sums_addr,
                          &cs_addr, &bias_addr, &p.in_features, &p.out_features, &p.n_pad, &p.group, &out_addr))
        return NULL;
    if (p.rows < 0 || p.in_features < 1 || p.out_features < 1 || p.x_stride < p.in_features || p.group < 4 ||
        p.group % 4 || p.in_features % p.group || p.n_pad < p.out_features || p.n_pad % 32) {
        PyErr_SetString(PyExc_ValueError, "int8_groups_f32: bad shape, stride or group");
        return NULL;
    }
    if (!fxq_vnni_usable())
        Py_RETURN_FALSE;
    p.x = PTR(const float, x_addr);
    p.input_scale = is_addr ? PTR(const float, is_addr) : NULL;
    p.w = PTR(const int8_t, w_addr);
    p.group_sums = PTR(const int32_t, sums_addr);
    p.col_scale = PTR(const float, cs_addr);
    p.bias = bias_addr ? PTR(const float, bias_addr) : NULL;
    p.out = PTR(float, out_addr);
    RUN_AND_RETURN(fxq_int8_groups_f32(&p), Py_RETURN_TRUE);
}

/* weight_only_f32((x_ptr, input_scale_ptr, rows, x_stride), (w_ptr, scale_ptr, bias_ptr, in_features, out_features,
 *                 group), (out_ptr, out_stride)) -> None
 *
 * Strides in floats; the weights dense (out_features, in_features) int8, their scales dense (out_features,
 * in_features / group); input_scale_ptr and bias_ptr 0 for none. */
PyObject *fxq_py_weight_only_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, is_addr, w_addr, scale_addr, bias_addr, out_addr;
    WeightOnlyRows p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKLL)(KKKLLL)(KL)", &x_addr, &is_addr, &p.rows, &p.x_stride, &w_addr, &scale_addr,
                          &bias_addr, &p.in_features, &p.out_features, &p.group, &out_addr, &p.out_stride))
        return NULL;
    if (p.rows < 0 || p.in_features < 1 || p.out_features < 1 || p.x_stride < p.in_features ||
        p.out_stride < p.out_features || p.group < 1 || p.in_features % p.group ||
        (p.group != p.in_features && p.group % 16)) {
        PyErr_SetString(PyExc_ValueError, "weight_only_f32: bad shape or stride");
        return NULL;
    }
    p.x = PTR(const float, x_addr);
    p.input_scale = is_addr ? PTR(const float, is_addr) : NULL;
    p.w = PTR(const int8_t, w_addr);
    p.scale = PTR(const float, scale_addr);
    p.bias = bias_addr ? PTR(const float, bias_addr) : NULL;
    p.out = PTR(float, out_addr);
    RUN_AND_RETURN(fxq_weight_only_f32(&p), Py_RETURN_NONE);
}

/* causal_attention_f32((q_ptr, s0, s1, s2), (k_ptr, s0, s1, s2), (v_ptr, s0, s1, s2), (out_ptr, s0, s1, s2),
 *                      (batch, heads, kv_heads, tokens, dim), scale) -> bool
 *
 * Each tensor's address and the strides (in floats) of its first three dims, its last dim dense. False (nothing
 * written) without AVX-512 or under a lower ISA cap. */
PyObject *fxq_py_causal_attention_f32(PyObject *self, PyObject *args) {
    unsigned long long q_addr, k_addr, v_addr, out_addr;
    double scale;
    CausalAttention p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLLL)(KLLL)(KLLL)(KLLL)(LLLLL)d", &q_addr, &p.q_strides[0], &p.q_strides[1],
                          &p.q_strides[2], &k_addr, &p.k_strides[0], &p.k_strides[1], &p.k_strides[2], &v_addr,
                          &p.v_strides[0], &p.v_strides[1], &p.v_strides[2], &out_addr, &p.out_strides[0],
                          &p.out_strides[1], &p.out_strides[2], &p.batch, &p.heads, &p.kv_heads, &p.tokens, &p.dim,
                          &scale))
        return NULL;
    if (p.batch < 1 || p.heads < 1 || p.kv_heads < 1 || p.heads % p.kv_heads || p.tokens < 1 || p.dim < 16 ||
        p.dim % 16 || p.dim > FXQ_ATTENTION_MAX_DIM) {
        PyErr_SetString(PyExc_ValueError, "causal_attention_f32: bad shape");
        return NULL;
    }
    if (!fxq_attention_usable())
        Py_RETURN_FALSE;
    p.scale = (float)scale;
    p.q = PTR(const float, q_addr);
    p.k = PTR(const float, k_addr);
    p.v = PTR(const float, v_addr);
    p.out = PTR(float, out_addr);
    RUN_AND_RETURN(fxq_causal_attention_f32(&p), Py_RETURN_TRUE);
}

/* full_attention_f32((q_ptr, s0, s1, s2), (k_ptr, ...), (v_ptr, ...), (out_ptr, ...), (mask_ptr, kind, s0, s1, s2),
 *                    (batch, heads, kv_heads, q_tokens, kv_tokens, dim), scale) -> bool
 *
 * As causal_attention_f32, over every key; mask_ptr 0 with kind FXQ_MASK_NONE, or a float32 (FXQ_MASK_ADD) or byte
 * (FXQ_MASK_KEEP) mask with the strides (in elements) of its first three dims, dense along the keys. */
PyObject *fxq_py_full_attention_f32(PyObject *self, PyObject *args) {
    unsigned long long q_addr, k_addr, v_addr, out_addr, mask_addr;
    double scale;
    FullAttention p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLLL)(KLLL)(KLLL)(KLLL)(KLLLL)(LLLLLL)d", &q_addr, &p.q_strides[0],
                          &p.q_strides[1], &p.q_strides[2], &k_addr, &p.k_strides[0], &p.k_strides[1],
                          &p.k_strides[2], &v_addr, &p.v_strides[0], &p.v_strides[1], &p.v_strides[2], &out_addr,
                          &p.out_strides[0], &p.out_strides[1], &p.out_strides[2], &mask_addr, &p.mask_kind,
                          &p.mask_strides[0], &p.mask_strides[1], &p.mask_strides[2], &p.batch, &p.heads,
                          &p.kv_heads, &p.q_tokens, &p.kv_tokens, &p.dim, &scale))
        return NULL;
    if (p.batch < 1 || p.heads < 1 || p.kv_heads < 1 || p.heads % p.kv_heads || p.q_tokens < 1 || p.kv_tokens < 1 ||
        p.dim < 16 || p.dim % 16 || p.dim > FXQ_ATTENTION_MAX_DIM || p.mask_kind < FXQ_MASK_NONE ||
        p.mask_kind > FXQ_MASK_KEEP || (p.mask_kind != FXQ_MASK_NONE) != (mask_addr != 0)) {
        PyErr_SetString(PyExc_ValueError, "full_attention_f32: bad shape or mask");
        return NULL;
    }
    if (!fxq_attention_usable())
        Py_RETURN_FALSE;
    p.scale = (float)scale;
    p.q = PTR(const float, q_addr);
    p.k = PTR(const float, k_addr);
    p.v = PTR(const float, v_addr);
    p.out = PTR(float, out_addr);
    p.mask = PTR(const void, mask_addr);
    RUN_AND_RETURN(fxq_full_attention_f32(&p), Py_RETURN_TRUE);
}

/* add_layer_norm_f32((a_ptr, b_ptr, y_ptr), (rows, b_rows, width), (gamma_ptr, beta_ptr), eps) -> None
 *
 * y = LayerNorm(a + b) over rows of width dense floats, b's b_rows rows repeating (rows a multiple of b_rows);
 * gamma_ptr, beta_ptr 0: none (beta only with gamma). */
PyObject *fxq_py_add_layer_norm_f32(PyObject *self, PyObject *args) {
    unsigned long long a_addr, b_addr, y_addr, gamma_addr, beta_addr;
    double eps;
    AddLayerNorm p;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KKK)(LLL)(KK)d", &a_addr, &b_addr, &y_addr, &p.rows, &p.b_rows, &p.width,
                          &gamma_addr, &beta_addr, &eps))
        return NULL;
    if (p.rows < 0 || p.b_rows < 1 || p.rows % p.b_rows || p.width < 1 || !a_addr || !b_addr || !y_addr ||
        (beta_addr && !gamma_addr) || !(eps >= 0)) {
        PyErr_SetString(PyExc_ValueError, "add_layer_norm_f32: bad shape, pointer or eps");
        return NULL;
    }
    p.a = PTR(const float, a_addr);
    p.b = PTR(const float, b_addr);
    p.y = PTR(float, y_addr);
    p.gamma = gamma_addr ? PTR(const float, gamma_addr) : NULL;
    p.beta = beta_addr ? PTR(const float, beta_addr) : NULL;
    p.eps = (float)eps;
    Py_BEGIN_ALLOW_THREADS
    fxq_add_layer_norm_f32(&p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* conv3x3_onednn((x_ptr, n, h, w, c, pad_h, pad_w, zx), (u_ptr, mult_ptr, bias_ptr, c16, k16, out_channels),
 *                (zx, zo, relu, float_out, qmax, dst_inv), (sum, sum_scale, sum_zero_point), (out_ptr, out_h, out_w))
 *     -> bool
 *
 * A 3x3 conv of stride 1 on contiguous channels-last uint8 as Winograd F(2x2, 3x3) with oneDNN's requantization
 * (WinoInput, WinoWeights, OnednnRequant; the requant's zx is unused: the input's is the one), into contiguous
 * channels-last uint8 (n, out_h, out_w, out_channels), read first as the accumulator with sum. The integer sums are
 * exact for c <= 1827 (ValueError above); oneDNN's equal them on 7-bit inputs, which the caller guarantees. False
 * (nothing written) without AVX2. */
PyObject *fxq_py_conv3x3_onednn(PyObject *self, PyObject *args) {
    unsigned long long x_addr, u_addr, mult_addr, bias_addr, out_addr;
    WinoInput x;
    WinoWeights w;
    OnednnRequant r;
    OnednnSum sum;
    int with_sum;
    long long out_h, out_w;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLLLLLLL)(KKKLLL)(LLppLf)(pfL)(KLL)", &x_addr, &x.n, &x.h, &x.w, &x.c, &x.pad_h,
                          &x.pad_w, &x.zx, &u_addr, &mult_addr, &bias_addr, &w.c16, &w.k16, &w.out_channels, &r.zx,
                          &r.zo, &r.relu, &r.float_out, &r.qmax, &r.dst_inv, &with_sum, &sum.scale, &sum.zero_point,
                          &out_addr, &out_h, &out_w))
        return NULL;
    if (x.n < 1 || x.c < 1 || x.c > 1827 || x.pad_h < 0 || x.pad_w < 0 || x.pad_h > 2 || x.pad_w > 2 ||
        out_h != x.h + 2 * x.pad_h - 2 || out_w != x.w + 2 * x.pad_w - 2 || out_h < 1 || out_w < 1 ||
        w.c16 != (x.c + 15) / 16 * 16 || w.out_channels < 1 || w.k16 != (w.out_channels + 15) / 16 * 16 ||
        x.zx < 0 || x.zx > 255 || r.zo < 0 || r.zo > 255 || r.qmax < 0 || r.qmax > 255 || r.float_out ||
        sum.zero_point < 0 || sum.zero_point > 255) {
        PyErr_SetString(PyExc_ValueError, "conv3x3_onednn: needs 1 to 1827 input channels, padding 0 to 2, the 3x3 "
                                          "output size, c16 and k16 rounded up to 16, uint8 zero points and output");
        return NULL;
    }
    x.data = PTR(const uint8_t, x_addr);
    w.u = PTR(const int16_t, u_addr);
    w.mult = PTR(const float, mult_addr);
    w.bias = PTR(const float, bias_addr);
    if (!fxq_avx2_usable())
        Py_RETURN_FALSE;
    const OnednnSum *summed = with_sum ? &sum : NULL;
    RUN_AND_RETURN(fxq_conv3x3_winograd_avx2(&x, &w, &r, summed, PTR(uint8_t, out_addr), out_h, out_w), Py_RETURN_TRUE);
}

/* dwconv3x3_onednn((x_ptr, n, h, w, c, pad_h, pad_w, stride, zx), (w_ptr, offset_ptr, mult_ptr, bias_ptr),
 *                  (zx, zo, relu, float_out, qmax, dst_inv), (out_ptr, out_h, out_w)) -> bool
 *
 * A depthwise 3x3 conv of stride 1 or 2 and padding 0 or 1 on contiguous channels-last uint8 (c a multiple of 8)
 * with oneDNN's requantization (DwInput, DwWeights, OnednnRequant; the requant's zx is unused: the input's is the
 * one), into contiguous channels-last uint8 (n, out_h, out_w, c). False (nothing written) without AVX2. */
PyObject *fxq_py_dwconv3x3_onednn(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, offset_addr, mult_addr, bias_addr, out_addr;
    DwInput x;
    DwWeights w;
    OnednnRequant r;
    long long out_h, out_w;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KLLLLLLLL)(KKKK)(LLppLf)(KLL)", &x_addr, &x.n, &x.h, &x.w, &x.c, &x.pad_h, &x.pad_w,
                          &x.stride, &x.zx, &w_addr, &offset_addr, &mult_addr, &bias_addr, &r.zx, &r.zo, &r.relu,
                          &r.float_out, &r.qmax, &r.dst_inv, &out_addr, &out_h, &out_w))
        return NULL;
    if (x.n < 1 || x.c < 8 || x.c % 8 || x.pad_h < 0 || x.pad_w < 0 || x.pad_h > 1 || x.pad_w > 1 || x.stride < 1 ||
        x.stride > 2 || x.h + 2 * x.pad_h < 3 || x.w + 2 * x.pad_w < 3 ||
        out_h != (x.h + 2 * x.pad_h - 3) / x.stride + 1 || out_w != (x.w + 2 * x.pad_w - 3) / x.stride + 1 ||
        x.zx < 0 || x.zx > 255 || r.zo < 0 || r.zo > 255 || r.qmax < 0 || r.qmax > 255 || r.float_out) {
        PyErr_SetString(PyExc_ValueError, "dwconv3x3_onednn: needs channels a multiple of 8, padding 0 or 1, stride 1 "
                                          "or 2, the conv's output size, uint8 zero points and output");
        return NULL;
    }
    x.data = PTR(const uint8_t, x_addr);
    w.w = PTR(const int16_t, w_addr);
    w.offset = PTR(const int32_t, offset_addr);
    w.mult = PTR(const float, mult_addr);
    w.bias = PTR(const float, bias_addr);
    if (!fxq_avx2_usable())
        Py_RETURN_FALSE;
    RUN_AND_RETURN(fxq_dwconv3x3_avx2(&x, &w, &r, PTR(uint8_t, out_addr), out_h, out_w), Py_RETURN_TRUE);
}
