"""Tasks for test_process_edges.py: tasks that fork a process which outlives them."""

from __future__ import annotations

import os
import select

import mpsched

HELPER_MAX_S = 60.0  # s; a helper exits by then in any case


def fork_helper(release: str, report: str) -> int:
    """Fork a helper that lives on after this task, until the test opens the FIFO ``release``
    (as a task that starts a background process with a bare ``os.fork()``). The helper writes
    into the file ``report`` what ``mpsched.submit`` did there. Returns the helper's pid."""
    gate = os.open(release, os.O_RDONLY | os.O_NONBLOCK)  # open before the test writes to it
    pid = os.fork()
    if pid == 0:
        try:
            try:
                mpsched.submit(abs, -1)
                outcome = "submit worked"
            except RuntimeError:
                outcome = "submit refused"
            with open(report, "w") as f:
                f.write(outcome)
            select.select([gate], [], [], HELPER_MAX_S)
        finally:
            os._exit(0)
    os.close(gate)
    return pid


def exit_worker(code: int) -> None:
    os._exit(code)
