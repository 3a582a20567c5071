/* The entry points module_rows.c defines for module.c's method table. */
#ifndef FXQUANT_MODULE_ROWS_H
#define FXQUANT_MODULE_ROWS_H

#include <Python.h>

#include "native.h"

FXQ_INTERNAL PyObject *fxq_py_quantize_rows_s8(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_rescale_rows(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_int8_rows_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_int8_groups_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_weight_only_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_causal_attention_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_full_attention_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_add_layer_norm_f32(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_conv3x3_onednn(PyObject *self, PyObject *args);
FXQ_INTERNAL PyObject *fxq_py_dwconv3x3_onednn(PyObject *self, PyObject *args);

#endif
