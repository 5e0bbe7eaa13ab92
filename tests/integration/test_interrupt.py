"""Ctrl-C (SIGINT) in the coordinator's process while it waits on a result or inside ``map``:
the KeyboardInterrupt reaches the caller, no worker prints a traceback, and leaving the ``with``
block shuts the pool down without hanging (run as a subprocess, like a user's terminal). And a
KeyboardInterrupt injected at chosen points of a user thread's calls into the pool."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any

import pytest

import mpsched
from mpsched import Pool, TaskState, _coord_drain, _future
from mpsched._coordinator import Coordinator
from mpsched._timed import Timetable

from . import tasks
from .conditions import start_every_worker, wait_until
from .interrupts import sigint_after, sigint_before

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXIT_DEADLINE = 20.0  # s from the SIGINT to the process's exit

SCRIPT = """
import sys, time
import mpsched
from tests.integration import tasks

if __name__ == "__main__":
    mode, start_method = sys.argv[1], sys.argv[2]
    try:
        with mpsched.Pool(2, start_method=start_method) as pool:
            assert pool.submit(tasks.ident, 1).result() == 1
            print("ready", flush=True)  # the test sends SIGINT after this line
            if mode == "result":
                pool.submit(tasks.spin, 60.0).result()
            else:
                for _ in pool.map(tasks.spin, [0.05] * 100_000):
                    pass
    except KeyboardInterrupt:
        print("caught KeyboardInterrupt", flush=True)
        raise
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["result", "map"])
@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_ctrl_c_reaches_the_caller_and_the_pool_shuts_down(mode: str, start_method: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode, start_method],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=EXIT_DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "caught KeyboardInterrupt" in out
    assert proc.returncode != 0
    # One traceback: the caller's. A worker printing its own would add another.
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.rstrip().endswith("KeyboardInterrupt"), err


@contextlib.contextmanager
def _coordinator_lock_wrapped(pool: Pool, wrapper: type[_AcquireThenInterrupt]) -> Iterator[Any]:
    """The pool's coordinator lock replaced by ``wrapper`` around it for the block; yields the
    real lock."""
    coordinator = pool._coordinator
    real = coordinator.lock
    coordinator.lock = wrapper(real)  # type: ignore[assignment]
    try:
        yield real
    finally:
        coordinator.lock = real


@pytest.fixture
def short_left_lock_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """``release_if_left`` waits ``LEFT_LOCK_WAIT`` (2 s) for another holder before it decides
    that the lock is its own thread's: where an ``_AcquireThenInterrupt`` took it, it is, and
    0.2 s decides the same (~2 s less for each of these tests)."""
    monkeypatch.setattr(_future, "LEFT_LOCK_WAIT", 0.2)


class _AcquireThenInterrupt:
    """A ``threading.Lock`` whose next blocking ``acquire()`` in the main thread takes it, then
    raises a Ctrl-C's KeyboardInterrupt: the eval loop runs signal handlers just after a call
    returns, before the ``try`` that would release the lock."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.armed = True

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken: bool = self.lock.acquire(blocking, timeout)
        if self.armed and blocking and threading.current_thread() is threading.main_thread():
            self.armed = False
            raise KeyboardInterrupt
        return taken

    def release(self) -> None:
        self.lock.release()

    def locked(self) -> bool:
        return bool(self.lock.locked())

    def __enter__(self) -> bool:
        return bool(self.lock.acquire())

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()


def _interrupt_submit(pool: Pool) -> None:
    pool.submit(tasks.ident, 1)


def _interrupt_schedule(pool: Pool) -> None:
    pool.schedule("id", time.monotonic(), 0, tasks.ident, 1)


def _interrupt_cancel(pool: Pool) -> None:
    pool.cancel("id")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "call", [_interrupt_submit, _interrupt_schedule, _interrupt_cancel], ids=lambda f: f.__name__
)
def test_a_ctrl_c_as_the_coordinators_lock_is_taken_leaves_it_not_taken(
    call: Callable[[Pool], None], short_left_lock_wait: None
) -> None:
    """A Ctrl-C just after a user thread's ``acquire()`` of the coordinator's lock returned, at
    the call's signal check before the ``try`` that releases it: the lock stayed taken for ever,
    so the coordinator thread, every later call and the ``with`` block's exit hung."""
    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        with _coordinator_lock_wrapped(pool, _AcquireThenInterrupt) as real:
            with pytest.raises(KeyboardInterrupt):
                call(pool)
            _poll(lambda: real.acquire(False) and (real.release() or True), "lock left taken")
            if real.locked() and not _released_within(real, 3.0):
                real.release()  # the failure above is the finding; let the exit go on
        assert pool.submit(tasks.ident, 2).result(timeout=20) == 2


@pytest.mark.timeout(30)
def test_a_ctrl_c_as_future_cancel_takes_the_coordinators_lock_leaves_it_not_taken(
    short_left_lock_wait: None,
) -> None:
    """The same window in ``Future.cancel`` (``Coordinator.cancel`` takes the lock bare, as the
    other per-task paths do); interrupted before its withdrawal, the task is still there to
    cancel."""
    with Pool(1) as pool:
        future = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        with _coordinator_lock_wrapped(pool, _AcquireThenInterrupt) as real:
            with pytest.raises(KeyboardInterrupt):
                future.cancel()
            _poll(lambda: real.acquire(False) and (real.release() or True), "lock left taken")
            if real.locked() and not _released_within(real, 3.0):
                real.release()  # the failure above is the finding; let the exit go on
        assert not future.done()
        assert future.cancel()
        assert future.cancelled()


@pytest.mark.timeout(30)
def test_a_ctrl_c_as_a_version_enters_the_heap_leaves_it_due() -> None:
    """A Ctrl-C as ``timetable.schedule`` returned inside ``Pool.schedule``: the version was in
    the heap but the loop's next due time was not noted, so it never ran and the drain (a
    ``with`` block's exit) waited for it for ever."""
    pool = Pool(1)
    assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
    timetable = pool._coordinator.timetable
    real = timetable.schedule
    armed = [True]

    def schedule_then_interrupt(*args: Any) -> None:
        real(*args)
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    timetable.schedule = schedule_then_interrupt  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        pool.schedule("id", time.monotonic() + 0.05, 0, tasks.ident, 1)
    timetable.schedule = real  # type: ignore[method-assign]
    done = threading.Event()
    threading.Thread(target=lambda: (pool.shutdown(wait=True), done.set()), daemon=True).start()
    assert done.wait(15), "shutdown hung"
    assert not timetable.busy()  # the version ran


def _released_within(lock: Any, seconds: float) -> bool:
    if lock.acquire(True, seconds):
        lock.release()
        return True
    return False


def _poll(condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 8
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


@pytest.mark.timeout(30)
def test_a_ctrl_c_after_a_submit_cleared_a_workers_sleep_flag_wakes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C in ``submit``'s direct dispatch after ``inject_wake`` cleared a sleeping
    worker's flag, before the write to its eventfd: the worker slept for ever with the task in
    its inbox, nothing woke it again (its flag said awake), and the pool and its shutdown hung."""
    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        slot = pool._coordinator.slots[0]
        _poll(slot.is_sleeping, "the worker never slept")
        real = type(slot).inject_wake
        armed = [True]

        def inject_then_interrupt(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(self, *args, **kwargs)
            if armed[0] and threading.current_thread() is threading.main_thread():
                armed[0] = False
                raise KeyboardInterrupt
            return out

        monkeypatch.setattr(type(slot), "inject_wake", inject_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            pool.submit(tasks.ident, 1)
        monkeypatch.undo()
        assert pool.submit(tasks.ident, 2).result(timeout=8) == 2


def _sigint_with_the_lock_taken(real: Callable[..., Any]) -> Callable[..., Any]:
    """``inject_wake`` hit between its acquire of the slot lock and its holder store."""
    armed = [True]

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and threading.current_thread() is threading.main_thread():
            armed[0] = False
            assert self._acquire(False)
            signal.raise_signal(signal.SIGINT)
        return real(self, *args, **kwargs)

    return wrapper


# step -> (the part, the method, the wrap): where submit's direct dispatch is hit.
_SUBMIT_STEPS: dict[str, tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "alloc": ("slab", "alloc", sigint_after),  # the block committed, its index not returned
    "write": ("slab", "write", sigint_after),  # written, not yet recorded in by_handle
    "inject": ("slot", "inject_wake", sigint_before),  # recorded, not injected
    "lock": ("slot", "inject_wake", _sigint_with_the_lock_taken),  # and a slot lock orphaned
    # Arguments too long for the slab's chains go to the stash: stashed, the key not yet in
    # the block (its bytes stayed in the stash for the pool's life).
    "stash": ("slab", "set_word", sigint_before),
}
_STASHED = b"x" * 400_000  # more than a chain of blocks holds


@pytest.mark.timeout(30)
@pytest.mark.parametrize("step", list(_SUBMIT_STEPS))
def test_a_ctrl_c_in_a_direct_submit_leaves_no_block_taken(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C in ``submit``'s direct dispatch (the pool idle) after a block was allocated for
    the task and before the task reached an inbox: before, a block not yet recorded leaked for
    the pool's life (the free count stayed one short, after the drain too), and a recorded one
    stayed taken until the drain's ``cancel_lost``, the direct dispatch off meanwhile; with the
    slot lock taken before its holder was recorded, the worker waited for it for ever and the
    drain hung. Now the task is withdrawn and its block freed at once."""
    with Pool(2, start_method="fork") as pool:
        coordinator = pool._coordinator
        slab = pool._views.slab
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        start_every_worker(pool)
        _poll(
            lambda: (
                all(w is not None for w in coordinator.workers)
                and all(s.is_sleeping() for s in coordinator.slots)
                and not coordinator.by_handle
            ),
            "the workers never slept",
        )
        free = slab.free_count()
        part, name, wrap = _SUBMIT_STEPS[step]
        target = type(slab) if part == "slab" else type(coordinator.slots[0])
        monkeypatch.setattr(target, name, wrap(getattr(target, name)))
        with pytest.raises(KeyboardInterrupt):
            pool.submit(tasks.ident, _STASHED if step == "stash" else 1)
        monkeypatch.undo()
        assert not coordinator.by_handle  # the direct dispatch is on again
        assert not coordinator.stash
        assert pool.submit(tasks.ident, 2).result(timeout=8) == 2
        _poll(lambda: not coordinator.by_handle and slab.free_count() == free, "a block left")
        assert pool.statistics().pending == 0
        # The count at the drain's end is read by the teardown's thread just before it
        # releases the memory: after ``finished`` the release may already have begun.
        at_teardown: list[int] = []
        read = threading.Event()
        real_teardown = pool._resources.teardown

        def teardown() -> None:
            at_teardown.append(slab.free_count())
            read.set()
            real_teardown()

        monkeypatch.setattr(pool._resources, "teardown", teardown)
        pool.shutdown(wait=False)
        assert coordinator.finished.wait(15), "the drain hung"
        assert read.wait(15), "the pool was never torn down"
        assert at_teardown == [free]


def _interrupted_timed_submit(pool: Pool) -> Callable[[], bool]:
    options = pool.with_options(timeout=0.2, timeout_grace=0.1)
    with pytest.raises(KeyboardInterrupt):
        options.submit(tasks.spin, 20.0)
    return lambda: pool.statistics().crashes >= 1  # its timeout killed its worker


def _interrupted_schedule(pool: Pool) -> Callable[[], bool]:
    with pytest.raises(KeyboardInterrupt):
        pool.schedule("id", time.monotonic() + 0.05, 0, tasks.ident, 1)
    return lambda: pool.state("id") is TaskState.COMPLETED


class _SlotAcquireThenInterrupt:
    """A slot's ``_acquire`` whose next successful call in the main thread raises a Ctrl-C's
    KeyboardInterrupt with the lock taken: the window between a slot operation's acquire and
    its ``holder_pid`` store (the eval loop runs signal handlers just after a call returns)."""

    def __init__(self, slot: Any) -> None:
        self.slot = slot
        self.real = slot._acquire
        slot._acquire = self

    def __call__(self, *args: Any) -> bool:
        taken: bool = self.real(*args)
        if taken and threading.current_thread() is threading.main_thread():
            self.slot._acquire = self.real
            raise KeyboardInterrupt
        return taken


def _exit_seconds(pool: Pool, lock: Any) -> float:
    """How long the ``with`` block's exit on a caught interrupt (``shutdown(wait=True)``) takes,
    run in a thread; past the bound, ``lock`` (the orphan) is released here so that the pool
    still ends (the test then fails on the time)."""
    done = threading.Event()
    started = time.monotonic()
    threading.Thread(target=lambda: (pool.shutdown(wait=True), done.set()), daemon=True).start()
    if not done.wait(ORPHANED_EXIT_BOUND):
        lock.release()
        assert done.wait(15), "shutdown hung with the lock released"
    return time.monotonic() - started


# A lock is released as an orphan after ORPHAN_WAIT (1 s) without a holder; the drain gave a
# worker waiting for it DRAIN_TIMEOUT (10 s), or waited for ever for a task behind it.
ORPHANED_EXIT_BOUND = 3.0


@pytest.mark.timeout(30)
def test_a_ctrl_c_holding_a_slot_lock_in_submit_does_not_hold_up_the_exit() -> None:
    """A Ctrl-C caught in ``submit``'s direct dispatch just after ``inject_wake`` took the slot
    lock, before it recorded its holder: the lock stayed taken with no holder. The task, in
    no inbox, was cancelled as lost, the drain ended, and the worker (woken, waiting for its
    lock) never answered DRAIN: the exit waited ``DRAIN_TIMEOUT`` and killed it."""
    pool = Pool(1)
    assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
    slot = pool._coordinator.slots[0]
    _poll(slot.is_sleeping, "the worker never slept")
    _SlotAcquireThenInterrupt(slot)
    with pytest.raises(KeyboardInterrupt):
        pool.submit(tasks.ident, 1)
    assert _exit_seconds(pool, pool._coordinator.locks.slots[0]) < ORPHANED_EXIT_BOUND
    assert pool.statistics().completed == 1


@pytest.mark.timeout(30)
def test_a_ctrl_c_holding_a_slot_lock_in_cancel_does_not_hold_up_the_exit(fifos: Any) -> None:
    """A Ctrl-C caught in ``Future.cancel`` of an injected task just after ``cancel_injected``
    took the slot lock: the worker, at the end of the task ahead of it, waited for ever for the
    lock (to report it, and to claim the next), nothing in the pool's process waited on it
    (the only guarded waits that release an orphan), and the drain waited for ever."""
    pool = Pool(1)
    ahead, behind = _cancel_behind_a_task_with_the_slot_lock_orphaned(pool, fifos)
    assert _exit_seconds(pool, pool._coordinator.locks.slots[0]) < ORPHANED_EXIT_BOUND
    assert (ahead.result(timeout=0), behind.result(timeout=0)) == (0, 1)  # nothing lost


def _cancel_behind_a_task_with_the_slot_lock_orphaned(pool: Pool, fifos: Any) -> tuple[Any, Any]:
    """A task running, one queued behind it in the same inbox, whose ``cancel()`` is hit by a
    Ctrl-C just after it took the slot lock (caught here); then the running task ends."""
    ahead = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
    tasks.wait_started(fifos.started)
    behind = pool.submit(tasks.ident, 1)
    _poll(lambda: behind._slot >= 0, "never injected")
    _SlotAcquireThenInterrupt(pool._coordinator.slots[0])
    with pytest.raises(KeyboardInterrupt):
        behind.cancel()
    tasks.open_gate(fifos.gate)
    return ahead, behind


@pytest.mark.timeout(60)
def test_a_ctrl_c_holding_a_slot_lock_does_not_stop_the_pool_that_goes_on(fifos: Any) -> None:
    """As above, but the program goes on with the pool (a notebook's interrupted cell): the
    task queued behind the orphaned lock waited for ever, with its worker, since only a drain
    looked for orphans; the loop now does while tasks are in flight."""
    with Pool(1) as pool:
        ahead, behind = _cancel_behind_a_task_with_the_slot_lock_orphaned(pool, fifos)
        try:
            assert (ahead.result(timeout=8), behind.result(timeout=8)) == (0, 1)
        finally:
            lock = pool._coordinator.locks.slots[0]
            if not behind.done():  # the orphan, released here so that the pool still ends
                lock.release()


class _ReleaseThenInterrupt(_AcquireThenInterrupt):
    """A lock whose next ``release()`` in the main thread releases it, then raises a Ctrl-C's
    KeyboardInterrupt: the signal check just after the call returned, before what follows the
    critical section (marking the withdrawn versions' futures cancelled)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return bool(self.lock.acquire(blocking, timeout))

    def release(self) -> None:
        self.lock.release()
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            raise KeyboardInterrupt


def _cancel_by_id(pool: Pool) -> None:
    pool.cancel("id")


def _reschedule(pool: Pool) -> None:
    pool.schedule("id", time.monotonic() + 600, 0, tasks.ident, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", [_cancel_by_id, _reschedule], ids=lambda f: f.__name__)
def test_a_ctrl_c_as_a_cancel_by_id_or_a_supersede_releases_the_lock_ends_the_future(
    call: Callable[[Pool], None],
) -> None:
    """A Ctrl-C as ``cancel_id`` (or ``schedule``, superseding) released the coordinator's
    lock, after it took the pending version out of the heap and before it marked its future:
    the future stayed pending for ever (its version never runs), and its waiters with it."""
    with Pool(1) as pool:
        future = pool.schedule("id", time.monotonic() + 600, 0, tasks.ident, 1)
        with (
            _coordinator_lock_wrapped(pool, _ReleaseThenInterrupt),
            pytest.raises(KeyboardInterrupt),
        ):
            call(pool)
        assert future.cancelled()
        pool.cancel("id")


@pytest.mark.timeout(30)
def test_a_ctrl_c_after_a_cancel_withdrew_the_task_ends_its_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C in ``Future.cancel`` after the coordinator withdrew the task (``cancel``
    returned, or was about to: it wakes the loop after the lock) and before ``_mark_cancelled``:
    the task never runs, and its future stayed pending for ever."""
    with Pool(1) as pool:
        future = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        real = type(pool._coordinator).cancel

        def cancel_then_interrupt(self: Any, future: Any) -> bool:
            real(self, future)
            raise KeyboardInterrupt

        monkeypatch.setattr(type(pool._coordinator), "cancel", cancel_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            future.cancel()
        monkeypatch.undo()
        assert future.cancelled()
        assert pool.state("later") is mpsched.TaskState.CANCELLED


class _InterruptedEntry:
    """A lock whose next ``with`` in the main thread raises a Ctrl-C's KeyboardInterrupt as it
    waits, the lock not taken (``with`` runs no signal handler between its acquire and its
    body: an interrupt lands in the wait, or before it)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.armed = True

    def __enter__(self) -> bool:
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            raise KeyboardInterrupt
        return bool(self.lock.acquire())

    def __exit__(self, *exc_info: object) -> None:
        self.lock.release()


@pytest.mark.timeout(30)
def test_a_ctrl_c_as_a_cancel_waits_for_the_condition_lock_still_ends_the_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C in ``_mark_cancelled`` as it waits for ``_CONDITION_LOCK`` (held by a thread
    settling a future): the future, withdrawn already, stayed pending for ever."""
    with Pool(1) as pool:
        future = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        monkeypatch.setattr(_future, "_CONDITION_LOCK", _InterruptedEntry(_future._CONDITION_LOCK))
        with pytest.raises(KeyboardInterrupt):
            future.cancel()
        monkeypatch.undo()
        assert future.cancelled()
        assert not _future._CONDITION_LOCK.locked()


class _InterruptingWaiter:
    """A ``concurrent.futures`` waiter whose notification raises a Ctrl-C's
    KeyboardInterrupt, as one landing in ``_mark_cancelled``'s loop over the waiters."""

    def add_cancelled(self, future: Any) -> None:
        raise KeyboardInterrupt


@pytest.mark.timeout(30)
def test_a_ctrl_c_as_a_cancel_notifies_the_waiters_still_wakes_a_thread_in_result() -> None:
    """A Ctrl-C in ``_mark_cancelled`` after the state moved to CANCELLED_AND_NOTIFIED and
    before ``notify_all``: a thread waiting in ``result()`` was not woken (only its own
    timeout ended its wait)."""
    with Pool(1) as pool:
        future = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        outcome: list[str] = []

        def wait() -> None:
            try:
                future.result(timeout=8)
            except CancelledError:
                outcome.append("cancelled")
            except FuturesTimeoutError:
                outcome.append("not woken")

        waiter = threading.Thread(target=wait)
        waiter.start()
        _poll(lambda: future._cond is not None and future._cond._waiters, "never waited")
        future._waiters.append(_InterruptingWaiter())
        with pytest.raises(KeyboardInterrupt):
            future.cancel()
        waiter.join(3)  # far below its result()'s own timeout
        woken = not waiter.is_alive()
        waiter.join()
        assert woken, "the thread in result() was not woken"
        assert outcome == ["cancelled"]


def _cancel_future(pool: Pool, future: Any) -> None:
    future.cancel()


def _cancel_id_of(pool: Pool, future: Any) -> None:
    pool.cancel("id")


def _supersede(pool: Pool, future: Any) -> None:
    pool.schedule("id", time.monotonic() + 600, 0, tasks.ident, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("method", "call"),
    [("submit", _interrupted_timed_submit), ("schedule", _interrupted_schedule)],
    ids=["submit", "schedule"],
)
def test_a_ctrl_c_before_the_loop_was_woken_wakes_it(
    method: str, call: Callable[[Pool], Callable[[], bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after the coordinator took the task and before ``Pool.submit`` (or
    ``schedule``) woke the loop: the loop, asleep with nothing to do, slept on, so a task
    with a timeout injected directly ran past its timeout (to its end), and a version of an
    id was due unnoticed (until something else woke the loop)."""
    with Pool(1, start_method="fork") as pool:
        coordinator = pool._coordinator
        assert pool.submit(tasks.ident, 0).result(timeout=20) == 0
        _poll(
            lambda: coordinator.slots[0].is_sleeping() and not coordinator.by_handle,
            "the worker never slept",
        )
        _poll(
            lambda: sys._current_frames()[coordinator.thread_id].f_code.co_name == "wait",
            "the loop never went to sleep",
        )
        monkeypatch.setattr(Coordinator, method, sigint_after(getattr(Coordinator, method)))
        done = call(pool)
        monkeypatch.undo()
        _poll(done, "the loop slept on")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "call", [_cancel_future, _cancel_id_of, _supersede], ids=lambda f: f.__name__
)
def test_a_ctrl_c_after_a_handed_out_version_was_withdrawn_ends_it(
    call: Callable[[Pool, Any], None], fifos: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C as ``withdraw`` returned, for a version handed out to an inbox and not
    claimed, before the timetable ended it: the version stayed handed out for ever, so
    ``busy()`` stayed true and the drain (the exit) waited for ever; its future stayed
    pending."""
    pool = Pool(1)
    blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
    tasks.wait_started(fifos.started)
    future = pool.schedule("id", time.monotonic(), 0, tasks.ident, 1)
    _poll(lambda: future._slot >= 0, "never handed out")
    real = type(pool._coordinator).withdraw
    armed = [True]

    def withdraw_then_interrupt(self: Any, withdrawn: Any) -> bool:
        out: bool = real(self, withdrawn)
        if armed[0] and withdrawn is future:
            armed[0] = False
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(type(pool._coordinator), "withdraw", withdraw_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        call(pool, future)
    monkeypatch.undo()
    assert future.cancelled()
    tasks.open_gate(fifos.gate)
    assert blocker.result(timeout=20) == 0
    done = threading.Event()
    threading.Thread(target=lambda: (pool.shutdown(wait=True, cancel_futures=True), done.set()),
                     daemon=True).start()  # fmt: skip
    assert done.wait(8), "shutdown hung: the withdrawn version was still handed out"


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_the_bookkeeping_of_an_injected_tasks_cancel_ends_its_future(
    fifos: Any,
) -> None:
    """A Ctrl-C in ``withdraw`` after the task's inbox entry became a TOMBSTONE and it left
    ``by_handle``, before it was marked withdrawn: its future stayed pending for ever (the
    task never runs, and ``cancel_lost`` looks in ``by_handle`` only)."""
    with Pool(1) as pool:
        blocker = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)
        future = pool.submit(tasks.ident, 1)
        _poll(lambda: future._slot >= 0, "never injected")
        coordinator = pool._coordinator
        real = coordinator.drop_stashed

        def interrupt(*args: Any) -> None:
            raise KeyboardInterrupt

        coordinator.drop_stashed = interrupt  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                future.cancel()
        finally:
            coordinator.drop_stashed = real  # type: ignore[method-assign]
        assert future.cancelled()
        tasks.open_gate(fifos.gate)
        assert blocker.result(timeout=20) == 0


class _NoteThenInterrupt(collections.deque[Any]):
    """A pool's ended-id memory (``VersionedHeap._finished``) whose ``after``-th ``append`` in
    the main thread is interrupted as it returns: a Ctrl-C in ``VersionedHeap.withdraw``, after
    it took the version out, as it notes the id that ended."""

    def __init__(self, entries: Iterable[Any], after: int) -> None:
        super().__init__(entries)
        self.countdown = after

    def append(self, entry: Any) -> None:
        super().append(entry)
        if threading.current_thread() is threading.main_thread():
            self.countdown -= 1
            if self.countdown == 0:
                raise KeyboardInterrupt


def _interrupt_the_heap_at_its_nth_end(pool: Pool, after: int) -> None:
    heap = pool._coordinator.timetable.heap
    heap._finished = _NoteThenInterrupt(heap._finished, after)


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_the_heaps_bookkeeping_of_a_cancel_by_id_ends_the_future() -> None:
    """The version was out of the heap, and only the heap's frame held its future: it stayed
    pending for ever (its version never runs), and its waiters with it."""
    with Pool(1) as pool:
        future = pool.schedule("id", time.monotonic() + 600, 0, tasks.ident, 1)
        _interrupt_the_heap_at_its_nth_end(pool, 1)
        with pytest.raises(KeyboardInterrupt):
            pool.cancel("id")
        assert future.cancelled()
        assert pool.state("id") is TaskState.CANCELLED


@pytest.mark.timeout(30)
def test_a_ctrl_c_in_the_middle_of_a_cancelling_shutdown_ends_every_future_it_withdrew() -> None:
    """Interrupted at the fifth of ten withdrawals: the four before it and the one it hit
    end cancelled at once (they were lost with the half-built list, pending for ever, the
    next shutdown withdrawing only the rest), and a shutdown after it cancels the rest."""
    pool = Pool(1)
    futures = [pool.schedule(i, time.monotonic() + 600, 0, tasks.ident, i) for i in range(10)]
    try:
        _interrupt_the_heap_at_its_nth_end(pool, 5)
        with pytest.raises(KeyboardInterrupt):
            pool.shutdown(cancel_futures=True)
        assert [f.cancelled() for f in futures] == [True] * 5 + [False] * 5
    finally:
        pool.shutdown(cancel_futures=True)
    assert all(f.cancelled() for f in futures)


@pytest.mark.timeout(30)
def test_a_ctrl_c_while_a_shutdown_stops_recurrences_leaves_the_rest_to_the_next_shutdown() -> None:
    """Interrupted as it withdrew the second of four recurrences' next runs (due in 10 min):
    the recurrences were all stopped first, so the next shutdown found none to stop and the
    last two runs waited in the heap, and the drain with them, until they were due."""
    pool = Pool(1)
    every = pool.with_options(every=600.0)
    futures = [every.schedule(i, time.monotonic() + 600, 0, tasks.ident, i) for i in range(4)]
    try:
        _interrupt_the_heap_at_its_nth_end(pool, 2)
        with pytest.raises(KeyboardInterrupt):
            pool.shutdown(wait=False)
    finally:
        pool.shutdown(wait=False)
    assert pool.await_termination(20), "the drain waited for the next runs of stopped ones"
    assert all(f.cancelled() for f in futures)


def _interrupt_at_entry(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, at: int) -> None:
    """``owner.name`` raises a Ctrl-C's KeyboardInterrupt at the entry of its ``at``-th call
    in the main thread (a point where the eval loop raises it), and runs as before otherwise."""
    real = getattr(owner, name)
    calls = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            calls[0] += 1
            if calls[0] == at:
                raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.timeout(30)
def test_a_ctrl_c_at_the_entry_of_a_cancels_mark_still_ends_the_future(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Future.cancel`` after the coordinator withdrew the task, at the entry of the mark
    (outside the handler's ``try``): the future stayed pending for ever."""
    with Pool(1) as pool:
        future = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        _interrupt_at_entry(monkeypatch, mpsched.Future, "_mark_cancelled", 1)
        with pytest.raises(KeyboardInterrupt):
            future.cancel()
        monkeypatch.undo()
        assert future.cancelled()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["a mark", "the marking"])
def test_a_ctrl_c_as_a_cancelling_shutdown_marks_its_futures_ends_every_one(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """At the entry of the second future's mark (``where``: "a mark"), or of the function that
    marks them all: the futures not marked yet were out of the heap, and stayed pending for
    ever (the next shutdown found nothing to withdraw)."""
    pool = Pool(1)
    futures = [pool.schedule(i, time.monotonic() + 600, 0, tasks.ident, i) for i in range(4)]
    try:
        if where == "a mark":
            _interrupt_at_entry(monkeypatch, mpsched.Future, "_mark_cancelled", 2)
        else:
            _interrupt_at_entry(monkeypatch, _coord_drain, "mark_all_cancelled", 1)
        with pytest.raises(KeyboardInterrupt):
            pool.shutdown(cancel_futures=True)
        monkeypatch.undo()
        assert all(f.cancelled() for f in futures)
    finally:
        pool.shutdown(cancel_futures=True)


@pytest.mark.timeout(30)
def test_a_ctrl_c_as_a_shutdown_cancels_the_queued_tasks_leaves_the_rest_queued(
    fifos: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted after the second of the due versions waiting in the ready queue was taken
    out of the timetable: the queue had been drained at once, so the rest were in no queue,
    their versions handed out for ever: futures pending, and the next shutdown's drain waited
    for ever. Now they go back to the queue, and the next shutdown cancels them."""
    pool = Pool(1, dispatch_window=1)
    try:
        held = pool.submit(tasks.started_then_gated, fifos.started, fifos.gate, 0)
        tasks.wait_started(fifos.started)
        due = [pool.schedule(i, time.monotonic() - 1, 0, tasks.ident, i) for i in range(6)]
        wait_until(lambda: pool.statistics().pending >= 4, "versions due wait in the ready queue")
        real_end = Timetable.end
        calls = [0]

        def end_then_interrupt(self: Timetable, *args: Any, **kwargs: Any) -> None:
            real_end(self, *args, **kwargs)
            if threading.current_thread() is threading.main_thread():
                calls[0] += 1
                if calls[0] == 2:
                    raise KeyboardInterrupt

        monkeypatch.setattr(Timetable, "end", end_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            pool.shutdown(wait=False, cancel_futures=True)
        monkeypatch.undo()
        pool.shutdown(wait=False, cancel_futures=True)
        tasks.open_gate(fifos.gate)
        assert held.result(timeout=20) == 0
        assert pool.await_termination(20), "the drain waited for versions in no queue"
        assert all(f.done() for f in due)
        assert sum(f.cancelled() for f in due) >= 4
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


_SETTLE_STEPS = {
    # kind of task -> (function, its module's file): a call in a user thread's collection
    # where a Ctrl-C's KeyboardInterrupt may land (at the function's entry)
    "submit": ("_store", "_coord_collect.py"),
    "schedule": ("end", "_timed.py"),
    "options": ("end_runs", "_coord_collect.py"),
}


@contextlib.contextmanager
def _results_held_in_the_done_ring(pool: Pool, fifos: Any) -> Iterator[Any]:
    """Under the coordinator's ``collect_lock`` (its loop collects nothing meanwhile): open the
    gate of the first of three tasks handed to the one worker, and wait until the three results
    are in its done ring; yields that slot's queues, for a collection by this thread."""
    with pool._coordinator.collect_lock:
        tasks.open_gate(fifos.gate)
        slot = pool._views.slots[0]
        wait_until(lambda: slot.done_depth() == 3, "the results are in the done ring")
        yield slot


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(_SETTLE_STEPS))
def test_a_ctrl_c_as_a_user_thread_settles_what_it_collected_ends_every_future(
    kind: str, fifos: Any
) -> None:
    """A thread in ``result()`` collects results itself (``help_wait``: ``collect`` reads the
    done rings, takes the futures out of ``by_handle``, frees the blocks and settles them). A
    Ctrl-C landing in the settling (a setter, ``end_runs``, ``Timetable.end``) left that future
    and every later one of the batch pending for ever, nothing else knowing them any more; a
    version with an id also stayed handed out, and the shutdown waited for ever. Here the
    test's thread holds ``collect_lock`` (so the loop collects nothing), lets three tasks end
    into the done ring, then collects as ``help_wait`` does with the interrupt injected."""
    target, filename = _SETTLE_STEPS[kind]
    pool = Pool(1)
    try:
        coordinator = pool._coordinator
        # The first task holds the worker at its gate; all three are handed to the worker
        # (its inbox holds the window) before the lock.
        calls = [(tasks.gated_ident, fifos.gate, 0), (tasks.ident, 1), (tasks.ident, 2)]
        if kind == "submit":
            futures = [pool.submit(*call) for call in calls]
        elif kind == "schedule":
            futures = [pool.schedule(("id", i), 0.0, 0, *call) for i, call in enumerate(calls)]
        else:
            submitter = pool.with_options(timeout=60)
            futures = [submitter.submit(*call) for call in calls]
        wait_until(lambda: len(coordinator.by_handle) == 3, "the tasks were handed out")
        armed = [True]

        def tracer(frame: Any, event: str, arg: Any) -> None:
            code = frame.f_code
            if armed[0] and event == "call" and code.co_name == target:  # noqa: SIM102
                if code.co_filename.endswith(filename):
                    armed[0] = False
                    raise KeyboardInterrupt

        with _results_held_in_the_done_ring(pool, fifos):
            sys.settrace(tracer)
            try:
                with pytest.raises(KeyboardInterrupt):
                    coordinator.collect_locked(False)
            finally:
                sys.settrace(None)
        assert not armed[0], "the interrupt was not injected"
        assert [f.result(timeout=20) for f in futures] == [0, 1, 2]
        if kind == "schedule":
            assert [pool.state(("id", i)) for i in range(3)] == [TaskState.COMPLETED] * 3
    finally:
        pool.shutdown(wait=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["release", "return"])
def test_a_ctrl_c_as_a_user_threads_take_of_a_done_ring_returns_ends_every_future(
    where: str, fifos: Any
) -> None:
    """``take_done`` moves the done ring's front (its commit), then releases the slot's lock
    and returns the handles it took. In a user thread's collection (``help_wait``), a Ctrl-C
    raised as the release returned, or as ``take_done`` returned, dropped them with its frame
    (found in review): their futures stayed pending until the drain's ``cancel_lost`` ended
    them cancelled, though their tasks ran. Now the handles are in the collector's list from
    the commit on, and it leaves them to the loop. Set up as the test above."""
    pool = Pool(1)
    try:
        coordinator = pool._coordinator
        calls = [(tasks.gated_ident, fifos.gate, 0), (tasks.ident, 1), (tasks.ident, 2)]
        futures = [pool.submit(*call) for call in calls]
        wait_until(lambda: len(coordinator.by_handle) == 3, "the tasks were handed out")
        slot = pool._views.slots[0]
        real_release = slot._release
        fired: list[str] = []

        def release_then_interrupt() -> None:
            real_release()
            if not fired and sys._getframe(1).f_code.co_name == "take_done":
                fired.append(where)
                raise KeyboardInterrupt  # as at the check after the release returned

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_name != "take_done" or fired:
                return None
            if event == "return":
                fired.append(where)
                raise KeyboardInterrupt  # as at the check after take_done returned
            return tracer  # this frame's return event

        with _results_held_in_the_done_ring(pool, fifos):
            if where == "release":
                slot._release = release_then_interrupt  # type: ignore[method-assign]
            else:
                sys.settrace(tracer)
            try:
                with pytest.raises(KeyboardInterrupt):
                    coordinator.collect_locked(False)
            finally:
                sys.settrace(None)
                slot._release = real_release  # type: ignore[method-assign]
            assert fired == [where], "the interrupt was not injected"
            assert slot.done_depth() == 0, "the handles were taken from the ring"
        assert [f.result(timeout=20) for f in futures] == [0, 1, 2]
    finally:
        pool.shutdown(wait=True)


def test_a_map_and_a_lambda_task_leave_no_weakref_callback_to_run_when_they_die() -> None:
    """A Python weakref callback (``WeakSet``'s removal) runs wherever its object dies, and the
    interpreter prints and drops any exception raised there: a Ctrl-C landing in it was lost
    (the random-SIGINT harness, 3 of ~1,000 trials: a ``map``'s ``MapRun`` leaving
    ``Pool._maps``). A lambda task's function, remembered as not tabled, did the same."""
    callbacks: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if (
            event == "call"
            and code.co_filename.endswith("_weakrefset.py")
            and code.co_name == "_remove"
        ):
            callbacks.append(code.co_name)

    with Pool(1) as pool:
        assert pool.submit(tasks.ident, 0).result(timeout=30) == 0  # started
        gc.collect()  # the earlier tests' garbage (their threads leave threading's WeakSet)
        gc.disable()
        sys.setprofile(profiler)
        try:
            assert list(pool.map(tasks.ident, range(4))) == [0, 1, 2, 3]
            for i in range(3):  # a new function each time, not picklable by reference
                assert pool.submit(lambda x, i=i: x + i, 1).result(timeout=30) == i + 1
            gc.collect()
        finally:
            sys.setprofile(None)
            gc.enable()
        assert callbacks == []
        assert pool._maps.live() == []  # the map's run did die


@pytest.mark.timeout(30)
def test_a_wait_inside_this_threads_collection_of_results_says_why_it_cannot_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler or a finalizer that runs while this thread collects the pool's results
    (``Future.result`` does, for a while, ``Coordinator.help_wait``) and waits for a task of
    the pool: only this thread could settle it (the coordinator thread waits for the lock it
    holds), and ``result()`` waited for ever (a hunt: a SIGUSR1 handler calling ``result()``
    during a loop of ``result()``). Now such a wait says why, at once; one with a timeout times
    out (a poll, ``timeout=0``, as any)."""
    with Pool(1) as pool:
        coordinator = pool._coordinator
        pending = pool.schedule("later", time.monotonic() + 600, 0, tasks.ident, 1)
        real = coordinator.collect_locked
        seen: list[str] = []

        def interrupted(*args: Any) -> None:
            if not seen:  # as a handler run here would
                for wait in (pending.result, pending.exception):
                    try:
                        wait()
                    except RuntimeError as exc:
                        seen.append(str(exc))
                    with pytest.raises(FuturesTimeoutError):
                        wait(0)
            real(*args)

        monkeypatch.setattr(coordinator, "collect_locked", interrupted)
        coordinator.collect()  # as a caller of result() does
        monkeypatch.undo()
        assert len(seen) == 2
        refusal = "a pool's future was waited for, with no timeout"
        assert all(text.startswith(refusal) for text in seen)
        assert pool.cancel("later")
        assert pool.submit(tasks.ident, 2).result(timeout=20) == 2
