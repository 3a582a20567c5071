"""fxquant/kernels/onednn"""
