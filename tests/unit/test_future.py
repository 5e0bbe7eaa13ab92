"""The pool's light ``Future``: outcomes set with and without a waiter behave as the stdlib's.

A pending future has no Condition and no ``_result``/``_exception`` yet (``_future`` module doc);
these tests pin that every way of settling it leaves a complete, stdlib-readable outcome.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import math
import threading
import weakref
from fractions import Fraction
from typing import Any

import pytest

from mpsched import _future
from mpsched._future import Future
from tests.integration.conditions import wait_until

pytestmark = pytest.mark.timeout(60)


class Boom(Exception):
    pass


def waited_on(
    future: Future, timeout: float = 30, method: str = "result"
) -> tuple[threading.Thread, list[object]]:
    """A thread that waits in ``future.result()`` (or ``method``), and what it saw. The
    Condition is created first, here, so the outcome is certain to take the stdlib's
    (notifying) path."""
    assert future._condition is not None
    seen: list[object] = []

    def wait() -> None:
        try:
            seen.append(getattr(future, method)(timeout=timeout))
        except BaseException as exc:
            seen.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, seen


@pytest.mark.parametrize("waiter", [False, True], ids=["nobody-waits", "a-thread-waits"])
def test_set_result_is_read_back_as_by_the_stdlib(waiter: bool) -> None:
    future = Future()
    if waiter:
        thread, seen = waited_on(future)
    future.set_result(42)
    assert future.result() == 42
    assert future.exception() is None
    assert "returned int" in repr(future)
    assert concurrent.futures.wait([future], timeout=0).done == {future}
    if waiter:
        thread.join()
        assert seen == [42]


@pytest.mark.parametrize("waiter", [False, True], ids=["nobody-waits", "a-thread-waits"])
def test_set_exception_is_read_back_as_by_the_stdlib(waiter: bool) -> None:
    future = Future()
    if waiter:
        thread, seen = waited_on(future)
    error = Boom("no")
    future.set_exception(error)
    assert future.exception() is error
    with pytest.raises(Boom):
        future.result()
    assert "raised Boom" in repr(future)
    if waiter:
        thread.join()
        assert seen == [error]


@pytest.mark.parametrize("waiter", [False, True], ids=["nobody-waits", "a-thread-waits"])
def test_a_second_outcome_is_refused_and_leaves_the_first(waiter: bool) -> None:
    future = Future()
    if waiter:
        future.add_done_callback(lambda f: None)  # creates the Condition: the stdlib path
    error = Boom("first")
    future.set_exception(error)
    with pytest.raises(concurrent.futures.InvalidStateError):
        future.set_result(1)
    assert future.exception() is error
    with pytest.raises(Boom):
        future.result()


@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_reading_a_settled_outcome_creates_no_condition(outcome: str) -> None:
    """``result()`` and ``exception()`` of a settled future read it without its condition:
    the stdlib's take it, which would create it here (~1-5 us of the reading thread's GIL
    time per future, time the coordinator thread needs to settle the next ones)."""
    future = Future()
    error = Boom("no")
    if outcome == "result":
        future.set_result(42)
    else:
        future.set_exception(error)
    for _ in range(2):  # a second read too: nothing was consumed
        if outcome == "result":
            assert future.result() == 42
            assert future.exception() is None
        else:
            with pytest.raises(Boom) as raised:
                future.result()
            assert raised.value is error
            assert future.exception() is error
    assert future._cond is None


def _read_raising(future: Future) -> None:
    """A waiter in ``result()`` that drops its own reference (its frame is in the traceback)."""
    try:
        with contextlib.suppress(Boom):
            future.result(timeout=30)
    finally:
        del future


@pytest.mark.parametrize("when", ["settled-before", "settled-while-waiting"])
def test_a_raised_outcome_leaves_no_reference_cycle(when: str) -> None:
    """As the stdlib's: ``result()`` raising the task's exception leaves no cycle through its
    frame (future -> exception -> traceback -> frame -> future), so the future and its
    exception go by reference counting, without waiting for a collection."""
    gc.disable()
    try:
        future = Future()
        if when == "settled-before":
            future.set_exception(Boom("no"))
            with contextlib.suppress(Boom):
                future.result()
        else:
            cond = future._condition
            waiter = threading.Thread(target=_read_raising, args=(future,))
            waiter.start()
            wait_until(lambda: len(cond._waiters) == 1, "the waiter waits")  # type: ignore[attr-defined]
            future.set_exception(Boom("no"))
            waiter.join()
            del cond, waiter
        gone = weakref.ref(future)
        del future
        assert gone() is None
    finally:
        gc.enable()


def test_ownerless_cancel_and_callbacks() -> None:
    future = Future()
    called: list[Future] = []
    future.add_done_callback(called.append)
    assert future.cancel()
    assert future.cancelled()
    assert future.done()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result()
    assert called == [future]
    late: list[Future] = []
    future.add_done_callback(late.append)  # already done: called at once
    assert late == [future]


def test_done_callbacks_run_without_the_condition_held() -> None:
    """As with the stdlib: a callback may hand the future to another thread and wait for it."""
    future = Future()
    seen: list[object] = []

    def callback(f: Future) -> None:
        reader = threading.Thread(target=lambda: seen.append(f.result()))
        reader.start()
        reader.join(timeout=20)
        seen.append(reader.is_alive())

    future.add_done_callback(callback)  # creates the Condition: the stdlib path
    future.set_result("ok")
    assert seen == ["ok", False]


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(math.nan, ValueError), (True, TypeError), ("1", TypeError)],
    ids=["nan", "bool", "str"],
)
@pytest.mark.parametrize("method", ["result", "exception"])
def test_a_wait_with_a_timeout_that_is_no_number_of_seconds_fails_at_the_call(
    method: str, timeout: object, error: type[Exception]
) -> None:
    """As every other wait of the library (``Pool.map``, ``await_termination``, a child's
    ``result``): the stdlib's timed out at once on NaN, waited a second on True and failed in
    its arithmetic on a str. Checked whether or not the future is settled."""
    pending, settled = Future(None, b"", 0), Future(None, b"", 0)
    settled.set_result(1)
    for future in (pending, settled):
        with pytest.raises(error, match="timeout"):
            getattr(future, method)(timeout)
    assert settled.result(math.inf) == 1  # no limit
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(-1.0)  # a negative timeout times out at once, as the stdlib's


@pytest.mark.parametrize("method", ["result", "exception"])
def test_a_wait_longer_than_a_lock_takes_is_no_limit_outside_the_main_thread(method: str) -> None:
    """``1e10`` s, a common "for ever", is past ``threading.TIMEOUT_MAX``: a lock's wait raised
    OverflowError for it in every thread but the main one, which waits in slices (API hunt)."""
    future = Future(None, b"", 0)
    thread, seen = waited_on(future, timeout=1e10, method=method)
    condition: Any = future._condition
    wait_until(lambda: condition._waiters or not thread.is_alive(), "the wait")
    future.set_result(1)
    thread.join()
    assert seen == [1 if method == "result" else None]


@pytest.mark.parametrize("method", ["result", "exception"])
def test_a_wait_out_of_time_says_so_and_takes_any_real_number(method: str) -> None:
    """The stdlib's TimeoutError has no message; a Fraction was refused as "not a number"."""
    pending, settled = Future(None, b"", 0), Future(None, b"", 0)
    settled.set_result(1)
    with pytest.raises(concurrent.futures.TimeoutError, match=r"not done within .* of 0\.01 s"):
        getattr(pending, method)(Fraction(1, 100))
    assert getattr(settled, method)(Fraction(1, 2)) in (1, None)


@pytest.mark.parametrize("method", ["result", "exception"])
def test_a_task_timeout_error_settled_as_the_wait_runs_out_is_the_tasks(method: str) -> None:
    """Settled between the end of the wait and the outcome's read, a future's own TimeoutError
    (a task's, or its ``TaskOptions.timeout``'s) is not taken for the wait's (diff review)."""
    future = Future(None, b"", 0)
    own = TimeoutError("the task ran longer than its timeout of 0.5 s")

    def wait_done(timeout: float | None = None) -> bool:
        future.set_exception(own)  # settled right after the wait ran out
        return False

    future.wait_done = wait_done  # type: ignore[method-assign]
    if method == "exception":
        assert future.exception(0.01) is own
    else:
        with pytest.raises(TimeoutError) as info:
            future.result(0.01)
        assert info.value is own


@pytest.mark.timeout(30)
def test_code_run_as_a_condition_is_made_may_use_other_futures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler, or a finalizer that the allocation's collection calls, may run while a
    future's condition is made (its ``__init__`` is Python code). One that reached another
    future's condition (``result()``, ``add_done_callback``, ``concurrent.futures.wait``)
    waited for ever for the module lock that its own thread held there, and so did every
    thread that settles futures (found by a hunt: SIGUSR1, or a ``weakref.finalize``, during a
    loop of ``result()``)."""
    other: Future[int] = Future()
    seen: list[Any] = []
    plain = _future._Sync

    class MadeWhileInterrupted(plain):
        def __init__(self) -> None:
            super().__init__()
            if not seen:  # the interruption, once
                seen.append("in")
                other.add_done_callback(lambda f: seen.append(f.result()))
                other.set_result(7)
                seen.append(other.result(timeout=5))
                seen.append(concurrent.futures.wait([other], timeout=5).done == {other})

    monkeypatch.setattr(_future, "_Sync", MadeWhileInterrupted)
    future: Future[None] = Future()
    future.add_done_callback(lambda f: seen.append("done"))  # makes its condition
    future.set_result(None)
    assert seen == ["in", 7, 7, True, "done"]
