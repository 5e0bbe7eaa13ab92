"""Worker lifecycle options: initializer/initargs and max_tasks_per_worker (crash-safety issue)."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait

import psutil
import pytest

from mpsched import BrokenPoolError, Pool, TaskPicklingError, _coord_recovery, _zygote

from . import tasks
from .conditions import wait_until

START_METHODS = ["forkserver", "spawn", "fork"]
ROOT = pathlib.Path(__file__).resolve().parents[2]

# A main module that the spawned zygote cannot import (it is gone by then).
UNSTARTABLE = """
import os, threading
from mpsched import BrokenPoolError, Pool

if __name__ == "__main__":
    os.remove(__file__)
    try:
        Pool(2, start_method="spawn")
    except BrokenPoolError as exc:
        print("BrokenPoolError:", exc, flush=True)
    print("threads:", threading.active_count(), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_initializer_runs_once_in_each_worker(start_method: str) -> None:
    with Pool(2, start_method=start_method, initializer=tasks.remember, initargs=(1, "a")) as pool:
        seen = [pool.submit(tasks.initialized).result(timeout=20) for _ in range(20)]
    assert all(s == [(1, "a")] for s in seen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_failing_initializer_breaks_the_pool_with_its_error_and_no_respawn_loop(
    start_method: str,
) -> None:
    pool = Pool(
        2, start_method=start_method, initializer=tasks.failing_initializer, initargs=("no db",)
    )
    try:  # the pool may already be broken when submit runs (fork starts fast): both are fine
        future = pool.submit(tasks.ident, 1)
    except BrokenPoolError as exc:
        error: BaseException = exc
    else:
        with pytest.raises(BrokenPoolError) as info:
            future.result(timeout=20)
        error = info.value
    assert isinstance(error, BrokenProcessPool)  # as ProcessPoolExecutor's, for its users' code
    chain = []
    while error is not None:
        chain.append(error)
        error = error.__cause__
    assert any("initializer" in str(e) for e in chain)
    (cause,) = [e for e in chain if isinstance(e, OSError) and "no db" in str(e)]
    # A later call's error too, as the Pool docstring says: its cause is the initializer's
    # exception (it was the first BrokenPoolError, the exception one level further down).
    calls: list[Callable[[], object]] = [
        lambda: pool.submit(tasks.ident, 2),
        lambda: pool.schedule("t", 0.0, 0, tasks.ident, 2),
        lambda: list(pool.map(tasks.ident, [2])),
    ]
    for call in calls:
        with pytest.raises(BrokenPoolError, match="initializer") as later:
            call()
        assert later.value.__cause__ is cause
    pool.shutdown(wait=True)
    assert pool.statistics().respawns == 0


@pytest.mark.timeout(60)
@pytest.mark.no_fd_check  # the Value's memory: multiprocessing's heap keeps its file for good
@pytest.mark.parametrize("start_method", START_METHODS)
def test_initargs_may_be_multiprocessing_objects_shared_by_inheritance(start_method: str) -> None:
    """A ``Value``, a ``Lock``, a ``Queue`` and a pipe's end in ``initargs``, as
    ProcessPoolExecutor takes them: the first three were refused at ``Pool()`` (they pickle
    only as a process starts), the pipe's end went as a bare fd number (found in review). The
    workers retire after each task: the queue's items, which its thread writes, were lost at
    a worker's exit (a diff review)."""
    ctx = multiprocessing.get_context(start_method)
    counter, lock, queue = ctx.Value("i", 0, lock=False), ctx.Lock(), ctx.Queue()
    receiver, sender = ctx.Pipe(duplex=False)
    n = 40
    with Pool(
        2,
        start_method=start_method,
        max_tasks_per_worker=1,
        initializer=tasks.remember,
        initargs=(counter, lock, queue, sender),
    ) as pool:
        assert sorted(pool.map(tasks.count_and_report, range(n))) == list(range(n))
    assert counter.value == n
    assert sorted(queue.get(timeout=20) for _ in range(n)) == list(range(n))
    assert sorted(receiver.recv() for _ in range(n)) == list(range(n))
    queue.close()
    queue.join_thread()
    receiver.close()
    sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_initargs_beside_a_queue_go_as_a_tasks_arguments_do(start_method: str) -> None:
    """With a ``Queue`` (an object that only a process's start carries) and a pipe's end, the
    other arguments still go as a task's do: a lambda, which multiprocessing's pickler refuses
    (a bare PicklingError at ``Pool()``), and a local function, which it writes by a name that
    the zygote lacks (the zygote died of it; a diff review)."""
    ctx = multiprocessing.get_context(start_method)
    queue = ctx.Queue()
    receiver, sender = ctx.Pipe(duplex=False)

    def local() -> str:
        return "local"

    config = {"k": 1}
    with Pool(
        1,
        start_method=start_method,
        initializer=tasks.remember,
        # (One that names multiprocessing.connection's module is no Connection: a review.)
        initargs=(queue, lambda: "lambda", local, sender, config, config, lambda: wait),
    ) as pool:
        assert pool.submit(tasks.call_remembered, 1).result(timeout=20) == "lambda"
        assert pool.submit(tasks.call_remembered, 2).result(timeout=20) == "local"
        # Two arguments that are one object stay one, as in one pickle (a diff review).
        assert pool.submit(tasks.remembered_are_one, 4, 5).result(timeout=20)
        assert pool.submit(tasks.call_remembered, 6).result(timeout=20) is wait
    queue.close()
    queue.join_thread()
    receiver.close()
    sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_pipes_end_alone_in_initargs_reaches_the_workers_as_a_working_connection(
    start_method: str,
) -> None:
    """A pipe's end with nothing else that only a process's start carries: plain pickle takes
    it (as a bare fd number, which a worker refuses to load), so ``pickled_initializer`` looks
    for the Connection's module in that pickle and sends the pipe's end by inheritance. Sent
    as pickled bytes, the initializer raised and broke the pool (a mutation hunt found this
    unpinned: the other tests have a Queue or a Value beside the pipe)."""
    receiver, sender = multiprocessing.Pipe()  # the default context's, as a user makes it
    try:
        with Pool(
            1, start_method=start_method, initializer=tasks.remember, initargs=(sender,)
        ) as pool:
            assert pool.submit(tasks.send_on_remembered, 0, "hi").result(timeout=30) == "sent"
        assert receiver.poll(20)
        assert receiver.recv() == "hi"
    finally:
        receiver.close()
        sender.close()


@pytest.mark.timeout(60)
def test_a_queue_left_full_delays_a_workers_exit_by_one_second_at_most() -> None:
    """A worker's exit runs multiprocessing's exit finalizers (so that a queue's items are
    written), which wait for a queue's thread: one filled past its pipe, which nobody reads,
    held each exit the retiring worker's 10 s alarm (a diff review). Now each waits at most
    ``EXIT_FLUSH_TIMEOUT`` (1 s): three one-task workers and the shutdown take seconds, not
    the 30 s and more they took."""
    started = time.monotonic()
    with Pool(1, max_tasks_per_worker=1) as pool:
        pids = {pool.submit(tasks.leave_a_full_queue).result(timeout=30) for _ in range(3)}
    assert len(pids) == 3
    assert time.monotonic() - started < 3 * _zygote.EXIT_FLUSH_TIMEOUT + 6.0


@pytest.mark.timeout(60)
def test_initargs_that_no_process_start_can_carry_fail_at_construction() -> None:
    generator = (x for x in ())
    with pytest.raises(TaskPicklingError, match=r"initializer's arguments.*generator"):
        Pool(1, start_method="forkserver", initializer=tasks.remember, initargs=(generator, 1))
    # A Lock made for fork with a forkserver pool: multiprocessing's own refusal (3.11 on), at
    # Pool(); ProcessPoolExecutor raises the same as it starts its workers. Python 3.10's
    # multiprocessing lets it through, and the lock works there.
    lock = multiprocessing.get_context("fork").Lock()
    if sys.version_info >= (3, 11):
        with pytest.raises(TaskPicklingError, match="fork context"):
            Pool(1, start_method="forkserver", initializer=tasks.remember, initargs=(lock,))
        with pytest.raises(TaskPicklingError, match="cannot pickle"):  # the function's own error
            Pool(1, initializer=lambda: threading.Lock(), initargs=(lock,))
    else:
        with Pool(1, start_method="forkserver", initializer=tasks.remember, initargs=(lock,)) as p:
            assert p.submit(abs, -1).result(timeout=30) == 1


def test_bad_lifecycle_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="max_tasks_per_worker"):
        Pool(1, max_tasks_per_worker=0)
    for wrong in ("3", 1.5, True):  # a wrong type was a ValueError, unlike workers'
        with pytest.raises(TypeError, match="max_tasks_per_worker"):
            Pool(1, max_tasks_per_worker=wrong)  # type: ignore[arg-type]
    for name in ("timed_after_shutdown", "recurring_after_shutdown"):
        with pytest.raises(TypeError, match=name):  # "no" was taken as True
            Pool(1, **{name: "no"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initializer"):
        Pool(1, initializer="setup")  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_the_zygote_reaps_the_workers_it_replaced(start_method: str) -> None:
    """Every recycled worker is reaped by the zygote, its parent, while the pool lives: no
    zombie piles up (an audit's mutant that read each exit status without reaping passed
    every test, with 20 zombies after 20 one-task workers)."""
    with Pool(1, start_method=start_method, max_tasks_per_worker=1) as pool:
        pids = {pool.submit(tasks.pid_of, i).result(timeout=30) for i in range(20)}
        assert len(pids) == 20
        zygote = psutil.Process(pool._resources.zygote.pid)

        def zombies() -> list[int]:
            found = []
            for child in zygote.children():
                try:  # listed, then reaped before its status is read: gone, as it should be
                    if child.pid in pids and child.status() == psutil.STATUS_ZOMBIE:
                        found.append(child.pid)
                except psutil.NoSuchProcess:
                    pass
            return found

        # The last worker's exit may still be on its way to the zygote's wait.
        wait_until(lambda: not zombies(), "the zygote reaped its retired workers")


@pytest.mark.timeout(60)
def test_max_tasks_per_worker_recycles_workers_and_loses_nothing() -> None:
    with Pool(2, max_tasks_per_worker=10, initializer=tasks.remember, initargs=("x",)) as pool:
        futures = [pool.submit(tasks.pid_of, i) for i in range(200)]
        pids = [f.result(timeout=30) for f in futures]
        nested = [pool.submit(tasks.fib, 10) for _ in range(20)]
        assert [f.result(timeout=30) for f in nested] == [55] * 20
        stats = pool.statistics()
    per_pid = {pid: pids.count(pid) for pid in set(pids)}
    assert max(per_pid.values()) <= 10
    assert len(per_pid) >= 20
    assert stats.recycled >= 19
    assert stats.crashes == 0


# ``Pool()`` returns before its workers have started (they register as they come): a shutdown
# right away must still drain every one of them, and the zygote must not find its coordinator
# gone while it reports a new worker (a traceback on stderr). In a fresh interpreter: under
# forkserver the zygote's stderr is the server's, which ``capfd`` in pytest's process did not
# read (the check of stderr could not fail there).
SHUT_DOWN_AT_ONCE = """
import sys
from mpsched import Pool

if __name__ == "__main__":
    for _ in range(3):
        with Pool(4, start_method=sys.argv[1]) as pool:
            pass
        assert sorted(pool._coordinator.final_stats) == [0, 1, 2, 3], pool._coordinator.final_stats
    print("done", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_a_pool_shut_down_at_once_drains_the_workers_still_starting(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    run_quietly(SHUT_DOWN_AT_ONCE, start_method, tmp_path)


@pytest.mark.timeout(60)
def test_a_zygote_that_cannot_start_fails_the_pool_creation(tmp_path: pathlib.Path) -> None:
    """The coordinator thread already runs (it waits for the zygote's READY): a failed start
    ends it too, and leaves no process (the no_leaks fixture) and no name in /dev/shm."""
    script = tmp_path / "unstartable.py"
    script.write_text(UNSTARTABLE)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr
    assert "BrokenPoolError: the pool's zygote process died" in result.stdout
    assert "threads: 1" in result.stdout


# A pool whose initializer fails in one worker, and in its peers only once the test says so,
# which it never does: the peer still in its initializer when the pool broke is killed with it.
# (Before, the peers lived on, each failed when told, and its report found its socket closed: a
# BrokenPipeError traceback per peer was the first bug here.)
LATE_INIT_FAILURES = """
import os, sys
import psutil
from mpsched import BrokenPoolError, Pool
from tests.integration import tasks

if __name__ == "__main__":
    directory = sys.argv[2]
    pool = Pool(
        2,
        start_method=sys.argv[1],
        initializer=tasks.failing_initializer_late_in_peers,
        initargs=(directory,),
    )
    try:
        pool.submit(tasks.ident, 1).result(timeout=20)
    except BrokenPoolError:
        pass
    assert pool._coordinator.finished.wait(20)
    pool._zygote.join(20)  # it kills every worker, then exits
    assert not pool._zygote.is_alive(), "the broken pool's zygote lives on"
    names = os.listdir(directory)  # a late peer may have been killed before it wrote its pid
    late = [int(n[5:]) for n in names if n.startswith("late-") and n[5:].isdigit()]
    assert not [pid for pid in late if psutil.pid_exists(pid)], late
    pool.shutdown(wait=True)
    print("done", flush=True)
"""


def run_quietly(script: str, start_method: str, tmp_path: pathlib.Path) -> None:
    """Run ``script`` (argv: start method, a directory) in a fresh interpreter: it must print
    "done" and nothing on stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", script, start_method, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=45,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "done\n"
    assert proc.stderr == "", proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_peer_in_its_initializer_when_the_pool_broke_ends_with_it_quietly(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    run_quietly(LATE_INIT_FAILURES, start_method, tmp_path)


# A worker runs a task while a peer's initializer breaks the pool: it is killed with the pool,
# at the task's gate, which the test never opens. (Before, the task ended when the test opened
# the gate, and its report found the worker's socket closed: a BrokenPipeError traceback was
# the first bug here. A worker the coordinator had not registered when the pool broke then
# lived on until the shutdown: see test_exit_paths.)
TASK_RUNNING_WHEN_THE_POOL_BROKE = """
import os, sys
import psutil
from mpsched import BrokenPoolError, Pool
from tests.integration import tasks

if __name__ == "__main__":
    directory = sys.argv[2]
    started, task_gate, init_gate = (os.path.join(directory, n) for n in ("s", "t", "i"))
    for fifo in (started, task_gate, init_gate):
        os.mkfifo(fifo)
    pool = Pool(
        2,
        start_method=sys.argv[1],
        initializer=tasks.initializer_failing_at_gate,
        initargs=(directory, init_gate),
    )
    future = pool.submit(tasks.report_pid_then_gate, started, task_gate)
    worker = psutil.Process(tasks.read_pid(started))
    tasks.open_gate(init_gate)  # the other worker's initializer raises: the pool breaks
    try:
        future.result(timeout=20)
    except BrokenPoolError:
        pass
    try:
        worker.wait(20)
    except psutil.TimeoutExpired:  # say where it is
        views = pool._views
        slots = [(s.is_sleeping(), s.inbox_depth(), len(s), s.done_depth()) for s in views.slots]
        with open(f"/proc/{worker.pid}/wchan") as wchan:
            where = wchan.read()
        print(worker.status(), where, worker.cpu_times(), slots, views.header.collector(),
              views.header.lazy_sweep(), file=sys.stderr)
        raise
    pool.shutdown(wait=True)
    print("done", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_worker_running_a_task_when_the_pool_broke_ends_with_it_quietly(
    tmp_path: pathlib.Path, start_method: str
) -> None:
    run_quietly(TASK_RUNNING_WHEN_THE_POOL_BROKE, start_method, tmp_path)


@pytest.mark.timeout(60)
def test_a_task_goes_to_a_ready_worker_not_to_one_still_in_its_initializer(
    tmp_path: pathlib.Path,
) -> None:
    """One worker's initializer is done and the worker sleeps; its peer's still runs: the
    task went to the peer, which looked awake, and waited for the end of its initializer
    while the ready worker slept (the test that gated that initializer hung)."""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    pool = Pool(2, initializer=tasks.initializer_waiting_at_gate, initargs=(str(tmp_path), gate))
    try:
        coordinator = pool._coordinator

        def one_ready_and_asleep() -> bool:
            workers, slots = coordinator.workers, coordinator.slots
            if any(w is None for w in workers):
                return False
            ready = [w is not None and slots[k].owner_pid() == w.pid for k, w in enumerate(workers)]
            return sorted(ready) == [False, True] and slots[ready.index(True)].is_sleeping()

        wait_until(one_ready_and_asleep, "one worker ready and asleep, its peer initializing")
        assert pool.submit(tasks.ident, 1).result(timeout=10) == 1
    finally:
        tasks.open_gate(gate)
        pool.shutdown()


def _broken_at_first_task(pool: Pool) -> BaseException:
    """The BrokenPoolError of a pool whose initializer breaks it: raised by the first submit
    or by its task's result (the pool may already be broken when submit runs: both are fine)."""
    try:
        future = pool.submit(tasks.ident, 1)
    except BrokenPoolError as exc:
        return exc
    with pytest.raises(BrokenPoolError) as info:
        future.result(timeout=20)
    return info.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_worker_sigkilled_in_its_initializer_is_replaced(
    start_method: str, tmp_path: pathlib.Path
) -> None:
    """An external SIGKILL (the OOM killer) of a worker still in its initializer broke the
    whole pool (every later task failed), as an initializer's own failure does: under
    ``max_tasks_per_worker=1`` a worker is nearly always starting. Now it is replaced."""
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    pool = Pool(
        2,
        start_method=start_method,
        initializer=tasks.initializer_waiting_at_gate,
        initargs=(str(tmp_path), gate),
    )
    try:
        coordinator = pool._coordinator

        def initializing() -> list[int]:
            return [
                w.pid
                for k, w in enumerate(coordinator.workers)
                if w is not None and coordinator.slots[k].owner_pid() != w.pid
            ]

        def bound() -> int:
            return sum(
                w is not None and coordinator.slots[k].owner_pid() == w.pid
                for k, w in enumerate(coordinator.workers)
            )

        wait_until(lambda: bound() == 1 and len(initializing()) == 1, "one worker at the gate")
        (waiting,) = initializing()
        os.kill(waiting, signal.SIGKILL)
        wait_until(lambda: initializing() not in ([], [waiting]), "its replacement at the gate")
        assert pool.submit(tasks.ident, 1).result(timeout=20) == 1
        tasks.open_gate(gate)  # the replacement gets through its initializer
        wait_until(lambda: bound() == 2, "both workers past the initializer")
        assert list(pool.map(tasks.ident, range(20))) == list(range(20))
        stats = pool.statistics()
        assert (stats.crashes, stats.respawns) == (1, 1)
    finally:
        pool.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_an_initializer_sigkilled_every_time_breaks_the_pool_after_a_few_respawns(
    start_method: str,
) -> None:
    """The replacement rule is bounded: ``INIT_KILLS_MAX`` workers SIGKILLed in the initializer
    with no task completed meanwhile (an initializer that the OOM killer ends each time) break
    the pool, with no endless respawn loop."""
    pool = Pool(1, start_method=start_method, initializer=tasks.kill_self)
    try:
        error = _broken_at_first_task(pool)
        assert "initializer" in str(error)
        assert "SIGKILL" in str(error)
    finally:
        pool.shutdown(wait=False)
        assert pool.await_termination(timeout=20)
    assert pool.statistics().respawns == _coord_recovery.INIT_KILLS_MAX - 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_an_initializer_that_kills_its_worker_breaks_the_pool_without_a_respawn_loop(
    start_method: str,
) -> None:
    # Was: every replacement died in the initializer too, ~1,500 respawns a second, the task
    # never ended and shutdown(wait=True) never returned.
    pool = Pool(2, start_method=start_method, initializer=tasks.exit_at_once, initargs=(3,))
    try:
        error = _broken_at_first_task(pool)
        assert "initializer" in str(error)
        assert "exit code 3" in str(error)
        with pytest.raises(BrokenPoolError):
            pool.submit(tasks.ident, 2)
    finally:
        pool.shutdown(wait=False)
        assert pool.await_termination(timeout=20)
    assert pool.statistics().respawns == 0
