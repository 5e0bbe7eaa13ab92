"""A pool that its user drops (no ``shutdown``, no ``with``) is collected and then shut down
like ``shutdown(wait=False)``: its pending work still runs and its futures resolve, then its
processes exit and its fds and memory are released (docs/design.md, "Lifecycle of a dropped
pool"). The waits are joins and bounded process waits, never sleeps; the autouse ``no_leaks``
fixture checks after each test that no process, fd or /dev/shm entry is left."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import psutil
import pytest

from mpsched import Pool, _lifecycle

from . import tasks
from .conditions import still_running

TIMEOUT = 30.0  # seconds for a dropped pool to end: far beyond its drain and teardown


def _processes(pool: Pool) -> list[psutil.Process]:
    """The pool's zygote and its workers."""
    zygote = psutil.Process(pool._zygote.pid)
    return [zygote, *zygote.children()]


def _assert_ended(thread: threading.Thread, processes: list[psutil.Process]) -> None:
    """The coordinator thread tears the pool down before it ends: once it is joined, every fd
    is closed; the zygote and the workers exit (bounded wait on their pids)."""
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "the dropped pool's coordinator thread did not end"
    alive = still_running(processes, TIMEOUT)
    assert not alive, f"the dropped pool's processes are still alive: {alive}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_dropped_pool_is_collected_and_its_processes_and_fds_end(start_method: str) -> None:
    fds_before = set(os.listdir("/proc/self/fd"))
    pool = Pool(2, start_method=start_method)
    assert pool.submit(tasks.add, 1, 2).result(TIMEOUT) == 3  # the workers are up
    processes = _processes(pool)
    thread = pool._thread
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None, "the coordinator thread keeps the dropped pool alive"
    _assert_ended(thread, processes)
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # the listing's own fd is gone too


@pytest.mark.timeout(120)
def test_the_futures_of_a_dropped_pool_still_resolve() -> None:
    pool = Pool(2)
    futures = [pool.submit(tasks.spin, 0.01) for _ in range(20)]
    futures.append(pool.submit(tasks.add, 2, 3))
    processes = _processes(pool)
    thread = pool._thread
    del pool
    gc.collect()
    assert [f.result(TIMEOUT) for f in futures[:-1]] == [0.01] * 20
    assert futures[-1].result(TIMEOUT) == 5
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
def test_a_pool_dropped_with_maps_ends_without_a_garbage_collection() -> None:
    """A map's state is held by the pool (maps to finish at shutdown) and refers to it only
    weakly: no reference cycle keeps the dropped pool alive until a collection. Its iterator
    keeps it alive while it is read."""
    pool = Pool(1)
    pool.map(tasks.ident, range(10))  # dropped unread
    results = pool.map(tasks.ident, range(10))
    ref = weakref.ref(pool)
    processes = _processes(pool)
    thread = pool._thread
    gc.disable()
    try:
        del pool
        assert ref() is not None  # the iterator's
        assert list(results) == list(range(10))
        del results
        assert ref() is None, "a reference cycle keeps the dropped pool alive"
    finally:
        gc.enable()
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
def test_a_pool_shut_down_without_waiting_then_dropped_ends() -> None:
    pool = Pool(1)
    future = pool.submit(tasks.add, 1, 1)
    processes = _processes(pool)
    thread = pool._thread
    pool.shutdown(wait=False)
    del pool
    gc.collect()
    assert future.result(TIMEOUT) == 2
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
def test_a_pool_referenced_only_by_a_done_callback_lives_until_the_callback_is_gone(
    tmp_path: object,
) -> None:
    gate = os.path.join(str(tmp_path), "gate")
    os.mkfifo(gate)
    pool = Pool(1)
    processes = _processes(pool)
    thread = pool._thread
    ref = weakref.ref(pool)
    more: list[Future[int]] = []
    ran = threading.Event()

    def callback(_: Future[bool], pool: Pool = pool) -> None:
        more.append(pool.submit(tasks.add, 40, 2))  # the pool works: nobody shut it down
        ran.set()

    future = pool.submit(tasks.gate, gate)
    future.add_done_callback(callback)
    del pool, callback
    gc.collect()
    assert ref() is not None  # the coordinator holds the future, which holds the callback
    tasks.open_gate(gate)
    assert future.result(TIMEOUT) is True
    assert ran.wait(TIMEOUT)
    assert more[0].result(TIMEOUT) == 42
    del future
    gc.collect()
    assert ref() is None
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
def test_a_pool_dropped_in_its_own_done_callback_ends() -> None:
    """The last reference goes in the coordinator thread (a done-callback): the pool is
    collected there, and the coordinator shuts it down once the callback returned."""
    holder: list[Pool] = [Pool(1)]
    processes = _processes(holder[0])
    thread = holder[0]._thread
    future = holder[0].submit(tasks.add, 1, 2)
    future.add_done_callback(lambda _: holder.clear())
    assert future.result(TIMEOUT) == 3
    gc.collect()
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
def test_a_pool_collected_while_its_thread_holds_the_pools_locks_does_not_deadlock() -> None:
    """The garbage collector may run the drop callback in a thread inside a critical section
    (here: the coordinator's lock and the wakeup's lock, held by this thread): the callback
    must take no lock. It returns, and the pool ends once the locks are free."""
    pool = Pool(1)
    processes = _processes(pool)
    thread = pool._thread
    coordinator_lock = pool._coordinator.lock
    wakeup_lock = pool._wakeup._lock
    ref = weakref.ref(pool)
    with coordinator_lock, wakeup_lock:
        del pool
        gc.collect()  # a deadlock hangs here (and the timeout fails the test)
        assert ref() is None
    _assert_ended(thread, processes)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_pool_whose_drop_callback_was_cut_short_still_ends_at_the_exit() -> None:
    """A Ctrl-C's KeyboardInterrupt landing in the drop callback (the garbage collector's weakref
    callback, whose exceptions the interpreter prints and ignores) left the pool running with
    nobody to shut it down: the exit (``join_dropped``) took it for a pool not dropped and cut
    its work off. The exit delivers such a drop again, and waits for the pool as for any
    dropped one."""
    pool = Pool(1)
    assert pool.submit(tasks.add, 1, 2).result(TIMEOUT) == 3
    processes = _processes(pool)
    thread = pool._thread
    left = pool.submit(tasks.spin, 0.05)  # work a dropped pool still runs

    def interrupt_the_drop(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "_on_pool_dropped":
            sys.settrace(None)
            raise KeyboardInterrupt

    sys.settrace(interrupt_the_drop)
    try:
        del pool
    finally:
        sys.settrace(None)
    gc.collect()
    _lifecycle.join_dropped()  # what the interpreter's exit runs
    assert left.done(), "the exit did not wait for the dropped pool's work"
    _assert_ended(thread, processes)
