"""hf_zero.pipeline"""
