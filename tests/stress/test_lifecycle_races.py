"""Race tests of the pool's lifecycle: a dropped ``Pool`` (collected, then shut down like
``shutdown(wait=False)``) and the deferred cancels of abandoned ``Pool.map`` generators
(``Coordinator.cancel_later``, applied by the loop in ``cancel_deferred``).

Same method as ``test_timed_races``/``test_engine_races``: players released together at a
barrier (``race``) under ``fast_switching()`` (the GIL changes hands every microsecond; the
coordinator thread races too). What ran is checked against a log written by the tasks (one
``O_APPEND`` write each, ``timed_tasks.log``). Only outcomes that hold in every interleaving are
asserted: every future ends; a cancelled task never ran; the others ran once with their
result; a dropped pool's coordinator thread ends, and its processes exit. The autouse
``no_leaks`` fixture (tests/conftest.py) checks that no process, fd or /dev/shm entry is left.
Pools use the fork start method: the lifecycle does not depend on it, and it starts fastest.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import signal
import sys
import threading
import time
import weakref
from concurrent.futures import CancelledError, wait
from pathlib import Path
from typing import Any

import pytest

import mpsched
from mpsched import Pool, PoolClosedError
from mpsched import _future as future_module
from mpsched._chunks import run_chunk
from mpsched._lifecycle import _unreleased
from tests.integration import tasks
from tests.integration import timed_tasks as tt
from tests.integration.test_dropped_pool import _assert_ended, _processes
from tests.stress.test_timed_races import CONDITION_TIMEOUT, fast_switching, race

pytestmark = pytest.mark.slow

METHOD = "fork"


def _jitter() -> None:
    """A tiny random spin: varies which side of the race goes first (outcomes all checked)."""
    for _ in range(random.randrange(0, 300)):
        pass


@pytest.fixture
def chunks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[mpsched.Future, list[Any]]]:
    """Every chunk future that ``Pool.map`` submits, with its items (recorded by a class-level
    wrapper of ``Pool._submit``, which a map's sends call, the shutdown's included: it keeps no
    reference to any pool)."""
    recorded: list[tuple[mpsched.Future, list[Any]]] = []
    original = Pool._submit

    def recording_submit(self: Pool, options: Any, fn: Any, *rest: Any) -> mpsched.Future:
        future = original(self, options, fn, *rest)
        if fn is run_chunk:  # rest: ((fn, chunk, star, budget, max_bytes), kwargs[, rest])
            recorded.append((future, rest[0][1]))
        return future

    monkeypatch.setattr(Pool, "_submit", recording_submit)
    return recorded


def _check_chunks(path: str, chunks: list[tuple[mpsched.Future, list[Any]]]) -> None:
    """Every chunk future ended; a cancelled chunk never ran (none of its items is in the log);
    any other ran its items exactly once. Items are ``(tag, ...)`` tuples (star maps)."""
    _, not_done = wait([f for f, _ in chunks], timeout=CONDITION_TIMEOUT)
    assert not not_done, f"{len(not_done)} chunk future(s) never ended"
    runs: dict[Any, int] = {}
    for tag in tt.read_tags(path):
        runs[tag] = runs.get(tag, 0) + 1
    for future, items in chunks:
        tags = [item[0] for item in items]
        if future.cancelled():
            ran = [t for t in tags if runs.get(t, 0)]
            assert not ran, f"chunk {tags} was reported cancelled but ran {ran}"
        else:
            assert future.exception() is None, future.exception()
            assert [runs.get(t, 0) for t in tags] == [1] * len(tags), tags
    recorded = {item[0] for _, items in chunks for item in items}
    assert set(runs) <= recorded, "a run nobody submitted"
    if os.environ.get("LIFECYCLE_COUNTS"):
        cancelled = sum(f.cancelled() for f, _ in chunks)
        print(f"chunks: {len(chunks)}, cancelled: {cancelled}")


def _log_map(pool: Pool, path: str, tags: list[Any], seconds: float = 0.0) -> Any:
    """A star map of ``tt.spin_then_log(path, tag, seconds)``: one chunk per item."""
    fn = functools.partial(tt.spin_then_log, path)
    return pool.map(fn, tags, [seconds] * len(tags), chunksize=1)


# ---------------------------------------------------------------- dropped while in use
# 180 s: its rounds switch threads every microsecond (fast_switching), which on a loaded
# machine took it from 6-15 s to 70 s (a flaky-test hunt, ten loaded runs of the suite).
@pytest.mark.timeout(180)
def test_a_pool_dropped_while_another_thread_submits_ends_when_that_thread_lets_go(
    tmp_path: Path, chunks: list[tuple[mpsched.Future, list[Any]]]
) -> None:
    """The main thread lets go of the pool (and collects) while another thread, holding the
    only other reference, is inside ``submit``/``schedule``/``map`` on it. The pool is dropped
    when that thread lets go (in that thread); every future it got settles (submitted and
    scheduled ones with their result; map chunks: ran once, or cancelled and never ran), and
    the pool ends."""
    path = str(tmp_path / "log")

    def play_round(round_: int) -> None:
        pool = Pool(2, start_method=METHOD)
        processes = _processes(pool)
        thread = pool._thread
        ref = weakref.ref(pool)
        holder = [pool]
        del pool
        got: list[tuple[int, mpsched.Future]] = []

        def user(_: int) -> None:
            pool = holder.pop()
            for i in range(60):
                if i % 3 == 0:
                    got.append((i, pool.submit(tasks.add, i, 1)))
                elif i % 3 == 1:
                    got.append((i, pool.schedule(("s", i), 0.0, i % 4, tasks.add, i, 1)))
                else:
                    it = _log_map(pool, path, [(round_, i, k) for k in range(6)])
                    next(it)
                    if i % 2:
                        it.close()
                    # else: closed by refcount when ``it`` is rebound or the frame ends

        def dropper(_: int) -> None:
            for _ in range(20):
                gc.collect()
                _jitter()

        with fast_switching():
            race(1, user, dropper)
        gc.collect()
        assert ref() is None, "the pool outlived every reference to it"
        for i, future in got:
            assert future.result(CONDITION_TIMEOUT) == i + 1
        _assert_ended(thread, processes)

    for round_ in range(4):
        play_round(round_)
    _check_chunks(path, chunks)


@pytest.mark.timeout(90)
def test_a_pool_dropped_racing_shutdown_nowait_and_blocked_result_waiters() -> None:
    """One thread calls ``shutdown(wait=False)`` and lets go of the pool; the main thread
    collects; two threads block in ``result()`` on its futures (``help_wait`` spins collecting
    done rings while the pool drains and, once dropped, is torn down). Every result arrives,
    no waiter raises, and the pool ends."""

    def play_round(_round: int) -> None:
        pool = Pool(2, start_method=METHOD)
        pool.submit(tasks.add, 0, 0).result(CONDITION_TIMEOUT)  # workers up: help_wait spins
        processes = _processes(pool)
        thread = pool._thread
        futures = [pool.submit(tasks.spin, 0.001 * (k % 4)) for k in range(12)]
        holder = [pool]
        del pool

        def closer(_: int) -> None:
            pool = holder.pop()
            _jitter()
            pool.shutdown(wait=False)

        def waiter(start: int) -> list[float]:
            return [f.result(CONDITION_TIMEOUT) for f in futures[start::2]]

        with fast_switching():
            _, _, evens, odds = race(
                1, closer, lambda _: gc.collect(), lambda _: waiter(0), lambda _: waiter(1)
            )
        gc.collect()
        assert evens[0] == [0.001 * (k % 4) for k in range(0, 12, 2)]
        assert odds[0] == [0.001 * (k % 4) for k in range(1, 12, 2)]
        _assert_ended(thread, processes)

    for _round in range(6):
        play_round(_round)


@pytest.mark.timeout(90)
def test_shutdown_wait_from_two_threads_races_the_last_reference_going_away() -> None:
    """Two threads each hold the pool, call ``shutdown`` (``wait`` chosen at random per
    thread) and let go; the main thread collects meanwhile. Whichever path releases (a
    ``wait=True`` caller's ``await_termination`` or the drop), it happens exactly once: every
    future has its result, the coordinator thread ends and the pool's resources leave the
    registry."""

    def play_round(round_: int) -> None:
        pool = Pool(1, start_method=METHOD)
        processes = _processes(pool)
        thread = pool._thread
        resources = pool._resources
        futures = [pool.submit(tasks.add, k, round_) for k in range(10)]
        holders = [[pool], [pool]]
        del pool
        waits = [random.random() < 0.5, random.random() < 0.5]

        def closer(j: int) -> Any:
            def play(_: int) -> None:
                pool = holders[j].pop()
                _jitter()
                pool.shutdown(wait=waits[j])
                if waits[j]:  # returned after the release: the thread is gone
                    assert not thread.is_alive()

            return play

        with fast_switching():
            race(1, closer(0), closer(1), lambda _: gc.collect())
        gc.collect()
        assert [f.result(CONDITION_TIMEOUT) for f in futures] == [k + round_ for k in range(10)]
        _assert_ended(thread, processes)
        assert resources._released
        assert resources not in _unreleased

    for round_ in range(8):
        play_round(round_)


@pytest.mark.timeout(90)
def test_many_pools_created_and_dropped_leave_no_thread_process_or_fd() -> None:
    """Pools created and dropped in a loop while the earlier ones still drain and tear down
    (some with work pending, some with an abandoned map): once their threads are joined, the
    fd count is back where it was (the ``no_leaks`` fixture also checks processes)."""
    fds_before = set(os.listdir("/proc/self/fd"))
    threads: list[threading.Thread] = []
    futures: list[tuple[int, mpsched.Future]] = []
    with fast_switching():
        for i in range(24):
            pool = Pool(1 + i % 2, start_method=METHOD)
            threads.append(pool._thread)
            futures.append((i, pool.submit(tasks.add, i, 1)))
            if i % 3 == 0:
                it = pool.map(tasks.ident, range(50), chunksize=5)
                assert next(it) == 0
                cycle: list[Any] = [it, pool]
                cycle.append(cycle)  # only the cyclic GC frees the pool and the map
                del it, cycle
            del pool
            if i % 4 == 0:
                gc.collect()
    gc.collect()
    for i, future in futures:
        assert future.result(CONDITION_TIMEOUT) == i + 1
    for thread in threads:
        thread.join(CONDITION_TIMEOUT)
        assert not thread.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= fds_before


# ---------------------------------------------------------------- collection in a critical section
def _log_second_gated(path: str, started: str, gate: str, tag: Any, _: Any) -> Any:
    """A map task: log ``tag``; item 1 (``tag[-1] == 1``) then announces itself (FIFO
    ``started``) and holds its worker at the gate, so that the items after it stay unclaimed."""
    tt.log(path, tag)
    if tag[-1] == 1:
        tasks.started_then_gated(started, gate, None)
    return tag


def _gated_map(pool: Pool, path: str, started: str, gate: str, tags: list[Any]) -> Any:
    fn = functools.partial(_log_second_gated, path, started, gate)
    return pool.map(fn, tags, [None] * len(tags), chunksize=1)


def _fifos(tmp_path: Path) -> tuple[str, str]:
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    return started, gate


@pytest.mark.timeout(90)
def test_a_dropped_pool_and_an_abandoned_map_collected_while_locks_are_held(
    tmp_path: Path, chunks: list[tuple[mpsched.Future, list[Any]]]
) -> None:
    """A dropped pool and its abandoned map, in one cycle, are finalized by a ``gc.collect()``
    that runs while this thread holds the coordinator's lock, the collector's lock, the
    wakeup's lock and the futures' module lock. Neither the drop callback nor the map's cleanup
    may wait for them: the collection returns; once the locks are free, the loop cancels the
    unclaimed chunks (items 2 and 3, behind item 1 held at a gate: never run) and the pool
    ends."""
    path = str(tmp_path / "log")
    started, gate = _fifos(tmp_path)
    for round_ in range(5):
        pool = Pool(1, start_method=METHOD)
        processes = _processes(pool)
        thread = pool._thread
        ref = weakref.ref(pool)
        locks = [
            pool._coordinator.lock,
            pool._coordinator.collect_lock,
            pool._wakeup._lock,
            future_module._CONDITION_LOCK,
        ]
        first = len(chunks)
        it = _gated_map(pool, path, started, gate, [(round_, k) for k in range(20)])
        assert next(it) == (round_, 0)
        tasks.wait_started(started)  # item 1 holds the only worker
        unclaimed = [f for f, _ in chunks[first + 2 :]]
        assert len(unclaimed) == 2  # read-ahead: 4 chunks per worker
        cycle: list[Any] = [it, pool]
        cycle.append(cycle)
        del it, pool, cycle
        for lock in locks:
            assert lock.acquire(timeout=CONDITION_TIMEOUT)
        try:
            gc.collect()  # a deadlock hangs here (the timeout fails the test)
            assert ref() is None
        finally:
            for lock in reversed(locks):
                lock.release()
        _, not_done = wait(unclaimed, timeout=CONDITION_TIMEOUT)  # the loop cancels them
        assert not not_done
        assert all(f.cancelled() for f in unclaimed)
        tasks.open_gate(gate)
        _assert_ended(thread, processes)
    _check_chunks(path, chunks)


@pytest.mark.timeout(90)
def test_a_collection_in_a_done_callback_finalizes_a_dropped_pool_and_an_abandoned_map(
    tmp_path: Path, chunks: list[tuple[mpsched.Future, list[Any]]]
) -> None:
    """``gc.collect()`` from a done-callback: it runs in a pool's callback thread (for a
    future its coordinator settled) or in a user thread collecting in ``help_wait`` (once it
    released the collector's lock), and there it finalizes a dropped pool and its abandoned map
    (a cycle). The callback's future is another pool's, or (odd rounds) the dropped pool's own:
    then the thread finalizing the pool is its own callback thread, while its loop drains. The
    drop callback and the deferred cancels wait for nothing: every chunk ends (cancelled ones
    never ran), and the pool ends."""
    path = str(tmp_path / "log")
    started, gate = _fifos(tmp_path)
    # The even rounds' trigger waits here until the pool and its map are dropped: finished
    # before the ``del`` below, its collection found them still referenced and freed nothing.
    trigger_gate = str(tmp_path / "trigger_gate")
    os.mkfifo(trigger_gate)
    other = Pool(1, start_method=METHOD)  # whose coordinator runs the even rounds' callbacks
    try:
        for round_ in range(6):
            own = round_ % 2 == 1
            pool = Pool(1, start_method=METHOD)
            processes = _processes(pool)
            thread = pool._thread
            ref = weakref.ref(pool)
            collected = threading.Event()

            def collect(_: Any, collected: threading.Event = collected) -> None:
                gc.collect()
                collected.set()

            first = len(chunks)
            it = _gated_map(pool, path, started, gate, [(round_, k) for k in range(20)])
            assert next(it) == (round_, 0)
            tasks.wait_started(started)  # item 1 holds the only worker
            unclaimed = [f for f, _ in chunks[first + 2 :]]
            # Own rounds: queued behind item 1, so the callback runs after the gate opened.
            if own:
                trigger = pool.submit(tasks.add, 1, 1)
            else:
                trigger = other.submit(tasks.gated_ident, trigger_gate, 2)
            trigger.add_done_callback(collect)
            cycle: list[Any] = [it, pool]
            cycle.append(cycle)
            del it, pool, cycle
            with fast_switching():
                tasks.open_gate(gate if own else trigger_gate)
                if round_ % 3 == 0:
                    assert trigger.result(CONDITION_TIMEOUT) == 2  # may collect here
                assert collected.wait(CONDITION_TIMEOUT)
            if not own:  # the worker is still held: the deferred cancels reach both chunks
                _, not_done = wait(unclaimed, timeout=CONDITION_TIMEOUT)
                assert not not_done
                assert all(f.cancelled() for f in unclaimed)
                tasks.open_gate(gate)
            del trigger
            gc.collect()
            assert ref() is None
            _assert_ended(thread, processes)
    finally:
        other.shutdown(wait=True)
    _check_chunks(path, chunks)


# ---------------------------------------------------------------- abandoned maps vs shutdown
@pytest.mark.timeout(90)
def test_abandoned_maps_closed_while_shutdown_cancels_futures(
    tmp_path: Path, chunks: list[tuple[mpsched.Future, list[Any]]]
) -> None:
    """Three maps abandoned three ways (``close()``, the last reference dropped, a cycle
    collected) while another thread calls ``shutdown(cancel_futures=True, wait=False)`` and a
    fourth map's owner asks for its next result. Every chunk future ends; none that was
    reported cancelled ran (the loop's deferred cancels and the shutdown's cancels both reach
    unclaimed chunks); the others ran once. The next result is a value or the error the
    shutdown gave (its chunk cancelled, or the pool closed to its read-ahead)."""
    path = str(tmp_path / "log")

    def play_round(round_: int) -> None:
        pool = Pool(2, start_method=METHOD)
        maps: list[Any] = [None] * 4
        # Started in reverse: the read-ahead of the last ones started still waits (in the
        # inboxes, or the ready queue) when the race begins.
        for m in reversed(range(4)):
            maps[m] = _log_map(pool, path, [(round_, m, k) for k in range(30)], 0.003)
            next(maps[m])
        holders = [[it] for it in maps]
        del maps

        def shut(_: int) -> None:
            _jitter()
            pool.shutdown(wait=False, cancel_futures=True)

        def by_close(_: int) -> None:
            _jitter()
            holders[0].pop().close()

        def by_refcount(_: int) -> None:
            _jitter()
            holders[1].clear()

        def by_cycle(_: int) -> None:
            it = holders[2].pop()
            cycle: list[Any] = [it]
            cycle.append(cycle)
            del it, cycle
            _jitter()
            gc.collect()

        def reader(_: int) -> Any:
            it = holders[3].pop()
            _jitter()
            try:
                return next(it)
            except (CancelledError, PoolClosedError) as exc:
                return type(exc)
            finally:
                it.close()

        with fast_switching():
            *_, got = race(1, shut, by_close, by_refcount, by_cycle, reader)
        assert isinstance(got[0], float) or got[0] in (CancelledError, PoolClosedError), got
        pool.shutdown(wait=True)

    for round_ in range(6):
        play_round(round_)
    _check_chunks(path, chunks)


# ---------------------------------------------------------------- the lock-free wake-up vs close
@pytest.mark.timeout(60)
def test_a_drop_callback_paused_before_its_wakeup_write_writes_nowhere_after_teardown(
    tmp_path: Path,
) -> None:
    """The drop callback sets ``release_requested`` and then writes its wake-up byte without a
    lock (``Wakeup.wakeup_nowait``). A thread that loses the CPU between the two (here forced
    with a profile hook at the ``os.write`` call) lets the coordinator thread drain (it polls
    while a task is in flight), see the flag, tear down and close the pipe; a file opened
    meanwhile may get the pipe's write-end number. The late byte must not land in that file
    (it did: the close now waits for a lock-free write in progress, see ``Wakeup.close``)."""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    pool = Pool(1, start_method=METHOD)
    processes = _processes(pool)
    thread = pool._thread
    wakeup = pool._wakeup
    writer_fd = wakeup._writer
    future = pool.submit(tasks.gated_ident, gate, 7)
    target = tmp_path / "victim"
    opened: list[int] = []
    paused = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is os.write and frame.f_code.co_name == "wakeup_nowait":
            sys.setprofile(None)
            paused.append(True)
            tasks.open_gate(gate)  # the task ends; the loop drains and tears down
            deadline = time.monotonic() + CONDITION_TIMEOUT
            while not wakeup._closed:  # the teardown reached the pipe's close
                assert time.monotonic() < deadline, "the dropped pool was not torn down"
                time.sleep(0.001)
            thread.join(0.2)  # unfixed: the pipe's fds are closed and the thread ends at once
            while True:  # a file takes the freed number (the lowest free numbers go first)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                opened.append(fd)
                if fd >= writer_fd:
                    break

    def drop(holder: list[Pool]) -> None:
        sys.setprofile(hook)
        try:
            holder.clear()  # the drop callback runs here, in this thread
        finally:
            sys.setprofile(None)

    holder = [pool]
    del pool
    dropper = threading.Thread(target=drop, args=(holder,))
    dropper.start()
    dropper.join(CONDITION_TIMEOUT)
    try:
        assert paused, "the drop callback wrote no wake-up byte: the test tests nothing"
        assert future.result(CONDITION_TIMEOUT) == 7
        assert target.read_bytes() == b"", "the late wake-up byte went into another file"
    finally:
        for fd in opened:
            os.close(fd)
    _assert_ended(thread, processes)


# ---------------------------------------------------------------- a user-thread collector vs drain
@pytest.mark.timeout(60)
def test_a_result_collected_by_a_waiting_thread_while_a_dropped_pool_drains_settles(
    tmp_path: Path,
) -> None:
    """A user thread blocked in ``result()`` collects its own result (``help_wait``): it pops
    the task from ``by_handle``, then frees its block and settles its future. If the drain's
    ``all_done()`` sees ``by_handle`` empty in between (forced here: a profile hook holds the
    coordinator thread inside ``all_done`` until the result is in the done ring and then until
    the user thread popped, and then holds the user thread until the coordinator thread ended,
    for at most 0.5 s each), the dropped pool
    must not be torn down under the collector: its future must still get its result. (It was:
    the future never settled; ``Coordinator.drained`` now decides under the collector's lock.)"""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    in_all_done, result_seen, popped = threading.Event(), threading.Event(), threading.Event()
    hooked: list[str] = []

    def coordinator_hook(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name != "all_done" or in_all_done.is_set():
            return
        coordinator = frame.f_locals["self"]
        if coordinator.draining and coordinator.by_handle:
            hooked.append("coordinator")
            in_all_done.set()
            # Held until the test saw the result in the done ring (which a torn-down pool
            # cannot show), however long the worker takes to get there on a loaded machine;
            # then the user thread pops the last task meanwhile.
            result_seen.wait(CONDITION_TIMEOUT)
            popped.wait(0.5)

    threading.setprofile(coordinator_hook)  # the threads started from here: the coordinator's
    try:
        pool = Pool(1, start_method=METHOD)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    processes = _processes(pool)
    thread = pool._thread
    coordinator = pool._coordinator
    assert pool.submit(tasks.add, 1, 1).result(CONDITION_TIMEOUT) == 2  # the worker is up
    future = pool.submit(tasks.gated_ident, gate, 7)
    del pool
    gc.collect()  # dropped: the loop begins the drain, and stops in all_done (the hook)
    assert in_all_done.wait(CONDITION_TIMEOUT)
    tasks.open_gate(gate)
    deadline = time.monotonic() + CONDITION_TIMEOUT
    while not coordinator.slots[0].done_depth():  # the result is in the done ring
        assert time.monotonic() < deadline
        time.sleep(0.001)
    result_seen.set()
    coordinator.help_misses = 0  # help_wait spins (collects) on this result

    def user_hook(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "call"
            and frame.f_code.co_name == "free_tasks"
            and frame.f_back is not None
            and frame.f_back.f_code.co_name == "read_results"
        ):
            sys.setprofile(None)
            hooked.append("user")
            popped.set()
            thread.join(0.5)  # unfixed: the coordinator drains and tears down meanwhile

    outcome: list[Any] = []

    def waiter() -> None:
        sys.setprofile(user_hook)
        try:
            outcome.append(future.result(5))
        except BaseException as exc:
            outcome.append(exc)
        finally:
            sys.setprofile(None)

    user = threading.Thread(target=waiter)
    user.start()
    user.join(CONDITION_TIMEOUT)
    # Fixed, the coordinator holds the collector's lock in all_done: the user thread may
    # then collect after it, or not at all (the loop's own collect may come first).
    assert hooked[:1] == ["coordinator"], "the interleaving was not forced"
    assert outcome == [7]
    _assert_ended(thread, processes)


@pytest.mark.timeout(60)
def test_shutdown_wait_during_another_threads_release_waits_for_its_end() -> None:
    """Thread A's ``shutdown(wait=True)`` is inside the release (forced: a profile hook holds
    it at ``request_release`` for at most 0.5 s) when thread B calls ``shutdown(wait=True)``:
    B must return only once the pool has ended (its coordinator thread joined). It returned at
    once: ``_release`` cleared ``_started`` before the join, and ``shutdown`` skips a pool
    that is not started. Found by the random ``wait`` flags of the test above."""
    pool = Pool(1, start_method=METHOD)
    processes = _processes(pool)
    thread = pool._thread
    assert pool.submit(tasks.add, 1, 1).result(CONDITION_TIMEOUT) == 2
    in_release, b_returned = threading.Event(), threading.Event()
    alive_when_b_returned: list[bool] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "request_release":
            sys.setprofile(None)
            in_release.set()
            b_returned.wait(0.5)  # unfixed: B returns meanwhile, the pool still running

    def a() -> None:
        sys.setprofile(hook)
        try:
            pool.shutdown(wait=True)
        finally:
            sys.setprofile(None)

    def b() -> None:
        assert in_release.wait(CONDITION_TIMEOUT)
        pool.shutdown(wait=True)
        alive_when_b_returned.append(thread.is_alive())
        b_returned.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CONDITION_TIMEOUT)
    assert alive_when_b_returned == [False], "shutdown(wait=True) returned before the end"
    _assert_ended(thread, processes)


# Fds that pool Y creates before its control pipe's child end (1 worker): the segment's memfd,
# the wakeup pipe (2), the worker's eventfd, the pipe's parent end.
FDS_BEFORE_CHILD_END = 5


def _open_fd_numbers() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.mark.timeout(60)
def test_a_pool_started_while_another_pool_forgets_a_worker_starts() -> None:
    """Pool X's coordinator thread closes a drained worker's socket (``forget_worker``) while
    the main thread starts pool Y under the fork start method. ``os.close`` releases the GIL
    before ``Connection.close`` marks the socket closed, so the fork of Y's zygote could see
    X's worker socket listed and open (forced here: a profile hook holds X's thread right
    after the ``os.close``) while Y's control pipe already reused its number (forced too: the
    free numbers below it are filled up to what Y creates first). The zygote's at-fork handler
    (``disown_all``) closed that copy, the zygote's own control socket, and the zygote died at
    start-up: ``BrokenPoolError`` from ``Pool()``, as seen once in ~15 runs of this file in
    ``test_many_pools_created_and_dropped_leave_no_thread_process_or_fd``."""
    closed, started = threading.Event(), threading.Event()
    freed: list[int] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "c_return"
            and arg is os.close
            and not closed.is_set()
            and frame.f_back is not None
            and frame.f_back.f_back is not None
            and frame.f_back.f_back.f_code.co_name == "forget_worker"
        ):
            freed.append(frame.f_back.f_locals["self"]._handle)  # closed, not marked yet
            closed.set()
            started.wait(10)  # Y starts meanwhile (its fork sees the socket not yet closed)

    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(FDS_BEFORE_CHILD_END + 3)]
    threading.setprofile(hook)
    try:
        x = Pool(1, start_method=METHOD)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    fillers: list[int] = []
    try:
        assert x.submit(tasks.add, 1, 1).result(CONDITION_TIMEOUT) == 2
        x.shutdown(wait=False)  # the drain forgets the worker: the hook holds X's thread
        assert closed.wait(CONDITION_TIMEOUT)
        for fd in spare:
            os.close(fd)
        spare.clear()
        number = freed[0]
        free_below = [n for n in range(number) if n not in _open_fd_numbers()]
        assert len(free_below) >= FDS_BEFORE_CHILD_END
        fillers.extend(
            os.open(os.devnull, os.O_RDONLY) for _ in range(len(free_below) - FDS_BEFORE_CHILD_END)
        )
        try:
            y = Pool(1, start_method=METHOD)
            try:
                assert y.submit(tasks.add, 2, 3).result(CONDITION_TIMEOUT) == 5
            finally:
                y.shutdown(wait=True)
        finally:
            started.set()
    finally:
        started.set()
        for fd in spare + fillers:
            os.close(fd)
        x.shutdown(wait=True)


SIGNAL_ROUNDS = 30


def _calls_until_a_signal_shuts_the_pool_down(round_: int, main: int) -> None:
    """One round of the test below: its pool, handler and sender."""
    pool = Pool(2, start_method=METHOD)
    cancel_futures = round_ % 2 == 0
    stopped = threading.Event()
    going = threading.Event()

    def handler(signum: int, frame: object) -> None:
        pool.shutdown(wait=True, cancel_futures=cancel_futures)
        stopped.set()

    def send() -> None:
        going.wait()
        _jitter()
        signal.pthread_kill(main, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, handler)
    sender = threading.Thread(target=send)
    sender.start()
    futures: list[mpsched.Future] = []
    i = 0
    try:
        with fast_switching():
            while not stopped.is_set():
                try:
                    future = pool.submit(tasks.ident, i)
                    futures.append(future)
                    futures.append(pool.schedule(i % 8, time.monotonic(), i % 3, tasks.ident, i))
                except PoolClosedError:  # a call the handler interrupted before it was taken
                    assert stopped.is_set(), f"round {round_}: refused before the shutdown"
                    break
                pool.cancel((i + 3) % 8)
                if i % 5 == 0:
                    future.cancel()
                pool.state(i % 8)
                i += 1
                if i == 20:
                    going.set()
    finally:
        going.set()
        sender.join()
    with pytest.raises(PoolClosedError):
        pool.submit(tasks.ident, -1)
    assert pool.await_termination(timeout=CONDITION_TIMEOUT), f"round {round_}: not ended"
    _, not_done = wait(futures, timeout=CONDITION_TIMEOUT)
    assert not not_done, f"round {round_}: futures left pending"
    pool.shutdown()


@pytest.mark.timeout(90)
def test_a_signal_handler_that_shuts_the_pool_down_wherever_it_lands_in_a_loop_of_calls() -> None:
    """A SIGUSR1 from another thread lands between two bytecodes of the main thread, in a loop
    of ``submit``, ``schedule``, cancels by id and by future and ``state``: inside the pool's
    critical sections, or between the calls. Its handler shuts the pool down (waiting, and
    in every other round cancelling). Before, that shutdown waited for ever for a lock of the
    call it interrupted (one run in three of a loop of submits). Now, in every round, the
    handler returns, the pool refuses the next call and ends, and every future ends."""
    main = threading.get_ident()
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        for round_ in range(SIGNAL_ROUNDS):
            _calls_until_a_signal_shuts_the_pool_down(round_, main)
    finally:
        signal.signal(signal.SIGUSR1, previous)
