"""Crash and bad-input matrix, in the style of CPython's test_concurrent_futures/test_deadlock.py.

Each case is one row of a table: what goes wrong (in the caller, in a worker, or in the
coordinator) and the error the caller must see. Every case runs on a fresh 2-worker pool, is
bounded by timeouts (a hang fails the case, it never stalls the run), and ends by checking that
the pool still runs a normal task and then shuts down. Cases whose outcome depends on how the
workers were started (crashes, replacements, fork and threads inside a task) run under every
start method (the ``ctx`` fixture); the pickling and payload cases do not depend on it and run
under the default one.

Expected outcomes, in short: nothing that can be pickled badly in the caller reaches the pool
(the error is raised by ``submit``); anything that goes wrong inside a task, including its
result or exception failing to travel, fails that task's future with a clear error and leaves
the worker alive; a worker that dies fails its running task with ``WorkerCrashedError`` (exit
code or signal in the message) and is replaced; nothing is ever lost or hung.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import multiprocessing
import os
import random
import re
import resource
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from mpsched import (
    BrokenPoolError,
    MpschedError,
    Pool,
    PoolClosedError,
    TaskOutcomeError,
    TaskPicklingError,
    TaskState,
    WorkerCrashedError,
)
from mpsched._protocol import RemoteTraceback
from mpsched._slot_region import MAX_NESTING

from . import bad_tasks as bt
from . import tasks
from .conditions import start_every_worker, wait_until

WORKERS = 2
CASE_TIMEOUT = 20.0  # s; each future of a case must end within this (a hang fails the case)
SHUTDOWN_TIMEOUT = 30.0  # s; the pool must shut down within this after each case
REPLACEMENT_TIMEOUT = 20.0  # s; a dead worker must be replaced within this
POLL = 0.005  # s; period of the statistics() polls while waiting for the replacement
SUBMITTERS = 4  # threads submitting while the pool shuts down
_CRASHED_PID = re.compile(r"\(pid (\d+), slot \d+\)")


@dataclass(frozen=True)
class Case:
    """One row: call ``fn(*args)`` in the pool; its future must raise ``error`` (a regex
    ``match`` on the message) or, with ``error=None``, return a value accepted by ``check``."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    error: type[BaseException] | None = None
    match: str | None = None
    check: Callable[[Any], bool] = field(default=lambda value: True)
    make_args: Callable[[], tuple[Any, ...]] | None = None  # instead of args: built at the run
    exitcode: int | None = None  # a worker died with this: it must be replaced

    def __str__(self) -> str:
        return self.name


@contextlib.contextmanager
def bounded_pool(start_method: str | None) -> Iterator[Pool]:
    """A pool that must shut down (draining its work) within SHUTDOWN_TIMEOUT."""
    pool = Pool(WORKERS, start_method=start_method)
    try:
        yield pool
    finally:
        pool.shutdown(wait=False)
        finished = pool.await_termination(SHUTDOWN_TIMEOUT)
    assert finished, f"the pool did not shut down within {SHUTDOWN_TIMEOUT} s"


def assert_pool_works(pool: Pool) -> None:
    assert pool.submit(tasks.add, 2, 3).result(CASE_TIMEOUT) == 5
    assert list(pool.map(tasks.ident, range(50), timeout=CASE_TIMEOUT)) == list(range(50))


def wait_replaced(pool: Pool, dead_pid: int) -> None:
    """Until every slot has a live worker other than ``dead_pid`` (bounded poll)."""
    deadline = time.monotonic() + REPLACEMENT_TIMEOUT
    while True:
        pids = [w.pid for w in pool.statistics().per_worker]
        if all(pids) and dead_pid not in pids:
            return
        assert time.monotonic() < deadline, f"worker {dead_pid} not replaced: {pids}"
        time.sleep(POLL)


def run_case(case: Case, start_method: str | None) -> None:
    with bounded_pool(start_method) as pool:
        if case.exitcode is not None:
            start_every_worker(pool)  # wait_replaced waits for a worker in every slot
        args = case.args if case.make_args is None else case.make_args()
        future = pool.submit(case.fn, *args)
        del args
        if case.error is None:
            value = future.result(CASE_TIMEOUT)
            assert case.check(value), f"{case}: unexpected result {str(value)[:200]}"
        else:
            with pytest.raises(case.error, match=case.match) as info:
                future.result(CASE_TIMEOUT)
            assert future.done()
        if case.exitcode is not None:
            assert isinstance(info.value, WorkerCrashedError)
            assert info.value.exitcode == case.exitcode
            found = _CRASHED_PID.search(str(info.value))
            assert found, str(info.value)
            wait_replaced(pool, int(found.group(1)))  # the future fails before the respawn
        assert_pool_works(pool)
        stats = pool.statistics()
        crashes = 0 if case.exitcode is None else 1
        assert (stats.crashes, stats.respawns) == (crashes, crashes), f"{case}: {stats}"


def _unpicklable_function() -> Callable[[], Any]:
    lock = threading.Lock()
    return lambda: lock  # cloudpickle would pickle the closure's lock: it cannot


# ------------------------------------------------------------------ errors raised by submit
SUBMIT_CASES = [
    Case("unpicklable argument", tasks.ident, (threading.Lock(),), TaskPicklingError, "pickle"),
    Case("unpicklable function", _unpicklable_function(), (), TaskPicklingError, "pickle"),
    Case("argument whose pickling raises", tasks.ident, (bt.ErrorAtPickle(),), TaskPicklingError),
    Case(
        "unpicklable function whose repr() raises",
        bt.HostileCallable(),
        (),
        TaskPicklingError,
        "HostileCallable cannot be pickled",
    ),
    # Pickling runs in the caller's thread: a SystemExit raised there reaches the caller as is.
    Case("argument whose pickling exits", tasks.ident, (bt.ExitAtPickle(),), SystemExit),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", SUBMIT_CASES, ids=str)
def test_a_call_that_cannot_be_pickled_fails_at_submit(case: Case) -> None:
    with bounded_pool(None) as pool:
        assert case.error is not None
        with pytest.raises(case.error, match=case.match):
            pool.submit(case.fn, *case.args)
        assert pool.statistics().submitted == 0
        assert_pool_works(pool)


# ------------------------------------------------------------------ tasks that exit or crash
def _fork_ok(value: tuple[int, int]) -> bool:
    return value[0] == 0  # the forked child's exit code, reaped by the task


WORKER_CASES = [
    Case("sys.exit(3) in a task", tasks.exit_task, (3,), SystemExit, "3"),
    Case("KeyboardInterrupt in a task", tasks.raise_keyboard_interrupt, (), KeyboardInterrupt),
    Case("recursion too deep", bt.recurse, (), RecursionError, "maximum recursion depth"),
    Case("os._exit(3)", bt.exit_process, (3,), WorkerCrashedError, r"exit code 3\b", exitcode=3),
    Case("segfault", bt.segfault, (), WorkerCrashedError, r"SIGSEGV\(-11\)", exitcode=-11),
    Case(
        "argument whose unpickling kills the worker",
        tasks.ident,
        (bt.CrashAtUnpickle(),),
        WorkerCrashedError,
        r"exit code 7\b",
        exitcode=7,
    ),
    Case("task forks and reaps its child", bt.fork_and_reap, (), check=_fork_ok),
    Case(
        "task runs threads",
        bt.start_threads,
        (4, False),
        check=lambda v: v == [sum(range(i * 1000)) for i in range(4)],
    ),
    Case(
        "task leaves a non-daemon thread blocked",
        bt.start_threads,
        (2, True),
        check=lambda v: v == [0, sum(range(1000))],
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", WORKER_CASES, ids=str)
def test_a_task_that_exits_crashes_forks_or_starts_threads(case: Case, ctx: Any) -> None:
    run_case(case, ctx.get_start_method())


# ------------------------------------------------------------------ results and exceptions
# What a child's future raises, each time it is asked, for a result that cannot be unpickled in
# the parent (as a top-level task's future does).
_CHILD_UNPICKLING_FAILED = "TaskOutcomeError: the task's result could not be unpickled: {}"

PICKLING_CASES = [
    Case(
        "unpicklable result",
        tasks.unpicklable_result,
        (),
        TaskPicklingError,
        # It names the result, and says what to return (not "pass picklable arguments").
        r"cannot pickle the result <unlocked _thread\.lock.*return picklable values",
    ),
    Case(
        "unpicklable result whose repr() raises",
        bt.return_instance,
        (bt.HostileError,),
        TaskPicklingError,
        "HostileError cannot be pickled",
    ),
    Case(
        "result whose pickling raises",
        bt.return_instance,
        (bt.ErrorAtPickle,),
        TaskPicklingError,
        "error at pickle",
    ),
    Case(
        "result that cannot be unpickled",
        bt.return_instance,
        (bt.ErrorAtUnpickle,),
        TaskOutcomeError,
        "result could not be unpickled.*error at unpickle",
    ),
    Case(
        "result whose unpickling exits",
        bt.return_instance,
        (bt.ExitAtUnpickle,),
        TaskOutcomeError,
        "result could not be unpickled.*exit at unpickle",
    ),
    Case(
        "result whose unpickling raises KeyboardInterrupt",
        bt.return_instance,
        (bt.InterruptAtUnpickle,),
        TaskOutcomeError,
        "result could not be unpickled.*interrupt at unpickle",
    ),
    Case(
        "child result that cannot be unpickled",
        bt.child_result_asked_twice,
        (bt.ErrorAtUnpickle,),
        check=lambda v: (
            v == [_CHILD_UNPICKLING_FAILED.format("ValueError('error at unpickle')")] * 2 + ["2"]
        ),
    ),
    Case(
        "child result whose unpickling exits",
        bt.child_result_asked_twice,
        (bt.ExitAtUnpickle,),
        check=lambda v: (
            v == [_CHILD_UNPICKLING_FAILED.format("SystemExit('exit at unpickle')")] * 2 + ["2"]
        ),
    ),
    Case(
        "child result that does not pickle",
        bt.child_result_asked_twice,
        (bt.ErrorAtPickle,),
        check=lambda v: (
            len(v) == 3
            and v[0] == v[1]
            and v[0].startswith("TaskPicklingError: cannot pickle the result <")
            and "return picklable values" in v[0]
            and v[2] == "2"
        ),
    ),
    Case(
        "argument that cannot be unpickled",
        tasks.ident,
        (bt.ErrorAtUnpickle(),),
        ValueError,
        "error at unpickle",
    ),
    Case(
        "argument whose unpickling exits",
        tasks.ident,
        (bt.ExitAtUnpickle(),),
        SystemExit,
        "exit at unpickle",
    ),
    Case(
        "exception with an unpicklable argument",
        bt.raise_error,
        ("unpicklable-arg",),
        TaskOutcomeError,
        r"ValueError.*could not be pickled",
    ),
    Case(
        "exception that cannot be unpickled",
        bt.raise_error,
        ("two-arg",),
        TaskOutcomeError,
        r"exception could not be unpickled.*TwoArgError",
    ),
    Case(
        "exception that cannot be pickled, nor repr()'d, nor str()'d",
        bt.raise_error,
        ("hostile",),
        TaskOutcomeError,
        r"HostileError.*could not be pickled",
    ),
    Case(
        "exception that unpickles as a non-exception",
        bt.raise_error,
        ("not-an-exception",),
        TaskOutcomeError,
        r"exception could not be unpickled.*str.* not an exception",
    ),
    Case(
        "result whose unpickling raises an error without a repr",
        bt.return_instance,
        (bt.ReprRaisesAtUnpickle,),
        TaskOutcomeError,
        r"result could not be unpickled.*ReprRaisesError",
    ),
    Case(
        "result whose pickling exits",
        bt.return_instance,
        (bt.ExitAtPickle,),
        TaskPicklingError,
        r"cannot pickle the result .*SystemExit\('exit at pickle'\)",
    ),
    Case(
        "result whose pickling raises KeyboardInterrupt",
        bt.return_instance,
        (bt.InterruptAtPickle,),
        TaskPicklingError,
        r"cannot pickle the result .*KeyboardInterrupt\('interrupt at pickle'\)",
    ),
    Case(
        "exception whose pickling exits",
        bt.raise_error,
        ("exit-at-pickle",),
        TaskOutcomeError,
        r"ExitAtPickleError.*could not be pickled",
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", PICKLING_CASES, ids=str)
def test_a_result_or_exception_that_does_not_travel_fails_its_future_only(case: Case) -> None:
    run_case(case, None)


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_unpickled_has_the_unpickling_error_as_cause() -> None:
    """The error of the user's ``__reduce__`` is the cause, with its traceback (the message
    had only its repr); the frame that caught it, which held the result's bytes, is not in
    that traceback."""
    with bounded_pool(None) as pool:
        future = pool.submit(bt.return_instance, bt.ErrorAtUnpickle)
        with pytest.raises(TaskOutcomeError, match="could not be unpickled") as info:
            future.result(CASE_TIMEOUT)
        cause = info.value.__cause__
        assert isinstance(cause, ValueError), repr(cause)
        assert str(cause) == "error at unpickle"
        names = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
        assert names == ["_raise"], names
        assert_pool_works(pool)


@pytest.mark.timeout(60)
def test_a_map_result_that_cannot_be_unpickled_fails_at_its_position() -> None:
    """Map unpickles its chunks' results in the caller's thread (their size bounds the later
    chunks): an error, SystemExit included, fails as a task's result would (TaskOutcomeError) after
    the earlier results; a KeyboardInterrupt goes on, as a Ctrl-C there would."""
    with bounded_pool(None) as pool:
        for cls in (bt.ErrorAtUnpickle, bt.ExitAtUnpickle):
            results = pool.map(bt.return_instance, [int, cls, int], chunksize=1)
            assert next(results) == 0
            with pytest.raises(TaskOutcomeError, match="result could not be unpickled"):
                next(results)
        results = pool.map(bt.return_instance, [int, bt.InterruptAtUnpickle], chunksize=1)
        assert next(results) == 0
        with pytest.raises(KeyboardInterrupt, match="interrupt at unpickle"):
            next(results)
        assert_pool_works(pool)


@pytest.mark.timeout(60)
def test_a_map_result_whose_pickling_exits_fails_at_its_position() -> None:
    """In the worker, a result's SystemExit at pickling is that result's error: the results
    before it in its chunk still come (they were lost with the chunk, and the map raised a
    bare SystemExit)."""
    with bounded_pool(None) as pool:
        results = pool.map(functools.partial(bt.exit_at_pickle_at, bad=5), range(8), chunksize=8)
        assert [next(results) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(TaskPicklingError, match="SystemExit"):
            next(results)
        assert_pool_works(pool)


@pytest.mark.timeout(60)
def test_an_exception_that_cannot_be_unpickled_keeps_the_workers_traceback() -> None:
    """The TaskOutcomeError that stands in for it has the worker's traceback as its cause, as the
    exception would have had: it is the only trace of where the task failed."""
    with bounded_pool(None) as pool:
        future = pool.submit(bt.raise_error, "two-arg")
        with pytest.raises(TaskOutcomeError, match="exception could not be unpickled") as info:
            future.result(CASE_TIMEOUT)
        assert isinstance(info.value, MpschedError)
        assert isinstance(info.value, RuntimeError)
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback), repr(cause)
        assert "in raise_error" in str(cause)
        assert "TwoArgError: bad exception (2)" in str(cause)


@pytest.mark.timeout(60)
def test_an_unpickling_that_waits_for_a_task_of_the_pool_is_refused_not_hung(
    tmp_path: Path,
) -> None:
    """A task's exception is unpickled where the pool settles futures (its coordinator thread,
    or a caller collecting in ``result()``); there, a wait with no timeout for a task of the
    pool waited for ever: the one thread that could settle it was the waiting one (a diff
    review). It is refused: the exception's unpickling fails, saying why."""
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    os.mkfifo(started)
    os.mkfifo(gate)
    with bounded_pool(None) as pool:
        holder = pool.submit(tasks.started_then_gated, started, gate, "held")
        tasks.wait_started(started)
        timed = pool.with_options(timeout=60)  # settled through end_runs: owner FINISHING
        try:
            first, second = (timed.submit(bt.raise_waits_at_unpickle, m) for m in "ab")
            bt.WAITED.append(second)
            tasks.open_gate(gate)
            for future in (first, second):
                with pytest.raises(TaskOutcomeError, match="with no timeout, in a thread"):
                    future.result(timeout=CASE_TIMEOUT)
        finally:
            bt.WAITED.clear()
        assert holder.result(timeout=CASE_TIMEOUT) == "held"
        assert_pool_works(pool)


@pytest.mark.timeout(60)
def test_an_open_file_fails_at_submit_or_as_a_result(tmp_path: Path) -> None:
    """As plain pickle refuses an open file: cloudpickle, the fallback, copied it as a
    ``StringIO`` of the whole file, read in the caller (found in review)."""
    path = tmp_path / "data.txt"
    path.write_text("x" * 1000)
    with bounded_pool(None) as pool, open(path) as file:
        with pytest.raises(TaskPicklingError, match="open text file"):
            pool.submit(len, file)
        with pytest.raises(TaskPicklingError, match="open text file"):
            pool.submit(bt.open_for_reading, str(path)).result(CASE_TIMEOUT)
        assert_pool_works(pool)


@pytest.mark.timeout(60)
def test_a_connection_in_a_tasks_arguments_or_result_fails_its_future(
    ctx: multiprocessing.context.BaseContext,
) -> None:
    """Plain pickle copies a ``Connection`` as its fd's number: in a worker it named another
    file (under spawn the pool's shared memory, which the task's ``send`` wrote into), so the
    task fails saying to give it to the workers in ``initargs`` (found in review)."""
    receiver, sender = ctx.Pipe(duplex=False)
    with receiver, sender, bounded_pool(ctx.get_start_method()) as pool:
        for future in (pool.submit(bt.send_on, sender, "x"), pool.submit(bt.pipe_end)):
            with pytest.raises(TaskPicklingError, match=r"Connection.*initargs"):
                future.result(CASE_TIMEOUT)
        assert not receiver.poll(0)
        assert_pool_works(pool)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [0, MAX_NESTING])
def test_a_child_whose_argument_cannot_be_unpickled_fails_its_future(depth: int) -> None:
    """Whether the child is queued or, nested deeper than the run stack, run inline by its
    parent, its argument's unpickling error ends the child's future, not ``submit()``."""
    with Pool(1) as pool:  # one worker: every level of the nest runs in it
        outcome = pool.submit(bt.nest_then_submit_bad_argument, depth).result(CASE_TIMEOUT)
        assert outcome == "result() raised ValueError('error at unpickle')"
        assert_pool_works(pool)


# ------------------------------------------------------------------ 200 MB payloads
BIG_CASES = [
    Case(
        "200 MB argument",
        bt.size_of,
        make_args=lambda: (bytes(bt.BIG),),
        check=lambda v: v == bt.BIG,
    ),
    Case(
        "200 MB result",
        bt.make_zeros,
        (bt.BIG,),
        check=lambda v: len(v) == bt.BIG and v.count(0) == bt.BIG,
    ),
    Case(
        "200 MB result of a child", bt.big_result_of_child, (bt.BIG,), check=lambda v: v == bt.BIG
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", BIG_CASES, ids=str)
def test_a_200_mb_payload_works(case: Case) -> None:
    run_case(case, None)


# ------------------------------------------------------------------ submit during shutdown
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cancel_futures", [False, True])
def test_submit_from_other_threads_during_shutdown(ctx: Any, cancel_futures: bool) -> None:
    """Threads keep submitting while the pool shuts down: each submit either returns a future
    that ends (with its result; or cancelled, with ``cancel_futures``) or raises
    PoolClosedError. Nothing hangs and no future is lost."""
    pool = Pool(WORKERS, start_method=ctx.get_start_method())
    submitted: list[list[tuple[int, Any]]] = [[] for _ in range(SUBMITTERS)]
    outcome: list[BaseException | None] = [None] * SUBMITTERS
    all_submitting = threading.Barrier(SUBMITTERS + 1)

    def submitter(k: int) -> None:
        mine = submitted[k]
        try:
            mine.append((0, pool.submit(tasks.ident, (k, 0))))
            all_submitting.wait(CASE_TIMEOUT)
            for i in range(1, 10**9):
                mine.append((i, pool.submit(tasks.ident, (k, i))))
        except BaseException as exc:
            outcome[k] = exc

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(SUBMITTERS)]
    for t in threads:
        t.start()
    try:
        all_submitting.wait(CASE_TIMEOUT)  # every thread is in its submit loop
        pool.shutdown(wait=False, cancel_futures=cancel_futures)
        assert pool.await_termination(SHUTDOWN_TIMEOUT), "shutdown did not finish"
    finally:
        for t in threads:
            t.join(CASE_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a submitter is stuck in submit()"
    for k in range(SUBMITTERS):
        assert isinstance(outcome[k], PoolClosedError), f"submitter {k}: {outcome[k]!r}"
        assert len(submitted[k]) >= 1
        for i, future in submitted[k]:
            assert future.done(), f"future {(k, i)} was lost"
            if future.cancelled():
                assert cancel_futures, f"future {(k, i)} cancelled"
            else:
                assert future.result() == (k, i)
    with pytest.raises(PoolClosedError):
        pool.submit(tasks.ident, 1)


@pytest.mark.timeout(60)
def test_an_id_whose_hash_changes_leaves_no_future_pending() -> None:
    """The version of such an id cannot be found again when it ends, which breaks the pool;
    the break still fails every future, that one's and the unrelated ones', and the shutdown
    ends. Before, ending the broken entry again raised inside the break: the future of the id
    and a pending timed task stayed pending for ever (their ``result()`` hung)."""
    pool = Pool(2)
    try:
        later = pool.schedule("later", time.monotonic() + 3600, 0, abs, -1)
        shifty = pool.schedule(bt.ShiftyId(), time.monotonic(), 0, abs, -2)
        for future in (shifty, later):
            with pytest.raises(BrokenPoolError):
                future.result(timeout=30)
        assert pool.state("later") is TaskState.FAILED
    finally:
        pool.shutdown()
    assert pool.await_termination(timeout=0)


# ---------------------------------------------------------------- tasks that damage their worker
@pytest.mark.timeout(120)
def test_a_task_that_closes_its_workers_wake_fd_costs_that_worker_only(ctx: Any) -> None:
    """The worker's next sleep read the closed eventfd: EBADF in mpsched's frame, which the
    worker took for an internal error of its own, and the pool broke. Now the worker exits as
    a crash and is replaced; the task that closed it had returned, so nothing fails."""
    with Pool(1, start_method=ctx.get_start_method()) as pool:
        pool.submit(bt.close_wake_fd, 0).result(timeout=30)
        assert [pool.submit(tasks.ident, i).result(timeout=30) for i in range(20)] == list(
            range(20)
        )
        assert pool.submit(tasks.fib, 12).result(timeout=30) == 144


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["read", "write"])
def test_a_task_that_closes_its_workers_signal_pipe_costs_that_worker_only(end: str) -> None:
    """The same for the worker's signal wake-up pipe: its next sleep failed with EBADF in
    mpsched's frame (the read end's read, the write end's ``set_wakeup_fd``), and the pool
    broke as on an internal error of the worker's."""
    with Pool(1) as pool:
        pool.submit(bt.close_signal_pipe, end).result(timeout=30)
        assert [pool.submit(tasks.ident, i).result(timeout=30) for i in range(20)] == list(
            range(20)
        )
        # At its next sleep (after a spin that a quick next submit may end first).
        wait_until(lambda: pool.statistics().crashes == 1, "the worker was replaced")
        assert pool.submit(tasks.fib, 12).result(timeout=30) == 144


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["closed", "replaced_by_a_file"])
def test_a_task_that_closes_its_copy_of_a_peers_wake_fd_hangs_no_join(
    tmp_path: Path, how: str
) -> None:
    """A worker's copy of its peer's eventfd closed: when it finished a child of the peer, or
    pushed work while the peer slept, it cleared the peer's sleeping flag, its write failed
    (into the task: a misattributed OSError), and the peer, asleep in a join, was never woken
    (8 runs in 10 hung). Now the worker exits as a crash (its task fails with
    WorkerCrashedError), and the recovery wakes every worker whatever its flag says. A file
    in its place took the wake-ups' writes, which succeeded, and the joins hung for ever
    (found in review): the worker now sees that the fd is no eventfd any more, and a join's
    sleep is bounded besides."""
    file = tmp_path / "user.log"
    with Pool(2) as pool:
        pool.submit(bt.close_wake_fd, None, str(file) if how != "closed" else None).result(30)
        outcomes = []
        for _ in range(30):
            try:
                outcomes.append(pool.submit(tasks.fib, 13).result(timeout=30))
            except WorkerCrashedError:
                outcomes.append("crashed")
        assert set(outcomes) <= {233, "crashed"}, outcomes
        assert outcomes.count("crashed") <= 1, outcomes  # the replacement's fds are whole
        assert outcomes[-1] == 233
    assert not file.exists() or file.stat().st_size == 0, "a wake-up was written into the file"


@pytest.mark.timeout(180)
def test_a_tasks_own_alarm_firing_in_a_join_does_not_break_the_pool(ctx: Any) -> None:
    """A task bounds its run with SIGALRM and a handler that raises; the alarm fires at any
    point of its fork-join. Raised in mpsched's code (a child claimed and not yet run, a slot
    lock taken), the exception went on into the task and the pool broke at the next
    completion (InternalError "not the innermost running task"; 4 runs in 4 within 200
    rounds). Now the worker exits as a crash there (WorkerCrashedError), and a join's sleep
    lets the task's own exception through."""
    outcomes: dict[str, int] = {}
    with Pool(2, start_method=ctx.get_start_method()) as pool:
        rng = random.Random(1)
        for _ in range(150):
            try:
                pool.submit(bt.fib_under_alarm, 10, rng.uniform(0.0005, 0.01)).result(timeout=30)
                kind = "ok"
            except (TimeoutError, WorkerCrashedError) as exc:
                kind = type(exc).__name__
            except RuntimeError as exc:  # the alarm in the unpickling of a child's result
                kind = "RuntimeError" if "TimeoutError" in str(exc) else repr(exc)
            outcomes[kind] = outcomes.get(kind, 0) + 1
        assert pool.submit(tasks.fib, 12).result(timeout=30) == 144
    assert set(outcomes) <= {"ok", "TimeoutError", "WorkerCrashedError", "RuntimeError"}, outcomes
    assert outcomes.get("ok", 0) > 0, outcomes


# ---------------------------------------------------------------- the pool's own resources
def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")} - {-1}


@pytest.mark.timeout(60)
def test_dormant_workers_woken_at_once_short_of_fds_start_in_turn() -> None:
    """Sixteen tasks at once wake seven dormant workers in one pass, with fds free for about
    three: each start checked for its own fds only, not for those of the starts under way,
    and the sockets of the last ones could not be received, which broke the pool (found in
    review). Now the starts beyond the free fds wait, and every task runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with Pool(8, start_method="fork") as pool:
        assert pool.submit(tasks.ident, 0).result(CASE_TIMEOUT) == 0  # worker 0 is up
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(_open_fds()) + 10, hard))
        try:
            futures = [pool.submit(tasks.spin, 0.05) for _ in range(16)]
            done = [f.result(CASE_TIMEOUT) for f in futures]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(done) == 16


@pytest.mark.timeout(180)
def test_pool_creation_out_of_fds_leaves_nothing_behind() -> None:
    """``Pool(4)`` under open-file limits from none free to enough: it raises EMFILE, or
    returns a pool (which may break at once, its workers short of fds), and either way leaves
    no fd and no process behind. The eventfds made before the one that failed stayed open (2
    more at each attempt, so a program that retried with a higher limit never caught up), and
    a zygote whose pidfd could not be opened stayed a zombie. Under fork only: under
    forkserver, an attempt that runs out in the middle of multiprocessing's own message to
    its forkserver kills that forkserver, and multiprocessing starts a new one (new pipes)."""
    start_method = "fork"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = _open_fds()
    me = psutil.Process()
    helpers = {p.pid for p in me.children(recursive=True)}  # the forkserver, the tracker
    outcomes = set()
    for free in range(0, 40):
        pool = None
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(before) + free, hard))
        try:
            pool = Pool(4, start_method=start_method)
        except OSError as exc:
            outcomes.add(errno.errorcode.get(exc.errno or 0, repr(exc)))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if pool is not None:
            try:
                outcomes.add(pool.submit(tasks.ident, 1).result(timeout=30))
            except BrokenPoolError:
                outcomes.add("broken")
            pool.shutdown()
        assert _open_fds() == before, f"{free} fds free: left open {_open_fds() - before}"
        left = [p for p in me.children(recursive=True) if p.pid not in helpers]
        assert not psutil.wait_procs(left, timeout=10)[1], f"{free} fds free: left {left}"
    assert {"EMFILE", 1} <= outcomes <= {"EMFILE", 1, "broken"}, outcomes
