"""Timed tasks: options and policies combined with cancel, shutdown, timeouts and crashes.

The cases here mix two features each (a timeout and ``state()``, a recurrence and a shutdown
setting, a misfire and the take-back of an inbox): each test checks that the future, ``state()``
and the side effects (tasks write to FIFOs and O_APPEND logs) tell the same story. Ordering is
by FIFO gates and conditions of the pool polled in a bounded loop, never by sleeping.
"""

from __future__ import annotations

import contextlib
import fractions
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import psutil
import pytest

import mpsched
from mpsched import Pool, TaskState
from mpsched._coordinator import Coordinator
from mpsched._payloads import BlockField
from mpsched._protocol import TopState
from mpsched._shm_deque import SlotQueues

from . import bad_tasks as bt
from . import tasks
from . import timed_tasks as tt
from .conditions import (
    CONDITION_TIMEOUT,
    GATE_RELEASE_WAIT,
    Fifos,
    start_every_worker,
    wait_until,
    wait_until_known,
)


# ---------------------------------------------------------------- timeouts and state()
@pytest.mark.timeout(60)
def test_state_of_a_task_that_timed_out_cooperatively_is_failed(fifos: Fifos) -> None:
    """The future fails with TimeoutError: ``state()`` must say FAILED, not CANCELLED (no cancel
    was asked for; the task ran out of time)."""
    with Pool(1) as pool:
        f = pool.with_options(timeout=0.05).schedule(
            "slow", 0.0, 0, tt.wait_for_cancel, fifos.started, False, timed=True
        )
        tasks.wait_started(fifos.started)
        with pytest.raises(FuturesTimeoutError):
            f.result(timeout=CONDITION_TIMEOUT)
        assert pool.state("slow") is TaskState.FAILED


@pytest.mark.timeout(60)
def test_recurrence_whose_run_times_out_ends_with_timeout_error(fifos: Fifos) -> None:
    """A run that acknowledges its timeout's cooperative cancel ran out of time: as for a
    one-shot task, that is a TimeoutError, and the recurrence ends with it (a run's error ends
    a recurrence), not as if it had been cancelled."""
    with Pool(1) as pool:
        rec = pool.with_options(every=30.0, timeout=0.05).schedule(
            "r", 0.0, 0, tt.wait_for_cancel, fifos.started, False, timed=True
        )
        tasks.wait_started(fifos.started)
        wait([rec], timeout=CONDITION_TIMEOUT)
        assert not rec.cancelled(), "a timed-out run ended its recurrence as cancelled"
        with pytest.raises(FuturesTimeoutError):
            rec.result(timeout=0)
        assert pool.state("r") is TaskState.FAILED


# ---------------------------------------------------------------- misfire
# s; a run that starts later than this after its due time misfires. Long enough for a run that
# must be on time (handed out, claimed) on a loaded 2-core CI machine: with 50 ms, the
# coordinator's release or a woken worker's claim came later there at times (a misfire the test
# did not ask for). A test waits out twice this for a run to be late (1 s).
MISFIRE_GRACE = 0.5


@pytest.mark.timeout(60)
def test_misfire_of_a_run_taken_back_from_an_inbox_frees_its_block(
    fifos: Fifos, caplog: pytest.LogCaptureFixture
) -> None:
    """A recurring run waits in the inbox of the busy worker until it is late; a higher
    priority task then takes it back to the ready queue, where the misfire policy drops it.
    It held a slab block (it had been injected): dropping it must free that block, or the pool
    counts it in flight for ever (the drain finds it "lost" at shutdown)."""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        wait_until_known(pool)  # (a run due before could misfire, unhanded)
        due = time.monotonic()
        rec = pool.with_options(every=600.0, misfire="skip", misfire_grace=MISFIRE_GRACE).schedule(
            "m", due, 0, tt.log, fifos.log, "m"
        )
        wait_until(lambda: pool.statistics().per_worker[0].inbox_depth == 1, "the run is injected")
        # Lateness is the subject here: wait for the clock, not for an event.
        wait_until(lambda: time.monotonic() > due + 2 * MISFIRE_GRACE, "the run is late")
        high = pool.schedule("high", 0.0, 1, tasks.ident, "high")
        wait_until(lambda: pool.statistics().misfires == 1, "the late run is skipped")
        assert pool.statistics().pending == 0  # it left the ready queue: not counted there
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        assert high.result(timeout=CONDITION_TIMEOUT) == "high"
        assert pool.cancel("m") is True
        assert rec.cancelled()
        assert pool.submit(tasks.ident, 1).result(timeout=CONDITION_TIMEOUT) == 1
        with caplog.at_level(logging.WARNING, logger="mpsched"):
            pool.shutdown(wait=True)
    assert tt.read_tags(fifos.log) == []
    lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert not lost, f"the skipped run stayed in flight: {lost}"


class _CallsThePool(logging.Handler):
    """On a misfire's warning: what a user's handler may do, ask the pool about the id and
    cancel it."""

    def __init__(self, pool: Pool, fails: bool) -> None:
        super().__init__(logging.WARNING)
        self.pool = pool
        self.fails = fails
        self.seen: list[Any] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "missed its run" in record.getMessage():
            self.seen.append((self.pool.state("m"), self.pool.cancel("m")))
            if self.fails:  # a handler's own error: it broke the pool (a diff review)
                raise ValueError("the handler failed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("where", ["taken back", "dropped by its worker"])
def test_a_logging_handler_may_call_the_pool_on_a_misfires_warning(
    fifos: Fifos, where: str, fails: bool
) -> None:
    """The warning was logged under the coordinator's lock, in the coordinator thread: a
    handler that called ``pool.state`` or ``pool.cancel`` waited for ever for the lock its own
    thread held, and the pool stopped (found by a hunt)."""
    with Pool(1) as pool:
        handler = _CallsThePool(pool, fails)
        logger = logging.getLogger("mpsched")
        logger.addHandler(handler)
        try:
            blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
            try:
                tasks.wait_started(fifos.started)
                wait_until_known(pool)
                due = time.monotonic()
                grace = MISFIRE_GRACE if where == "taken back" else 0.0
                options = pool.with_options(every=600.0, misfire="skip", misfire_grace=grace)
                rec = options.schedule("m", due, 0, tt.log, fifos.log, "m")
                wait_until(
                    lambda: pool.statistics().per_worker[0].inbox_depth == 1, "it is injected"
                )
                # Lateness is the subject here: wait for the clock, not for an event.
                wait_until(lambda: time.monotonic() > due + 2 * grace, "the run is late")
                if where == "taken back":  # by a higher task: the dispatch drops it
                    high = pool.schedule("high", 0.0, 1, tasks.ident, "high")
                    wait_until(lambda: pool.statistics().misfires == 1, "the run is skipped")
            finally:
                tasks.open_gate(fifos.gate)
            assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
            wait_until(lambda: bool(handler.seen), "the handler ran")
            assert handler.seen == [(TaskState.PENDING, True)]  # the next run was pending
            assert rec.cancelled()
            if where == "taken back":
                assert high.result(timeout=CONDITION_TIMEOUT) == "high"
            assert pool.submit(tasks.ident, 1).result(timeout=CONDITION_TIMEOUT) == 1
        finally:
            logger.removeHandler(handler)
    assert tt.read_tags(fifos.log) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace", [MISFIRE_GRACE, 0.0])
@pytest.mark.parametrize("policy", ["skip", "run_late"])
def test_a_run_that_waits_past_its_grace_in_a_busy_workers_inbox_misfires(
    fifos: Fifos, policy: str, grace: float
) -> None:
    """The run is handed on time to the inbox of the busy worker (with a grace of 0: in the
    first dispatch after it came due, which is no misfire) and waits there, past its grace,
    behind the task that holds the worker: under "skip" the worker drops it unstarted
    (counted, and the recurrence goes on from the next grid time); under "run_late" it runs
    late. (Judged only as a run left the ready queue, it ran late under "skip" too.)"""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        try:
            tasks.wait_started(fifos.started)
            # Registered too: the worker starts with the first task, and a run due before the
            # coordinator knew of it could not be handed out in the first dispatch (a misfire).
            wait_until_known(pool)
            due = time.monotonic()
            options = pool.with_options(every=0.05, misfire=policy, misfire_grace=grace)
            rec = options.schedule("m", due, 0, tt.log_version, fifos.log)
            wait_until(
                lambda: pool.statistics().per_worker[0].inbox_depth == 1, "the run is injected"
            )
            assert pool.statistics().misfires == 0  # handed out on time
            # Lateness is the subject here: wait for the clock, not for an event.
            wait_until(lambda: time.monotonic() > due + 2 * grace, "the run is late")
        finally:
            tasks.open_gate(fifos.gate)  # a failure above must not leave the exit waiting on it
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        wait_until(lambda: tt.count_records(fifos.log) >= 2, "two runs ran")
        assert pool.cancel("m") is True
        assert rec.cancelled()
        misfires = pool.statistics().misfires
    stats = pool.statistics()  # the final counters
    # A dropped run is no run: the worker counted it executed (found in review).
    assert sum(w.executed for w in stats.per_worker) == stats.completed
    versions = tt.read_tags(fifos.log)
    if policy == "skip":
        # The late run is dropped; so may be a next one, if its worker came to it late too (a
        # worker off the CPU between two runs claims the next one past its grace).
        assert misfires >= 1
        assert 1 not in versions, f"the late run ran: {versions}"
    else:
        assert misfires == 0
        assert versions[0] == 1
        assert tt.read_starts(fifos.log)[0] > due + 2 * grace  # it ran, late


@pytest.mark.timeout(60)
def test_a_run_dropped_as_a_misfire_does_not_count_towards_max_tasks_per_worker(
    fifos: Fifos,
) -> None:
    """``max_tasks_per_worker`` counts the tasks that ran: a recurring run that the worker
    drops unstarted under "skip" is none, so the worker that ran one task before it runs a
    second one after it (counted, it retired one task early)."""
    with Pool(1, max_tasks_per_worker=2) as pool:
        blocker = pool.submit(tasks.report_pid_then_gate, fifos.started, fifos.gate)
        try:
            pid = tasks.read_pid(fifos.started)
            wait_until_known(pool)
            due = time.monotonic()
            options = pool.with_options(every=600.0, misfire="skip", misfire_grace=MISFIRE_GRACE)
            rec = options.schedule("m", due, 0, tt.log_version, fifos.log)
            wait_until(
                lambda: pool.statistics().per_worker[0].inbox_depth == 1, "the run is injected"
            )
            # Lateness is the subject here: wait for the clock, not for an event.
            wait_until(lambda: time.monotonic() > due + 2 * MISFIRE_GRACE, "the run is late")
        finally:
            tasks.open_gate(fifos.gate)  # a failure above must not leave the exit waiting on it
        assert blocker.result(timeout=CONDITION_TIMEOUT) == pid
        wait_until(lambda: pool.statistics().misfires == 1, "the late run is dropped")
        assert pool.submit(tasks.pid_of).result(timeout=CONDITION_TIMEOUT) == pid
        assert pool.cancel("m") is True
        assert rec.cancelled()
    assert tt.read_tags(fifos.log) == []


# ---------------------------------------------------------------- shutdown settings
@pytest.mark.timeout(60)
def test_recurrence_kept_after_shutdown_survives_timed_after_shutdown_false(
    tmp_path: Path,
) -> None:
    """``timed_after_shutdown=False`` cancels one-shot versions; a recurrence kept by
    ``recurring_after_shutdown=True`` goes on (its next run, waiting in the timetable at the
    shutdown, is not a one-shot version), until it is cancelled."""
    log = str(tmp_path / "log")
    pool = Pool(1, timed_after_shutdown=False, recurring_after_shutdown=True)
    try:
        once = pool.schedule("once", time.monotonic() + 600, 0, tasks.ident, 1)
        rec = pool.with_options(every=0.01).schedule(
            "r", time.monotonic() + 600, 0, tt.log, log, "r"
        )
        pool.shutdown(wait=False)
        assert once.cancelled()
        assert not rec.done(), "the kept recurrence lost its next run at the shutdown"
        assert pool.state("r") is TaskState.PENDING
    finally:
        pool.cancel("r")
        assert pool.await_termination(timeout=CONDITION_TIMEOUT)
    assert rec.cancelled()


@pytest.mark.timeout(60)
def test_shutdown_cancel_futures_ends_a_recurrence_kept_after_shutdown(tmp_path: Path) -> None:
    """``cancel_futures=True`` cancels every task not started; a recurrence kept after shutdown
    has nothing running, so it ends: its future must not stay pending after the pool ended."""
    log = str(tmp_path / "log")
    pool = Pool(1, recurring_after_shutdown=True)
    rec = pool.with_options(every=30.0).schedule("r", time.monotonic() + 600, 0, tt.log, log, "r")
    pool.shutdown(wait=True, cancel_futures=True)
    assert rec.cancelled(), "the recurrence's future was lost (never settled)"
    assert pool.state("r") is TaskState.CANCELLED
    assert tt.read_tags(log) == []


# ---------------------------------------------------------------- aging
def stop_worker(pool: Pool) -> int:
    """SIGSTOP the only worker of ``pool`` while it sleeps (blocked in poll, holding no lock):
    tasks injected meanwhile stay unclaimed in its inbox until ``os.kill(pid, SIGCONT)``.
    A first task brings the worker up (under forkserver it waits for one)."""
    assert pool.submit(int, 7).result(timeout=CONDITION_TIMEOUT) == 7
    pid = wait_until_known(pool)
    slot = pool._views.slots[0]
    wait_until(slot.is_sleeping, "the worker sleeps")
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, "it is stopped")
    return pid


@pytest.mark.timeout(60)
def test_aging_keeps_priority_order_for_a_task_dispatched_to_an_idle_pool(tmp_path: Path) -> None:
    """A task submitted to an idle pool goes straight to an inbox. Taken back there by a higher
    priority task, it waits in the ready queue like any other: aging counts from when it was
    submitted (a moment ago), so it must not jump ahead of the higher priority."""
    log = str(tmp_path / "log")
    with Pool(1, aging=600.0, dispatch_window=1) as pool:
        pid = stop_worker(pool)
        try:
            low = pool.submit(tt.log, log, "low")
            assert pool.statistics().per_worker[0].inbox_depth == 1  # injected directly
            high = pool.schedule("high", 0.0, 1, tt.log, log, "high")
            # Two more loop passes (each releases its nudge, ages the ready queue, then
            # dispatches): an aging pass has run while "low" waited in the ready queue.
            for name in ("nudge1", "nudge2"):
                pool.schedule(name, 0.0, 0, tt.log, log, name)
                wait_until(lambda: pool.statistics().scheduled == 0, f"{name} is released")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait([low, high], timeout=CONDITION_TIMEOUT)
        wait_until(lambda: len(tt.read_tags(log)) == 4, "every task ran")
    assert tt.read_tags(log) == ["high", "low", "nudge1", "nudge2"]


# ---------------------------------------------------------------- retries
def _runs_after_killing_the_first(f: mpsched.Future, fifos: Fifos) -> int:
    """SIGKILL the worker of the one ``log_pid_then_gate`` run logged so far; once ``f`` ended
    or ran again, the number of runs (a rerun is let through its gate, so that the pool can
    shut down)."""
    [(_, pid)] = tt.read_tags(fifos.log)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: f.done() or len(tt.read_tags(fifos.log)) > 1, "it ends or reruns")
    runs = len(tt.read_tags(fifos.log))
    if runs > 1:
        tasks.open_gate(fifos.gate)
    return runs


@pytest.mark.timeout(60)
def test_a_task_asked_to_cancel_is_not_retried_when_its_worker_dies(fifos: Fifos) -> None:
    """``pool.cancel(id)`` asked the running task to stop (True); its worker then dies. The
    retries option runs a task again after a crash, but this one was asked to stop: it must not
    start again. It ends as a crash with no retries left does (it did not acknowledge)."""
    with Pool(1) as pool:
        f = pool.with_options(retries=1).schedule(
            "r", 0.0, 0, tt.log_pid_then_gate, fifos.log, "r", fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the task runs")
        assert pool.cancel("r") is True
        runs = _runs_after_killing_the_first(f, fifos)
        if runs > 1:
            wait([f], timeout=CONDITION_TIMEOUT)
        assert runs == 1, "the task asked to cancel started again after its worker died"
        with pytest.raises(mpsched.WorkerCrashedError):
            f.result(timeout=0)
        assert pool.state("r") is TaskState.FAILED
        assert pool.statistics().retried == 0


@pytest.mark.timeout(60)
def test_a_task_is_not_retried_after_shutdown_cancelled_the_unstarted(fifos: Fifos) -> None:
    """``shutdown(cancel_futures=True)`` cancels every task not yet started; a retry is a new
    start of a task whose run crashed, so a worker dying after that call must not start its task
    again (it ran once the drain had cancelled what was queued). It ends as a crash."""
    pool = Pool(1)
    try:
        f = pool.with_options(retries=1).submit(tt.log_pid_then_gate, fifos.log, "r", fifos.gate)
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the task runs")
        pool.shutdown(wait=False, cancel_futures=True)
        runs = _runs_after_killing_the_first(f, fifos)
        assert pool.await_termination(timeout=CONDITION_TIMEOUT)
        assert runs == 1, "a retry started after shutdown(cancel_futures=True)"
        with pytest.raises(mpsched.WorkerCrashedError):
            f.result(timeout=0)
        assert pool.statistics().retried == 0
    finally:
        pool.shutdown(wait=True)


GRACE = 5.0  # s; far longer than the test takes to kill the worker once asked to stop


@pytest.mark.timeout(60)
def test_a_task_whose_timeout_expired_is_not_retried_when_its_worker_dies(fifos: Fifos) -> None:
    """The timeout asked the task to stop; its worker dies before the grace period ends. It ran
    out of time: TimeoutError, not a second run (and not a second timeout period)."""
    with Pool(1) as pool:
        f = pool.with_options(retries=1, timeout=0.05, timeout_grace=GRACE).submit(
            tt.log_pid_until_asked_then_gate, fifos.log, fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 2, "the timeout asked it to stop")
        pid = tt.read_tags(fifos.log)[0][1]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: f.done() or len(tt.read_tags(fifos.log)) > 2, "it ends or reruns")
        runs = [tag for tag, _ in tt.read_tags(fifos.log)].count("run")
        wait([f], timeout=CONDITION_TIMEOUT)  # a rerun would be killed at the end of its grace
        assert runs == 1, "the timed-out task started again after its worker died"
        with pytest.raises(FuturesTimeoutError):
            f.result(timeout=0)
        assert pool.statistics().retried == 0


# ---------------------------------------------------------------- a broken pool
@pytest.mark.timeout(60)
def test_state_after_the_pool_broke_agrees_with_the_futures(fifos: Fifos) -> None:
    """The pool breaks (its initializer fails) with a version handed out to the starting
    worker, one waiting for its run_at and a recurrence: each future fails with
    BrokenPoolError, and ``state()`` must say FAILED for each id, also once the pool is shut
    down (its shared memory released), and ``cancel`` finds nothing left to cancel."""
    pool = Pool(1, initializer=tt.gated_failing_initializer, initargs=(fifos.gate,))
    try:
        try:
            due = pool.schedule("due", 0.0, 0, tasks.ident, 1)
            later = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 2)
            rec = pool.with_options(every=600.0).schedule(
                "rec", time.monotonic() + 600, 0, tasks.ident, 3
            )
            assert pool.state("due") is TaskState.PENDING
        finally:
            tasks.open_gate(fifos.gate)
        for f in (due, later, rec):
            with pytest.raises(mpsched.BrokenPoolError):
                f.result(timeout=CONDITION_TIMEOUT)
        states = {task_id: pool.state(task_id) for task_id in ("due", "later", "rec")}
        assert states == dict.fromkeys(("due", "later", "rec"), TaskState.FAILED)
    finally:
        pool.shutdown(wait=True)
    for task_id in ("due", "later", "rec"):
        assert pool.state(task_id) is TaskState.FAILED
        assert pool.cancel(task_id) is False


# ---------------------------------------------------------------- bad input
def test_a_run_at_too_large_for_a_float_is_a_value_error() -> None:
    """An int or Fraction beyond the float range is an infinite time: ValueError at the call,
    as for ``math.inf`` (the documented errors are TypeError and ValueError, not
    OverflowError), and nothing is scheduled."""
    with Pool(1) as pool:
        for run_at in (10**400, -(10**400), fractions.Fraction(10**400, 3)):
            with pytest.raises(ValueError, match="finite"):
                pool.schedule("huge", run_at, 0, tasks.ident, 1)
            with pytest.raises(ValueError, match="finite"):
                pool.with_options(every=1.0).schedule("huge", run_at, 0, tasks.ident, 1)
        assert pool.statistics().scheduled == 0
        assert pool.state("huge") is None


# ---------------------------------------------------------------- results
@pytest.mark.timeout(60)
def test_state_of_a_task_whose_result_cannot_be_unpickled_is_failed() -> None:
    """The task returned, but its result cannot be unpickled in the pool's process: the future
    fails (RuntimeError), so ``state()`` must say FAILED, not COMPLETED."""
    with Pool(1) as pool:
        f = pool.schedule("u", 0.0, 0, bt.return_instance, bt.ErrorAtUnpickle)
        with pytest.raises(RuntimeError, match="could not be unpickled"):
            f.result(timeout=CONDITION_TIMEOUT)
        assert pool.state("u") is TaskState.FAILED
        g = pool.schedule("ok", 0.0, 0, tasks.ident, 7)
        assert g.result(timeout=CONDITION_TIMEOUT) == 7
        assert pool.state("ok") is TaskState.COMPLETED


# ---------------------------------------------------------------- forced cancel
@pytest.mark.timeout(60)
def test_forced_cancel_of_a_task_whose_worker_dies_meanwhile_keeps_the_pool(fifos: Fifos) -> None:
    """``cancel(force=True)`` sets the task's cancel flag, then stops and kills its worker; this
    task ends its worker itself as soon as it sees the flag, so the kill meets a process that
    is exiting or already reaped. The pool must go on (the task ends cancelled or crashed)."""
    with Pool(1) as pool:
        f = pool.schedule("x", 0.0, 0, tt.exit_when_asked, fifos.started)
        tasks.wait_started(fifos.started)
        assert pool.cancel("x", force=True) is True
        wait([f], timeout=CONDITION_TIMEOUT)
        assert f.cancelled() or isinstance(f.exception(), mpsched.WorkerCrashedError)
        assert pool.submit(tasks.ident, 1).result(timeout=CONDITION_TIMEOUT) == 1


@pytest.mark.timeout(60)
def test_a_retried_run_goes_running_again_and_completes(fifos: Fifos) -> None:
    """A task with retries whose worker is killed runs again (in the replacement): ``state()``
    says RUNNING for that run too, and the future and ``state()`` end COMPLETED."""
    with Pool(1) as pool:
        f = pool.with_options(retries=1).schedule(
            "r", 0.0, 0, tt.log_pid_then_gate, fifos.log, "r", fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the first run runs")
        assert pool.state("r") is TaskState.RUNNING
        [(_, first_pid)] = tt.read_tags(fifos.log)
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 2, "the retry runs")
        assert pool.state("r") is TaskState.RUNNING
        assert not f.done()
        tasks.open_gate(fifos.gate)
        second_pid = f.result(timeout=CONDITION_TIMEOUT)
        assert second_pid != first_pid
        assert pool.state("r") is TaskState.COMPLETED
        assert pool.statistics().retried == 1


@pytest.mark.timeout(60)
def test_a_retry_waiting_for_its_claim_stays_running(fifos: Fifos) -> None:
    """From its worker's death until the retry's claim, a retried version said PENDING: a
    state went back (RUNNING, PENDING, RUNNING), against TaskState's rule. Read in the
    coordinator thread right after the recovery put the retry back in the ready queue: that
    thread has not dispatched it yet, so no worker can have claimed it."""
    with Pool(1) as pool:
        coordinator = pool._coordinator
        seen: list[TaskState | None] = []
        recover_slot = coordinator.recover_slot

        def read_state_after_recovery(*args: Any) -> None:
            recover_slot(*args)
            seen.append(coordinator.state("r"))

        coordinator.recover_slot = read_state_after_recovery  # type: ignore[method-assign]
        f = pool.with_options(retries=1).schedule(
            "r", 0.0, 0, tt.log_pid_then_gate, fifos.log, "r", fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the first run runs")
        [(_, first_pid)] = tt.read_tags(fifos.log)
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 2, "the retry runs")
        assert seen == [TaskState.RUNNING]
        tasks.open_gate(fifos.gate)
        assert f.result(timeout=CONDITION_TIMEOUT) != first_pid
        assert pool.state("r") is TaskState.COMPLETED


@pytest.mark.timeout(60)
def test_a_settled_task_with_retries_keeps_no_copy_of_its_arguments() -> None:
    """A task with retries keeps its pickled call in its future, to run it again if its worker
    dies; once it ended (completed, or failed with no retry left) nothing can run it again, yet
    the future kept the call, arguments of any size, for as long as the caller kept it."""
    big = bytes(400_000)  # stashed: the coordinator's copy is another one
    with Pool(1) as pool:
        ok = pool.with_options(retries=1).submit(len, big)
        failed = pool.with_options(retries=1).submit(tasks.add, big, 1)  # TypeError
        scheduled = pool.with_options(retries=1).schedule("r", 0.0, 0, len, big)
        assert ok.result(timeout=CONDITION_TIMEOUT) == len(big)
        assert scheduled.result(timeout=CONDITION_TIMEOUT) == len(big)
        assert failed.exception(timeout=CONDITION_TIMEOUT) is not None
        assert [f._payload for f in (ok, failed, scheduled)] == [b"", b"", b""]


@pytest.mark.timeout(60)
def test_a_recurrence_kept_after_shutdown_runs_until_its_future_is_cancelled(
    tmp_path: Path,
) -> None:
    """``recurring_after_shutdown=True``: the recurrence goes on after ``shutdown``, the drain
    waits for it, and ``future.cancel()`` stops it and lets the pool end."""
    log = str(tmp_path / "log")
    pool = Pool(1, recurring_after_shutdown=True)
    rec = pool.with_options(every=0.005).schedule("r", 0.0, 0, tt.log, log, "r")
    try:
        wait_until(lambda: len(tt.read_tags(log)) >= 1, "a first run")
        pool.shutdown(wait=False)
        n = len(tt.read_tags(log))
        wait_until(lambda: len(tt.read_tags(log)) >= n + 2, "runs go on after the shutdown")
        assert not pool.await_termination(timeout=0)
    finally:
        assert rec.cancel()
        assert pool.await_termination(timeout=CONDITION_TIMEOUT)
    n = len(tt.read_tags(log))
    assert rec.cancelled()
    assert pool.state("r") in (TaskState.CANCELLED, TaskState.COMPLETED)
    assert len(tt.read_tags(log)) == n


# ---------------------------------------------------------------- retries of recurring runs
@pytest.mark.timeout(60)
def test_a_retried_run_of_a_superseded_recurrence_keeps_the_new_schedule(fifos: Fifos) -> None:
    """A recurring run (retries=1, misfire "skip") runs; the id is scheduled again (a new
    recurrence, its first run deferred behind the running one); the run's worker dies once the
    run is later than its misfire grace. The retry started on time, so it is no misfire: it
    runs again. (Dropped as a misfire, it continued the recurrence that the new schedule had
    replaced: that next run superseded the new schedule's version, which never ran.)"""
    with Pool(1) as pool:
        start_every_worker(pool)  # the worker's start is no part of the first run's grace
        due = time.monotonic()
        old = pool.with_options(
            every=600.0, retries=1, misfire="skip", misfire_grace=MISFIRE_GRACE
        ).schedule("r", due, 0, tt.log_pid_then_gate, fifos.log, "old", fifos.gate)
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the first run runs")
        new = pool.with_options(every=600.0).schedule(
            "r", time.monotonic(), 0, tt.log, fifos.log, "new"
        )
        assert old.cancelled()
        # Lateness is the subject here: wait for the clock, not for an event.
        wait_until(lambda: time.monotonic() > due + 2 * MISFIRE_GRACE, "the run is late")
        [(_, pid)] = tt.read_tags(fifos.log)
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: len(tt.read_tags(fifos.log)) == 2 or pool.statistics().misfires > 0,
            "the retry runs or is dropped",
        )
        assert pool.statistics().misfires == 0, "the retry was dropped as a misfire"
        tasks.open_gate(fifos.gate)
        wait_until(lambda: "new" in tt.read_tags(fifos.log), "the new schedule runs")
        assert not new.done()
        assert pool.cancel("r") is True
        assert new.cancelled()
    assert [t if t == "new" else t[0] for t in tt.read_tags(fifos.log)] == ["old", "old", "new"]
    assert pool.statistics().retried == 1


@contextlib.contextmanager
def _pool_gating_replacements(tmp_path: Path) -> Iterator[tuple[Pool, str, str]]:
    """A one-worker pool whose replacement workers wait in their initializer on the gate
    (a fifo) once the marker file exists: (pool, marker, gate)."""
    marker = str(tmp_path / "replacing")
    init_gate = str(tmp_path / "init")
    os.mkfifo(init_gate)
    with Pool(1, initializer=tt.gate_replacements, initargs=(marker, init_gate)) as pool:
        yield pool, marker, init_gate


@contextlib.contextmanager
def _gates_released_on_failure(*gates: str) -> Iterator[None]:
    """A failing body leaves no task waiting at ``gates`` (the replacement's initializer, a
    retry that ran), so that the pool's exit ends and the test fails rather than hangs."""
    try:
        yield
    except BaseException:
        for gate in gates:
            tasks.open_gate_within(gate, GATE_RELEASE_WAIT)
        raise


def _kill_the_run_and_hold_its_retry(pool: Pool, fifos: Fifos, marker: str) -> None:
    """SIGKILL the worker running the one logged run; its retry then waits, unclaimed, in the
    inbox of the replacement, whose initializer (``tt.gate_replacements``) sees ``marker`` and
    waits on its gate."""
    open(marker, "w").close()
    [(_, pid)] = tt.read_tags(fifos.log)
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: pool.statistics().per_worker[0].inbox_depth == 1,
        "the retry waits in the replacement's inbox",
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["future_cancel", "pool_cancel", "supersede"])
def test_a_retry_not_yet_claimed_is_cancelled_and_never_runs(
    fifos: Fifos, tmp_path: Path, how: str
) -> None:
    """What the docstrings of ``Future.cancel``, ``TaskOptions.retries``, ``TaskState`` and
    ``Pool.schedule`` say: the retry of a run whose worker died is not claimed until it starts,
    so a cancel (the future's, or ``pool.cancel`` by id) or a supersede (the id scheduled
    again) then wins, the retry never runs, and the state goes from RUNNING to CANCELLED; a
    superseding version runs. The retry is held unclaimed in the inbox of the replacement,
    whose initializer waits on a gate."""
    with (
        _pool_gating_replacements(tmp_path) as (pool, marker, init_gate),
        _gates_released_on_failure(init_gate, fifos.gate),
    ):
        f = pool.with_options(retries=1).schedule(
            "r", 0.0, 0, tt.log_pid_then_gate, fifos.log, "r", fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "the first run runs")
        _kill_the_run_and_hold_its_retry(pool, fifos, marker)
        assert pool.state("r") is TaskState.RUNNING
        if how == "supersede":
            new = pool.schedule("r", 0.0, 0, tt.log, fifos.log, "new")
            assert f.cancelled()
        else:
            assert (pool.cancel("r") if how == "pool_cancel" else f.cancel()) is True
            assert f.cancelled()
            assert pool.state("r") is TaskState.CANCELLED
        tasks.open_gate(init_gate)
        assert pool.submit(tasks.ident, 1).result(timeout=CONDITION_TIMEOUT) == 1
        if how == "supersede":
            assert new.result(timeout=CONDITION_TIMEOUT) > 0
    tags = [t if t == "new" else t[0] for t in tt.read_tags(fifos.log)]
    assert tags == (["r", "new"] if how == "supersede" else ["r"]), "the cancelled retry ran"
    assert pool.statistics().retried == 1


@pytest.mark.timeout(60)
def test_future_cancel_of_a_retry_lets_the_deferred_version_run(
    fifos: Fifos, tmp_path: Path
) -> None:
    """Version 1 of an id (retries=1) runs; version 2 is scheduled, so it waits behind the
    running one; the worker dies and the retry of version 1 waits, unclaimed, in the
    replacement's inbox, where ``Future.cancel()`` withdraws it. That ends version 1, and
    version 2 may start: it must run (its due time was not handed to the loop, which never
    released it: its future never settled and the shutdown waited for it for ever)."""
    with (
        _pool_gating_replacements(tmp_path) as (pool, marker, init_gate),
        _gates_released_on_failure(init_gate, fifos.gate),
    ):
        v1 = pool.with_options(retries=1).schedule(
            "x", 0.0, 0, tt.log_pid_then_gate, fifos.log, "v1", fifos.gate
        )
        wait_until(lambda: len(tt.read_tags(fifos.log)) == 1, "version 1 runs")
        v2 = pool.schedule("x", 0.0, 0, tt.log, fifos.log, "v2")
        wait_until(lambda: pool.statistics().scheduled == 1, "version 2 waits behind it")
        _kill_the_run_and_hold_its_retry(pool, fifos, marker)
        assert pool.statistics().retried == 1
        assert v1.cancel() is True
        tasks.open_gate(init_gate)
        assert v2.result(timeout=CONDITION_TIMEOUT) > 0
        assert pool.state("x") is TaskState.COMPLETED
    assert [t if t == "v2" else t[0] for t in tt.read_tags(fifos.log)] == ["v1", "v2"]


class PollWatch:
    """Stands for the coordinator's epoll: notes when the loop goes to sleep with no timeout
    and no wake-up pending (it then sleeps until someone writes the wakeup pipe)."""

    def __init__(self, epoll: Any, wakeup_fd: int) -> None:
        self.epoll = epoll
        self.wakeup_fd = wakeup_fd
        self.armed = threading.Event()
        self.asleep = threading.Event()

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        pending = select.select([self.wakeup_fd], [], [], 0)[0]
        if self.armed.is_set() and timeout == -1 and not pending:
            self.asleep.set()
        result: list[tuple[int, int]] = self.epoll.poll(timeout)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.epoll, name)


@pytest.mark.timeout(60)
def test_a_recurrence_collected_by_a_user_thread_wakes_the_loop_for_its_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user thread collects results (``result()``'s help_wait) and settles a recurring run;
    it wakes the loop, then schedules the next run. The loop may run its pass, find nothing due
    and go to sleep with no timeout in between: the next run's due time must wake it (it was
    only noted, and the recurrence stopped until something else woke the loop)."""
    log = str(tmp_path / "log")
    loop_collects = threading.Event()
    loop_collects.set()
    real_collect = Coordinator.collect
    real_end_runs = Coordinator.end_runs
    real_end_recurring_run = Coordinator.end_recurring_run

    def collect(self: Coordinator) -> None:  # the loop leaves the run to the user thread
        if loop_collects.is_set() or threading.get_ident() != self.thread_id:
            real_collect(self)

    def end_runs(self: Coordinator, outcomes: Any) -> None:
        real_end_runs(self, outcomes)
        if threading.get_ident() != self.thread_id:
            watch.armed.set()  # from here on, a sleep with no timeout is the one in question

    def end_recurring_run(self: Coordinator, future: Any, status: int, data: bytes) -> None:
        if threading.get_ident() != self.thread_id:
            assert watch.asleep.wait(CONDITION_TIMEOUT), "the loop did not go to sleep"
        real_end_recurring_run(self, future, status, data)

    monkeypatch.setattr(Coordinator, "collect", collect)
    monkeypatch.setattr(Coordinator, "end_runs", end_runs)
    monkeypatch.setattr(Coordinator, "end_recurring_run", end_recurring_run)
    with Pool(1) as pool:
        coordinator = pool._coordinator
        watch = PollWatch(coordinator.epoll, coordinator.wakeup_fd)
        coordinator.epoll = watch  # type: ignore[assignment]
        loop_collects.clear()
        rec = pool.with_options(every=0.01).schedule("r", time.monotonic(), 0, tt.log, log, "r")
        slot = pool._views.slots[0]
        wait_until(lambda: slot.done_depth() == 1, "the first run's result waits in the ring")
        coordinator.collect()  # as a user thread's help_wait does
        loop_collects.set()
        wait_until(lambda: len(tt.read_tags(log)) >= 2, "the next run runs")
        assert pool.cancel("r") is True
        assert rec.cancelled()


# ---------------------------------------------------------------- a recurrence due in the past
@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", ["coalesce", "skip"])
def test_a_recurrence_scheduled_in_the_past_starts_its_grid_at_once(
    fifos: Fifos, overlap: str
) -> None:
    """``run_at`` in the past means due at once (``Pool.schedule``). For a recurrence, the due
    times between that ``run_at`` and the call did not pass "while its previous run was still
    going" (the overlap policy's subject): the grid starts at the call. (From ``run_at=0.0``,
    the first run ended with days of grid times behind it: "coalesce" ran once more at once,
    "skip" counted them all as skipped, "queue" ran each of them back to back.)"""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        rec = pool.with_options(every=600.0, overlap=overlap).schedule(
            "r", 0.0, 0, tt.log, fifos.log, "r"
        )
        # Due at once after "r" (a later run_at): it starts after the first run ended, and
        # settles after that run was collected and the next one scheduled.
        after = pool.schedule("after", time.monotonic(), 0, tt.log, fifos.log, "after")
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        after.result(timeout=CONDITION_TIMEOUT)
        assert pool.statistics().skipped_runs == 0
        assert pool.cancel("r") is True
        assert rec.cancelled()
    assert tt.read_tags(fifos.log) == ["r", "after"]


@pytest.mark.timeout(60)
def test_a_recurrence_scheduled_in_the_past_is_no_misfire(tmp_path: Path) -> None:
    """A recurrence due at once (``run_at`` in the past) with the misfire policy "skip": its
    first run starts within its grace of the call, so it runs (it was dropped as a misfire,
    late by all the time since ``run_at``)."""
    log = str(tmp_path / "log")
    with Pool(1) as pool:
        rec = pool.with_options(every=600.0, misfire="skip", misfire_grace=10.0).schedule(
            "m", 0.0, 0, tt.log, log, "m"
        )
        wait_until(
            lambda: tt.read_tags(log) or pool.statistics().misfires, "the first run runs or not"
        )
        assert pool.statistics().misfires == 0
        assert tt.read_tags(log) == ["m"]
        assert pool.cancel("m") is True
        assert rec.cancelled()


@pytest.mark.timeout(60)
def test_a_zero_misfire_grace_skips_no_run_of_an_idle_pool(tmp_path: Path) -> None:
    """``misfire_grace=0`` (accepted: not negative) on an idle pool: every run is handed to a
    worker in the first dispatch after it came due, so none is a misfire. The coordinator's
    own wake-up after the due time counted as lateness: every run was skipped, with a warning
    each, and none ever ran."""
    log = str(tmp_path / "log")
    with Pool(2) as pool:
        # Its workers up first: a run due before any could take it waited for one (a misfire).
        start_every_worker(pool)
        coordinator = pool._coordinator
        wait_until(lambda: all(w is not None for w in coordinator.workers), "the workers are up")
        options = pool.with_options(every=0.02, misfire="skip", misfire_grace=0.0)
        rec = options.schedule("z", time.monotonic(), 0, tt.log, log, "z")
        wait_until(
            lambda: len(tt.read_tags(log)) >= 3 or pool.statistics().misfires, "three runs or not"
        )
        assert pool.cancel("z") is True
        assert rec.cancelled()
        assert pool.statistics().misfires == 0
        assert len(tt.read_tags(log)) >= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", ["coalesce", "queue"])
def test_a_catch_up_run_is_judged_from_when_it_could_start(tmp_path: Path, overlap: str) -> None:
    """The first run outlasts a grid time by more than the grace; the catch-up run that
    "coalesce" or "queue" makes is due at that past grid time, but could not start before the
    first run ended: its grace counts from then (it was dropped as a misfire, on an idle pool).
    """
    log = str(tmp_path / "log")
    with Pool(2) as pool:
        options = pool.with_options(every=1.0, overlap=overlap, misfire="skip", misfire_grace=0.5)
        rec = options.schedule("r", time.monotonic(), 0, tt.recurring_run, log, 1.6, 2)
        with pytest.raises(LookupError, match="run 2 ends the recurrence"):
            rec.result(timeout=CONDITION_TIMEOUT)
        assert pool.statistics().misfires == 0
        assert [version for version, _ in tt.read_tags(log)] == [1, 2]


# ---------------------------------------------------------------- cancel requests
class SlabHook:
    """Stands for the coordinator's slab: calls ``before_flag()`` before the cancel flag is
    written into a block (``apply_requests``), once armed."""

    def __init__(self, slab: Any, before_flag: Any) -> None:
        self.slab = slab
        self.before_flag = before_flag
        self.armed = False

    def set_word(self, index: int, field: int, value: int) -> None:
        if self.armed and field == BlockField.STATE and value == TopState.CANCEL_REQUESTED:
            self.armed = False
            self.before_flag()
        self.slab.set_word(index, field, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.slab, name)


@pytest.mark.timeout(60)
def test_a_cancel_request_never_flags_the_next_task_of_a_reused_block(
    fifos: Fifos, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pool.cancel(id)`` of a version that has just finished (its result not collected yet)
    queues a request; the loop checks that the version is still in flight, then writes the
    flag into its block. A user thread's collection (``result()``'s help_wait) may free that
    block in between, and a submit to the idle pool may put a new task into it at once: the
    flag must not reach that task, which nobody asked to cancel (nor may a forced request kill
    its worker). The hook lets a collector run there whenever nothing excludes it
    (``collect_lock`` is free), as a user thread's can."""
    loop_collects = threading.Event()
    loop_collects.set()
    real_collect = Coordinator.collect

    def collect(self: Coordinator) -> None:  # the loop leaves the result to the user thread
        if loop_collects.is_set() or threading.get_ident() != self.thread_id:
            real_collect(self)

    monkeypatch.setattr(Coordinator, "collect", collect)
    with Pool(1) as pool:
        coordinator = pool._coordinator
        later: list[mpsched.Future] = []

        def collect_and_submit() -> None:  # a user thread: collect, then submit to the idle pool
            coordinator.collect()
            later.append(pool.submit(tt.gated_cancel_flag, fifos.gate))

        def before_flag() -> None:
            if coordinator.collect_lock.acquire(blocking=False):  # nothing excludes a collector
                coordinator.collect_lock.release()
                user = threading.Thread(target=collect_and_submit)
                user.start()
                user.join()

        hook = SlabHook(coordinator.slab, before_flag)
        coordinator.slab = hook  # type: ignore[assignment]
        loop_collects.clear()
        done = pool.schedule("x", 0.0, 0, tasks.ident, "x")
        slot = pool._views.slots[0]
        wait_until(lambda: slot.done_depth() == 1, "the version's result waits in the ring")
        hook.armed = True
        assert pool.cancel("x") is True  # it runs, as far as the pool knows: asked to stop
        wait_until(lambda: not hook.armed, "the loop applied the request")
        loop_collects.set()
        assert done.result(timeout=CONDITION_TIMEOUT) == "x"
        if not later:  # the collector was excluded: the next task comes now
            later.append(pool.submit(tt.gated_cancel_flag, fifos.gate))
        tasks.open_gate(fifos.gate)
        assert later[0].result(timeout=CONDITION_TIMEOUT) is False, "a stale request flagged it"
        assert pool.state("x") is TaskState.COMPLETED


# ---------------------------------------------------------------- statistics
@pytest.mark.timeout(60)
def test_pending_does_not_count_cancelled_tasks(fifos: Fifos) -> None:
    """``statistics().pending`` counts the due tasks not yet handed to a worker. A cancelled
    one will never be: it must not count, also while the worker is busy and nothing is taken
    from the ready queue (cancelled tasks stayed counted there until a dispatch popped them)."""
    with Pool(1, dispatch_window=1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        try:
            tasks.wait_started(fifos.started)
            wait_until_known(pool)
            injected = pool.submit(tasks.ident, "injected")  # the window of one: in the inbox
            queued = [pool.submit(tasks.ident, i) for i in range(3)]
            due = [pool.schedule(i, 0.0, 0, tasks.ident, i) for i in range(3)]
            # (the release from the heap and the dispatch are two holds of the lock)
            wait_until(
                lambda: (
                    pool.statistics().scheduled == 0
                    and pool.statistics().per_worker[0].inbox_depth == 1
                ),
                "the timed ones are due and the first submit is injected",
            )
            assert pool.statistics().pending == 6
            assert all(f.cancel() for f in queued)
            assert pool.cancel(0) is True
            assert pool.statistics().pending == 2
            assert pool.cancel(1) is True
            assert pool.cancel(2) is True
            assert pool.statistics().pending == 0
            # A higher priority takes the injected one back to the ready queue, with its block.
            high = pool.schedule("high", 0.0, 1, tasks.ident, "high")
            wait_until(
                lambda: injected._slot < 0 and pool.statistics().pending == 1,
                "the injected one is taken back",
            )
            assert injected.cancel() is True
            assert pool.statistics().pending == 0
        finally:
            tasks.open_gate(fifos.gate)  # a failure above must not leave the exit waiting on it
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        assert high.result(timeout=CONDITION_TIMEOUT) == "high"
        assert pool.statistics().pending == 0
    assert all(f.cancelled() for f in [injected, *queued, *due])


# ---------------------------------------------------------------- tasks lost by an interrupt
def interrupt_next_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next tombstone of an inbox entry is followed by a KeyboardInterrupt (a Ctrl-C in the
    cancelling thread), before the coordinator's bookkeeping: the task is left in ``by_handle``
    but in no ring, for the drain to find lost (``cancel_lost``)."""
    real = SlotQueues.cancel_injected
    pending = [True]

    def cancel_then_interrupt(self: SlotQueues, handle: int) -> bool:
        done = real(self, handle)
        if pending:
            pending.clear()
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(SlotQueues, "cancel_injected", cancel_then_interrupt)


@pytest.mark.timeout(60)
def test_a_version_deferred_behind_one_lost_by_an_interrupt_runs_at_shutdown(
    fifos: Fifos, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel interrupted after its tombstone leaves the id's version handed out: the next
    schedule of the id, taking it for a running one, defers its version behind it. The drain's
    ``cancel_lost`` ends the lost one: the deferred one enters the heap, and the loop must learn
    its due time (else it never ran and the drain waited for it for ever)."""
    pool = Pool(1)
    try:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        lost = pool.schedule("x", 0.0, 0, tasks.ident, 1)
        wait_until(lambda: pool.statistics().per_worker[0].inbox_depth == 1, "it is injected")
        interrupt_next_cancel(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            pool.cancel("x")
        deferred = pool.schedule("x", 0.0, 0, tasks.ident, 2)
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        pool.shutdown(wait=False)
        assert pool.await_termination(timeout=5.0), "the drain waited for the deferred version"
        assert lost.cancelled()
        assert deferred.result(timeout=0) == 2
        assert pool.state("x") is TaskState.COMPLETED
    finally:
        pool.cancel("x")  # lets a drain stuck on the deferred version end (before the fix)
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_a_taken_back_task_cancelled_as_lost_is_counted_withdrawn(
    fifos: Fifos, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task taken back from an inbox (a higher priority came) waits in the ready queue with
    its block, in ``by_handle``; if it cannot be injected again (the tasks in flight, here one
    lost by an interrupt, fill ``max_inflight``), the drain's ``cancel_lost`` cancels it there.
    The ready queue must count it withdrawn, as ``withdraw`` does, or ``pending`` is off by one
    once the loop pops it (the count went negative)."""
    pool = Pool(1)
    try:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        lost = pool.submit(tasks.ident, "lost")
        wait_until(lambda: pool.statistics().per_worker[0].inbox_depth == 1, "lost is injected")
        interrupt_next_cancel(monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            lost.cancel()
        taken_back = pool.submit(tasks.ident, "taken back")
        wait_until(lambda: pool.statistics().per_worker[0].inbox_depth == 2, "it is injected")
        # Stands for a pool whose max_inflight lost tasks fill: blocker, lost and taken_back
        # are in flight, and none can be injected until two of them end.
        pool._coordinator.max_inflight = 2
        high = pool.schedule("high", 0.0, 1, tasks.ident, "high")
        wait_until(lambda: pool.statistics().pending == 2, "taken_back is taken back")
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        pool.shutdown(wait=True)
        assert lost.cancelled()
        assert taken_back.cancelled()
        assert high.result(timeout=0) == "high"
        assert pool.statistics().pending == 0
    finally:
        pool.shutdown(wait=True)
