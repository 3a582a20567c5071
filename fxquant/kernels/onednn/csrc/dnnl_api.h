/* oneDNN int8 convolution and matmul primitives called directly, built once per layer and input shape.

Why: torch 2.13's plain-tensor ops (onednn::qconv_pointwise, qlinear_pointwise) rebuild the primitive descriptor,
the scale and zero-point memories and the scratchpad on every call, which at batch 1 costs about as much as the
kernel itself (docs/backends.md). Here all of that is built once (``Primitive(...)``) and a call sets two data
pointers and executes.

Files: dnnl_api.h (the declarations), loader.c (dlopen and the function table), primitive.c (the Primitive type),
reorder.c (weights from one layout into another), module.c (the module).

The library is not linked: ``load(path)`` dlopens the libdnnl.so.3 of the ``onednn-cpu-gomp`` wheel and resolves the
functions below, so fxquant builds and runs without it (the onednn backend then calls the torch ops). That library
needs ``libgomp.so.1``, the soname of torch's own OpenMP runtime: loaded after torch, both share one thread pool and
``torch.set_num_threads`` governs oneDNN's threads too (fxquant/kernels/onednn/direct.py checks).

The declarations are oneDNN's v3 C API (dnnl.h, Apache-2.0), reduced to what is used; the enum values are the same
in oneDNN 3.2 and 3.12 (checked against both headers) and the v3 ABI is stable within the major version.
*/
#ifndef FXQUANT_DNNL_API_H
#define FXQUANT_DNNL_API_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DNNL_MAX_NDIMS 12
#define dnnl_success 0
#define dnnl_undef_type 0
#define dnnl_f32 3
#define dnnl_s32 4
#define dnnl_s8 5
#define dnnl_u8 6
#define dnnl_format_tag_any 1
#define dnnl_forward_inference 96
#define dnnl_convolution_direct 1
#define dnnl_query_weights_md 131
#define dnnl_query_scratchpad_md 136
#define dnnl_scratchpad_mode_user 1
#define dnnl_cpu 1
#define dnnl_stream_default_flags 1
#define DNNL_ARG_SRC 1
#define DNNL_ARG_DST 17
#define DNNL_ARG_WEIGHTS 33
#define DNNL_ARG_BIAS 41
#define DNNL_ARG_SCRATCHPAD 80
#define DNNL_ARG_ATTR_SCALES 4096
#define DNNL_ARG_ATTR_ZERO_POINTS 8192
#define DNNL_MEMORY_ALLOCATE ((void *)(size_t)-1)

typedef int dnnl_status_t;
typedef void *handle_t;
typedef const void *chandle_t;
typedef struct { int arg; handle_t memory; } dnnl_exec_arg_t;
typedef struct { int major, minor, patch; const char *hash; unsigned cpu_runtime, gpu_runtime; } dnnl_version_t;

typedef struct {
    dnnl_status_t (*engine_create)(handle_t *, int, size_t);
    dnnl_status_t (*stream_create)(handle_t *, handle_t, unsigned);
    dnnl_status_t (*memory_desc_create_with_strides)(handle_t *, int, const int64_t *, int, const int64_t *);
    dnnl_status_t (*memory_desc_create_with_tag)(handle_t *, int, const int64_t *, int, int);
    dnnl_status_t (*memory_desc_destroy)(handle_t);
    dnnl_status_t (*memory_desc_clone)(handle_t *, chandle_t);
    dnnl_status_t (*memory_desc_create_submemory)(handle_t *, chandle_t, const int64_t *, const int64_t *);
    int (*memory_desc_equal)(chandle_t, chandle_t);
    dnnl_status_t (*memory_get_data_handle)(chandle_t, void **);
    size_t (*memory_desc_get_size)(chandle_t);
    dnnl_status_t (*memory_create)(handle_t *, chandle_t, handle_t, void *);
    dnnl_status_t (*memory_set_data_handle)(handle_t, void *);
    dnnl_status_t (*memory_destroy)(handle_t);
    dnnl_status_t (*primitive_attr_create)(handle_t *);
    dnnl_status_t (*primitive_attr_destroy)(handle_t);
    dnnl_status_t (*primitive_attr_set_scratchpad_mode)(handle_t, int);
    dnnl_status_t (*primitive_attr_set_scales_mask)(handle_t, int, int);
    dnnl_status_t (*primitive_attr_set_zero_points_mask)(handle_t, int, int);
    dnnl_status_t (*primitive_attr_set_post_ops)(handle_t, chandle_t);
    dnnl_status_t (*post_ops_create)(handle_t *);
    dnnl_status_t (*post_ops_destroy)(handle_t);
    dnnl_status_t (*post_ops_append_sum)(handle_t, float, int32_t, int);
    dnnl_status_t (*post_ops_append_eltwise)(handle_t, int, float, float);
    dnnl_status_t (*convolution_forward_primitive_desc_create)(handle_t *, handle_t, int, int, chandle_t, chandle_t,
                                                              chandle_t, chandle_t, const int64_t *, const int64_t *,
                                                              const int64_t *, const int64_t *, chandle_t);
    dnnl_status_t (*matmul_primitive_desc_create)(handle_t *, handle_t, chandle_t, chandle_t, chandle_t, chandle_t,
                                                 chandle_t);
    dnnl_status_t (*reorder_primitive_desc_create)(handle_t *, chandle_t, handle_t, chandle_t, handle_t, chandle_t);
    chandle_t (*primitive_desc_query_md)(chandle_t, int, int);
    dnnl_status_t (*primitive_desc_destroy)(handle_t);
    dnnl_status_t (*primitive_create)(handle_t *, chandle_t);
    dnnl_status_t (*primitive_execute)(chandle_t, handle_t, int, const dnnl_exec_arg_t *);
    dnnl_status_t (*primitive_destroy)(handle_t);
    const dnnl_version_t *(*version)(void);
} DnnlApi;

#define HIDDEN __attribute__((visibility("hidden")))
extern HIDDEN DnnlApi api;              /* resolved by load() (loader.c) */
extern HIDDEN handle_t engine, stream;  /* NULL until load() succeeds */
extern HIDDEN PyTypeObject PrimitiveType;
HIDDEN PyObject *dnnl_load(PyObject *self, PyObject *args);
/* the weights at ``src`` (layout ``src_md``) written at ``dst`` in layout ``dst_md``; -1 with a Python error */
HIDDEN int reorder_weights(chandle_t src_md, void *src, chandle_t dst_md, void *dst);
/* a Linear's outputs ``first`` to ``first + count`` of the weights in layout ``weights_md`` (matmul's (K, N)), written
   at ``rows`` as (count, in_features) int8: oneDNN takes such a range only where it starts and ends on its blocks of
   outputs (-1 with a RuntimeError otherwise) */
HIDDEN int unpack_outputs(chandle_t weights_md, void *weights, int64_t in_features, int64_t first, int64_t count,
                          void *rows);

#endif
