"""A gloo worker still freeing a finished collective's tensors as the interpreter finalizes: the script
tests/test_exit_quiesce.py runs (docs/reliability.md, "The exit abort").

    python tests/_exit_quiesce_script.py hf_zero [--no-quiesce]
    python tests/_exit_quiesce_script.py application STORE_FILE [--no-quiesce]

A world of one on gloo, created by hf_zero (``init_distributed``, as DeepSpeed scripts and accelerate's DeepSpeed
path do) or by the application (``torch.distributed.init_process_group``, then used by hf_zero). The script issues
an all-gather of 64 MiB and drops its tensors at once, so the gloo worker that copies them frees them itself --
their Python objects first, which takes the GIL. Then the script ends.

An exit handler registered before hf_zero's (so it runs after them) holds the GIL for 1 s with a switch interval
that never hands it over. It stands in for whatever keeps the main thread from releasing the GIL between hf_zero's
exit handlers and finalization (the other exit handlers; a worker descheduled under load lands there by chance).
The worker finishes its copy meanwhile and waits for the GIL. The group is still referenced, as an engine
references it, so it is freed during teardown, which releases the GIL: the worker takes it while the interpreter
finalizes, CPython ends it with pthread_exit, and the unwind through the tensor's noexcept destructor aborts the
process ('terminate called without an active exception', SIGABRT). hf_zero's exit handlers quiesce gloo's workers
first (process_group.quiesce_gloo_workers): the worker has freed the tensors and gone back to sleep before the
handler holding the GIL starts. ``--no-quiesce`` turns that off (the control: the process aborts).
"""

from __future__ import annotations

import atexit
import sys
import time

import torch
import torch.distributed as dist

GROUP = None  # the default group, held to the end as an engine holds its group: gloo's threads outlive destroy


def _hold_the_gil() -> None:
    sys.setswitchinterval(1000.0)  # a thread waiting for the GIL never makes this one drop it
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        pass


def main() -> None:
    creator = sys.argv[1]
    atexit.register(_hold_the_gil)  # before hf_zero's handlers: runs after them

    from hf_zero.comm import context, process_group

    if "--no-quiesce" in sys.argv:
        process_group.quiesce_gloo_workers = lambda *args, **kwargs: True
    if creator == "hf_zero":
        process_group.init_distributed("gloo")
    else:  # a file store: no port to race for
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
    context.get()  # what hf_zero's first collective on the group does: its exit handler is registered
    global GROUP
    GROUP = dist.group.WORLD
    numel = 1 << 24
    out = torch.empty(numel)
    dist.all_gather_into_tensor(out, torch.ones(numel), async_op=True)  # the Work and both tensors dropped here
    del out
    print("script done", flush=True)


if __name__ == "__main__":
    main()
