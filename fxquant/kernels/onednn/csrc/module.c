/* The fxquant.kernels.onednn._dnnl module: load() and the Primitive type. */

#include "dnnl_api.h"

static PyMethodDef module_methods[] = {
    {"load", dnnl_load, METH_VARARGS, "load(path) -> (major, minor, patch): dlopen oneDNN v3 and create an engine"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dnnl", "Direct oneDNN int8 primitives.", -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__dnnl(void) {
    if (PyType_Ready(&PrimitiveType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PrimitiveType);
    if (PyModule_AddObject(m, "Primitive", (PyObject *)&PrimitiveType) < 0) {
        Py_DECREF(&PrimitiveType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
