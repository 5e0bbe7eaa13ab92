"""The edges of a pool's life, in the test's own process: bad constructor arguments (a clear
error naming the argument, and nothing started: the no_leaks fixture checks processes, fds and
/dev/shm), many pools in a row (no fd left behind), a pool made and ended in another thread,
and what a shut-down pool answers."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsched import Pool, PoolClosedError, _coordinator

from . import tasks
from .conditions import Fifos, wait_until


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"workers": 0}, ValueError, "workers"),
        ({"workers": -1}, ValueError, "workers"),
        ({"workers": 1.5}, TypeError, "workers"),
        ({"workers": "2"}, TypeError, "workers"),
        ({"workers": True}, TypeError, "workers"),
        ({"start_method": "nope"}, ValueError, "start_method"),
        ({"start_method": 3}, TypeError, "start_method"),
        ({"start_method": b"fork"}, TypeError, "start_method"),
        ({"dispatch_window": 0}, ValueError, "dispatch_window"),
        ({"aging": -1}, ValueError, "aging"),
        ({"aging": math.nan}, ValueError, "aging"),
        ({"aging": "slow"}, TypeError, "aging"),
        ({"max_tasks_per_worker": 0}, ValueError, "max_tasks_per_worker"),
        ({"initializer": 1}, TypeError, "initializer"),
        ({"initializer": abs, "initargs": 5}, TypeError, "initargs"),
        ({"initializer": abs, "initargs": None}, TypeError, "initargs"),
    ],
    ids=str,
)
def test_a_bad_constructor_argument_is_named_in_the_error(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Pool(**kwargs)


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_twenty_pools_in_a_row_leave_no_fd_behind(start_method: str) -> None:
    with Pool(1, start_method=start_method) as pool:  # lazily made fds of the stdlib, first
        pool.submit(tasks.ident, 0).result(timeout=20)
    before = _fds()
    for i in range(20):
        with Pool(2, start_method=start_method) as pool:
            assert pool.submit(tasks.ident, i).result(timeout=20) == i
    assert _fds() - before == set()


@pytest.mark.timeout(60)
def test_a_pool_shut_down_without_waiting_lets_go_of_its_resources_when_its_work_ended() -> None:
    """Kept referenced, never awaited: its thread, fds and memory went only at
    ``await_termination``, its collection or the exit (15 such pools held 150 fds, 15
    threads and 256 MB); ProcessPoolExecutor's go when its work ended."""
    with Pool(1) as warm:  # lazily made fds of the stdlib, first
        warm.submit(tasks.ident, 0).result(timeout=20)
    before = _fds()
    pools = []
    for _ in range(5):
        pool = Pool(2)
        futures = [pool.submit(tasks.ident, k) for k in range(100)]
        pool.shutdown(wait=False)
        pools.append((pool, futures))
    for pool, futures in pools:
        assert [f.result(timeout=20) for f in futures] == list(range(100))
        thread = pool._resources.thread
        assert thread is not None
        wait_until(lambda t=thread: not t.is_alive(), "the coordinator thread ended")
        stats = pool.statistics()  # the final counters, without the memory
        assert stats.completed == 100
        assert sum(w.executed for w in stats.per_worker) == 100
        assert all(w.pid == 0 and w.inbox_depth == 0 for w in stats.per_worker)
    assert _fds() - before == set()
    for pool, _ in pools:
        assert pool.await_termination(timeout=20)


@pytest.mark.timeout(60)
def test_a_pool_made_and_shut_down_in_another_thread() -> None:
    results: list[Any] = []

    def run() -> None:
        try:
            with Pool(2) as pool:
                results.append(pool.submit(tasks.add, 2, 3).result(timeout=20))
                results.append(list(pool.map(tasks.ident, range(5))))
        except BaseException as exc:  # reported below, in the test's thread
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(50)
    assert not thread.is_alive()
    assert results == [5, [0, 1, 2, 3, 4]]


@pytest.mark.timeout(60)
def test_a_shut_down_pool_refuses_work_and_await_termination_says_when_it_ended() -> None:
    pool = Pool(1)
    gate = pool.submit(tasks.spin, 0.3)
    assert pool.await_termination(timeout=0.01) is False  # running: no shutdown asked
    pool.shutdown(wait=False)
    with pytest.raises(PoolClosedError):
        pool.submit(tasks.ident, 1)
    with pytest.raises(PoolClosedError):
        pool.map(tasks.ident, [1])
    with pytest.raises(PoolClosedError):
        pool.schedule("x", time.monotonic(), 0, tasks.ident, 1)
    assert pool.await_termination(timeout=20) is True
    assert gate.result(timeout=0) == 0.3  # the drain ran it
    assert pool.await_termination(timeout=0) is True  # and again: still ended
    pool.shutdown(wait=True)  # a no-op
    assert pool.cancel("x") is False
    assert pool.state("x") is None
    assert pool.statistics().completed == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["fork", "forkserver"])
def test_a_fork_pool_made_while_another_pool_lives(first: str) -> None:
    """The zygote of a fork pool is an ``os.fork()`` of this process, taken while the other
    pool is alive: the after-fork hook that disowns that pool in a fork child, and the zygote's
    closing of the other pool's control socket, must leave both pools working (and the
    workers' ``parent_process()`` intact)."""
    with Pool(1, start_method=first) as a, Pool(2, start_method="fork") as b:
        name, daemon, parent, parent_alive, _ = b.submit(tasks.process_context).result(timeout=20)
        assert (name, daemon, parent, parent_alive) == ("mpsched-zygote", True, os.getpid(), True)
        assert a.submit(tasks.add, 1, 2).result(timeout=20) == 3
        assert b.submit(tasks.add, 3, 4).result(timeout=20) == 7


def _holds_inode(pid: int, inode: int) -> list[str]:
    """Where process ``pid`` holds the file of ``inode``: its open fds and its mappings."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                held.append(f"fd {fd}")
    with open(f"/proc/{pid}/maps") as maps:
        held += [line.strip() for line in maps if line.split()[4] == str(inode)]
    return held


@pytest.mark.timeout(60)
def test_a_fork_pool_holds_none_of_the_memory_of_a_pool_made_before_it() -> None:
    """A fork pool's zygote (and so its workers) is an ``os.fork()`` of this process, which
    copied the other live pools' segment mappings and fds: a pool shut down meanwhile kept its
    ~10 MiB of shared memory as long as the later pool lived. The zygote closes them first."""
    a = Pool(2, start_method="fork")
    assert a.submit(tasks.add, 1, 2).result(timeout=20) == 3
    inode = os.fstat(a._resources.segment.fd).st_ino
    with Pool(1, start_method="fork") as b:
        worker = b.submit(tasks.pid_of).result(timeout=20)
        a.shutdown()
        for pid in (b._resources.zygote.pid, worker):
            assert _holds_inode(pid, inode) == [], pid
        assert b.submit(tasks.add, 3, 4).result(timeout=20) == 7


def _open_gate_while_read(gate: str, give_up: Callable[[], bool]) -> None:
    """Release a task waiting at ``gate`` once it reads it; a task that was killed never
    does: then stop once ``give_up()``."""

    def release() -> bool:
        try:
            fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet (or any more)
            if exc.errno != errno.ENXIO:
                raise
            return give_up()
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        return True

    wait_until(release, "the task reads its gate (or ended)")


@pytest.mark.timeout(60)
def test_a_generator_closed_inside_a_with_block_lets_the_running_task_finish(
    tmp_path: Path,
) -> None:
    """GeneratorExit (a generator closed by its consumer, or by the garbage collector) leaves
    the ``with`` block as any ordinary exit does, as with ProcessPoolExecutor: the running
    task finishes. It was taken for a Ctrl-C, which kills the workers that run tasks."""
    fifos = Fifos(tmp_path)
    pools: list[Pool] = []

    def produce() -> Iterator[Any]:
        with Pool(1) as pool:
            pools.append(pool)
            yield pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 7)
            yield None  # never reached: the consumer closes the generator

    gen = produce()
    future = next(gen)
    tasks.wait_started(fifos.started)

    def release() -> None:
        wait_until(lambda: pools[0]._closed, "the with block's shutdown began")
        _open_gate_while_read(fifos.gate, future.done)

    opener = threading.Thread(target=release)
    opener.start()
    gen.close()  # the with block's exit: it returns once the pool ended
    opener.join()
    assert not future.cancelled()
    assert future.result(timeout=0) == 7


class _SignalInSubmit:
    """Stands for the ``time`` module of ``mpsched._coordinator``: the main thread's next
    ``monotonic()`` there, which ``Coordinator.submit`` reads while it holds the coordinator's
    lock, raises SIGUSR1 first. So its handler runs inside that critical section, as a
    SIGTERM's may in a loop of submits, where a signal comes between any two bytecodes."""

    def __init__(self) -> None:
        self.armed = False

    def monotonic(self) -> float:
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            signal.raise_signal(signal.SIGUSR1)  # the handler runs before this returns
        return time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancel_futures", [True, False])
def test_a_shutdown_in_a_signal_handler_that_interrupted_a_submit_is_asked_not_awaited(
    fifos: Fifos, monkeypatch: pytest.MonkeyPatch, cancel_futures: bool
) -> None:
    """The handler's ``shutdown`` waited for ever for the coordinator's lock, which the
    interrupted ``submit`` of its own thread held (one run in three of a loop of submits with
    a SIGTERM handler that shuts the pool down). Now it asks for the shutdown and returns;
    the pool refuses work from then on, and ends by itself."""
    shim = _SignalInSubmit()
    monkeypatch.setattr(_coordinator, "time", shim)
    pool = Pool(1)
    returned: list[bool] = []

    def handler(signum: int, frame: object) -> None:
        pool.shutdown(wait=True, cancel_futures=cancel_futures)
        returned.append(True)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        held = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)
        shim.armed = True
        queued = pool.submit(tasks.ident, 1)  # the handler runs in here
        assert returned == [True]
        with pytest.raises(PoolClosedError):
            pool.submit(tasks.ident, 2)
        if cancel_futures:  # the loop began the shutdown: what no worker claimed is cancelled
            wait_until(queued.done, "the queued task is cancelled")
            assert queued.cancelled()
        tasks.open_gate(fifos.gate)
        assert pool.await_termination(timeout=20) is True
        assert held.result(timeout=0) == 0
        assert cancel_futures or queued.result(timeout=0) == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)
        shim.armed = False
        pool.shutdown(cancel_futures=True)
