"""hf_zero.runtime"""
