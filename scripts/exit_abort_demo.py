"""The mechanism behind 'terminate called without an active exception' at exit, in isolation (docs/reliability.md).

A daemon Python thread is inside a TCPStore call -- C++, the GIL released -- when the interpreter finalizes, and the
call returns then (here: the store's server, in this process, goes away). Taking the GIL back, the thread is ended
with pthread_exit; the forced unwind meets a noexcept C++ frame and std::terminate aborts the process (exit 134).
Python 3.11 and torch 2.13 abort on every run. hf_zero therefore joins every thread of its own that calls the store
(the fault monitors, comm/faults.py FaultChannel.close) before the interpreter finalizes.

    python scripts/exit_abort_demo.py          # prints 'main done', then aborts: exit status 134
    python scripts/exit_abort_demo.py --join   # the thread stopped and joined first: exit status 0
"""

import datetime
import sys
import threading
import time

import torch.distributed as dist

server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
client.set_timeout(datetime.timedelta(seconds=0.3))
stop = threading.Event()


def poll() -> None:
    while not stop.is_set():
        try:
            client.get("never-set")  # blocks in C++ until the timeout, then raises
        except Exception:  # the timeout: poll again
            pass


thread = threading.Thread(target=poll, daemon=True)
thread.start()
time.sleep(0.2)
if "--join" in sys.argv:
    stop.set()
    thread.join()
print("main done", flush=True)
