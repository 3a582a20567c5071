"""fxquant/inspect"""
