"""``deepspeed.env_report`` (``python -m deepspeed.env_report``, what ``ds_report`` runs): hf_zero's ``doctor``."""

import sys

from hf_zero.doctor import main  # noqa: F401  (DeepSpeed's two entry points)
from hf_zero.doctor import main as cli_main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
