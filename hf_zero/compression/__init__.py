"""hf_zero.compression"""
