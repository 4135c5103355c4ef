"""The old home of the offline converter, kept because it is a documented path: the ``zero_to_fp32.py`` script
that hf_zero wrote into every checkpoint directory before the checkpoint package existed runs
``from hf_zero.runtime.zero_to_fp32 import main``. The code is hf_zero/checkpoint/zero_to_fp32.py."""

from hf_zero.checkpoint.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                             get_fp32_state_dict_from_zero_checkpoint,
                                             load_state_dict_from_zero_checkpoint, main)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "main"]
