/* Primitive: one oneDNN int8 convolution or matmul, built for one input shape and run many times. */

#include "dnnl_api.h"

/* Memories set for every call: the ones a running call owns (see ``busy``). */
typedef struct { handle_t src, dst, scratchpad; } CallMemories;

typedef struct {
    PyObject_HEAD
    handle_t primitive;
    handle_t src_md, dst_md, scratchpad_md;  /* for the memories of calls that overlap another (threads) */
    handle_t owned[8];                       /* weights, bias, scales and zero points: bound once */
    int n_owned;
    CallMemories memories;
    void *scratchpad;
    dnnl_exec_arg_t args[16];
    int nargs, src_arg, dst_arg, scratchpad_arg;  /* indices in ``args`` of the per-call memories (-1: none) */
    float *constants;                             /* scales and bias the owned memories point to */
    int busy;                                     /* a call is using ``memories``: another makes its own */
    handle_t weights_md;                          /* the layout the weights were reordered into */
    handle_t plain_md;                            /* ... and the plain layout they came from (for unpack) */
    int64_t in_features;                          /* a Linear's (0: a conv) */
    void *weights;                                /* ... and where they are */
    PyObject *donor;                              /* the primitive whose weights these are, if shared */
} Primitive;

static int dims_of(PyObject *sequence, int64_t out[DNNL_MAX_NDIMS]) {
    PyObject *fast = PySequence_Fast(sequence, "dims must be a sequence of ints");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > DNNL_MAX_NDIMS) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "too many dims");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : (int)n;
}

static void contiguous_strides(int ndims, const int64_t *dims, int64_t *strides) {
    int64_t stride = 1;
    for (int i = ndims - 1; i >= 0; i--) strides[i] = stride, stride *= dims[i];
}

#define CHECK(call, what)                                                                         \
    do {                                                                                          \
        dnnl_status_t status_ = (call);                                                           \
        if (status_ != dnnl_success) {                                                            \
            PyErr_Format(PyExc_RuntimeError, "oneDNN %s failed (status %d)", what, (int)status_); \
            goto fail;                                                                            \
        }                                                                                         \
    } while (0)

static handle_t vector_md(int64_t n, int data_type) {
    int64_t dims[1] = {n}, strides[1] = {1};
    handle_t md = NULL;
    return api.memory_desc_create_with_strides(&md, 1, dims, data_type, strides) == dnnl_success ? md : NULL;
}

/* A memory over ``data`` (bound for good) added to the call's arguments. */
static int bind_constant(Primitive *p, int arg, int64_t n, int data_type, void *data) {
    handle_t md = vector_md(n, data_type), memory = NULL;
    if (md == NULL || api.memory_create(&memory, md, engine, data) != dnnl_success) {
        if (md) api.memory_desc_destroy(md);
        PyErr_SetString(PyExc_RuntimeError, "oneDNN memory_create failed");
        return -1;
    }
    api.memory_desc_destroy(md);
    p->owned[p->n_owned++] = memory;
    p->args[p->nargs++] = (dnnl_exec_arg_t){arg, memory};
    return 0;
}

static void Primitive_dealloc(Primitive *p) {
    if (p->primitive) api.primitive_destroy(p->primitive);
    handle_t *per_call[] = {&p->memories.src, &p->memories.dst, &p->memories.scratchpad};
    for (int i = 0; i < 3; i++)
        if (*per_call[i]) api.memory_destroy(*per_call[i]);
    for (int i = 0; i < p->n_owned; i++) api.memory_destroy(p->owned[i]);
    handle_t *mds[] = {&p->src_md, &p->dst_md, &p->scratchpad_md};
    for (int i = 0; i < 3; i++)
        if (*mds[i]) api.memory_desc_destroy(*mds[i]);
    if (p->weights_md) api.memory_desc_destroy(p->weights_md);
    if (p->plain_md) api.memory_desc_destroy(p->plain_md);
    free(p->scratchpad);
    free(p->constants);
    Py_XDECREF(p->donor);  /* after the memories over its weights are gone */
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static int make_memories(Primitive *p, CallMemories *m) {
    memset(m, 0, sizeof(*m));
    if (api.memory_create(&m->src, p->src_md, engine, NULL) != dnnl_success ||
        api.memory_create(&m->dst, p->dst_md, engine, NULL) != dnnl_success ||
        (p->scratchpad_md && api.memory_create(&m->scratchpad, p->scratchpad_md, engine, NULL) != dnnl_success))
        return -1;
    return 0;
}

static void free_memories(CallMemories *m) {
    if (m->src) api.memory_destroy(m->src);
    if (m->dst) api.memory_destroy(m->dst);
    if (m->scratchpad) api.memory_destroy(m->scratchpad);
}

/* Primitive(weight_ptr, weight_dims, src_dims, src_strides, dst_dims, dst_strides, dst_type, weight_scales, bias,
             src_scale, src_zero_point, dst_scale, dst_zero_point, conv, eltwise, sum, share=())
   weight_dims: plain int8 weight, row-major: (O, I) for a Linear, (O, I, k...) or (G, O/G, I/G, k...) for a conv;
   weight_scales / bias: float32 bytes (bias may be None); dst_type: "u8" or "f32" (no dst scale/zero point);
   conv: None for a Linear, else (strides, dilations (oneDNN's: 0 = dense), padding_l, padding_r);
   eltwise: a tuple of (algorithm, alpha, beta), applied in order;
   sum: None or (scale, zero_point): dst += scale * (dst_before - zp);
   share: Primitives built from the same weight (other input shapes or thread counts): where oneDNN chose the layout
   of one of them, its reordered weights are used, not a copy. weight_ptr None: the weights must come from ``share``
   (the caller keeps no plain copy); LookupError where none of them has the chosen layout. */
static PyObject *Primitive_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *weight_address, *weight_dims_seq, *src_dims_seq, *src_strides_seq, *dst_dims_seq, *dst_strides_seq;
    PyObject *bias_obj, *conv, *eltwise, *sum, *share = NULL;
    const char *dst_type;
    Py_buffer weight_scales;
    float src_scale, dst_scale;
    int src_zp, dst_zp;
    if (!PyArg_ParseTuple(args, "OOOOOOsy*OfifiOO!O|O", &weight_address, &weight_dims_seq, &src_dims_seq,
                          &src_strides_seq, &dst_dims_seq, &dst_strides_seq, &dst_type, &weight_scales, &bias_obj,
                          &src_scale, &src_zp, &dst_scale, &dst_zp, &conv, &PyTuple_Type, &eltwise, &sum, &share))
        return NULL;
    if (engine == NULL) {
        PyBuffer_Release(&weight_scales);
        PyErr_SetString(PyExc_RuntimeError, "oneDNN is not loaded (call load() first)");
        return NULL;
    }
    int64_t weight_dims[DNNL_MAX_NDIMS], weight_strides[DNNL_MAX_NDIMS], src_dims[DNNL_MAX_NDIMS];
    int64_t src_strides[DNNL_MAX_NDIMS], dst_dims[DNNL_MAX_NDIMS], dst_strides[DNNL_MAX_NDIMS];
    int64_t conv_strides[DNNL_MAX_NDIMS], dilations[DNNL_MAX_NDIMS], pad_l[DNNL_MAX_NDIMS], pad_r[DNNL_MAX_NDIMS];
    Primitive *p = (Primitive *)type->tp_alloc(type, 0);
    handle_t weight_md = NULL, bias_md = NULL, attr = NULL, post_ops = NULL, pd = NULL;
    Py_buffer bias = {0};
    if (p == NULL) {
        PyBuffer_Release(&weight_scales);
        return NULL;
    }
    int weight_ndims = dims_of(weight_dims_seq, weight_dims), src_ndims = dims_of(src_dims_seq, src_dims);
    int dst_ndims = dims_of(dst_dims_seq, dst_dims);
    if (weight_ndims < 0 || src_ndims < 0 || dst_ndims < 2 || dims_of(src_strides_seq, src_strides) != src_ndims ||
        dims_of(dst_strides_seq, dst_strides) != dst_ndims) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dims and strides do not match");
        goto fail;
    }
    void *weight_data = weight_address == Py_None ? NULL : PyLong_AsVoidPtr(weight_address);
    if (PyErr_Occurred()) goto fail;
    int64_t out_channels = dst_dims[1], n_scales = (int64_t)(weight_scales.len / sizeof(float));
    if (bias_obj != Py_None && PyObject_GetBuffer(bias_obj, &bias, PyBUF_SIMPLE) < 0) goto fail;
    if ((bias.buf && bias.len != out_channels * (Py_ssize_t)sizeof(float)) ||
        (n_scales != 1 && n_scales != out_channels)) {
        PyErr_SetString(PyExc_ValueError, "bias and weight scales take one float32 per output channel (scales: or 1)");
        goto fail;
    }
    int float_dst = strcmp(dst_type, "f32") == 0;
    int has_src_zp = src_zp != 0, has_dst_zp = !float_dst && dst_zp != 0;

    /* scales (src, weights, dst) then the bias, owned by the primitive */
    p->constants = malloc(sizeof(float) * (size_t)(2 + n_scales + out_channels) + 2 * sizeof(int32_t));
    if (p->constants == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    float *c = p->constants;
    c[0] = src_scale, c[1] = dst_scale;
    memcpy(c + 2, weight_scales.buf, sizeof(float) * (size_t)n_scales);
    if (bias.buf) memcpy(c + 2 + n_scales, bias.buf, sizeof(float) * (size_t)out_channels);
    int32_t *zero_points = (int32_t *)(c + 2 + n_scales + out_channels);
    zero_points[0] = src_zp, zero_points[1] = dst_zp;

    CHECK(api.memory_desc_create_with_strides(&p->src_md, src_ndims, src_dims, dnnl_u8, src_strides), "src md");
    CHECK(api.memory_desc_create_with_strides(&p->dst_md, dst_ndims, dst_dims, float_dst ? dnnl_f32 : dnnl_u8,
                                              dst_strides), "dst md");
    int matmul = conv == Py_None;
    contiguous_strides(weight_ndims, weight_dims, weight_strides);
    if (matmul) {  /* a Linear's (O, I) weight is matmul's (K, N) = (I, O) operand, transposed */
        int64_t o = weight_dims[0], o_stride = weight_strides[0];
        weight_dims[0] = weight_dims[1], weight_strides[0] = weight_strides[1];
        weight_dims[1] = o, weight_strides[1] = o_stride;
        p->in_features = weight_dims[0];
    }
    CHECK(api.memory_desc_create_with_tag(&weight_md, weight_ndims, weight_dims, dnnl_s8, dnnl_format_tag_any),
          "weights md");
    CHECK(api.memory_desc_create_with_strides(&p->plain_md, weight_ndims, weight_dims, dnnl_s8, weight_strides),
          "plain weights md");
    if (bias.buf) {
        int64_t bias_dims[2] = {1, out_channels}, bias_strides[2] = {out_channels, 1};
        CHECK(api.memory_desc_create_with_strides(&bias_md, matmul ? 2 : 1, matmul ? bias_dims : bias_dims + 1,
                                                  dnnl_f32, matmul ? bias_strides : bias_strides + 1), "bias md");
    }
    CHECK(api.primitive_attr_create(&attr), "attr");
    CHECK(api.primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "scratchpad mode");
    int grouped = conv != Py_None && weight_ndims == src_ndims + 1;
    CHECK(api.primitive_attr_set_scales_mask(attr, DNNL_ARG_SRC, 0), "src scales");
    CHECK(api.primitive_attr_set_scales_mask(attr, DNNL_ARG_WEIGHTS, n_scales > 1 ? (matmul ? 2 : grouped ? 3 : 1) : 0),
          "weight scales");
    if (!float_dst) CHECK(api.primitive_attr_set_scales_mask(attr, DNNL_ARG_DST, 0), "dst scales");
    if (has_src_zp) CHECK(api.primitive_attr_set_zero_points_mask(attr, DNNL_ARG_SRC, 0), "src zero point");
    if (has_dst_zp) CHECK(api.primitive_attr_set_zero_points_mask(attr, DNNL_ARG_DST, 0), "dst zero point");
    CHECK(api.post_ops_create(&post_ops), "post-ops");
    if (sum != Py_None) {
        float sum_scale;
        int sum_zp;
        if (!PyArg_ParseTuple(sum, "fi", &sum_scale, &sum_zp)) goto fail;
        CHECK(api.post_ops_append_sum(post_ops, sum_scale, sum_zp, dnnl_undef_type), "sum post-op");
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(eltwise); i++) {
        int algorithm;
        float alpha, beta;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(eltwise, i), "iff", &algorithm, &alpha, &beta)) goto fail;
        CHECK(api.post_ops_append_eltwise(post_ops, algorithm, alpha, beta), "eltwise post-op");
    }
    CHECK(api.primitive_attr_set_post_ops(attr, post_ops), "set post-ops");

    if (conv != Py_None) {
        PyObject *s, *d, *l, *r;
        int spatial = src_ndims - 2;
        if (!PyArg_ParseTuple(conv, "OOOO", &s, &d, &l, &r)) goto fail;
        if (dims_of(s, conv_strides) != spatial || dims_of(d, dilations) != spatial || dims_of(l, pad_l) != spatial ||
            dims_of(r, pad_r) != spatial) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "conv geometry does not match the input");
            goto fail;
        }
        CHECK(api.convolution_forward_primitive_desc_create(&pd, engine, dnnl_forward_inference,
                                                            dnnl_convolution_direct, p->src_md, weight_md, bias_md,
                                                            p->dst_md, conv_strides, dilations, pad_l, pad_r, attr),
              "convolution descriptor");
    } else {
        CHECK(api.matmul_primitive_desc_create(&pd, engine, p->src_md, weight_md, bias_md, p->dst_md, attr),
              "matmul descriptor");
    }
    CHECK(api.primitive_create(&p->primitive, pd), "primitive");

    /* the weights, reordered once into the layout the primitive chose (with the zero-point compensation it needs) */
    chandle_t packed_md = api.primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    handle_t packed = NULL;
    CHECK(api.memory_desc_clone(&p->weights_md, packed_md), "weights md copy");
    Primitive *donor = NULL;
    PyObject *candidates = share ? PySequence_Fast(share, "share must be a sequence of Primitives") : PyTuple_New(0);
    if (candidates == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(candidates) && donor == NULL; i++) {
        PyObject *candidate = PySequence_Fast_GET_ITEM(candidates, i);
        if (PyObject_TypeCheck(candidate, &PrimitiveType) &&
            api.memory_desc_equal(((Primitive *)candidate)->weights_md, packed_md))
            donor = (Primitive *)candidate;
    }
    Py_XINCREF(donor);  /* held before the sequence (which may own the only reference) goes; dealloc releases it */
    Py_DECREF(candidates);
    p->donor = (PyObject *)donor;
    if (donor != NULL) {
        CHECK(api.memory_create(&packed, packed_md, engine, donor->weights), "shared weights memory");
        p->owned[p->n_owned++] = packed;
        p->weights = donor->weights;
    } else if (weight_data == NULL) {
        PyErr_SetString(PyExc_LookupError, "no primitive in share holds the weights in the layout chosen");
        goto fail;
    } else {
        CHECK(api.memory_create(&packed, packed_md, engine, DNNL_MEMORY_ALLOCATE), "weights memory");
        p->owned[p->n_owned++] = packed;
        CHECK(api.memory_get_data_handle(packed, &p->weights), "weights address");
        if (reorder_weights(p->plain_md, weight_data, packed_md, p->weights) < 0) goto fail;
    }

    chandle_t scratchpad_md = api.primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    size_t scratchpad_size = scratchpad_md ? api.memory_desc_get_size(scratchpad_md) : 0;
    if (scratchpad_size > 0) {
        p->scratchpad_md = vector_md((int64_t)scratchpad_size, dnnl_u8);
        p->scratchpad = malloc(scratchpad_size);
        if (p->scratchpad_md == NULL || p->scratchpad == NULL) CHECK(-1, "scratchpad");
    }
    if (make_memories(p, &p->memories) < 0) CHECK(-1, "call memories");
    p->args[p->nargs++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, packed};
    p->src_arg = p->nargs, p->args[p->nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, p->memories.src};
    p->dst_arg = p->nargs, p->args[p->nargs++] = (dnnl_exec_arg_t){DNNL_ARG_DST, p->memories.dst};
    p->scratchpad_arg = -1;
    if (p->scratchpad_md) {
        api.memory_set_data_handle(p->memories.scratchpad, p->scratchpad);
        p->scratchpad_arg = p->nargs, p->args[p->nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD,
                                                                              p->memories.scratchpad};
    }
    if (bind_constant(p, DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, 1, dnnl_f32, c) < 0 ||
        bind_constant(p, DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS, n_scales, dnnl_f32, c + 2) < 0 ||
        (!float_dst && bind_constant(p, DNNL_ARG_ATTR_SCALES | DNNL_ARG_DST, 1, dnnl_f32, c + 1) < 0) ||
        (bias.buf && bind_constant(p, DNNL_ARG_BIAS, out_channels, dnnl_f32, c + 2 + n_scales) < 0) ||
        (has_src_zp && bind_constant(p, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, 1, dnnl_s32, zero_points) < 0) ||
        (has_dst_zp && bind_constant(p, DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_DST, 1, dnnl_s32, zero_points + 1) < 0))
        goto fail;
    goto done;
fail:
    Py_CLEAR(p);
done:
    if (pd) api.primitive_desc_destroy(pd);
    if (post_ops) api.post_ops_destroy(post_ops);
    if (attr) api.primitive_attr_destroy(attr);
    if (bias_md) api.memory_desc_destroy(bias_md);
    if (weight_md) api.memory_desc_destroy(weight_md);
    if (bias.obj) PyBuffer_Release(&bias);
    PyBuffer_Release(&weight_scales);
    return (PyObject *)p;
}

/* run(src_address, dst_address): one execution. ``dst`` holds the accumulator when the primitive sums. The GIL is
   released; a call overlapping another on the same primitive (two Python threads) uses memories of its own. */
static PyObject *Primitive_run(Primitive *p, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run(src_address, dst_address)");
        return NULL;
    }
    void *src = PyLong_AsVoidPtr(args[0]), *dst = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    dnnl_status_t status;
    if (__atomic_exchange_n(&p->busy, 1, __ATOMIC_ACQUIRE) == 0) {
        api.memory_set_data_handle(p->memories.src, src);
        api.memory_set_data_handle(p->memories.dst, dst);
        Py_BEGIN_ALLOW_THREADS
        status = api.primitive_execute(p->primitive, stream, p->nargs, p->args);
        Py_END_ALLOW_THREADS
        __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
    } else {
        CallMemories own;
        dnnl_exec_arg_t call_args[16];
        void *scratchpad = p->scratchpad_md ? malloc(api.memory_desc_get_size(p->scratchpad_md)) : NULL;
        if (make_memories(p, &own) < 0 || (p->scratchpad_md && scratchpad == NULL)) {
            free_memories(&own);
            free(scratchpad);
            return PyErr_NoMemory();
        }
        memcpy(call_args, p->args, sizeof(call_args));
        api.memory_set_data_handle(own.src, src);
        api.memory_set_data_handle(own.dst, dst);
        call_args[p->src_arg].memory = own.src, call_args[p->dst_arg].memory = own.dst;
        if (p->scratchpad_arg >= 0) {
            api.memory_set_data_handle(own.scratchpad, scratchpad);
            call_args[p->scratchpad_arg].memory = own.scratchpad;
        }
        Py_BEGIN_ALLOW_THREADS
        status = api.primitive_execute(p->primitive, stream, p->nargs, call_args);
        Py_END_ALLOW_THREADS
        free_memories(&own);
        free(scratchpad);
    }
    if (status != dnnl_success) return PyErr_Format(PyExc_RuntimeError, "oneDNN execute failed (status %d)", status);
    Py_RETURN_NONE;
}

/* unpack(address, first=0, count=-1): the weights, reordered back into the plain layout they were built from,
   written at ``address``; with ``count`` >= 0 (a Linear's), only outputs ``first`` to ``first + count``, as
   (count, in_features) rows (``unpack_outputs``). */
static PyObject *Primitive_unpack(Primitive *p, PyObject *args) {
    PyObject *address;
    long long first = 0, count = -1;
    if (!PyArg_ParseTuple(args, "O|LL", &address, &first, &count)) return NULL;
    void *plain = PyLong_AsVoidPtr(address);
    if (PyErr_Occurred()) return NULL;
    if (count < 0 ? reorder_weights(p->weights_md, p->weights, p->plain_md, plain)
                  : unpack_outputs(p->weights_md, p->weights, p->in_features, first, count, plain))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef Primitive_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Primitive_run, METH_FASTCALL, "run(src_address, dst_address)"},
    {"unpack", (PyCFunction)Primitive_unpack, METH_VARARGS,
     "unpack(address, first=0, count=-1): the plain int8 weights (or some outputs' rows), written there"},
    {NULL, NULL, 0, NULL},
};

static PyObject *Primitive_weights(Primitive *p, void *closure) {
    return PyLong_FromVoidPtr(p->weights);
}

static PyObject *Primitive_weights_bytes(Primitive *p, void *closure) {
    return PyLong_FromSize_t(p->donor != NULL ? 0 : api.memory_desc_get_size(p->weights_md));
}

static PyGetSetDef Primitive_getset[] = {
    {"weights_address", (getter)Primitive_weights, NULL, "where the reordered weights are (shared or own)", NULL},
    {"weights_bytes", (getter)Primitive_weights_bytes, NULL,
     "bytes of reordered weights this primitive allocated (0: it uses another's)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PrimitiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fxquant.kernels.onednn._dnnl.Primitive",
    .tp_basicsize = sizeof(Primitive),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A oneDNN int8 convolution or matmul (a Linear), built for one input shape.",
    .tp_new = Primitive_new,
    .tp_dealloc = (destructor)Primitive_dealloc,
    .tp_methods = Primitive_methods,
    .tp_getset = Primitive_getset,
};
