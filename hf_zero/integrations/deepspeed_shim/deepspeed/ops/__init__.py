"""``deepspeed.ops``: the CPU optimizers accelerate swaps in for a torch optimizer when the optimizer states are
offloaded (``map_pytorch_optim_to_deepspeed``): Adam/AdamW -> ``adam``, Adagrad -> ``adagrad``, Lion -> ``lion``; and
DeepSpeed's async file I/O handle (``aio``, ``op_builder.AsyncIOBuilder``).
"""

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, submodules=["adagrad", "adam", "aio", "lion", "op_builder"])
