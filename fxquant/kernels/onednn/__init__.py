"""The ``onednn`` backend: INT8 on plain int8/uint8 tensors through torch's oneDNN ops, or fxquant's own oneDNN
primitives where the library loads.

``backend`` (the Backend), ``weights`` (packed weights and their bound calls), ``calls`` (one call per input shape),
``post_ops`` (output kinds, post-ops and clamps), ``workarounds`` (the geometries torch's op gets wrong),
``max_pool`` (uint8 max-pool), ``direct`` (fxquant's primitives through the ``_dnnl`` C extension) and ``rows``
(few-row Linears on fxquant's AVX2 row loop, on CPUs without VNNI).
"""
