"""A worker killed mid-task: only its running task fails; the pool replaces it and goes on."""

from __future__ import annotations

import os
import signal
from concurrent.futures import BrokenExecutor
from concurrent.futures.process import BrokenProcessPool

import pytest

from mpsched import Pool, WorkerCrashedError

from . import tasks
from .conditions import Fifos, wait_until


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_sigkill_of_a_worker_fails_only_its_running_task(
    tmp_path: object, start_method: str
) -> None:
    started = os.path.join(str(tmp_path), "started")
    gate = os.path.join(str(tmp_path), "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    with Pool(2, start_method=start_method) as pool:
        victim = pool.submit(tasks.report_pid_then_gate, started, gate)
        pid = tasks.read_pid(started)  # the task runs in worker `pid` and waits at the gate
        others = [pool.submit(tasks.add, i, i) for i in range(2000)]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashedError, match=r"SIGKILL\(-9\)") as info:
            victim.result()
        assert info.value.exitcode == -9
        # ProcessPoolExecutor's code catches it (there, every pending future fails so)
        assert isinstance(info.value, BrokenProcessPool)
        assert isinstance(info.value, BrokenExecutor)
        assert [f.result() for f in others] == [2 * i for i in range(2000)]  # nothing else lost
        assert pool.submit(tasks.pid_of).result() != pid
        stats = pool.statistics()
        assert stats.crashes == 1
        assert stats.respawns == 1  # a replacement was asked for: the pool keeps its size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["slot", "slab"])
@pytest.mark.parametrize("record_pid", [True, False], ids=["pid-recorded", "died-before-pid"])
def test_a_worker_dying_with_a_lock_held_stalls_nobody(which: str, record_pid: bool) -> None:
    """The lock is repaired: by its recorded dead holder's pid, or, when the worker died between
    the acquire and the pid store, as an orphan after ORPHAN_WAIT. Then the pool goes on."""
    with Pool(2) as pool:
        doomed = pool.submit(tasks.die_holding_lock, which, record_pid)
        # Submitted at once: the coordinator may be dispatching into the dead worker's inbox
        # (and so waiting for its lock) before it has even seen the death.
        futures = [pool.submit(tasks.fib, 8) for _ in range(200)]
        with pytest.raises(WorkerCrashedError, match="exit code 3"):
            doomed.result(timeout=30)
        assert [f.result(timeout=30) for f in futures] == [21] * 200
        assert pool.statistics().crashes == 1


@pytest.mark.timeout(60)
def test_a_worker_that_exits_with_code_0_mid_task_is_reported_by_its_exit_code() -> None:
    """``os._exit(0)`` in a task is a crash like any other: its message names "exit code 0",
    not a signal 0 (only a negative exit code is a signal; a mutation hunt found 0 unpinned),
    and the pool replaces the worker and goes on."""
    with Pool(1) as pool:
        with pytest.raises(WorkerCrashedError, match=r"exit code 0\b") as info:
            pool.submit(os._exit, 0).result(timeout=30)
        assert info.value.exitcode == 0
        assert "signal 0" not in str(info.value)
        assert pool.submit(tasks.add, 1, 2).result(timeout=30) == 3
        assert pool.statistics().crashes == 1


def _main_thread_blocked(pid: int) -> bool:
    """The process's main thread is blocked in a system call (state S, D or t)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "SDt"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_a_signal_caught_by_another_thread_of_a_sleeping_worker_runs_its_handler(
    fifos: Fifos,
) -> None:
    """A task leaves a raising handler and a thread that signals itself once the worker is
    asleep: the signal interrupts that thread, not the worker's main thread in ``poll``, so
    the handler (which runs in the main thread) ran only once something else woke the worker,
    here never. Likewise a signal that came just before the worker blocked in ``poll`` (its
    handler not yet run: Python runs handlers between bytecodes) waited for the next wake-up.
    The worker's wakeup fd (``signal.set_wakeup_fd``) wakes it: the handler runs, raises, and
    the worker is replaced."""
    with Pool(1) as pool:
        pid = pool.submit(tasks.raise_on_sigusr1_sent_by_a_thread, fifos.gate).result(timeout=30)
        slot = pool._coordinator.slots[0]
        wait_until(lambda: slot.is_sleeping() and _main_thread_blocked(pid), "the worker sleeps")
        tasks.open_gate(fifos.gate)
        wait_until(lambda: pool.statistics().respawns == 1, "the worker was replaced")
        assert pool.statistics().crashes == 1
        assert pool.submit(tasks.add, 1, 2).result(timeout=30) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_a_signal_handler_that_raises_between_tasks_costs_its_worker_not_the_pool(
    start_method: str,
) -> None:
    """A task leaves a handler that raises; the signal comes while its worker runs mpsched's
    code (idle here). The worker exits as if killed there and is replaced: it broke the pool
    (BrokenPoolError "worker 0 hit an internal error") for an error of user code."""
    with Pool(2, start_method=start_method) as pool:
        pid = pool.submit(tasks.raise_on_sigusr1).result(timeout=30)
        os.kill(pid, signal.SIGUSR1)
        wait_until(lambda: pool.statistics().respawns == 1, "the worker was replaced")
        assert pool.statistics().crashes == 1
        assert [
            f.result(timeout=30) for f in [pool.submit(tasks.add, i, i) for i in range(50)]
        ] == [2 * i for i in range(50)]
        assert pid not in [w.pid for w in pool.statistics().per_worker]
