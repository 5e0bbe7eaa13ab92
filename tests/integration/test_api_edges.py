"""The public API at its edges, as a demanding user drives it: what statistics() adds up to
across crashes, recycling and shutdown; await_termination before and after shutdown, from
several threads; a pool or a future sent to a task; the pool's futures next to the stdlib's
(wait, as_completed, callbacks, the executor-only setters); map's timeout; which ids are one
id (equal ids, NaN); what current_task() says in plain tasks, timed tasks and children."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import itertools
import math
import multiprocessing
import os
import pathlib
import pickle
import signal
import sys
import threading
import time
import typing
from fractions import Fraction
from typing import Any

import pytest

import mpsched
from mpsched import Pool, PoolStatistics, TaskPicklingError, TaskState, WorkerCrashedError, _startup
from mpsched._coord_collect import HELP_SPIN
from mpsched._lifecycle import ZYGOTE_JOIN_TIMEOUT
from mpsched._payloads import BlockField
from mpsched._protocol import TopState

from . import api_edge_tasks as at
from . import edge_tasks, tasks
from .conditions import Fifos, wait_until, wait_until_known

RESULT_TIMEOUT = 20.0  # s; a future of these tests must end within this (a hang fails)
FAR = 3600.0  # s; a run_at this far ahead never comes during a test


def _executed(stats: PoolStatistics) -> int:
    return sum(w.executed for w in stats.per_worker)


# ---------------------------------------------------------------- statistics()
def test_statistics_add_up_across_a_crash_between_tasks_and_shutdown() -> None:
    """A worker SIGKILLed while idle: its slot's counts stay (the replacement goes on counting
    in the same slot), and the final snapshot after shutdown says the same."""
    with Pool(2) as pool:
        assert [pool.submit(tasks.ident, i).result(RESULT_TIMEOUT) for i in range(10)] == list(
            range(10)
        )
        wait_until_known(pool)
        before = pool.statistics()  # a run is counted before its result is published
        assert _executed(before) == 10
        assert before.completed == 10
        victim = before.per_worker[0]
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(
            lambda: pool.statistics().per_worker[0].pid not in (0, victim.pid),
            "the dead worker is replaced",
        )
        after = pool.statistics()
        assert after.crashes == after.respawns == 1
        assert after.per_worker[0].executed == victim.executed  # kept, not dropped
        futures = [pool.submit(tasks.ident, i) for i in range(10)]
        assert [f.result(RESULT_TIMEOUT) for f in futures] == list(range(10))
        assert _executed(pool.statistics()) == 20
    final = pool.statistics()
    assert final.submitted == final.completed == _executed(final) == 20
    assert final.steals == sum(w.stolen for w in final.per_worker)
    assert all(w.pid == 0 and w.inbox_depth == w.deque_depth == 0 for w in final.per_worker)


def test_statistics_add_up_with_recycled_workers() -> None:
    with Pool(2, max_tasks_per_worker=3) as pool:
        futures = [pool.submit(tasks.ident, i) for i in range(20)]
        assert [f.result(RESULT_TIMEOUT) for f in futures] == list(range(20))
    final = pool.statistics()
    assert final.submitted == final.completed == _executed(final) == 20
    assert final.recycled >= 20 // 3 - 1  # one worker may have got its third task at the drain
    assert final.crashes == 0


def test_each_run_of_a_recurring_task_counts_as_submitted() -> None:
    """completed counts every run; submitted counted only the schedule() call, so a
    recurring task made completed exceed submitted."""
    with Pool(1) as pool:
        pool.with_options(every=0.001, overlap="skip").schedule(
            "tick", time.monotonic(), 0, tasks.ident, 1
        )
        wait_until(lambda: pool.statistics().completed >= 5, "five runs ended")
        assert pool.cancel("tick")
    final = pool.statistics()
    assert final.completed >= 5
    assert final.submitted >= final.completed == _executed(final)


def test_final_statistics_keep_the_counts_of_a_worker_that_died_in_the_drain(
    fifos: Fifos,
) -> None:
    """A worker that dies while the pool drains sends no DRAINED message: its slot's counters
    (in shared memory until the release) are kept all the same. The final snapshot read 0 for
    its slot, so the per-worker counts no longer added up to the tasks that ran. One worker:
    it runs all 20 tasks, so the counts it must keep are not 0 (with two, the one that took the
    blocking task had at times run none of them: the other, up first, took them all)."""
    pool = Pool(1)
    try:
        futures = [pool.submit(tasks.ident, i) for i in range(20)]
        assert [f.result(RESULT_TIMEOUT) for f in futures] == list(range(20))
        running = pool.submit(tasks.report_pid_then_gate, fifos.started, fifos.gate)
        pid = tasks.read_pid(fifos.started)
        live = pool.statistics()
        slot = next(w.slot for w in live.per_worker if w.pid == pid)
        pool.shutdown(wait=False)
        os.kill(pid, signal.SIGKILL)
        assert pool.await_termination(RESULT_TIMEOUT)
    finally:
        pool.shutdown()
    with pytest.raises(WorkerCrashedError, match="unless it is shutting down"):
        running.result(0)  # not replaced: the message said it was
    final = pool.statistics()
    assert final.completed == _executed(final) == 20
    assert final.per_worker[slot].executed == live.per_worker[slot].executed > 0


def test_children_run_inline_count_as_executed() -> None:
    """A chain nested deeper than the run stack runs its deepest children inline (as with a
    full deque or slab): they count in ``executed`` like any child. They were not counted, so
    the per-worker counts fell short of what ran (63 of 101 here)."""
    depth = 100  # > MAX_NESTING (64): the last ~37 links run inline
    with Pool(1) as pool:
        assert pool.submit(edge_tasks.chain, depth).result(RESULT_TIMEOUT) == depth
        assert _executed(pool.statistics()) == 1 + depth  # the run counted before its result
    final = pool.statistics()
    assert final.completed == 1
    assert _executed(final) == 1 + depth


def test_a_childs_result_out_of_time_raises_the_futures_timeout_error() -> None:
    """A child's ``result(timeout)`` that runs out raises what a ``Future``'s does,
    ``concurrent.futures.TimeoutError``: on Python 3.10 that is not the builtin
    ``TimeoutError``, which it raised, and ``except concurrent.futures.TimeoutError`` missed it.
    One worker: the child waits in its parent's deque, so it is not done at the deadline."""
    with Pool(1) as pool:
        assert pool.submit(at.child_result_with_no_time_left).result(RESULT_TIMEOUT) == (True, 7)


def test_a_bad_timeout_for_a_childs_result_fails_in_the_task_not_the_worker() -> None:
    """A timeout that is no number, NaN, infinite or past the float range: the join's
    arithmetic raised (``monotonic() + "1"``, ``int(inf)``), which was taken for an interrupt
    of mpsched's own code, and the worker exited (WorkerCrashedError). Checked as the pool's
    own waits check theirs: infinite is no limit."""
    timeouts = ["1", [1], math.nan, math.inf, 10**400, 1e300, 5]
    expected = ["TypeError", "TypeError", "ValueError", 3, 3, 3, 3]
    with Pool(1) as pool:
        assert pool.submit(at.child_results_with_timeouts, timeouts).result(30) == expected
        assert pool.statistics().crashes == 0


@pytest.mark.timeout(60)
def test_a_join_that_sleeps_with_a_timeout_longer_than_poll_takes_wakes_with_its_child(
    fifos: Fifos,
) -> None:
    """A join whose timeout (10^7 s, ~116 days) is more milliseconds than ``poll()`` takes (a C
    int) sleeps at most that long at a time (``SLEEP_MS_MAX``) and wakes when its child ends:
    the whole timeout given to ``poll()`` raised OverflowError in the worker's sleep."""
    with Pool(2) as pool:
        f = pool.submit(at.join_a_stolen_child, fifos.started, fifos.gate, fifos.log, 1e7)
        wait_until(lambda: os.path.exists(fifos.log) and os.path.getsize(fifos.log) == 1, "join")
        # The peer runs the child at its gate: the only worker that can sleep is the joiner.
        header = pool._coordinator.header
        wait_until(lambda: header.sleepers() == 1, "the join sleeps")
        tasks.open_gate(fifos.gate)
        assert f.result(timeout=RESULT_TIMEOUT) == 7
        assert pool.statistics().crashes == 0


class _EqRaises:
    """An id whose ``==`` raises against any other object of its hash (1, as ``hash(1)``)."""

    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        raise RuntimeError("eq raised")


def test_a_schedule_that_raised_is_not_counted_as_submitted() -> None:
    with Pool(1) as pool:
        pool.schedule(_EqRaises(), 0, 0, tasks.ident, 1).result(30)
        with pytest.raises(RuntimeError, match="eq raised"):
            pool.schedule(1, 0, 0, tasks.ident, 2)  # its id's lookup raises
    final = pool.statistics()
    assert (final.submitted, final.completed) == (1, 1)


def test_statistics_from_many_threads_across_shutdown() -> None:
    """Snapshots taken from several threads while the pool works, drains and is released:
    each is whole and sane, and no count goes back."""
    pool = Pool(2)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[list[PoolStatistics]] = [[] for _ in range(4)]

    def poll(out: list[PoolStatistics]) -> None:
        try:
            while not stop.is_set():
                out.append(pool.statistics())
            out.append(pool.statistics())
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=poll, args=(out,)) for out in seen]
    for thread in threads:
        thread.start()
    try:
        futures = [pool.submit(tasks.ident, i) for i in range(200)]
        pool.shutdown(wait=True)
    finally:
        stop.set()
        for thread in threads:
            thread.join(RESULT_TIMEOUT)
    assert not errors
    assert [f.result(0) for f in futures] == list(range(200))
    for snapshots in seen:
        for earlier, later in itertools.pairwise(snapshots):
            assert later.completed >= earlier.completed
            assert later.submitted >= earlier.submitted
        for stats in snapshots:
            assert stats.workers == len(stats.per_worker) == 2
            assert 0 <= stats.completed <= stats.submitted <= 200
            assert stats.steals == sum(w.stolen for w in stats.per_worker)
            assert all(w.inbox_depth >= 0 and w.deque_depth >= 0 for w in stats.per_worker)
        assert snapshots[-1].completed == _executed(snapshots[-1]) == 200
    stats = seen[0][-1]
    with pytest.raises(AttributeError):  # frozen, with its per-worker records
        stats.completed = 0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        stats.per_worker[0].executed = 0  # type: ignore[misc]


# ---------------------------------------------------------------- await_termination()
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["future", "by_id"])
def test_a_recurrences_future_cancel_lets_its_running_run_end(fifos: Fifos, how: str) -> None:
    """The recurrence's future's ``cancel()`` stops the recurrence, and the run in progress
    goes on to its end (its docstring); ``Pool.cancel(id)`` also asks that run to stop. Both
    asked it."""
    pathlib.Path(fifos.log).touch()
    with Pool(1) as pool:
        recurrence = pool.with_options(every=60.0).schedule(
            "tick", 0.0, 0, edge_tasks.report_cancel_requested, fifos.started, fifos.gate, fifos.log
        )
        tasks.wait_started(fifos.started)
        assert recurrence.cancel() if how == "future" else pool.cancel("tick")
        if how == "by_id":  # the loop sets the run's flag on its next pass (it raced the gate)
            slot, slab = pool._views.slots[0], pool._coordinator.slab

            def flagged() -> bool:
                running = slot.running()
                return bool(running) and all(
                    slab.get_word(h, BlockField.STATE) == TopState.CANCEL_REQUESTED for h in running
                )

            wait_until(flagged, "the run's cancel flag is set")
        tasks.open_gate(fifos.gate)
        wait_until(lambda: tasks.read_log(fifos.log), "the run ended")
    assert tasks.read_log(fifos.log) == [0 if how == "future" else 1]
    assert recurrence.cancelled()


@pytest.mark.timeout(60)
def test_statistics_in_a_handler_that_interrupted_a_call_holding_the_pools_locks() -> None:
    """A signal handler (or a finalizer) runs in the thread it interrupted, which may hold the
    coordinator's lock (in a submit) or be in statistics() itself: statistics() there waited
    for its own thread, and the whole pool with it, for ever (a hunt: a SIGUSR1 handler that
    printed the statistics hung a loop of submits within a second, 4 runs of 4)."""
    with Pool(1) as pool:
        assert pool.submit(abs, -1).result(timeout=30) == 1
        with pool._coordinator.lock:  # as a submit holds it
            held = pool.statistics()
        with pool._resources.memory_lock:  # as statistics() holds it
            again = pool.statistics()
        assert held.submitted == again.submitted == 1
        assert held.pending == again.pending == 0


@pytest.mark.timeout(60)
def test_a_shutdown_called_straight_from_c_shuts_the_pool_down() -> None:
    """``atexit.register(pool.shutdown)`` or ``_thread.start_new_thread(pool.shutdown, ())``:
    no Python frame calls it, and its look at its caller raised ValueError ("call stack is not
    deep enough"): the pool stayed open."""
    import _thread

    pool = Pool(1)
    assert pool.submit(abs, -1).result() == 1
    _thread.start_new_thread(pool.shutdown, ())
    assert pool.await_termination(30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags", [{"wait": "no"}, {"cancel_futures": "no"}, {"wait": None}])
def test_a_shutdown_flag_that_is_no_bool_is_refused_before_anything_ends(
    flags: dict[str, object],
) -> None:
    """``cancel_futures="no"`` cancelled the work (and ``wait="no"`` waited), where ``Pool()``
    refuses such flags (a typing and options hunt)."""
    with Pool(1) as pool:
        gated = pool.submit(abs, -1)
        with pytest.raises(TypeError, match=f"{next(iter(flags))} must be a bool"):
            pool.shutdown(**flags)  # type: ignore[arg-type]
        assert not gated.cancelled()
        assert pool.submit(abs, -2).result(timeout=30) == 2
        assert gated.result(timeout=30) == 1


class _ShutdownLogged(Pool):
    calls: typing.ClassVar[list[bool]] = []

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.calls.append(wait)
        super().shutdown(wait, cancel_futures=cancel_futures)


@pytest.mark.timeout(60)
def test_a_subclass_that_overrides_shutdown_waits_at_the_end_of_a_with_block() -> None:
    """``Pool.__exit__`` calls the override, which calls ``Pool.shutdown``: that took its
    caller, code of the user's called from the package, for a signal handler interrupting a
    call of the pool's, and only asked for the shutdown (the block did not wait)."""
    with _ShutdownLogged(1) as pool:
        future = pool.submit(tasks.spin, 0.5)
    assert _ShutdownLogged.calls == [True]
    assert future.done()
    assert future.result() == 0.5
    assert pool.await_termination(0)


def test_await_termination_before_shutdown_waits_for_anothers_shutdown() -> None:
    """Before shutdown, await_termination waits for one (Java's awaitTermination): a timeout
    returns False and changes nothing; waiters in several threads all return True once
    another thread shut the pool down."""
    pool = Pool(1)
    try:
        assert pool.await_termination(0) is False
        assert pool.await_termination(0.01) is False
        assert pool.submit(tasks.ident, 1).result(RESULT_TIMEOUT) == 1  # not poisoned
        answers: list[bool] = []
        waiters = [
            threading.Thread(target=lambda: answers.append(pool.await_termination()))
            for _ in range(3)
        ]
        for waiter in waiters:
            waiter.start()
        work = pool.submit(tasks.ident, 2)
        pool.shutdown(wait=False)
        for waiter in waiters:
            waiter.join(RESULT_TIMEOUT)
        assert answers == [True, True, True]
        assert work.result(0) == 2
        assert pool.await_termination(0) is True
    finally:
        pool.shutdown()


def test_a_shut_down_pool_answers_every_call() -> None:
    with Pool(1) as pool:
        pool.schedule("t", time.monotonic(), 0, tasks.ident, 1).result(RESULT_TIMEOUT)
    with pool as again:  # re-entered: the same pool, still shut down
        assert again is pool
        with pytest.raises(mpsched.PoolClosedError):
            again.submit(tasks.ident, 1)
    with pytest.raises(mpsched.PoolClosedError):
        pool.map(tasks.ident, [1])
    with pytest.raises(mpsched.PoolClosedError):
        pool.with_options(timeout=1).schedule("t", 0.0, 0, tasks.ident, 1)
    assert pool.state("t") is TaskState.COMPLETED
    assert pool.cancel("t") is False
    assert pool.cancel("t", force=True) is False
    assert pool.statistics().completed == 1
    assert "closed" in repr(pool)


# ---------------------------------------------------------------- pools and futures in tasks
def test_a_pool_sent_to_a_task_fails_at_submit_with_a_clear_error() -> None:
    """A task cannot use the pool (it runs in another process): a call that would carry it
    (its bound method, an argument, a submitter, a closure) fails in the caller, saying so."""
    with Pool(1) as pool:
        for submit in (
            lambda: pool.submit(pool.shutdown),
            lambda: pool.submit(tasks.ident, pool),
            lambda: pool.submit(tasks.ident, pool.with_options(timeout=1)),
            lambda: pool.submit(lambda: pool.statistics()),
            lambda: pool.schedule("s", 0.0, 0, pool.cancel, "s"),
        ):
            with pytest.raises(TaskPicklingError, match=r"mpsched\.Pool.*mpsched\.submit"):
                submit()
        with pytest.raises(TaskPicklingError, match=r"mpsched\.Pool"):
            next(pool.map(pool.state, ["s"]))
        with pytest.raises(TypeError, match=r"mpsched\.Pool"):
            pickle.dumps(pool)
        assert pool.state("s") is None  # nothing was scheduled
        assert pool.submit(tasks.ident, 3).result(RESULT_TIMEOUT) == 3  # not poisoned


def test_a_future_sent_to_a_task_fails_at_submit_with_a_clear_error() -> None:
    """A pool's future belongs to the pool's process, pending or done (a done one pickled,
    a pending one failed on whatever it referred to)."""
    with Pool(1, timed_after_shutdown=False) as pool:
        pending = pool.schedule("p", time.monotonic() + FAR, 0, tasks.ident, 1)
        done = pool.submit(tasks.ident, 2)
        done.result(RESULT_TIMEOUT)
        fresh = pool.submit(tasks.ident, 3)
        for future in (pending, done, fresh):
            with pytest.raises(TaskPicklingError, match=r"mpsched\.Future"):
                pool.submit(tasks.ident, future)
            with pytest.raises(TypeError, match=r"mpsched\.Future"):
                pickle.dumps(future)
        assert fresh.result(RESULT_TIMEOUT) == 3
        assert pending.cancel()


# ---------------------------------------------------------------- futures vs the stdlib's
def test_set_running_or_notify_cancel_is_refused() -> None:
    """An executor's method, not a user's: on a pool's future it made the future RUNNING,
    after which cancel() withdrew the task but reported False, and the future never ended
    (result() waited for ever, also after shutdown)."""
    with Pool(1, timed_after_shutdown=False) as pool:
        future = pool.schedule("r", time.monotonic() + FAR, 0, tasks.ident, 1)
        with pytest.raises(RuntimeError, match="set_running_or_notify_cancel"):
            future.set_running_or_notify_cancel()
        assert not future.running()
        assert future.cancel() is True
        with pytest.raises(cf.CancelledError):
            future.result(RESULT_TIMEOUT)
        assert pool.state("r") is TaskState.CANCELLED


def test_pool_futures_next_to_stdlib_futures() -> None:
    context = multiprocessing.get_context("forkserver")
    with (
        Pool(1) as first,
        Pool(1, timed_after_shutdown=False) as second,
        cf.ProcessPoolExecutor(1, mp_context=context) as stdlib,
    ):
        stdlib_future = stdlib.submit(pow, 2, 3)
        failing = first.submit(tasks.boom, "first")
        slow = second.schedule("slow", time.monotonic() + FAR, 0, tasks.ident, 1)
        assert repr(slow).endswith("state=pending>")
        done, not_done = cf.wait(
            [stdlib_future, failing, slow], timeout=RESULT_TIMEOUT, return_when=cf.FIRST_EXCEPTION
        )
        assert failing in done
        assert slow in not_done
        assert "raised ValueError" in repr(failing)
        with pytest.raises(cf.TimeoutError):
            list(cf.as_completed([slow], timeout=0.01))
        with pytest.raises(cf.TimeoutError):
            slow.result(timeout=0)
        with pytest.raises(cf.TimeoutError):
            slow.exception(timeout=0)
        assert slow.running() is False  # never True for a pool's future (claims unreported)
        assert slow.cancel()
        assert "state=cancelled" in repr(slow)
        assert stdlib_future.result(RESULT_TIMEOUT) == 8
        ok = second.submit(tasks.ident, 4)
        assert {f.result() for f in cf.as_completed([ok, stdlib_future], RESULT_TIMEOUT)} == {4, 8}
        assert "returned int" in repr(ok)
        called: list[Any] = []
        ok.add_done_callback(called.append)  # after done: at once, in this thread
        assert called == [ok]
        assert isinstance(failing.exception(0), ValueError)


# ---------------------------------------------------------------- map(timeout=...)
def test_map_timeout_is_checked_at_the_call() -> None:
    with Pool(1) as pool:
        with pytest.raises(TypeError, match="timeout"):
            pool.map(tasks.ident, [1], timeout="1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="timeout"):
            pool.map(tasks.ident, [1], timeout=True)
        with pytest.raises(ValueError, match="timeout"):
            pool.map(tasks.ident, [1], timeout=math.nan)
        # Infinite: no limit, as None (it overflowed the wait); an int past the float range
        # too (float() raised OverflowError), and a negative one times out at once.
        assert list(pool.map(tasks.ident, [1, 2], timeout=math.inf)) == [1, 2]
        assert list(pool.map(tasks.ident, [1, 2], timeout=10**400)) == [1, 2]
        assert list(pool.map(tasks.ident, [], timeout=-(10**400))) == []
        # Negative or zero: as the stdlib's map, the first result not ready times out.
        assert list(pool.map(tasks.ident, [], timeout=-1)) == []
        assert list(pool.map(tasks.ident, [1, 2], timeout=Fraction(10**6))) == [1, 2]
    assert pool.await_termination(10**400)


# ---------------------------------------------------------------- which ids are one id
def test_equal_ids_are_one_id_and_a_nan_id_is_only_itself() -> None:
    """Ids are matched as dict keys are: equal ids (1, 1.0 and True; 0.0 and -0.0) are one id,
    and an id that is not equal to itself (NaN) is found only by the very object scheduled."""
    later = time.monotonic() + FAR
    with Pool(1, timed_after_shutdown=False) as pool:
        one = pool.schedule(1, later, 0, tasks.ident, "int")
        true = pool.schedule(True, later, 0, tasks.ident, "bool")
        assert one.cancelled()  # superseded: the same id
        assert pool.state(1.0) is TaskState.PENDING
        assert pool.cancel(1.0)
        assert true.cancelled()
        zero = pool.schedule(0.0, later, 0, tasks.ident, 0)
        pool.schedule(-0.0, later, 0, tasks.ident, 0)
        assert zero.cancelled()
        assert pool.cancel(0)

        nan = math.nan
        pending = pool.schedule(nan, later, 0, tasks.ident, "nan")
        other = float("nan")
        assert pool.state(other) is None
        assert pool.cancel(other) is False
        assert pool.state(nan) is TaskState.PENDING
        assert pool.schedule(nan, time.monotonic(), 0, at.task_id_is_nan).result(RESULT_TIMEOUT)
        assert pending.cancelled()
        wait_until(lambda: pool.state(nan) is TaskState.COMPLETED, "the NaN id completed")
        assert pool.cancel(nan) is False


@pytest.mark.timeout(60)
def test_a_poll_of_a_result_collects_nothing_itself(fifos: Fifos) -> None:
    """``result(timeout)`` with a timeout under the collecting spin (``HELP_SPIN``) does not
    spin: a poll (``timeout=0``) spun 0.3 ms and ran the done-callbacks of the other futures
    it settled in the caller's thread, as long as they took (a callback that took a lock the
    poller held deadlocked; found in review). A longer wait still collects."""
    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(RESULT_TIMEOUT) == 0  # the worker is up
        f = pool.submit(tasks.gated_ident, fifos.gate, 1)
        coordinator = pool._coordinator
        spins: list[mpsched.Future] = []
        spin = coordinator.help_spin

        def counted_spin(future: mpsched.Future) -> bool:
            spins.append(future)
            return spin(future)

        coordinator.help_spin = counted_spin  # type: ignore[method-assign]
        for timeout in (0, -1, HELP_SPIN / 2):
            coordinator.help_misses = 0
            with pytest.raises(cf.TimeoutError):  # not the builtin one on 3.10
                f.result(timeout=timeout)
        assert spins == []
        coordinator.help_misses = 0
        with pytest.raises(cf.TimeoutError):  # not the builtin one on 3.10
            f.result(timeout=0.01)
        assert spins == [f]
        tasks.open_gate(fifos.gate)
        assert f.result(RESULT_TIMEOUT) == 1


@pytest.mark.timeout(60)
def test_a_shutdown_that_cancels_withdraws_the_tasks_of_futures_the_user_settled(
    fifos: Fifos,
) -> None:
    """``set_result`` on a queued task's future: the caller's outcome wins, and the future
    stays so; ``shutdown(cancel_futures=True)`` must still keep its task from running, as it
    keeps every task that no worker claimed (those in an inbox ran: found in review)."""
    open(fifos.log, "wb").close()
    pool = Pool(1, dispatch_window=64)
    try:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, "blocker")
        tasks.wait_started(fifos.started)
        queued = [pool.submit(tasks.record, fifos.log, i) for i in range(20)]
        wait_until(lambda: all(f._slot >= 0 for f in queued), "the tasks were dispatched")
        for f in queued:
            f.set_result("mine")
        pool.shutdown(wait=False, cancel_futures=True)  # the cancels are done as it returns
        tasks.open_gate(fifos.gate)
        assert blocker.result(RESULT_TIMEOUT) == "blocker"
        assert pool.await_termination(RESULT_TIMEOUT)
        assert tasks.read_log(fifos.log) == []
        assert [f.result() for f in queued] == ["mine"] * 20
    finally:
        pool.shutdown(wait=False)


def _in_call(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is inside a call of ``function`` now."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("releaser", ["itself", "another_threads_shutdown"])
def test_await_termination_keeps_its_timeout_while_the_teardown_waits_for_the_zygote(
    releaser: str,
) -> None:
    """Once the loop ended, ``await_termination`` joined the coordinator thread with no limit,
    whose teardown gives a zygote that does not exit ``ZYGOTE_JOIN_TIMEOUT`` (5 s) before it
    kills it: with the zygote stopped, ``await_termination(0.5)`` returned True after 5 s
    (found in review). Now it returns False at its timeout, and True once the teardown ended.
    The same while a ``shutdown(wait=True)`` in another thread does that join (it held a lock
    there, which this waited for with no limit; found in review)."""
    pool = Pool(1)
    zygote = pool._resources.zygote.pid
    closer = threading.Thread(target=pool.shutdown)
    try:
        assert pool.submit(tasks.ident, 1).result(RESULT_TIMEOUT) == 1
        os.kill(zygote, signal.SIGSTOP)
        pool.shutdown(wait=False)
        wait_until(pool._coordinator.finished.is_set, "the loop ended")
        if releaser == "another_threads_shutdown":
            closer.start()
            wait_until(lambda: _in_call(closer, "join_interruptibly"), "the other thread joins")
        started = time.monotonic()
        assert pool.await_termination(0.5) is False
        assert time.monotonic() - started < ZYGOTE_JOIN_TIMEOUT - 1.0
        assert pool.await_termination(RESULT_TIMEOUT) is True
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(zygote, signal.SIGCONT)
        pool.shutdown()
        if closer.ident is not None:  # started
            closer.join(RESULT_TIMEOUT)


def test_await_termination_timeout_is_checked() -> None:
    """An infinite timeout is no limit (it overflowed the wait, before and after shutdown);
    a timeout that is not a number, or NaN, is refused (NaN answered False at once)."""
    pool = Pool(1)
    try:
        with pytest.raises(TypeError, match="timeout"):
            pool.await_termination("1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="timeout"):
            pool.await_termination(True)
        with pytest.raises(ValueError, match="timeout"):
            pool.await_termination(math.nan)
        assert pool.await_termination(-1) is False  # running: times out at once
        work = pool.submit(tasks.ident, 1)
        pool.shutdown(wait=False)
        assert pool.await_termination(math.inf) is True
        assert work.result(0) == 1
    finally:
        pool.shutdown()


def test_map_and_with_options_check_their_arguments_at_the_call() -> None:
    with Pool(1) as pool:
        with pytest.raises(TypeError, match="fn must be callable"):
            pool.map(5, [1])  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="options must be a TaskOptions"):
            pool.with_options("fast", timeout=1)  # type: ignore[arg-type]
        assert pool.with_options(mpsched.TaskOptions(), timeout=1).options.timeout == 1
        assert list(pool.map(tasks.ident, [1, 2])) == [1, 2]


@pytest.mark.timeout(60)
def test_with_options_takes_exactly_the_fields_of_task_options() -> None:
    """Its keywords are TaskOptions' fields (names, order, types, keyword-only), spelled out for
    type checkers: a field added to one and not the other fails here. Not given, a field keeps
    the value of the options given, or its default."""
    from mpsched._pool import NOT_GIVEN, _NotGiven

    params = list(inspect.signature(Pool.with_options).parameters.values())[2:]
    fields = dataclasses.fields(mpsched.TaskOptions)
    assert [p.name for p in params] == [f.name for f in fields]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is NOT_GIVEN for p in params)
    hints = typing.get_type_hints(Pool.with_options)
    field_hints = typing.get_type_hints(mpsched.TaskOptions)
    for f in fields:
        assert hints[f.name] == field_hints[f.name] | _NotGiven, f.name
    pool = Pool.__new__(Pool)  # with_options reads nothing of the pool's
    base = mpsched.TaskOptions(timeout=3, retries=2)
    assert pool.with_options(base, retries=5).options == mpsched.TaskOptions(timeout=3, retries=5)
    assert pool.with_options(timeout=None).options == mpsched.TaskOptions()
    assert pool.with_options().options == mpsched.TaskOptions()
    with pytest.raises(ValueError, match="overlap"):
        pool.with_options(overlap="bogus")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_a_task_submitter_says_what_it_is_and_the_api_documents_its_errors() -> None:
    with Pool(1) as pool:
        submitter = pool.with_options(timeout=5)
        assert repr(submitter) == f"<mpsched.TaskSubmitter {submitter.options!r} of {pool!r}>"
    assert mpsched.TaskSubmitter.options.__doc__
    assert mpsched.Scheduler.closed.__doc__
    raises = (Pool.submit.__doc__ or "").split("Raises:")[1]
    assert "TypeError" in raises
    assert "BrokenPoolError" in raises
    assert "TypeError" in (Pool.state.__doc__ or "").split("Raises:")[1]


# ---------------------------------------------------------------- current_task()
def test_current_task_in_plain_and_timed_tasks_and_their_children() -> None:
    with Pool(1) as pool:
        assert pool.submit(at.context_fields).result(RESULT_TIMEOUT) == (None, 0, False)
        parent, child = pool.schedule(
            "ctx", time.monotonic(), 0, at.contexts_of_parent_and_child
        ).result(RESULT_TIMEOUT)
        assert parent[:2] == ("ctx", 1)
        assert parent[2] is False
        assert child == (None, 0, False)  # a child has no id and cannot be cancelled
        with pytest.raises(RuntimeError, match="only works inside a task"):
            mpsched.current_task()
        with pytest.raises(RuntimeError, match="only works inside a task"):
            mpsched.submit(tasks.ident, 1)
        # TaskCancelled raised with no cancel asked is an error, not a cancel.
        unprompted = pool.schedule("tc", time.monotonic(), 0, tasks.boom_cancelled)
        with pytest.raises(mpsched.TaskCancelled):
            unprompted.result(RESULT_TIMEOUT)
        assert not unprompted.cancelled()
        wait_until(lambda: pool.state("tc") is TaskState.FAILED, "the id failed")


@pytest.mark.timeout(60)
def test_current_task_in_children_run_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children that find the deque full run inline, inside their parent's run: they still
    have no id, version or cancel flag (they reported their parent's)."""
    monkeypatch.setattr(_startup, "DEQUE_CAPACITY", 2)
    with Pool(1, start_method="fork") as pool:  # the zygote inherits the patched layout
        contexts = pool.schedule("ctx", time.monotonic(), 0, at.contexts_of_children, 5).result(
            RESULT_TIMEOUT
        )
    assert contexts == [(None, 0, False)] * 5 + [("ctx", 1, False)]


# ---------------------------------------------------------------- constructor
def test_a_number_of_workers_beyond_any_memory_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="workers"):
        Pool(10**30)
