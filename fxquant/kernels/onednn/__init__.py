"""The ``onednn`` backend: INT8 on plain int8/uint8 tensors through torch's oneDNN ops, or fxquant's own oneDNN
primitives (:mod:`~fxquant.kernels.onednn.direct`) where the library loads."""
