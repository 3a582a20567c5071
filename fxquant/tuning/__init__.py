"""fxquant/tuning"""
