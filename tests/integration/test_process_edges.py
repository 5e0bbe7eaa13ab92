"""How the pool behaves inside the user's process and the processes its tasks make: a task
that forks a process outliving it (a bare ``os.fork()``, as daemons and some libraries do)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import time

import psutil
import pytest

from mpsched import Pool, WorkerCrashedError

from . import proc_tasks, tasks
from .conditions import wait_until

TIMEOUT = 20.0  # s; bound of every wait that must succeed
SOON = 5.0  # s; what the pool may take to notice a death or end, far below the helper's life


def _release(fifo: str, helper: int | None) -> None:
    """Let the helper go (it waits on the FIFO) and wait until it has exited: after its
    worker died it is no child of ours, so the leak check would not see it."""
    with contextlib.suppress(OSError):
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"x")
        os.close(fd)
    if helper is not None:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(helper).wait(TIMEOUT)


@pytest.mark.timeout(60)
def test_a_worker_death_is_seen_while_a_process_its_task_forked_lives(
    tmp_path: pathlib.Path,
) -> None:
    """The coordinator learns of a worker's death by EOF on the worker's socket. A process
    forked by a task inherited the worker's end of it, so a worker that died after such a task
    was noticed only once that process exited (never, for a daemon): the dead worker's task
    did not fail, its slot was not replaced and the shutdown waited the drain's timeout. The
    forked process is no worker either: ``mpsched.submit`` refuses to run there."""
    release, report = str(tmp_path / "release"), tmp_path / "report"
    os.mkfifo(release)
    helper = None
    pool = Pool(1)
    try:
        helper = pool.submit(proc_tasks.fork_helper, release, str(report)).result(TIMEOUT)
        with pytest.raises(WorkerCrashedError, match=r"exit code 3\b"):
            pool.submit(proc_tasks.exit_worker, 3).result(SOON)
        assert pool.submit(tasks.ident, 7).result(SOON) == 7  # the replacement runs it
        assert psutil.pid_exists(helper), "the helper should still be alive here"
        wait_until(lambda: report.exists() and report.read_text() != "", "the helper reported")
        assert report.read_text() == "submit refused"
        started = time.monotonic()
        pool.shutdown()
        assert time.monotonic() - started < SOON, "the shutdown waited for the helper"
    finally:
        _release(release, helper)
        pool.shutdown()
