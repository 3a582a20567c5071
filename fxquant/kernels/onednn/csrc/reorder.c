/* reorder_weights: a layer's int8 weights copied from one oneDNN layout into another (plain -> the layout a
   primitive chose, when it is built; back to plain, for Primitive.unpack); unpack_outputs: some of a Linear's. */

#include "dnnl_api.h"

int reorder_weights(chandle_t src_md, void *src, chandle_t dst_md, void *dst) {
    handle_t from = NULL, to = NULL, pd = NULL, reorder = NULL;
    dnnl_status_t status = api.memory_create(&from, src_md, engine, src);
    if (status == dnnl_success) status = api.memory_create(&to, dst_md, engine, dst);
    if (status == dnnl_success) status = api.reorder_primitive_desc_create(&pd, src_md, engine, dst_md, engine, NULL);
    if (status == dnnl_success) status = api.primitive_create(&reorder, pd);
    if (status == dnnl_success) {
        dnnl_exec_arg_t args[2] = {{DNNL_ARG_SRC, from}, {DNNL_ARG_DST, to}};
        Py_BEGIN_ALLOW_THREADS
        status = api.primitive_execute(reorder, stream, 2, args);
        Py_END_ALLOW_THREADS
    }
    if (reorder) api.primitive_destroy(reorder);
    if (pd) api.primitive_desc_destroy(pd);
    if (to) api.memory_destroy(to);
    if (from) api.memory_destroy(from);
    if (status != dnnl_success) {
        PyErr_Format(PyExc_RuntimeError, "oneDNN weights reorder failed (status %d)", (int)status);
        return -1;
    }
    return 0;
}

int unpack_outputs(chandle_t weights_md, void *weights, int64_t in_features, int64_t first, int64_t count,
                   void *rows) {
    if (in_features == 0) {
        PyErr_SetString(PyExc_ValueError, "a range of outputs is unpacked from a Linear's weights only");
        return -1;
    }
    /* matmul's (K, N) operand: outputs are its columns; the rows come out as (count, K): strides (1, K) */
    int64_t dims[2] = {in_features, count}, offsets[2] = {0, first}, strides[2] = {1, in_features};
    handle_t range_md = NULL, rows_md = NULL;
    int result = -1;
    if (api.memory_desc_create_submemory(&range_md, weights_md, dims, offsets) != dnnl_success)
        PyErr_Format(PyExc_RuntimeError, "oneDNN takes no range of %lld outputs from %lld here", (long long)count,
                     (long long)first);
    else if (api.memory_desc_create_with_strides(&rows_md, 2, dims, dnnl_s8, strides) != dnnl_success)
        PyErr_SetString(PyExc_RuntimeError, "oneDNN memory_desc_create failed");
    else
        result = reorder_weights(range_md, weights, rows_md, rows);
    if (rows_md) api.memory_desc_destroy(rows_md);
    if (range_md) api.memory_desc_destroy(range_md);
    return result;
}
