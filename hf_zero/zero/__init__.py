"""hf_zero.zero"""
