"""``deepspeed.launcher.runner``: DeepSpeed's launcher front end -> ``hf_zero.launcher`` (also as
``python -m deepspeed.launcher.runner``), and the name of the environment file multi-node runs export."""

import sys

from hf_zero.integrations.deepspeed_shim._forward import forward as _forward

_forward(__name__, {
    "DEEPSPEED_ENVIRONMENT_NAME": "hf_zero.launcher.envfile:DEEPSPEED_ENVIRONMENT_NAME",
    "main": "hf_zero.launcher:runner_main",
    "parse_args": "hf_zero.launcher:parse_args",
    "fetch_hostfile": "hf_zero.launcher.hosts:read_hostfile",
})

if __name__ == "__main__":
    from hf_zero.launcher import main as _main

    sys.exit(_main(sys.argv[1:], prog="deepspeed"))
