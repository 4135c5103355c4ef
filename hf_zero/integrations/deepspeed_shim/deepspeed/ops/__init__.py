"""``deepspeed.ops``: the CPU optimizers accelerate swaps in for a torch optimizer when the optimizer states are
offloaded (``map_pytorch_optim_to_deepspeed``): Adam/AdamW -> ``adam``, Adagrad -> ``adagrad``, Lion -> ``lion``; and
DeepSpeed's async file I/O handle (``aio``, ``op_builder.AsyncIOBuilder``); ``__compatible_ops__``, the ops that
run here by builder name.
"""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {"__compatible_ops__": "hf_zero.integrations.compat:compatible_ops"},
         submodules=["adagrad", "adam", "aio", "lion", "op_builder"])
