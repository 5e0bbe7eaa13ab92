"""Rules of timed tasks that only a mutation hunt showed unpinned: each test here failed with a
mutant of the coordinator that the rest of the suite let through.

Ordering between a due timed task and a plain submit, what a timeout does to a task that
returns within its grace or that the caller waits for without ``result()``, the full timeout
of each retry, the misfire grace of a run claimed behind other work and of a catch-up run,
the state of a handed version with options, and the counts of ``statistics()``. Ordering comes
from FIFO gates; where lateness is the subject, the test waits for the clock.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from concurrent.futures import TimeoutError as FuturesTimeoutError
from pathlib import Path

import pytest

from mpsched import Pool, TaskState

from . import tasks
from . import timed_tasks as tt
from .conditions import (
    CONDITION_TIMEOUT,
    GATE_RELEASE_WAIT,
    Fifos,
    start_every_worker,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def _inbox_depth(pool: Pool) -> int:
    return pool.statistics().per_worker[0].inbox_depth


def test_a_timed_task_due_before_a_submit_starts_before_it(tmp_path: Path) -> None:
    """README: among due tasks, the one that became due first starts first. A submit to an
    idle pool went straight to the worker, ahead of a timed task already due at the call
    (still in the heap, for the loop to release)."""
    log = str(tmp_path / "log")
    with Pool(1) as pool:
        start_every_worker(pool)
        for i in range(10):
            timed = pool.schedule(("t", i), time.monotonic() - 0.001, 0, tt.log, log, ("t", i))
            plain = pool.submit(tt.log, log, ("p", i))
            plain.result(timeout=CONDITION_TIMEOUT)
            timed.result(timeout=CONDITION_TIMEOUT)
    tags = tt.read_tags(log)
    assert tags == [tag for i in range(10) for tag in (("t", i), ("p", i))]


def test_a_timeout_fires_while_the_caller_waits_without_result(fifos: Fifos) -> None:
    """The timeout of a task submitted to an idle pool is armed by the loop, which the submit
    must wake: a caller that waits with ``concurrent.futures.wait`` (not ``result()``, whose
    own collection woke it) saw the task run its whole length."""
    with Pool(1) as pool:
        start_every_worker(pool)
        f = pool.with_options(timeout=0.2).submit(tt.spin_checking_cancel, 25.0, True)
        done, _ = concurrent.futures.wait([f], timeout=CONDITION_TIMEOUT)
        assert done == {f}
        assert isinstance(f.exception(), FuturesTimeoutError)


@pytest.mark.parametrize("timed", [False, True], ids=["submit", "schedule"])
def test_a_task_that_returns_within_its_grace_keeps_its_result(fifos: Fifos, timed: bool) -> None:
    """design.md: a task past its timeout is asked to cancel, and killed after the grace; it
    fails with TimeoutError unless it returned first. This one returns once asked."""
    with Pool(1) as pool:
        options = pool.with_options(timeout=0.1, timeout_grace=600)
        call = (tt.wait_for_cancel, fifos.started, True)
        if timed:
            f = options.schedule("job", 0.0, 0, *call, timed=True)
        else:
            f = options.submit(*call, timed=True)
        tasks.wait_started(fifos.started)
        assert f.result(timeout=CONDITION_TIMEOUT) == "finished anyway"
        if timed:
            assert pool.state("job") is TaskState.COMPLETED
        assert pool.statistics().crashes == 0


def test_a_retry_gets_the_whole_timeout(tmp_path: Path) -> None:
    """The timeout counts from each run's start: the first run took 2 of its 3 s and died;
    its retry, which takes 1.5 s, was timed from the first run's start and failed."""
    with Pool(1) as pool:
        options = pool.with_options(timeout=3.0, timeout_grace=0.1, retries=1)
        f = options.submit(tt.die_first_then_spin, str(tmp_path / "ran"), 2.0, 1.5)
        assert f.result(timeout=CONDITION_TIMEOUT) == "retried"
        assert pool.statistics().retried == 1


def test_a_run_claimed_behind_other_work_within_its_grace_runs(fifos: Fifos) -> None:
    """Misfire "skip" drops a run claimed more than ``misfire_grace`` after it could start;
    one claimed later than its due time but within the grace runs."""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        try:
            tasks.wait_started(fifos.started)
            due = time.monotonic()
            options = pool.with_options(every=600.0, misfire="skip", misfire_grace=30.0)
            rec = options.schedule("r", due, 0, tt.log_version, fifos.log)
            wait_until(lambda: _inbox_depth(pool) == 1, "the run waits behind the blocker")
            # Lateness is the subject here: wait for the clock, not for an event.
            wait_until(lambda: time.monotonic() > due + 0.05, "the run is late")
        finally:
            tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"
        wait_until(lambda: tt.read_tags(fifos.log) == [1], "the late run runs")
        assert pool.statistics().misfires == 0
        assert pool.cancel("r") is True
        assert rec.cancelled()


def test_a_catch_up_run_claimed_behind_other_work_is_judged_from_the_previous_runs_end(
    fifos: Fifos, tmp_path: Path
) -> None:
    """Overlap "queue": a grid time that passed during a long run becomes a catch-up run,
    which could start only when that run ended: its grace counts from there. Here it is
    claimed behind a short task (so by the worker's check, not after an idle wait), its grid
    time more than its grace ago: judged from that, it was dropped."""
    short_started, short_gate = str(tmp_path / "short_started"), str(tmp_path / "short_gate")
    os.mkfifo(short_started)
    os.mkfifo(short_gate)
    every, grace = 1.0, 1.5
    with Pool(1) as pool:
        start_every_worker(pool)
        due = time.monotonic()
        options = pool.with_options(
            every=every, overlap="queue", misfire="skip", misfire_grace=grace
        )
        rec = options.schedule(
            "r", due, 0, tt.gate_the_first_run_then_log, fifos.log, fifos.started, fifos.gate
        )
        tasks.wait_started(fifos.started)
        short = pool.submit(tt.announce_then_gate, short_started, short_gate)
        try:
            wait_until(lambda: _inbox_depth(pool) == 1, "the short task waits behind run 1")
            # Lateness is the subject here: wait for the clock, not for an event.
            wait_until(
                lambda: time.monotonic() > due + every + grace + 0.1,
                "the first grid time after run 1's start is more than the grace ago",
            )
            tasks.open_gate(fifos.gate)
            tasks.wait_started(short_started)  # run 1 ended; the worker runs the short task
            wait_until(lambda: _inbox_depth(pool) >= 1, "the catch-up run waits behind it")
            tasks.open_gate(short_gate)
        except BaseException:
            # Leave no task at a gate or a FIFO, so that the pool's exit ends: fail, not hang.
            tasks.open_gate_within(fifos.gate, GATE_RELEASE_WAIT)
            tasks.wait_started_within(short_started, GATE_RELEASE_WAIT)
            tasks.open_gate_within(short_gate, GATE_RELEASE_WAIT)
            raise
        assert short.result(timeout=CONDITION_TIMEOUT) > 0
        wait_until(lambda: 2 in tt.read_tags(fifos.log), "the catch-up run runs")
        assert pool.statistics().misfires == 0
        assert pool.cancel("r") is True
        assert rec.cancelled()


def test_a_handed_version_with_options_is_pending_until_claimed(fifos: Fifos) -> None:
    """A version waiting in a busy worker's inbox has not started: PENDING, with options (a
    timeout, no retry) as without; a retry's wait is the only unclaimed RUNNING."""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        try:
            tasks.wait_started(fifos.started)
            pool.with_options(timeout=600).schedule("x", 0.0, 0, tasks.ident, 1)
            pool.schedule("y", 0.0, 0, tasks.ident, 2)
            wait_until(lambda: _inbox_depth(pool) == 2, "both wait behind the blocker")
            assert (pool.state("x"), pool.state("y")) == (TaskState.PENDING, TaskState.PENDING)
        finally:
            tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=CONDITION_TIMEOUT) == "blocker"


def test_submitted_counts_each_run_of_a_recurrence(tmp_path: Path) -> None:
    """``PoolStatistics.submitted``: each run of a recurring task is one, so that
    ``completed <= submitted`` holds (the runs after the first were not counted)."""
    log = str(tmp_path / "log")
    with Pool(1) as pool:
        rec = pool.with_options(every=0.01).schedule("r", 0.0, 0, tt.log_version, log)
        wait_until(lambda: tt.count_records(log) >= 3, "three runs ran")
        assert pool.cancel("r") is True
        assert rec.cancelled()
    stats = pool.statistics()
    assert stats.completed >= 3
    assert stats.submitted >= stats.completed


def test_pending_stays_exact_after_cancels_in_the_ready_queue(fifos: Fifos) -> None:
    """Tasks cancelled in the ready queue are withdrawn there and dropped when dispatch meets
    them; ``pending`` counts the live ones. Dropped without their count, the withdrawn ones
    were subtracted again and again: the next batch read 40 too few."""
    tasks_per_round, cancelled = 60, 20
    live = tasks_per_round - cancelled
    with Pool(1, dispatch_window=4) as pool:
        for _ in range(2):
            blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "b")
            tasks.wait_started(fifos.started)
            try:
                futures = [pool.submit(tasks.ident, i) for i in range(tasks_per_round)]
                assert all(f.cancel() for f in futures[-cancelled:])  # in the ready queue
                wait_until(
                    lambda: pool.statistics().pending + _inbox_depth(pool) == live,
                    "every live task counted, pending or in the inbox",
                )
            finally:
                tasks.open_gate(fifos.gate)
            assert blocker.result(timeout=CONDITION_TIMEOUT) == "b"
            for i, f in enumerate(futures[:-cancelled]):
                assert f.result(timeout=CONDITION_TIMEOUT) == i
            assert pool.statistics().pending == 0
