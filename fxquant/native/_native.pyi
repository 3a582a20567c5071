# The entry points of fxquant.native._native (fxquant/native/csrc/module.c), argument for argument: a tuple per C
# struct of csrc/native.h, its fields in order (the wrappers pass the NamedTuples of the same names). Pointers are
# data_ptr() integers. tests/native/test_native_stub.py checks every signature here against module.c's PyArg_ParseTuple
# format strings. Only the typed wrappers in fxquant/native/ call these.

_Triple = tuple[int, int, int]
_Quad = tuple[int, int, int, int]

# histogram.c
_HistogramGrid = tuple[float, float, int]  # start, top, bins

# elementwise.c
_Planes = tuple[int, int, int]  # outer, channels, inner
_PlaneStrides = tuple[int, int, int]  # outer, channel, inner (elements)
_QuantizeParams = tuple[float, int, int, int]  # scale, zero_point, qmin, qmax
_ByteLevels = tuple[int, int, int]  # zero_point, qmin, qmax
_Bytes3 = tuple[int, _Triple]  # data, strides (elements)
_MulRequant = tuple[int, int, int, int, int, float, bool]  # za, zb, zo, qmin, qmax, factor, wide
_ByteRows = tuple[int, int]  # data, stride (bytes)

# pool.c
_PoolShape = tuple[int, int, int, int, int, int]  # batch, height, width, channels, out_h, out_w
_PoolWindow = tuple[int, int, int, int, int, int, int, int]  # kernel, stride, padding, dilation: (h, w) each

# amx_gemm.c, patches.c
_GemmWeights = tuple[int, int, int, int, int, int, int, int]  # w, colsum, int_bias, bias, multipliers, sizes (3)
_Requant = tuple[int, int, bool, int]  # zx, zo, relu, qmax
_ConvInput = tuple[int, tuple[int, int, int, int, int], _Quad]  # data, (N, D, H, W, C), strides (bytes)
_ConvWindow = tuple[_Triple, _Triple, _Triple]  # kernel, stride, padding
_ConvOutput = tuple[int, _Triple, _Quad]  # data, (Do, Ho, Wo), strides (bytes)
_PatchInput = tuple[int, _Triple, _Triple]  # data, (N, H, W), strides (bytes)
_PatchWeights = tuple[int, int, int, int, int, int]  # w, colsum, bias, in_channels, n_pad, out_channels
_PatchRequant = tuple[float, float, int, int]  # rcp, multiplier, zx, zo
_PatchOutput = tuple[int, _Triple]  # data, strides (bytes)

# weight_only.c: the three parts of WeightOnlyRows (int8_rows.c: Int8Rows starts with the same rows)
_FloatRows = tuple[int, int, int, int]  # x, input_scale (0: none), rows, x_stride (floats)
_Int8Weights = tuple[int, int, int, int, int, int]  # w, scale, bias (0: none), in_features, out_features, group
_FloatOut = tuple[int, int]  # out, out_stride (floats)

def set_isa_cap(level: int, /) -> None: ...
def scan_f32(x_ptr: int, n: int, grid: _HistogramGrid, counts_ptr: int, /) -> tuple[float, float, bool]: ...
def quantize_f32(x_ptr: int, out_ptr: int, shape: _Planes, params: _QuantizeParams, to_nhwc: bool,
                 /) -> None: ...
def mean_u8(x_ptr: int, out_ptr: int, shape: _Planes, strides: _PlaneStrides, levels: _ByteLevels, /) -> None: ...
def max_pool_u8(x_ptr: int, out_ptr: int, shape: _PoolShape, window: _PoolWindow, /) -> None: ...
def mul_u8(shape: _Triple, a: _Bytes3, b: _Bytes3, out: _Bytes3, requant: _MulRequant, /) -> None: ...
def lookup_u8(src_ptr: int, dst_ptr: int, n: int, table_ptr: int, /) -> None: ...
def copy_rows(src: _ByteRows, dst: _ByteRows, rows: int, width: int, /) -> None: ...
def linear_rows_onednn(x: _ByteRows, rows: int, weights: _GemmWeights,
                       requant: tuple[int, int, bool, bool, int, float], out: _ByteRows, /) -> bool: ...
def conv3x3_onednn(x: tuple[int, int, int, int, int, int, int, int], weights: tuple[int, int, int, int, int, int],
                   requant: tuple[int, int, bool, bool, int, float], sum: tuple[bool, float, int],
                   out: tuple[int, int, int], /) -> bool: ...
def dwconv3x3_onednn(x: tuple[int, int, int, int, int, int, int, int, int], weights: tuple[int, int, int, int],
                     requant: tuple[int, int, bool, bool, int, float], out: tuple[int, int, int], /) -> bool: ...
def linear_rows_u8(x: _ByteRows, rows: int, weights: _GemmWeights, requant: _Requant, out: _ByteRows, /) -> bool: ...
def conv_u8(x: _ConvInput, window: _ConvWindow, weights: _GemmWeights, requant: _Requant, out: _ConvOutput,
            /) -> bool: ...
def patches_u8(x: _PatchInput, weights: _PatchWeights, requant: _PatchRequant, out: _PatchOutput,
               kernel: tuple[int, int], /) -> bool: ...
def weight_only_f32(x: _FloatRows, weights: _Int8Weights, out: _FloatOut, /) -> None: ...
def quantize_rows_s8(x: tuple[int, int, int, int, int], q_ptr: int, scale_ptr: int, /) -> None: ...
def rescale_rows(acc: tuple[int, int, int], scales: tuple[int, int, int], out_ptr: int, /) -> None: ...
def int8_rows_f32(rows: _FloatRows, weights: tuple[int, int, int, int, int, int], out_ptr: int,
                  /) -> bool: ...
def int8_groups_f32(rows: _FloatRows, weights: tuple[int, int, int, int, int, int, int, int], out_ptr: int,
                    /) -> bool: ...

# attention.c
_Heads = tuple[int, int, int, int]  # data, batch stride, head stride, token stride (floats)

def causal_attention_f32(q: _Heads, k: _Heads, v: _Heads, out: _Heads, shape: tuple[int, int, int, int, int],
                         scale: float, /) -> bool: ...
def full_attention_f32(q: _Heads, k: _Heads, v: _Heads, out: _Heads, mask: tuple[int, int, int, int, int],
                       shape: tuple[int, int, int, int, int, int], scale: float, /) -> bool: ...

# layer_norm.c
def add_layer_norm_f32(tensors: tuple[int, int, int], shape: tuple[int, int, int], affine: tuple[int, int],
                       eps: float, /) -> None: ...
