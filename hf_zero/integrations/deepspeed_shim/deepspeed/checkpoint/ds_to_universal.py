"""``python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT``: a universal checkpoint of
an hf_zero or DeepSpeed tag -> ``hf_zero.checkpoint.to_universal`` (no DeepSpeed installation needed)."""

import sys

from hf_zero.checkpoint.to_universal import main, parse_arguments  # noqa: F401  (DeepSpeed's two entry points)

if __name__ == "__main__":
    sys.exit(main(parse_arguments()))
