"""Scheduler: the public, validated, thread-safe face of the versioned heap.

Owns a ``VersionedHeap`` (``_heap``), the clock it reads and a lock. Called by users directly, and
by the pool's coordinator thread (which may also drive ``VersionedHeap`` itself, without the lock).

Thread safety: every public method holds one ``threading.Lock`` for its whole body, so concurrent
calls from several threads are serialized and each sees the effects of those before it (the
state machine stays consistent; ``next()`` hands each version out once). The clock is called under
that lock, so it must not call back into the scheduler. What the lock cannot give is atomicity
*across* calls: ``state()`` followed by ``cancel()`` in one thread may interleave with a ``next()``
in another, so act on the return value of ``cancel()``, not on an earlier ``state()``.

Input is checked at the call, before anything changes: NaN or infinite ``run_at`` -> ValueError;
non-real ``run_at``, non-int ``priority``, unhashable ``task_id`` (for every method that takes
one), non-callable ``fn``, a ``finish()`` of something that is no ``Due`` or with an ``error``
that is no exception -> TypeError.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections.abc import Callable, Hashable
from typing import Any

from mpsched._clock import SYSTEM_CLOCK, Clock
from mpsched._errors import SchedulerClosed
from mpsched._heap import RECORD_VERSION, VersionedHeap
from mpsched._task import Due, TaskState, Wait

_INF = math.inf


def check_run_at(run_at: object) -> float:
    """``run_at`` as a finite float, or TypeError / ValueError naming the problem."""
    if type(run_at) is not float:
        if isinstance(run_at, bool) or not isinstance(run_at, numbers.Real):
            raise TypeError(f"run_at must be a real number of seconds, not {type(run_at).__name__}")
        try:
            run_at = float(run_at)
        except OverflowError:  # an int or Fraction beyond the float range: infinite, as inf is
            kind = type(run_at).__name__  # not its repr: an int's may be refused (too long)
            raise ValueError(f"run_at must be finite, not an {kind} beyond floats") from None
    if not math.isfinite(run_at):
        raise ValueError(f"run_at must be finite, not {run_at!r}")
    return run_at


def check_priority(priority: object) -> int:
    """``priority`` as an int (higher runs first), or TypeError."""
    if type(priority) is int:
        return priority
    if isinstance(priority, bool):
        raise TypeError("priority must be an int, not bool")
    try:
        return operator.index(priority)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"priority must be an int, not {type(priority).__name__}") from None


def check_task_id(task_id: object) -> None:
    try:
        hash(task_id)
    except TypeError:
        raise TypeError(f"task_id must be hashable, not {type(task_id).__name__}") from None


class Scheduler:
    """A time/priority scheduler with one live version per task id.

    ``next()`` returns the live pending task with the smallest ``(run_at, -priority, sequence)``
    among those with ``run_at <= clock()``: earlier first, then **higher** priority (the opposite
    sign of ``sched``), then submission order.

    Args:
        clock: zero-argument callable returning monotonic seconds; default ``time.monotonic``.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a zero-argument callable, not {type(clock).__name__}")
        self._clock: Clock = SYSTEM_CLOCK if clock is None else clock
        self._heap = VersionedHeap()
        self._lock = threading.Lock()
        self._closed = False

    def schedule(
        self, task_id: Hashable, run_at: float, priority: int, fn: Callable[..., Any]
    ) -> int:
        """Schedule a new version of ``task_id`` at ``run_at`` with ``priority``.

        Supersedes the pending version of ``task_id`` (it will never come out of ``next()``).
        If a version is running, the new one waits until ``finish()`` ends it.

        Returns:
            The new version number, increasing per ``task_id`` from 1.

        Raises:
            SchedulerClosed: after ``close()``.
            TypeError: unhashable ``task_id``, non-real ``run_at``, non-int ``priority`` or
                non-callable ``fn``.
            ValueError: ``run_at`` is NaN or infinite.
        """
        if type(run_at) is not float or not -_INF < run_at < _INF:  # fast path: finite float
            run_at = check_run_at(run_at)
        if type(priority) is not int:
            priority = check_priority(priority)
        check_task_id(task_id)
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed; no new tasks can be scheduled")
            return self._heap.schedule(task_id, run_at, priority, fn)[RECORD_VERSION]

    def cancel(self, task_id: Hashable) -> bool:
        """Cancel ``task_id``: its pending version never runs (a guarantee); a running version
        is marked cancel-requested (see ``cancel_requested()``). False for unknown ids and ids
        whose versions have all finished."""
        check_task_id(task_id)
        with self._lock:
            return self._heap.cancel(task_id)

    def next(self) -> Due | Wait | None:
        """The next due task (now RUNNING), a ``Wait`` if none is due yet, None if none pending."""
        with self._lock:
            return self._heap.pop_due(self._clock())

    def finish(self, due: Due, error: BaseException | None = None) -> TaskState:
        """Report the end of a task that ``next()`` handed out; returns its terminal state.

        Raises:
            InvalidTransition: ``due`` is not running (finished twice, or stale).
            TypeError: ``due`` is not a ``Due``, or ``error`` is neither None nor an exception.
        """
        if not isinstance(due, Due):
            raise TypeError(f"due must be a Due that next() returned, not {type(due).__name__}")
        if error is not None and not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception or None, not {type(error).__name__}")
        with self._lock:
            return self._heap.finish(due, error)

    def state(self, task_id: Hashable) -> TaskState | None:
        """State of the latest version of ``task_id``; None if unknown."""
        check_task_id(task_id)
        with self._lock:
            return self._heap.state(task_id)

    def cancel_requested(self, task_id: Hashable) -> bool:
        """True if the running version of ``task_id`` has been asked to cancel."""
        check_task_id(task_id)
        with self._lock:
            return self._heap.cancel_requested(task_id)

    def discard(self, task_id: Hashable) -> bool:
        """Forget a finished id so its record stops using memory; True if it was dropped."""
        check_task_id(task_id)
        with self._lock:
            return self._heap.discard(task_id)

    def close(self) -> None:
        """Refuse new tasks from now on; pending and running ones are unaffected. Idempotent."""
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called: ``schedule`` then raises ``SchedulerClosed``."""
        return self._closed

    def __len__(self) -> int:
        """Number of live pending tasks (deferred ones included)."""
        with self._lock:  # another thread's update moves one version between two counts
            return len(self._heap)
