"""The coordinator's books after tasks end, are cancelled or are drained: no timeout watch, block
or in-flight entry outlives its task, and the counters count every run.

Each of these was a mutant of the code that the rest of the suite let through (a mutation
hunt): a watch left behind asked a later task of the same block to cancel, blocks leaked by
cancels left a pool one task at a time, timed tasks withdrawn by a draining shutdown were never
ended and the shutdown waited for ever. The checks read the pool's private state where the
public one cannot show it in bounded time; ordering comes from FIFO gates.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

from mpsched import Future, Pool, TaskState
from mpsched._slot_region import MAX_NESTING

from . import tasks
from .conditions import wait_until

QUEUED_TASKS = 300  # more than a worker's inbox takes: the rest wait in the ready queue
RESULT_TIMEOUT = 30.0  # seconds


def _fifos(tmp_path: Path) -> tuple[str, str]:
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    return started, gate


def _any_injected(futures: list[Future[Any]]) -> bool:
    return any(f._handle >= 0 for f in futures)


def _blocks_in_use(pool: Pool) -> int:
    slab = pool._views.slab
    return int(slab.capacity - slab.free_count())


@pytest.mark.timeout(60)
def test_a_timeout_watch_ends_with_its_task_whether_it_ran_or_was_cancelled(
    tmp_path: Path,
) -> None:
    """Left behind, the watch of a task with a timeout fired on the next task that its block
    carried: that task, which asked for no timeout, was asked to cancel."""
    started, gate = _fifos(tmp_path)
    with Pool(1) as pool:
        coordinator = pool._coordinator
        timed = pool.with_options(timeout=600)
        assert timed.submit(tasks.ident, 1).result(timeout=RESULT_TIMEOUT) == 1
        wait_until(lambda: not coordinator.watched, "the finished task's watch is gone")
        holder = pool.submit(tasks.started_then_gated, started, gate, "held")
        tasks.wait_started(started)
        queued = timed.submit(tasks.ident, 2)  # waits in the busy worker's inbox
        wait_until(lambda: queued._handle >= 0, "the task is in the worker's inbox")
        assert queued.cancel()
        assert not coordinator.watched  # the cancel withdrew its watch too
        tasks.open_gate(gate)
        assert holder.result(timeout=RESULT_TIMEOUT) == "held"


@pytest.mark.timeout(60)
def test_tasks_cancelled_in_an_inbox_or_the_ready_queue_free_their_blocks(
    tmp_path: Path,
) -> None:
    """Their blocks leaked: each round of submits and cancels behind a busy worker took the
    slab's blocks until one task at a time could be in flight."""
    started, gate = _fifos(tmp_path)
    with Pool(1) as pool:
        for _ in range(3):
            holder = pool.submit(tasks.started_then_gated, started, gate, "held")
            tasks.wait_started(started)
            try:
                futures = [pool.submit(tasks.ident, i) for i in range(QUEUED_TASKS)]
                wait_until(functools.partial(_any_injected, futures), "one is in the inbox")
                assert all(f.cancel() for f in futures)
                assert not pool._coordinator.by_handle.keys() - {holder._handle}
            finally:
                tasks.open_gate(gate)
            assert holder.result(timeout=RESULT_TIMEOUT) == "held"
            wait_until(lambda: _blocks_in_use(pool) == 0, "every block is free")


@pytest.mark.timeout(60)
def test_a_draining_shutdown_ends_the_timed_tasks_it_cancels_in_the_ready_queue(
    tmp_path: Path,
) -> None:
    """Withdrawn by ``shutdown(cancel_futures=True)`` without being ended in the timetable,
    they kept it busy, and the shutdown waited for them for ever."""
    started, gate = _fifos(tmp_path)
    pool = Pool(1)
    try:
        holder = pool.submit(tasks.started_then_gated, started, gate, "held")
        tasks.wait_started(started)
        try:
            futures = [pool.schedule(i, 0.0, 0, tasks.ident, i) for i in range(QUEUED_TASKS)]
            wait_until(lambda: pool._coordinator.ready.live() > 0, "some wait in the ready queue")
            pool.shutdown(wait=False, cancel_futures=True)
        finally:
            tasks.open_gate(gate)
        assert pool.await_termination(timeout=RESULT_TIMEOUT)
        assert holder.result() == "held"
        assert all(f.cancelled() for f in futures)
        assert {pool.state(i) for i in range(QUEUED_TASKS)} == {TaskState.CANCELLED}
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.timeout(60)
def test_a_finished_future_lets_go_of_its_pickled_call() -> None:
    """A settled future of a task with options or a run time (which keeps its call to run it
    again after a crash) kept its pickled function and arguments for as long as its caller
    kept it."""
    data = b"x" * 100_000
    with Pool(1) as pool:
        futures = [
            pool.submit(tasks.ident, data),
            pool.with_options(retries=1).submit(tasks.ident, data),
            pool.schedule("id", 0.0, 0, tasks.ident, data),
        ]
        for future in futures:
            assert future.result(timeout=RESULT_TIMEOUT) == data
            wait_until(lambda f=future: not f._payload, "the future's payload is dropped")


@pytest.mark.timeout(120)
def test_children_run_past_the_nesting_limit_are_counted_as_executed() -> None:
    """Past ``MAX_NESTING`` a worker runs a child unrecorded in its run stack, inline as it is
    spawned or popped from its deque by a join: such runs went uncounted in
    ``per_worker[k].executed``."""
    depth = 100
    assert depth > MAX_NESTING
    with Pool(1) as pool:
        assert pool.submit(tasks.chain, depth).result(timeout=RESULT_TIMEOUT) == depth
        stats = pool.statistics()
        assert sum(w.executed for w in stats.per_worker) == depth + 1
        future = pool.submit(tasks.chain_joining_shallow_children, depth)
        assert future.result(timeout=RESULT_TIMEOUT) == 2 * depth
        executed = sum(w.executed for w in pool.statistics().per_worker)
    assert executed - (depth + 1) == 1 + 2 * depth
