"""``cancel(force=True)``: the worker is stopped, its run stack checked, and killed only if it
still runs the task (``Coordinator.kill_running``; docs/design.md section 3)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import pytest

from mpsched import Pool, TaskState, _coord_cancel
from mpsched._coord_state import WorkerHandle

from . import tasks
from .conditions import wait_until


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shown_stopped", [True, False], ids=["stop-shown", "stop-not-shown"])
def test_a_forced_cancel_spares_the_worker_that_moved_on_to_another_task(
    shown_stopped: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target ends, and its worker claims the next task, after the coordinator found the
    target on the run stack and before its SIGSTOP (held here until then). The check after the
    stop sees the target gone: the worker continues, nobody is killed. Also when the kernel does
    not show the stop within STOP_WAIT (``wait_stopped`` answering at once, as on its timeout):
    the check is still exact, since a process with a SIGSTOP pending runs no more user code
    (it stops on its next return to user mode), so its run stack cannot change after the
    signal was sent."""
    paths = {name: str(tmp_path / name) for name in ("s1", "g1", "s2", "g2")}
    for path in paths.values():
        os.mkfifo(path)
    real_send = _coord_cancel.send_signal
    sent: list[int] = []

    def move_on_first(worker: Any, sig: int) -> None:
        if sig == signal.SIGSTOP and not sent:
            tasks.open_gate(paths["g1"])  # the target returns ...
            tasks.wait_started(paths["s2"])  # ... and the worker runs the next task
        sent.append(sig)
        real_send(worker, sig)

    monkeypatch.setattr(_coord_cancel, "send_signal", move_on_first)
    if not shown_stopped:
        monkeypatch.setattr(_coord_cancel, "wait_stopped", lambda pid: True)
    with Pool(1) as pool:
        target = pool.schedule("t", 0.0, 0, tasks.started_then_gated, paths["s1"], paths["g1"], 1)
        tasks.wait_started(paths["s1"])
        innocent = pool.submit(tasks.started_then_gated, paths["s2"], paths["g2"], 2)
        # In the inbox before the cancel: the loop, held in the hook, cannot dispatch it then.
        wait_until(lambda: innocent._slot >= 0, "the next task is in the worker's inbox")
        assert pool.cancel("t", force=True) is True
        assert target.result(timeout=20) == 1  # it returned before the stop: not cancelled
        assert pool.state("t") is TaskState.COMPLETED
        tasks.open_gate(paths["g2"])
        assert innocent.result(timeout=20) == 2
        assert sent == [signal.SIGSTOP, signal.SIGCONT]
        assert pool.statistics().crashes == 0


@pytest.mark.timeout(60)
def test_a_worker_registered_without_a_pidfd_is_never_signalled_by_its_pid() -> None:
    """``pidfd_open`` fails (ProcessLookupError) only for a worker the zygote has reaped before
    the coordinator registered it; its pid may name another process by then. A forced cancel
    of a task on its run stack (the crash path has not run yet) signalled that pid: SIGSTOP,
    then SIGKILL, to whatever process now has it. Here a process of the test stands for it."""
    command = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    with subprocess.Popen(command, stdin=subprocess.PIPE) as bystander:  # ends at stdin's EOF
        worker = WorkerHandle(0, bystander.pid, cast(Connection, None), -1, bool)
        with pytest.raises(ProcessLookupError):
            _coord_cancel.send_signal(worker, signal.SIGKILL)
        assert bystander.poll() is None
