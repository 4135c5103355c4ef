"""``python -m hf_zero COMMAND``: same as the ``hf-zero`` console script."""

import sys

from hf_zero.cli import main

sys.exit(main())
