/* load(path): dlopen oneDNN v3 and resolve the functions fxquant calls (see dnnl_api.h). */

#include "dnnl_api.h"

DnnlApi api;
handle_t engine, stream;

#define SYMBOL(field, name) {(void **)&api.field, name}
static const struct { void **slot; const char *name; } symbols[] = {
    SYMBOL(engine_create, "dnnl_engine_create"),
    SYMBOL(stream_create, "dnnl_stream_create"),
    SYMBOL(memory_desc_create_with_strides, "dnnl_memory_desc_create_with_strides"),
    SYMBOL(memory_desc_create_with_tag, "dnnl_memory_desc_create_with_tag"),
    SYMBOL(memory_desc_destroy, "dnnl_memory_desc_destroy"),
    SYMBOL(memory_desc_clone, "dnnl_memory_desc_clone"),
    SYMBOL(memory_desc_create_submemory, "dnnl_memory_desc_create_submemory"),
    SYMBOL(memory_desc_equal, "dnnl_memory_desc_equal"),
    SYMBOL(memory_get_data_handle, "dnnl_memory_get_data_handle"),
    SYMBOL(memory_desc_get_size, "dnnl_memory_desc_get_size"),
    SYMBOL(memory_create, "dnnl_memory_create"),
    SYMBOL(memory_set_data_handle, "dnnl_memory_set_data_handle"),
    SYMBOL(memory_destroy, "dnnl_memory_destroy"),
    SYMBOL(primitive_attr_create, "dnnl_primitive_attr_create"),
    SYMBOL(primitive_attr_destroy, "dnnl_primitive_attr_destroy"),
    SYMBOL(primitive_attr_set_scratchpad_mode, "dnnl_primitive_attr_set_scratchpad_mode"),
    SYMBOL(primitive_attr_set_scales_mask, "dnnl_primitive_attr_set_scales_mask"),
    SYMBOL(primitive_attr_set_zero_points_mask, "dnnl_primitive_attr_set_zero_points_mask"),
    SYMBOL(primitive_attr_set_post_ops, "dnnl_primitive_attr_set_post_ops"),
    SYMBOL(post_ops_create, "dnnl_post_ops_create"),
    SYMBOL(post_ops_destroy, "dnnl_post_ops_destroy"),
    SYMBOL(post_ops_append_sum, "dnnl_post_ops_append_sum"),
    SYMBOL(post_ops_append_eltwise, "dnnl_post_ops_append_eltwise"),
    SYMBOL(convolution_forward_primitive_desc_create, "dnnl_convolution_forward_primitive_desc_create"),
    SYMBOL(matmul_primitive_desc_create, "dnnl_matmul_primitive_desc_create"),
    SYMBOL(reorder_primitive_desc_create, "dnnl_reorder_primitive_desc_create"),
    SYMBOL(primitive_desc_query_md, "dnnl_primitive_desc_query_md"),
    SYMBOL(primitive_desc_destroy, "dnnl_primitive_desc_destroy"),
    SYMBOL(primitive_create, "dnnl_primitive_create"),
    SYMBOL(primitive_execute, "dnnl_primitive_execute"),
    SYMBOL(primitive_destroy, "dnnl_primitive_destroy"),
    SYMBOL(version, "dnnl_version"),
};

PyObject *dnnl_load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (engine == NULL) {
        void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (library == NULL) return PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
        for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
            *symbols[i].slot = dlsym(library, symbols[i].name);
            if (*symbols[i].slot == NULL) {
                dlclose(library);
                return PyErr_Format(PyExc_OSError, "%s has no %s (not oneDNN v3?)", path, symbols[i].name);
            }
        }
        const dnnl_version_t *version = api.version();
        if (version->major != 3) {
            dlclose(library);
            return PyErr_Format(PyExc_OSError, "%s is oneDNN %d.%d; the v3 API is needed", path, version->major,
                                version->minor);
        }
        handle_t new_engine, new_stream;
        if (api.engine_create(&new_engine, dnnl_cpu, 0) != dnnl_success ||
            api.stream_create(&new_stream, new_engine, dnnl_stream_default_flags) != dnnl_success) {
            dlclose(library);
            return PyErr_Format(PyExc_OSError, "%s: no CPU engine", path);
        }
        engine = new_engine, stream = new_stream;  /* the library stays loaded for the process */
    }
    const dnnl_version_t *version = api.version();
    return Py_BuildValue("(iii)", version->major, version->minor, version->patch);
}
