"""The ``deepspeed`` console command hf-zero installs, which must never take the place of a real DeepSpeed's.

Two distributions cannot both own ``bin/deepspeed``: pip writes whichever was installed last. So the command
hf-zero installs decides at each run:

- a real DeepSpeed is installed (a ``deepspeed`` package or distribution on ``sys.path``, the same test by which
  the ``import deepspeed`` shim stands aside): run *its* launcher, ``deepspeed.launcher.runner.main`` -- exactly
  what DeepSpeed's own ``bin/deepspeed`` runs, so installing hf-zero after DeepSpeed changes nothing;
- otherwise: hf_zero's launcher (``hf_zero.launcher``, the same as ``hf-zero launch``).

Installing DeepSpeed after hf-zero overwrites the file with DeepSpeed's own script, which is also right. The one
order pip cannot get right: ``pip uninstall hf-zero`` while DeepSpeed stays removes ``bin/deepspeed`` (it is in
hf-zero's file list too); ``pip install --force-reinstall --no-deps deepspeed`` puts DeepSpeed's back, and
``python -m deepspeed.launcher.runner`` works meanwhile. ``hf-zero doctor`` reports which launcher the command runs.
``ds_report`` (hf_zero/cli.py) follows the same rule: DeepSpeed's report when DeepSpeed is installed, else
``hf-zero doctor``.
"""

from __future__ import annotations

import sys

__all__ = ["main", "real_deepspeed_installed"]


def real_deepspeed_installed() -> bool:
    from hf_zero.integrations.deepspeed_shim import real_deepspeed_installed as installed

    return installed()


def main() -> int:
    if real_deepspeed_installed():
        from deepspeed.launcher.runner import main as deepspeed_main  # the real one: the shim stands aside

        return deepspeed_main()
    from hf_zero.launcher import main as launch_main

    return launch_main(sys.argv[1:], prog="deepspeed")


if __name__ == "__main__":
    sys.exit(main())
