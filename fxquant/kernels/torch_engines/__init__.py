"""The ``fbgemm`` and ``qnnpack`` backends: torch's quantized engines on its (deprecated) quantized dtypes, with
fxquant's C loops where they compute the same results.

``backends`` (the two Backends), ``engine`` (the engine switch and the quantized-dtype tensors, the one module that
touches them), ``amx_conv`` (the C-loop convs and Linears: layout and dispatch), ``transposed`` (transposed convs
around fbgemm's broken kernel, and the upsampler loop) and ``onednn_bridge`` (fbgemm's float-output Linears on oneDNN).
"""
