"""fxquant/runtime"""
