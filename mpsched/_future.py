"""The futures a pool hands out (coordinator side): ``Future``.

``Future`` is a ``concurrent.futures.Future``, so ``wait``, ``as_completed`` and callbacks work.
It is *light*: the ``threading.Condition`` that the stdlib future creates up front (~1 us and a
few hundred bytes) is created only when someone needs it (a waiter, a callback, a cancel).
``set_result``/``set_exception`` on a future that nobody waits on just store the outcome.

Why that is safe: every stdlib method reads the state under ``self._condition``, and reaching
``_condition`` creates it under the module lock ``_CONDITION_LOCK``. The fast setters change the
state under that same lock, and only while no condition exists. So either the setter runs first
(any later reader creates the condition afterwards and sees the outcome) or a reader created the
condition first (the setter sees it and takes the stdlib path, which notifies). ``result()``
and ``exception()`` of a FINISHED future read it without the condition: every setter stores
both outcome fields before the state, and FINISHED is final.

Besides the outcome, a pool future carries its task's routing fields (written by the coordinator,
coordinator process only): where the task is, so that ``cancel()`` can withdraw it. ``cancel()``
asks the pool: a task that no worker has claimed is cancelled for certain (it will never run);
once claimed, ``cancel()`` returns False, as for a running stdlib future. ``running()`` stays
False: the claim happens in a worker and is not reported (one message per task would halve
throughput).

Where done-callbacks run (docs/design.md, "Where done-callbacks run"): a future is settled under
the pool's locks (a collector holds ``Coordinator.collect_lock``), and a callback may re-enter
the pool, block on another future of it, or shut it down. So a thread that settles futures
while it holds a lock first sets a *sink* (``defer_callbacks``): ``_invoke_callbacks`` hands the
future to it instead of calling its callbacks. The coordinator thread's sink, for its whole
life, is a ``CallbackRunner``: a thread of the pool's that runs the callbacks of the futures the
coordinator settles, since a callback that blocks there would stop the loop that must collect
what it waits for; a user thread that collected in ``result()`` queues there what it settled
before it releases the lock (``CallbackRunner.put``), so that no callback runs inside a
caller's ``result()`` and none after the loop's end. A withdrawal of many futures (a shutdown's
``cancel_futures``) calls their callbacks once all are marked (``callbacks_after_all``). Each
future's callbacks are called once, after it is done.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    LOGGER,
    PENDING,
    RUNNING,
    InvalidStateError,
)
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mpsched._clock import join_interruptibly, wait_interruptibly, wait_seconds
from mpsched._errors import timeout_error

# Guards the lazy creation of every future's condition. Taken by ``with`` only, around code that
# calls nothing: while the main thread holds it, neither a signal handler nor a finalizer may
# run there, since one that reached a future's condition (``result()``, ``add_done_callback``,
# ``concurrent.futures.wait``) waited for this lock that its own thread held, and with it the
# coordinator threads of every pool, which settle futures under it (found by a hunt: SIGUSR1 or
# a ``weakref.finalize`` during a loop of ``result()``). An acquire()/release() pair, ~100 ns
# cheaper here, has such a window: the eval loop runs signal handlers after every call, the
# acquire's too; ``with`` runs none between the acquire and its body.
_CONDITION_LOCK = threading.Lock()
# The threads that settle a pool's futures now: every coordinator thread, and a user thread
# while it collects results (``Coordinator.collect``: ``result()`` does, for a while). User
# code may run there (a result's unpickling, a finalizer, a logging handler, a signal handler
# that interrupted the collection), and an unbounded wait there for a pool's future waited for
# ever: the one thread that could settle it, or let the coordinator collect it, is this one
# (found by hunts: a SIGUSR1 handler calling ``result()`` during a loop of ``result()``, and a
# result's ``__reduce__`` in the coordinator thread). ``wait_done`` refuses it, saying why. A
# wait with a timeout times out as usual. (A thread of one pool waiting so for another pool's
# future is refused too: known gap.)
SETTLING: set[int] = set()
WAIT_WHILE_SETTLING_MESSAGE = (
    "a pool's future was waited for, with no timeout, in a thread that settles a pool's "
    "futures (the pool's own thread, or one collecting results in result(); in a signal "
    "handler, a finalizer, a logging handler or an unpickling that ran there): it would wait "
    "for ever. Wait elsewhere (have the handler set a flag), or give a timeout"
)
# The pool's other per-task locks are taken by acquire()/release(): on 3.11 ``with`` on a lock
# allocates two bound methods, 2-3x the cost of the pair. That leaves the window described at
# _CONDITION_LOCK, where a Ctrl-C's KeyboardInterrupt can be raised just after ``acquire()``
# returned, before the ``try`` whose ``finally`` releases (measured: 4% of the interrupts of a
# loop of such holds left the lock taken). Every such acquire sits alone in a ``try`` whose
# handler is ``release_if_left`` (no work until an exception).
LEFT_LOCK_WAIT = 2.0  # seconds; far above any hold of these locks (see release_if_left)
# Per thread: where a settled future's callbacks go instead of being called (defer_callbacks).
_local = threading.local()
_DONE_STATES = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED))
_CANCELLED_STATES = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))
# The result type of a Future. Generic through concurrent.futures.Future's own parameter (its
# __class_getitem__ makes ``mpsched.Future[int]`` work at run time), not typing.Generic: no
# work on any per-task path.
_T = TypeVar("_T")


def _timed_out(timeout: float | None) -> Exception:
    """The TimeoutError of a ``result()`` or ``exception()`` whose wait ran out (the stdlib's
    has no message)."""
    within = "in time" if timeout is None else f"within the wait's timeout of {timeout:g} s"
    return timeout_error(
        f"the task was not done {within}; it was not cancelled, and may still run (cancel() "
        "withdraws it if no worker has started it)"
    )


class _Owner(Protocol):
    def cancel(self, future: Future[Any]) -> bool: ...

    def help_wait(self, future: Future[Any], timeout: float | None) -> None: ...


class _Finishing:
    """The owner of a future whose outcome is being set: too late to cancel. (With no owner
    at all, a racing ``cancel()`` would mark a task that ran as cancelled.)"""

    def cancel(self, future: Future[Any]) -> bool:
        return False

    def help_wait(self, future: Future[Any], timeout: float | None) -> None:
        return None


FINISHING: _Owner = _Finishing()


class _Sync(threading.Condition):
    """A future's condition, created on first need, with the two lists that the stdlib keeps
    per future and that matter only once it exists (as slots, they would be two more references
    per future for the garbage collector to walk: a pending task's future is its only object
    that the collector tracks)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiters: list[Any] = []  # concurrent.futures' _Waiter objects (wait, as_completed)
        self.callbacks: list[Any] = []  # add_done_callback's


class Future(concurrent.futures.Future[_T]):
    """The future of a task submitted to an ``mpsched.Pool``.

    A ``concurrent.futures.Future`` (``wait``, ``as_completed`` and callbacks work, also mixed
    with other executors' futures), with these differences: ``running()`` is always False
    (a worker's claim is not reported; ``pool.state(task_id)`` says RUNNING);
    ``set_running_or_notify_cancel()`` raises RuntimeError, and ``set_result()`` /
    ``set_exception()`` are the pool's (a caller's outcome wins over the task's, which is then
    dropped); it cannot be pickled (TypeError), so it cannot be an argument of a task.
    """

    # Every field is a slot, so no instance fills its __dict__: a million pending futures are
    # part of a scheduled pool's memory budget (1 KB per pending task, futures included).
    __slots__ = (
        "_cond",
        "_due",
        "_due_at",
        "_exception",
        "_handle",
        "_owner",
        "_payload",
        "_priority",
        "_result",
        "_run",
        "_slot",
        "_state",
        "_withdrawn",
    )

    def __init__(
        self, owner: _Owner | None = None, payload: bytes = b"", priority: int = 0
    ) -> None:
        # No super().__init__(): it would create the Condition eagerly (see the module doc).
        # ``_result`` and ``_exception`` stay unset until the outcome (both are set then, and
        # the stdlib reads them only once FINISHED): two slots fewer for the collector to
        # walk in each pending future.
        self._cond: _Sync | None = None
        self._state = PENDING
        # Routing (the coordinator's): who can withdraw the task, and where it is.
        self._owner = owner  # None once the outcome is known
        self._payload = payload  # dropped once written to shared memory (unless retried)
        self._handle = -1  # slab block once dispatched
        self._slot = -1  # the inbox it waits in; < 0 in the coordinator (_ready.QUEUED...)
        self._withdrawn = False  # cancelled before dispatch: dispatch skips it
        self._priority = priority  # base priority (due tasks run highest first)
        self._due_at = 0.0  # when the task became due (aging measures from here)
        self._due: Any = None  # the scheduler heap's Due, for tasks with an id
        self._run: Any = None  # per-task options and their state (_coordinator.TaskRun)

    @property
    def _condition(self) -> threading.Condition:
        cond = self._cond
        if cond is None:
            new = _Sync()  # not under the lock: its __init__, or a collection, runs Python code
            with _CONDITION_LOCK:
                cond = self._cond
                if cond is None:
                    cond = self._cond = new
        return cond

    @_condition.setter
    def _condition(self, value: threading.Condition) -> None:  # typeshed's protocols: settable
        raise AttributeError("a pool future's condition is its own")

    # The stdlib reads and appends to these only while holding the condition (so after
    # ``_condition`` created it); without one there is no waiter and no callback.
    @property
    def _waiters(self) -> Any:
        cond = self._cond
        return () if cond is None else cond.waiters

    @_waiters.setter
    def _waiters(self, value: Any) -> None:  # typeshed's _AsCompletedFuture: settable
        raise AttributeError("a pool future's waiters are its condition's")

    @property
    def _done_callbacks(self) -> Any:
        cond = self._cond
        return () if cond is None else cond.callbacks

    # Racy snapshots, as the stdlib's are at the moment they return; no condition needed.
    def done(self) -> bool:
        """Whether the future is settled or cancelled (as ``concurrent.futures.Future``)."""
        return self._state in _DONE_STATES

    def cancelled(self) -> bool:
        """Whether the future was cancelled (as ``concurrent.futures.Future``)."""
        return self._state in _CANCELLED_STATES

    def running(self) -> bool:
        """False, unlike the stdlib's: a worker's claim is not reported to the future
        (``pool.state(task_id)`` says RUNNING for a timed task; docs/design.md, "Futures")."""
        return self._state == RUNNING

    def result(self, timeout: float | None = None) -> _T:
        """As ``concurrent.futures.Future.result``; while the pool is lightly loaded, the
        caller first collects results itself for a short while (``Coordinator.help_wait``).
        The main thread waits in slices of 0.1 s, so that a Ctrl-C always ends the wait
        (``_clock.wait_interruptibly``).
        A ``timeout`` that is not a number (a bool is not) is a TypeError and NaN a ValueError,
        at the call, as in every other wait of the library (the stdlib's timed out at once on
        NaN and waited a second on True)."""
        if timeout is not None:
            timeout = wait_seconds(timeout)
        state = self._state
        if state != FINISHED:
            owner = self._owner
            if owner is not None and state == PENDING:
                owner.help_wait(self, timeout)
            if not self.wait_done(timeout) or self._state != FINISHED:
                # Not done: the wait's own TimeoutError. Not an except around the stdlib's
                # result(0): a future settled since the wait ended raises its task's error
                # there, and a task's TimeoutError was taken for the wait's (diff review).
                if self._state not in _DONE_STATES:
                    raise _timed_out(timeout)
                try:
                    return super().result(0)  # cancelled, or settled since the wait ended
                finally:
                    del self  # (the cycle below, were it settled meanwhile with an exception)
        # Settled: nothing more to wait for, so no condition. The stdlib's result() takes it
        # on every call and would create it here (a threading.Condition, ~1-5 us), in the
        # caller's thread, whose GIL time the coordinator thread needs: reading 20,000
        # results in order spent more of it on conditions than on anything else. Both
        # outcome fields are set before the state (_settle_fast, set_result), so FINISHED
        # seen here means they are there.
        exception = self._exception
        if exception is not None:
            try:
                raise exception
            finally:
                # As the stdlib: the traceback holds this frame, whose locals would hold
                # the future (a cycle: future -> exception -> traceback -> frame).
                del self, exception
        return self._result  # type: ignore[return-value]  # FINISHED without exception

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``concurrent.futures.Future.exception`` (a settled one without its condition, as
        ``result``; its ``timeout`` checked as there)."""
        if timeout is not None:
            timeout = wait_seconds(timeout)
        if self._state != FINISHED and (not self.wait_done(timeout) or self._state != FINISHED):
            if self._state not in _DONE_STATES:  # as in result()
                raise _timed_out(timeout)
            return super().exception(0)  # cancelled, or settled since the wait ended
        return self._exception

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until the future is done (True) or ``timeout`` (read already) passed (False);
        in the main thread, in slices that let a Ctrl-C through (``wait_interruptibly``)."""
        if self._state in _DONE_STATES:
            return True
        if timeout is None and threading.get_ident() in SETTLING:
            raise RuntimeError(WAIT_WHILE_SETTLING_MESSAGE)
        return wait_interruptibly(self._wait_settled, timeout)

    def _wait_settled(self, timeout: float | None) -> bool:
        cond = self._condition
        with cond:
            if self._state not in _DONE_STATES:
                cond.wait(timeout)
            return self._state in _DONE_STATES

    # The stdlib path sets only the field it is given: the other one is set first, while the
    # future is not done, under the condition (released before the stdlib call, which runs
    # the done-callbacks without it, as the stdlib does; a setter racing in between makes that
    # call raise InvalidStateError and finds both fields set).
    def set_result(self, result: _T) -> None:
        """As ``concurrent.futures.Future.set_result``: a caller's outcome set before the
        task's wins, and the task's result is then dropped (InvalidStateError once settled)."""
        if not self._settle_fast(result, None):
            with self._condition:
                if self._state not in _DONE_STATES:
                    self._exception = None
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        """As ``concurrent.futures.Future.set_exception``; a caller's outcome wins over the
        task's, as in ``set_result``."""
        if not self._settle_fast(None, exception):
            with self._condition:
                if self._state not in _DONE_STATES:
                    self._result = None
            super().set_exception(exception)

    def _settle_fast(self, result: Any, exception: BaseException | None) -> bool:
        """Store the outcome if no condition exists (nobody waits); False: take the stdlib path.
        (Waiters and done-callbacks register under the condition, so without one there is
        nobody to notify and no callback to run.)"""
        with _CONDITION_LOCK:  # (not acquire(): see _CONDITION_LOCK)
            if self._cond is not None:
                return False
            done = self._state in _DONE_STATES
            if not done:
                self._result = result
                self._exception = exception
                self._state = FINISHED
        if done:  # repr() takes the condition, hence _CONDITION_LOCK: raise outside it
            raise InvalidStateError(f"{self._state}: {self!r}")
        return True

    def _invoke_callbacks(self) -> None:
        """Called by the one thread that made the future done (the stdlib's setters,
        ``_mark_cancelled``): call the callbacks now, or hand them to this thread's sink."""
        cond = self._cond
        if cond is None or not cond.callbacks:  # waiters only: nothing to call
            return
        sink = getattr(_local, "sink", None)
        if sink is None:
            super()._invoke_callbacks()  # type: ignore[misc]
        else:
            sink(self)

    def cancel(self) -> bool:
        """Cancel the task if no worker has claimed it yet; then it never runs. (A task with
        ``retries`` whose worker died while running it is not claimed again until its retry
        starts: until then it can be cancelled, and the retry never runs.) The future of a
        recurrence stands for the whole recurrence: its cancel stops it, even while a run is
        in progress (``TaskSubmitter.schedule``).

        Returns:
            True if the future is cancelled; False if the task was claimed or has finished.
        """
        state = self._state
        if state in _DONE_STATES:  # done() and cancelled(), two frames less
            return state in _CANCELLED_STATES
        owner = self._owner
        try:
            if owner is not None and not owner.cancel(self):
                return False
            return self._mark_cancelled()
        except BaseException:
            # An exception (a Ctrl-C's KeyboardInterrupt) after the owner withdrew the task
            # and before it said so, or at the entry of the mark: the task never runs, and its
            # future stayed pending for ever (its waiters with it). (A recurrence's owner marks
            # it itself.)
            if self._withdrawn:
                self._mark_cancelled()
            raise

    def set_running_or_notify_cancel(self) -> bool:
        """Refused: an executor's method, and the pool's futures' states are the pool's (a
        future made RUNNING by it could no longer be cancelled, nor settled by a cancel, and
        its ``result()`` would wait for ever)."""
        raise RuntimeError(
            "set_running_or_notify_cancel() is not for an mpsched.Future: the pool sets its "
            "futures' states (running() stays False: claims are not reported; "
            "pool.state(task_id) says RUNNING)"
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "an mpsched.Future cannot be pickled: it belongs to its pool's process (send the "
            "result instead)"
        )

    if TYPE_CHECKING:  # the stdlib's, typed for this class: a callback is given this future

        def add_done_callback(self, fn: Callable[[Future[_T]], object]) -> None: ...

    def _mark_cancelled(self) -> bool:
        """The task will never run: cancel and notify at once (``wait()`` and ``as_completed()``
        count only CANCELLED_AND_NOTIFIED as done; ProcessPoolExecutor forgets this after
        ``shutdown(cancel_futures=True)``, leaving its waiters blocked)."""
        self._owner = None
        try:
            with _CONDITION_LOCK:  # as _settle_fast: no condition yet means nobody to notify
                if self._cond is None:
                    if self._state != PENDING:
                        return self._state in _CANCELLED_STATES
                    self._state = CANCELLED_AND_NOTIFIED
                    return True
            # One hold of the condition from PENDING to CANCELLED_AND_NOTIFIED: two threads may
            # both get here (a Future.cancel() racing another, or shutdown(cancel_futures=True)),
            # and with the stdlib's cancel() then set_running_or_notify_cancel() (two holds) the
            # second one's notify finds the state moved on and raises RuntimeError.
            with self._condition:
                if self._state in _CANCELLED_STATES:  # cancelled twice (e.g. by id, then here)
                    return True
                if self._state != PENDING:
                    return False
                self._state = CANCELLED_AND_NOTIFIED
                try:
                    for waiter in self._waiters:
                        waiter.add_cancelled(self)
                finally:  # a waiter in result() must wake whatever happened to the others
                    self._condition.notify_all()
        except BaseException:
            # An exception (a Ctrl-C's KeyboardInterrupt) on the way: the caller withdrew the
            # task, which never runs, so the future must end cancelled all the same (it stayed
            # pending, and its waiters waited for ever). Once moved, waiters in result() are
            # woken again (a wake-up too many costs them one look at the state).
            if self._state == PENDING:
                self._mark_cancelled()
            elif self._cond is not None:
                with self._condition:
                    self._condition.notify_all()
            raise
        self._invoke_callbacks()  # once: only the thread that moved the state gets here
        return True


Sink = Callable[[Future[Any]], None]


def mark_all_cancelled(futures: Sequence[Future[Any]]) -> None:
    """``_mark_cancelled`` each of ``futures``, whose tasks were withdrawn (none will run). An
    exception at one of them (a Ctrl-C's KeyboardInterrupt at the entry of its mark or between
    two, or one a done-callback raised in this thread) still marks it and the rest, and the
    first goes on once all are marked: left pending, they stayed so for ever, their waiters
    with them (the rest were marked after one exception, and a second one left them, as the
    fourth of five raising callbacks did in a ``shutdown(cancel_futures=True)``)."""
    error: BaseException | None = None
    done = 0
    while done < len(futures):
        try:
            while done < len(futures):
                futures[done]._mark_cancelled()
                done += 1
        except BaseException as exc:  # the mark it hit is done or not: a second one is a no-op
            if error is None:
                error = exc
    if error is not None:
        raise error


def cancel_all(futures: Sequence[Future[Any]]) -> None:
    """``cancel()`` each of ``futures``, tasks in inboxes: each wins only against a claim
    that has not happened. An exception (one a done-callback raised in this thread) goes on
    once each was tried: the rest were left to run after ``shutdown(cancel_futures=True)``.
    A future that the user settled (``set_result``) keeps that outcome, and its task is
    withdrawn all the same: ``cancel()`` refused at once, as for any done future, and the
    task ran after the shutdown had cancelled what was not started (found in review)."""
    error: BaseException | None = None
    for future in futures:
        try:
            state = future._state
            if state == FINISHED:  # settled by the user: only the task is withdrawn
                owner = future._owner
                if owner is not None:
                    owner.cancel(future)
            elif state not in _CANCELLED_STATES:  # a cancelled one was withdrawn already
                future.cancel()
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error


def release_if_left(lock: Any) -> None:
    """Exception path of a bare ``lock.acquire()`` of a ``threading.Lock`` (see
    ``LEFT_LOCK_WAIT``): the exception (a Ctrl-C's KeyboardInterrupt) was raised either inside
    a wait for the lock while another thread held it (not taken) or just after the acquire
    returned (taken, and then nothing ever released it: every thread of the pool, the
    coordinator's too, waited for it for ever). The two leave the same traceback. Another
    thread lets the lock go within one critical section (the longest, an orphaned shared lock's
    repair under the coordinator's lock, lasts ``ORPHAN_WAIT``): got back within
    ``LEFT_LOCK_WAIT``, it was not this thread's; still taken then, it is. Either way this
    thread now holds it and releases it. A second interrupt during the wait leaves it as it
    was."""
    lock.acquire(True, LEFT_LOCK_WAIT)
    lock.release()


def defer_callbacks(sink: Sink | None) -> Sink | None:
    """From now on, this thread's settled futures go to ``sink`` instead of calling their
    callbacks (None: call them at once again). Returns the sink it replaces."""
    previous: Sink | None = getattr(_local, "sink", None)
    _local.sink = sink
    return previous


@contextlib.contextmanager
def callbacks_after_all() -> Iterator[None]:
    """Within: the futures that this thread settles keep their callbacks; at the end those are
    called (or go to the sink that was set, the coordinator thread's), once every future of the
    block is settled. For a withdrawal of many futures marked one by one (a shutdown's
    ``cancel_futures``): a callback of the first that waited for a later one (``wait``, or a
    lock that a thread in its ``result()`` held) found it withdrawn but pending, and the
    shutdown waited for ever (found in review)."""
    settled: list[Future[Any]] = []
    previous = defer_callbacks(settled.append)
    try:
        yield
    finally:
        defer_callbacks(previous)
        if previous is None:
            invoke_all(settled)
        else:
            for future in settled:
                previous(future)


def take(box: list[list[Future[Any]]]) -> list[Future[Any]]:
    """Empty ``box`` (``CallbackRunner.put``'s): its list, or [] if another thread took
    it. ``list.pop`` is one step under the GIL, so two threads cannot both take it."""
    try:
        return box.pop()
    except IndexError:
        return []


def invoke_all(futures: list[Future[Any]]) -> None:
    """Call the callbacks of ``futures`` (a sink's) in this thread, as the stdlib
    would have: an Exception is logged; a BaseException (a Ctrl-C's KeyboardInterrupt) goes
    on to the caller, once the other futures' callbacks were called."""
    error: BaseException | None = None
    for future in futures:
        try:
            concurrent.futures.Future._invoke_callbacks(future)  # type: ignore[attr-defined]
        except BaseException as exc:
            if error is None:
                error = exc
    if error is not None:
        raise error


class CallbackRunner:
    """The pool's callback thread (started at the first future with callbacks): it calls the
    callbacks of the futures that the coordinator thread settles (its sink, ``append``) and of
    those that a user thread's ``result()`` collected (``put``), in the order they were
    handed over. Every exception a callback raises is logged, as the stdlib logs an Exception,
    and the next callback is called: a SystemExit here would otherwise end the thread and lose
    every later callback."""

    def __init__(self) -> None:
        # Items: a future (the coordinator's), a one-element list holding a user thread's list
        # of futures (``put``), a call (``poke``), or None (``close``: the end).
        self._queue: queue.SimpleQueue[
            Future[Any] | list[list[Future[Any]]] | Callable[[], None] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the thread's lazy start, and ``_closed``
        self._closed = False
        self.thread: threading.Thread | None = None

    def append(self, future: Future[Any]) -> None:
        """The coordinator thread's sink. That thread alone closes the runner, so it is open.
        If the thread cannot start, this thread calls the callbacks (``_start``)."""
        if self.thread is None:
            with self._lock:
                started = self._start()
            if not started:
                call_logged((future,))
                return
        self._queue.put(future)

    def put(self, box: list[list[Future[Any]]]) -> bool:
        """A user thread that collected in ``result()`` (``Collecting.collect``): the callbacks
        of what it settled (the list in ``box``) run in this thread, not in its own, where they
        would run inside its wait (a lock the caller holds around ``result()``, which a callback
        takes, deadlocked; the stdlib's pools call them from their manager thread). False if
        the runner is closed (the loop ended: no pool call waits for this thread any more) or
        cannot start: the caller calls them, once it released its locks.

        A Ctrl-C may land anywhere in here: the box is emptied at most once, by the runner
        thread or by the caller's handler (``take``), so the callbacks are called once, by
        whichever takes them (never lost between the queue and the handler, never twice)."""
        with self._lock:
            if not self._closed and self._start():
                self._queue.put(box)
                return True
        return False

    def start(self) -> None:
        """Any thread but the garbage collector's: start the thread now, so that ``poke``
        finds it (a pool's first map: see ``_map.MapRun.start``)."""
        with self._lock:
            if not self._closed:
                self._start()

    def poke(self, call: Callable[[], None]) -> bool:
        """Have the thread make ``call`` (its exception logged); False if the thread is not
        running. Takes no lock (a SimpleQueue's ``put`` takes none): callable from a weak
        reference's callback, which the garbage collector may run inside any call of any
        thread. A call put after ``close`` is never made: the caller has another way."""
        if self.thread is None or self._closed:
            return False
        self._queue.put(call)
        return True

    def _start(self) -> bool:
        """Under ``_lock``: start the thread if it is not running yet; False if it cannot
        start. Python 3.12 and later start no thread once the interpreter's finalization began
        (3.12.0-3.12.2 already in its atexit handlers), nor may one start at a thread limit:
        the first future with callbacks that a pool left
        running at exit settled (a dropped pool's, or one shut down without waiting; an
        ``asyncio.wrap_future`` adds a callback) raised RuntimeError in the coordinator thread,
        which broke the pool: the tasks still running were killed, the rest failed (found in
        review). The caller then calls the callbacks itself, as the stdlib's pools call them
        from their manager thread, and the next future tries the start again."""
        if self.thread is None:
            thread = threading.Thread(target=self._run, name="mpsched-callbacks", daemon=True)
            # Known before it starts: a Ctrl-C in ``start()`` lands, in all likelihood, in its
            # wait for the new thread, which then runs: a second one would share the queue.
            self.thread = thread
            try:
                thread.start()
            except RuntimeError:
                self.thread = None
        return self.thread is not None

    def close(self) -> None:
        """Coordinator thread: no future comes any more from it, and a user thread's
        ``put``'s caller calls its own; the thread ends once it called what it was given."""
        with self._lock:
            self._closed = True
            if self.thread is not None:
                self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every callback handed over was called (after ``close``); True if so.
        From a callback (this runner's thread) it returns at once: it would wait for itself."""
        thread = self.thread
        if thread is None or thread is threading.current_thread():
            return True
        return join_interruptibly(thread, timeout)

    def _run(self) -> None:
        get = self._queue.get
        while True:
            item = get()
            if item is None:
                return
            if isinstance(item, Future):
                call_logged((item,))
            elif isinstance(item, list):
                call_logged(take(item))
            else:
                try:
                    item()
                except BaseException:
                    LOGGER.exception("exception in %r", item)
            # Not kept while waiting: a future holds its callbacks, which may hold the pool (a
            # dropped pool must be collectable).
            item = None


def call_logged(futures: Sequence[Future[Any]]) -> None:
    """The callback thread's calls: each exception is logged and the next callback called."""
    for future in futures:
        for callback in future._done_callbacks:
            try:
                callback(future)
            except BaseException:
                LOGGER.exception("exception calling callback for %r", future)
