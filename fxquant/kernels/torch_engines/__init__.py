"""fxquant/kernels/torch_engines"""
