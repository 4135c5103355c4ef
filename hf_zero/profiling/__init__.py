"""hf_zero.profiling"""
