"""hf_zero.ops"""
