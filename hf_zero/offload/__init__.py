"""hf_zero.offload"""
