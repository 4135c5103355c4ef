"""hf_zero.integrations"""
