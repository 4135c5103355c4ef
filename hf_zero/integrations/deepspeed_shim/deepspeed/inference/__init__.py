"""``deepspeed.inference``: DeepSpeed's InferenceEngine (``hf_zero.runtime.inference``) and its config."""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"InferenceEngine": "hf_zero.runtime.inference:InferenceEngine"},
         submodules=["config", "engine"])
