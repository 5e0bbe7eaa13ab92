"""Timetable: the pool's tasks that have an id (``Pool.schedule``), from schedule to the end.

Owns the scheduler core's ``VersionedHeap`` (pending versions, keyed ``(run_at, -priority,
seq)``), the version of each id that the heap has handed out (it waits in the ready queue or an
inbox, or runs), the recurrences, and the bounded memory of finished ids. The coordinator calls
every method under its lock (``Coordinator.lock``); user threads reach it only through the
coordinator.

Each version of an id is one ``Future``. ``future._due`` is the version's heap record (a plain
tuple holding its id and version, see ``_heap``; no object of its own) while the version waits in
the heap, and the heap's ``Due`` (a NamedTuple) once it was handed out (``finish`` needs it).

States: the heap says RUNNING from the moment it hands a version out; ``state()`` refines that
for the pool, since a handed-out version that no worker has claimed yet has not started: it is
PENDING until the claim (the coordinator answers ``claimed``; a retry after its worker died
started before, so it stays RUNNING).

Memory: records of ids whose latest version ended are kept for ``state()`` up to
``FINISHED_IDS_KEPT`` ids, then forgotten oldest first (``state()`` then answers None, as for an
id never seen).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable
from typing import Any

from mpsched._future import Future
from mpsched._heap import RECORD_TASK_ID, RECORD_VERSION, VersionedHeap
from mpsched._options import TaskOptions
from mpsched._task import Due, TaskState

# Ids whose state() still answers after they end (~200 B each; as many again at most for the
# ends of ids that ran again since, until the memory compacts: _heap, "ended-id memory").
FINISHED_IDS_KEPT = 100_000

_BROKEN = RuntimeError("the pool broke")  # stands for the error in heap.finish (fail_all)
_RUNNING = TaskState.RUNNING
_PENDING = TaskState.PENDING


class Recurrence:
    """A recurring id: the call it repeats and the future that reports its end.

    It is also that future's owner: ``future.cancel()`` stops the recurrence through ``stop``
    (the coordinator's ``cancel_id``, called with this recurrence: once it was stopped or
    replaced, the id's versions are no longer its to cancel), as ``pool.cancel(task_id)``
    does."""

    __slots__ = (
        "active",
        "call",
        "future",
        "options",
        "priority",
        "stop",
        "task_id",
    )

    def __init__(
        self,
        task_id: Hashable,
        priority: int,
        call: bytes,
        options: TaskOptions,
        stop: Callable[[Recurrence, Hashable], bool],  # stop(self, task_id)
    ) -> None:
        self.task_id = task_id
        self.priority = priority
        self.call = call  # the encoded call; each run appends its own version (with_version)
        self.options = options
        self.stop = stop
        # Public: ends when the recurrence ends (cancel, error, shutdown).
        self.future: Future[Any] = Future(self)
        self.active = True

    def cancel(self, future: Future[Any]) -> bool:
        return self.stop(self, self.task_id)

    def help_wait(self, future: Future[Any], timeout: float | None) -> None:
        return None  # no task behind this future to collect


class Timetable:
    def __init__(self) -> None:
        self.heap = VersionedHeap(remember=FINISHED_IDS_KEPT)
        self.handed: dict[Hashable, Future[Any]] = {}  # by id: the version out of the heap
        self.recurring: dict[Hashable, Recurrence] = {}
        self.known = self.heap.knows  # known(task_id): the id has a record (pending, ran, ...)
        # cancel_pending(task_id) -> Future | None: cancel the version of ``task_id`` waiting
        # in the heap, if any, and return its future (bound: a measured path, no extra frame).
        self.cancel_pending: Callable[[Hashable], Any] = self.heap.withdraw

    def busy(self) -> bool:
        """True while a version waits in the heap or is handed out (drain must wait)."""
        return len(self.heap) > 0 or bool(self.handed)

    def schedule(
        self, task_id: Hashable, run_at: float, priority: int, future: Future[Any]
    ) -> None:
        """Add a version. The caller withdrew the handed-out version if it could (then it
        called ``end``); a version that already runs defers the new one."""
        future._due = self.heap.schedule(task_id, run_at, priority, future)

    def pending_future(self, task_id: Hashable) -> Future[Any] | None:
        item = self.heap.pending_item(task_id)
        return item if isinstance(item, Future) else None

    def withdrawn(self, future: Future[Any]) -> bool:
        """``future``'s version will never run (the coordinator withdrew its future): take it
        out of the heap if it still waits there, or end it if it was handed out. (A version no
        longer in the heap was taken by a supersede or a cancel by id racing ``Future.cancel``,
        which marks the future cancelled itself.) True if that made a newer version of the id
        eligible: it waited behind this one (a retry, see ``Coordinator.recover_slot``) and
        entered the heap, with a due time the caller must hand to the loop."""
        due = future._due
        if type(due) is tuple:
            self.withdraw_pending(future)
            return False
        self.end(future, None, cancelled=True)
        return self.heap.pending_item(due.task_id) is not None

    def withdraw_pending(self, future: Future[Any]) -> bool:
        """Cancel ``future``'s version if it still waits in the heap."""
        due = future._due  # its heap record (never a Due: callers hold a pending version's)
        return self.heap.withdraw(due[RECORD_TASK_ID], due[RECORD_VERSION]) is not None

    def release_due(self, now: float, on_due: Callable[[Future[Any], int], None]) -> float | None:
        """Hand out every version due at ``now``, in key order, to ``on_due(future, priority)``.
        Returns the next due time, or None if no version waits on time."""
        heap = self.heap
        while True:
            due = heap.pop_due(now)
            if due is None:
                return None
            if not isinstance(due, Due):
                return None if due.seconds == math.inf else now + due.seconds
            future: Any = due.fn
            future._due = due
            self.handed[due.task_id] = future
            on_due(future, due.priority)

    def end(self, future: Future[Any], error: BaseException | None, *, cancelled: bool) -> None:
        """A handed-out version ended (ran, or was withdrawn before it started)."""
        due = future._due
        future._due = None  # ended from here on (``Cancelling.end_withdrawn`` reads it)
        try:
            task_id = due.task_id
            handed = self.handed
            # No call up to the removal (``in`` and subscripts are no point where the eval loop
            # raises a Ctrl-C's KeyboardInterrupt; ``handed.get()`` was: the version stayed
            # handed out for ever, ``busy()`` true, and the drain waited for it).
            if task_id in handed and handed[task_id] is future:
                del handed[task_id]
        finally:
            # Even after an exception above (a Ctrl-C's KeyboardInterrupt, in a task id's own
            # __hash__ or __eq__): the version stayed RUNNING in the heap for ever, with no
            # future to end it, and the drain waited for it.
            self.heap.finish(due, error, cancelled=cancelled)

    def state(self, task_id: Hashable, claimed: Callable[[Future[Any]], bool]) -> TaskState | None:
        state = self.heap.state(task_id)
        if state is _RUNNING:
            future = self.handed.get(task_id)
            if future is not None and not claimed(future):
                return _PENDING
        return state

    def cancel_all_pending(self, cancelled: list[Future[Any]]) -> None:
        """Shutdown with cancel_futures (or timed_after_shutdown=False): every version still in
        the heap but the next runs of the recurrences still in ``recurring`` (kept after the
        shutdown: they go on until cancelled); their ids end CANCELLED. Appends their futures
        to ``cancelled`` (to be marked cancelled outside the lock) one by one, so that the
        caller has those withdrawn before an exception (a Ctrl-C's KeyboardInterrupt) too."""
        recurring = self.recurring
        for task_id in self.heap.pending_ids():
            if task_id not in recurring:
                future = self.cancel_pending(task_id)
                if future is not None:
                    cancelled.append(future)

    def fail_all(self) -> list[Future[Any]]:
        """The pool broke: end every version, handed out or waiting in the heap (deferred ones
        included), as FAILED, as their futures are about to fail. Returns their futures (the
        handed-out ones too: one whose end raised had left the pool's in-flight map, and its
        future stayed pending for ever after the pool broke). Afterwards nothing is
        handed out, so ``state()`` never reads the pool's shared memory again (it is released
        when the pool ends)."""
        # One entry that cannot be ended (an id whose __hash__ or __eq__ changed or raises,
        # which may be what broke the pool) must not stop the rest: every future fails, and
        # what the heap cannot end stays as it is (state() is the id's own riddle then).
        futures: list[Future[Any]] = list(self.handed.values())
        for handed in futures:
            with contextlib.suppress(Exception):
                self.end(handed, _BROKEN, cancelled=False)  # a deferred one may enter the heap
        self.handed.clear()
        heap = self.heap
        while isinstance(due := heap.pop_due(math.inf), Due):
            future: Any = due.fn  # the heap's item: the version's future
            futures.append(future)
            with contextlib.suppress(Exception):
                heap.finish(due, _BROKEN)
        return futures

    def stop_recurrences(self) -> list[Recurrence]:
        stopped = [r for r in self.recurring.values() if r.active]
        for rec in stopped:
            rec.active = False
        self.recurring.clear()
        return stopped


class TaskRun:
    """The options of one task and their running state (coordinator thread and lock)."""

    __slots__ = (
        "cancel_requested",
        "forced",
        "made_ready",
        "misfire_from",
        "options",
        "recurrence",
        "retries_left",
        "run_at",
        "started_at",
        "timed_out",
    )

    def __init__(
        self, options: TaskOptions, recurrence: Recurrence | None = None, run_at: float = 0.0
    ) -> None:
        self.options = options
        self.recurrence = recurrence  # set on each run of a recurring id (and its future)
        self.run_at = run_at  # due time of this run of a recurring id
        # When this run could first start, from which its misfire grace counts: its run_at,
        # or, for a catch-up run of "queue"/"coalesce" due at a grid time that passed while
        # the previous run went on, the end of that run (judged from its grid time, every
        # such run was a misfire, even on an idle pool).
        self.misfire_from = run_at
        self.made_ready = -1  # Coordinator.dispatches when it came due (misfired)
        self.retries_left = options.retries
        self.started_at: float | None = None  # first seen on a run stack (timeouts)
        self.timed_out = False  # the cooperative cancel of the timeout was sent
        self.forced = False  # cancel(force=True) or the timeout's grace ran out: killed on purpose
        self.cancel_requested = False  # pool.cancel(id) asked this run to stop (not retried)
