/* fxquant.native._native: the Python entry points of the C loops.
 *
 * Each entry point parses its arguments into the structs of native.h (one Python tuple per struct, in the order of
 * its fields; fxquant/native/_native.pyi spells them out and tests/native/test_native_stub.py checks it against the format
 * strings here), checks them (ValueError), and runs its kernel with the GIL released. Pointers arrive as integers
 * (torch's data_ptr()); the typed wrappers in fxquant/native/ are the only callers and keep them in bounds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "native.h"
#include "module_rows.h"

int fxq_isa_cap = ISA_AMX;

#define PTR(type, addr) ((type *)(uintptr_t)(addr))

static PyObject *set_isa_cap(PyObject *self, PyObject *args) {
    int level;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &level))
        return NULL;
    if (level < ISA_AVX2 || level > ISA_AMX) {
        PyErr_SetString(PyExc_ValueError, "set_isa_cap: level must be 0 (avx2) to 3 (amx)");
        return NULL;
    }
    fxq_isa_cap = level;
    Py_RETURN_NONE;
}

/* scan_f32(x_ptr, n, (start, top, bins), counts_ptr) -> (lo, hi, on_grid)
 *
 * x_ptr: n dense float32 values; the grid: bins bins of equal power-of-two width from start to top, both exact in
 * float32 (ValueError otherwise). When every value lies in [start, top], counts_ptr's bins float64 slots are
 * overwritten with the per-bin counts (values equal to top in the last bin, as torch.histc) and on_grid is True;
 * otherwise (a value off the grid, or NaN) they are left alone and on_grid is False. lo/hi: the min and max of all n
 * values (NaN if any is NaN), read to the end either way because the caller needs the whole batch's range. */
static PyObject *scan_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    long long n;
    HistogramGrid grid;
    ScanResult result;
    int status;
    (void)self;
    if (!PyArg_ParseTuple(args, "KL(ddL)K", &x_addr, &n, &grid.start, &grid.top, &grid.bins, &out_addr))
        return NULL;
    const float fstart = (float)grid.start, ftop = (float)grid.top;
    if (n < 0 || grid.bins < 1 || !(grid.top > grid.start) || (double)fstart != grid.start ||
        (double)ftop != grid.top) {
        PyErr_SetString(PyExc_ValueError, "scan_f32: needs n >= 0, bins >= 1 and a grid exact in float32");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = fxq_scan_f32(PTR(const float, x_addr), n, &grid, PTR(double, out_addr), &result);
    Py_END_ALLOW_THREADS
    if (status < 0)
        return PyErr_NoMemory();
    return Py_BuildValue("ddO", (double)result.lo, (double)result.hi, result.on_grid ? Py_True : Py_False);
}

/* quantize_f32(x_ptr, out_ptr, (outer, channels, inner), (scale, zero_point, qmin, qmax), to_nhwc): the
 * output's bytes are the same for uint8 and int8 (qmin, qmax say which) */
static PyObject *quantize_f32(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    Planes shape;
    QuantizeParams q;
    int to_nhwc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK(LLL)(dLLL)p", &x_addr, &out_addr, &shape.outer, &shape.channels, &shape.inner,
                          &q.scale, &q.zero_point, &q.qmin, &q.qmax, &to_nhwc))
        return NULL;
    if (shape.outer < 0 || shape.channels < 1 || shape.inner < 0 || !(q.scale > 0) || q.qmin > q.qmax ||
        q.qmin < -128 || q.qmax > 255) {
        PyErr_SetString(PyExc_ValueError, "quantize_f32: bad shape, scale or range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fxq_quantize_f32(PTR(const float, x_addr), PTR(void, out_addr), &shape, &q, to_nhwc);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* mean_u8(x_ptr, out_ptr, (outer, channels, inner), (s_outer, s_channel, s_inner), (zero_point, qmin, qmax)) */
static PyObject *mean_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    Planes shape;
    PlaneStrides strides;
    ByteLevels levels;
    int status;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK(LLL)(LLL)(LLL)", &x_addr, &out_addr, &shape.outer, &shape.channels, &shape.inner,
                          &strides.outer, &strides.channel, &strides.inner, &levels.zero_point, &levels.qmin,
                          &levels.qmax))
        return NULL;
    if (shape.outer < 0 || shape.channels < 1 || shape.inner < 1 || shape.inner > (long long)(UINT32_MAX / 255) ||
        levels.qmin < 0 || levels.qmax > 255 || levels.qmin > levels.qmax || levels.zero_point < levels.qmin ||
        levels.zero_point > levels.qmax) {
        PyErr_SetString(PyExc_ValueError, "mean_u8: bad shape or range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = fxq_mean_u8(PTR(const uint8_t, x_addr), PTR(uint8_t, out_addr), &shape, &strides, &levels);
    Py_END_ALLOW_THREADS
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* max_pool_u8(x_ptr, out_ptr, (batch, height, width, channels, out_h, out_w),
 *             (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w)) */
static PyObject *max_pool_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr;
    PoolShape s;
    PoolWindow w;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK(LLLLLL)(LLLLLLLL)", &x_addr, &out_addr, &s.batch, &s.height, &s.width,
                          &s.channels, &s.out_h, &s.out_w, &w.kernel_h, &w.kernel_w, &w.stride_h, &w.stride_w,
                          &w.pad_h, &w.pad_w, &w.dilation_h, &w.dilation_w))
        return NULL;
    /* every output's window must start inside the padded input and hold an in-bounds tap (torch's own rule:
     * padding at most half the window), of at most FXQ_POOL_MAX_KERNEL rows */
    if (s.batch < 0 || s.height < 1 || s.width < 1 || s.channels < 1 || s.out_h < 1 || s.out_w < 1 ||
        w.kernel_h < 1 || w.kernel_h > FXQ_POOL_MAX_KERNEL || w.kernel_w < 1 || w.stride_h < 1 || w.stride_w < 1 ||
        w.dilation_h < 1 || w.dilation_w < 1 || w.pad_h < 0 || w.pad_w < 0 || 2 * w.pad_h > w.kernel_h ||
        2 * w.pad_w > w.kernel_w ||
        (s.out_h - 1) * w.stride_h - w.pad_h >= s.height || (s.out_w - 1) * w.stride_w - w.pad_w >= s.width) {
        PyErr_SetString(PyExc_ValueError, "max_pool_u8: bad shape or window");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fxq_max_pool_u8(PTR(const uint8_t, x_addr), PTR(uint8_t, out_addr), &s, &w);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* mul_u8((outer, rows, length), (a_ptr, a_strides), (b_ptr, b_strides), (out_ptr, out_strides),
 *        (za, zb, zo, qmin, qmax, factor, wide)) */
static PyObject *mul_u8(PyObject *self, PyObject *args) {
    unsigned long long a_addr, b_addr, out_addr;
    int64_t shape[3];
    Bytes3 a, b, out;
    MulRequant r;
    (void)self;
    if (!PyArg_ParseTuple(args, "(LLL)(K(LLL))(K(LLL))(K(LLL))(LLLLLdp)", &shape[0], &shape[1], &shape[2], &a_addr,
                          &a.stride[0], &a.stride[1], &a.stride[2], &b_addr, &b.stride[0], &b.stride[1], &b.stride[2],
                          &out_addr, &out.stride[0], &out.stride[1], &out.stride[2], &r.za, &r.zb, &r.zo, &r.qmin,
                          &r.qmax, &r.factor, &r.wide))
        return NULL;
    if (shape[0] < 0 || shape[1] < 0 || shape[2] < 0 || r.qmin < 0 || r.qmax > 255 || r.qmin > r.qmax ||
        r.zo < r.qmin || r.zo > r.qmax || !(r.factor == r.factor)) {
        PyErr_SetString(PyExc_ValueError, "mul_u8: bad shape, range or factor");
        return NULL;
    }
    a.data = PTR(uint8_t, a_addr);
    b.data = PTR(uint8_t, b_addr);
    out.data = PTR(uint8_t, out_addr);
    Py_BEGIN_ALLOW_THREADS
    fxq_mul_u8(shape, &a, &b, &out, &r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* lookup_u8(src_ptr, dst_ptr, n, table_ptr): dst[i] = table[src[i]] over n bytes. */
static PyObject *lookup_u8(PyObject *self, PyObject *args) {
    unsigned long long src_addr, dst_addr, table_addr;
    Py_ssize_t n;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKnK", &src_addr, &dst_addr, &n, &table_addr))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "lookup_u8: negative length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fxq_lookup_u8(PTR(const uint8_t, src_addr), PTR(uint8_t, dst_addr), (int64_t)n, PTR(const uint8_t, table_addr));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy_rows((src_ptr, src_stride), (dst_ptr, dst_stride), rows, width): rows rows of width bytes. */
static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long src_addr, dst_addr;
    ByteRows src, dst;
    int64_t rows, width;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KL)(KL)LL", &src_addr, &src.stride, &dst_addr, &dst.stride, &rows, &width))
        return NULL;
    if (rows < 0 || width < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: negative size");
        return NULL;
    }
    src.data = PTR(uint8_t, src_addr);
    dst.data = PTR(uint8_t, dst_addr);
    Py_BEGIN_ALLOW_THREADS
    fxq_copy_rows(&src, &dst, rows, width);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The packed weights of conv_u8 and linear_rows_u8, (w, colsum, int_bias, bias, multipliers, in_channels, n_pad,
 * out_channels), arrive as five addresses and three sizes. */
static void gemm_weights(GemmWeights *w, const unsigned long long *addr) {
    w->w = PTR(const int8_t, addr[0]);
    w->colsum = PTR(const int32_t, addr[1]);
    w->ibias = PTR(const int32_t, addr[2]);
    w->bias = PTR(const float, addr[3]);
    w->mult = PTR(const float, addr[4]);
}

static int bad_gemm(const GemmWeights *w, const Requant *r) {
    return w->n_pad % 16 || w->n_pad < w->out_channels || w->out_channels < 1 || r->zx < 0 || r->zx > 255 ||
           r->zo < 0 || r->qmax < r->zo || r->qmax > 255;
}

/* What both few-row Linear entry points parse besides their requantization: the input and output rows, the row
 * count, the weights, and the addresses that become their pointers (rows_ready). */
typedef struct {
    ByteRows x, out;
    int64_t rows;
    GemmWeights w;
    unsigned long long x_addr, out_addr, addr[5];
} RowsCall;

/* 0 with the pointers set, or -1 with ValueError where the shapes, packing or zero points (in `r`) are bad. */
static int rows_ready(const char *name, RowsCall *c, const Requant *r) {
    if (c->rows < 0 || c->w.in_channels < 1 || bad_gemm(&c->w, r)) {
        PyErr_Format(PyExc_ValueError, "%s: bad shape, packing or zero point", name);
        return -1;
    }
    gemm_weights(&c->w, c->addr);
    c->x.data = PTR(uint8_t, c->x_addr);
    c->out.data = PTR(uint8_t, c->out_addr);
    return 0;
}

/* linear_rows_u8((x_ptr, x_stride), rows, weights, (zx, zo, relu, qmax), (out_ptr, out_stride)) -> bool
 *
 * weights blocked by 64 channels (fxquant.native.amx_gemm.linear_rows_into): the AVX512-VNNI loop, else the AVX2
 * one. False (nothing written) without AVX2. */
static PyObject *linear_rows_u8(PyObject *self, PyObject *args) {
    RowsCall c;
    Requant r;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KL)L(KKKKKLLL)(LLpL)(KL)", &c.x_addr, &c.x.stride, &c.rows, &c.addr[0], &c.addr[1],
                          &c.addr[2], &c.addr[3], &c.addr[4], &c.w.in_channels, &c.w.n_pad, &c.w.out_channels, &r.zx,
                          &r.zo, &r.relu, &r.qmax, &c.out_addr, &c.out.stride) ||
        rows_ready("linear_rows_u8", &c, &r) < 0)
        return NULL;
    const int vnni = fxq_vnni_usable();
    if (!vnni && !fxq_avx2_usable())
        Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS
    (vnni ? fxq_linear_rows_u8 : fxq_linear_rows_u8_avx2)(&c.x, c.rows, &c.w, &r, &c.out);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
}

/* linear_rows_onednn((x_ptr, x_stride), rows, weights, (zx, zo, relu, float_out, qmax, dst_inv), (out_ptr,
 * out_stride)) -> bool
 *
 * linear_rows_u8's sums with oneDNN's requantization (OnednnRequant), on the AVX2 loop whatever the CPU has: exact on
 * 7-bit inputs, which the caller guarantees. out_stride in bytes. False (nothing written) without AVX2. */
static PyObject *linear_rows_onednn(PyObject *self, PyObject *args) {
    RowsCall c;
    OnednnRequant r;
    (void)self;
    if (!PyArg_ParseTuple(args, "(KL)L(KKKKKLLL)(LLppLf)(KL)", &c.x_addr, &c.x.stride, &c.rows, &c.addr[0],
                          &c.addr[1], &c.addr[2], &c.addr[3], &c.addr[4], &c.w.in_channels, &c.w.n_pad,
                          &c.w.out_channels, &r.zx, &r.zo, &r.relu, &r.float_out, &r.qmax, &r.dst_inv, &c.out_addr,
                          &c.out.stride))
        return NULL;
    const Requant range = {r.zx, r.zo, 0, r.qmax};
    if (rows_ready("linear_rows_onednn", &c, &range) < 0)
        return NULL;
    if (!fxq_avx2_usable())
        Py_RETURN_FALSE;
    Py_BEGIN_ALLOW_THREADS
    fxq_linear_rows_onednn_avx2(&c.x, c.rows, &c.w, &r, &c.out);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
}

/* conv_u8((x_ptr, (N, D, H, W, C), x_strides), (kernel, stride, padding), weights, (zx, zo, relu),
 *         (out_ptr, (Do, Ho, Wo), out_strides)) -> bool
 *
 * Triples over (depth, height, width); strides of the (N, D, H, W) dimensions in bytes, channels at stride 1. False
 * (nothing written) where AMX is not usable; the caller keeps the engine's conv. */
static PyObject *conv_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, out_addr, addr[5];
    ConvInput x;
    ConvWindow win;
    GemmWeights w;
    Requant r;
    ConvOutput out;
    int status;
    (void)self;
    if (!PyArg_ParseTuple(args, "(K(LLLLL)(LLLL))((LLL)(LLL)(LLL))(KKKKKLLL)(LLpL)(K(LLL)(LLLL))", &x_addr,
                          &x.dims[0], &x.dims[1], &x.dims[2], &x.dims[3], &x.dims[4], &x.strides[0], &x.strides[1],
                          &x.strides[2], &x.strides[3], &win.kernel[0], &win.kernel[1], &win.kernel[2],
                          &win.stride[0], &win.stride[1], &win.stride[2], &win.padding[0], &win.padding[1],
                          &win.padding[2], &addr[0], &addr[1], &addr[2], &addr[3], &addr[4], &w.in_channels,
                          &w.n_pad, &w.out_channels, &r.zx, &r.zo, &r.relu, &r.qmax, &out_addr, &out.size[0],
                          &out.size[1],
                          &out.size[2], &out.strides[0], &out.strides[1], &out.strides[2], &out.strides[3]))
        return NULL;
    int bad = x.dims[0] < 0 || x.dims[4] < 1 || w.in_channels != x.dims[4] || bad_gemm(&w, &r);
    for (int i = 0; i < 3; i++)
        bad |= x.dims[i + 1] < 1 || win.kernel[i] < 1 || win.stride[i] < 1 || win.padding[i] < 0 || out.size[i] < 1 ||
               out.size[i] != (x.dims[i + 1] + 2 * win.padding[i] - win.kernel[i]) / win.stride[i] + 1;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "conv_u8: bad shape, packing or zero point");
        return NULL;
    }
    if (!fxq_amx_usable())
        Py_RETURN_FALSE;
    gemm_weights(&w, addr);
    x.data = PTR(const uint8_t, x_addr);
    out.data = PTR(uint8_t, out_addr);
    Py_BEGIN_ALLOW_THREADS
    status = fxq_conv_u8(&x, &win, &w, &r, &out);
    Py_END_ALLOW_THREADS
    if (status < 0)
        return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

/* patches_u8((x_ptr, (N, H, W), x_strides), (w, colsum, bias, in_channels, n_pad, out_channels),
 *            (rcp, multiplier, zx, zo), (out_ptr, out_strides), (kh, kw)) -> bool
 *
 * Strides in bytes of the (N, H, W) dimensions, channels at stride 1 in both. False (nothing written) where the CPU
 * has no AVX512-VNNI: the caller keeps fbgemm's Linear. */
static PyObject *patches_u8(PyObject *self, PyObject *args) {
    unsigned long long x_addr, w_addr, colsum_addr, bias_addr, out_addr;
    PatchInput x;
    PatchWeights w;
    PatchRequant r;
    PatchOutput out;
    int64_t patch[2];
    (void)self;
    if (!PyArg_ParseTuple(args, "(K(LLL)(LLL))(KKKLLL)(ddLL)(K(LLL))(LL)", &x_addr, &x.dims[0], &x.dims[1],
                          &x.dims[2], &x.strides[0], &x.strides[1], &x.strides[2], &w_addr, &colsum_addr, &bias_addr,
                          &w.in_channels, &w.n_pad, &w.out_channels, &r.rcp, &r.multiplier, &r.zx, &r.zo, &out_addr,
                          &out.strides[0], &out.strides[1], &out.strides[2], &patch[0], &patch[1]))
        return NULL;
    const int64_t n_cols = patch[0] * patch[1] * w.out_channels;
    if (x.dims[0] < 0 || x.dims[1] < 0 || x.dims[2] < 0 || w.in_channels < 1 || w.out_channels < 1 || patch[0] < 1 ||
        patch[1] < 1 || w.n_pad % 16 || w.n_pad < n_cols || w.n_pad - n_cols >= 16 || w.n_pad > 2048 || r.zx < 0 ||
        r.zx > 255 || r.zo < 0 || r.zo > 255) {
        PyErr_SetString(PyExc_ValueError, "patches_u8: bad shape, packing or zero point");
        return NULL;
    }
    if (!fxq_vnni_usable())
        Py_RETURN_FALSE;
    const int amx = fxq_amx_usable();
    x.data = PTR(const uint8_t, x_addr);
    w.w = PTR(const int8_t, w_addr);
    w.colsum = PTR(const int32_t, colsum_addr);
    w.bias = PTR(const float, bias_addr);
    out.data = PTR(uint8_t, out_addr);
    Py_BEGIN_ALLOW_THREADS
    fxq_patches_u8(&x, &w, &r, &out, patch, amx);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"set_isa_cap", set_isa_cap, METH_VARARGS, "Cap the instruction sets the loops use (FXQUANT_ISA)."},
    {"scan_f32", scan_f32, METH_VARARGS, "Min, max and grid counts of dense float32 values in one read."},
    {"quantize_f32", quantize_f32, METH_VARARGS, "float32 -> uint8/int8 with one scale and zero point (NCHW->NHWC)."},
    {"mean_u8", mean_u8, METH_VARARGS, "Rounded per-channel means of uint8 activations (global average pool)."},
    {"max_pool_u8", max_pool_u8, METH_VARARGS, "A 2-d max pool of channels-last uint8 activations."},
    {"mul_u8", mul_u8, METH_VARARGS, "Product of two uint8 activations (b may broadcast), rounded once."},
    {"lookup_u8", lookup_u8, METH_VARARGS, "dst[i] = table[src[i]] over n bytes (a 256-entry table)."},
    {"conv_u8", conv_u8, METH_VARARGS, "A conv as fbgemm or qnnpack computes it, on AMX tiles."},
    {"linear_rows_u8", linear_rows_u8, METH_VARARGS, "A Linear on a few rows as fbgemm or qnnpack computes it."},
    {"linear_rows_onednn", linear_rows_onednn, METH_VARARGS, "A Linear on a few rows as oneDNN computes it."},
    {"conv3x3_onednn", fxq_py_conv3x3_onednn, METH_VARARGS, "A 3x3 conv as oneDNN computes it, by Winograd."},
    {"dwconv3x3_onednn", fxq_py_dwconv3x3_onednn, METH_VARARGS, "A depthwise 3x3 conv as oneDNN computes it."},
    {"copy_rows", copy_rows, METH_VARARGS, "Copy rows of bytes between two strided 2-d layouts."},
    {"patches_u8", patches_u8, METH_VARARGS, "A kernel == stride transposed conv as fbgemm's Linear, in place."},
    {"quantize_rows_s8", fxq_py_quantize_rows_s8, METH_VARARGS, "Symmetric per-row int8 of float32 rows (per token)."},
    {"rescale_rows", fxq_py_rescale_rows, METH_VARARGS, "int32 sums -> float32 with per-row and per-column scales."},
    {"int8_rows_f32", fxq_py_int8_rows_f32, METH_VARARGS, "A few-row per-token INT8 Linear on AVX512-VNNI."},
    {"int8_groups_f32", fxq_py_int8_groups_f32, METH_VARARGS, "A per-group dynamic INT8 Linear on AVX512-VNNI."},
    {"causal_attention_f32", fxq_py_causal_attention_f32, METH_VARARGS, "A decoder's causal attention in float32."},
    {"full_attention_f32", fxq_py_full_attention_f32, METH_VARARGS, "Attention over every key, masked, in float32."},
    {"add_layer_norm_f32", fxq_py_add_layer_norm_f32, METH_VARARGS, "LayerNorm(a + b) over rows of float32."},
    {"weight_only_f32", fxq_py_weight_only_f32, METH_VARARGS, "A few-row float32 Linear on int8 weights (W8A16)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fxquant.native._native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
