"""The ``fbgemm`` and ``qnnpack`` backends: torch's quantized engines on its (deprecated) quantized dtypes, with
fxquant's C loops where they compute the same results faster."""
