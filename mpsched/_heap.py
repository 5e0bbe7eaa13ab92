"""VersionedHeap: the coordinator's time/priority queue with one live version per task id.

Owns the heap of pending tasks and the record of every task id it has seen. Pure: no I/O, no
locks, no clock; every time-dependent call takes ``now`` (trio's ``Deadlines`` and ``MockClock``),
so the whole module is deterministic and tested without processes. ``Scheduler`` (``_scheduler``)
wraps it with a clock, a lock, input validation and ``close()``; the pool's coordinator thread
drives it.

Ordering key (the only place it is defined: ``_key``)::

    (run_at, -priority, seq)

``seq`` is a counter over all schedule calls, so equal time and priority run in submission order,
and since ``seq`` is unique the tuple comparison never reaches the record in the fourth field: the
heap never compares task ids or functions (heapq docs, "Priority Queue Implementation Notes").

Lazy deletion (Java STPE without ``setRemoveOnCancelPolicy``, trio ``Deadlines``):

* Each id has one mutable ``_Record``. Its ``seq`` names the one heap entry that is live for it;
  rescheduling or cancelling only changes ``record.seq``, never the heap. A heap entry
  ``(run_at, -priority, seq, record)`` is *stale* iff ``record.seq != seq``. (An entry naming
  the id instead would let the garbage collector untrack it, 5% off a million schedules, but
  every staleness check would become a dict lookup: 19% onto cancelling.)
* ``pop_due`` drops stale entries when they reach the top; each is popped at most once, at
  O(log n).
* The prune check (``_maybe_prune``; inlined in ``_cancel_pending`` and ``pop_due``) runs after
  every call that adds a stale entry or lowers the live count (schedule, cancel, withdraw, pop)
  and rebuilds the heap from its live entries when ``len(heap) >
  PRUNE_FACTOR * in_heap + PRUNE_SLACK``. So the heap never holds more than ``PRUNE_FACTOR * live
  + PRUNE_SLACK`` entries after any call: memory is O(live tasks) under any mix of reschedules and
  cancels. Time: a rebuild costs O(len(heap)); when it triggers, the stale entries outnumber the
  live ones (factor 2), so its cost is O(number of stale entries it removes). Each stale entry is
  created once (by one reschedule or cancel) and removed once (popped at the top, at O(log n), or
  dropped by one rebuild), so stale entries cost O(log n) amortized each.

One live version per id: scheduling an id again supersedes its pending version. If a version of
the id is RUNNING, the new version is *deferred*: it is not in the heap (so it can never come out
of ``pop_due``) and enters the heap when ``finish()`` ends the running one. Two versions of one id
therefore never run at once.

Not handled here: validation of arguments (``Scheduler``), thread safety (callers serialize), and
forgetting: a record stays after its id reaches a terminal state so that ``state()`` can answer,
until ``discard()`` drops it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any

from mpsched._errors import InvalidTransition, TaskCancelled
from mpsched._task import Due, TaskState, Wait

PENDING = TaskState.PENDING
RUNNING = TaskState.RUNNING
COMPLETED = TaskState.COMPLETED
FAILED = TaskState.FAILED
CANCELLED = TaskState.CANCELLED

# Rebuild when the heap exceeds PRUNE_FACTOR x its live entries plus PRUNE_SLACK. Factor 2 bounds
# the heap at twice the live set (memory) while charging each rebuild to at least as many stale
# entries as there are live ones (time). The slack stops a small heap from being rebuilt on every
# second cancel; 64 entries are ~6 KiB.
PRUNE_FACTOR = 2
PRUNE_SLACK = 64

NOT_IN_HEAP = -1  # record.seq when the id has no pending version


class _Record:
    """Everything known about one task id. One per id; mutated in place, never replaced.

    Invariants:
      * ``seq != NOT_IN_HEAP`` iff ``state is PENDING``; ``seq`` is then the sequence number the
        pending version got from its ``schedule()`` call.
      * ``deferred`` iff ``state is PENDING`` and the pending version waits behind ``running``;
        otherwise a pending version has exactly one heap entry whose third field is ``seq``.
      * ``running`` is the version being run (0: none); it may be older than ``version``.
      * ``fn`` is set only while ``state is PENDING`` (so finished tasks do not pin payloads).
    """

    __slots__ = (
        "cancel_requested",
        "deferred",
        "fn",
        "priority",
        "run_at",
        "running",
        "seq",
        "state",
        "task_id",
        "version",
    )

    def __init__(self, task_id: Hashable, run_at: float, priority: int, fn: Any, seq: int) -> None:
        """A record whose first version (1) is pending in the heap with sequence ``seq``."""
        self.task_id = task_id
        self.version = 1  # latest version number handed out by schedule()
        self.state = PENDING  # state of the latest version
        self.seq = seq
        self.deferred = False
        self.run_at = run_at
        self.priority = priority
        self.fn = fn
        self.running = 0
        self.cancel_requested = False


HeapEntry = tuple[float, int, int, _Record]

# -priority as one shared int object per priority level: CPython caches only -5..256, so every
# heap key would otherwise hold its own 28-byte int (8% of a pending task's memory).
_NEGATED = {p: -p for p in range(-1024, 1025)}
_negated_get = _NEGATED.get


def _negated(priority: int) -> int:
    neg = _negated_get(priority)
    return -priority if neg is None else neg


# Due's constructor runs Python code (NamedTuple.__new__); tuple.__new__ builds the same object
# without it, saving ~0.2 us per next().
_new_due = tuple.__new__


class VersionedHeap:
    """Pending tasks ordered by ``(run_at, -priority, seq)``; one live version per task id.

    Arguments are trusted (``Scheduler`` validates them). Not thread-safe: one caller at a time.
    """

    def __init__(self, remember: int = 0) -> None:
        """``remember``: if > 0, keep the records of at most this many ids that reached a
        terminal state (oldest forgotten first, as ``discard`` does); 0 keeps them all."""
        self._remember = remember
        self._finished: collections.deque[Hashable] = collections.deque()
        # Invariant: every live record appears once in _heap (stale entries may appear too).
        self._heap: list[HeapEntry] = []
        # Invariant: _records[r.task_id] is r for every record; the only path to a record.
        self._records: dict[Hashable, _Record] = {}
        # ``task_id in heap`` without a Python frame (asked on every Pool.schedule).
        self.knows: Callable[[Hashable], bool] = self._records.__contains__
        self._seq = itertools.count()
        self._in_heap = 0  # live entries in _heap
        self._deferred = 0  # pending versions waiting behind a running one of their id

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        """Live pending versions: those in the heap plus the deferred ones."""
        return self._in_heap + self._deferred

    def __contains__(self, task_id: Hashable) -> bool:
        """Whether ``task_id`` has a record (pending, running or remembered)."""
        return task_id in self._records

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale included (bounded by PRUNE_FACTOR * live + PRUNE_SLACK)."""
        return len(self._heap)

    def state(self, task_id: Hashable) -> TaskState | None:
        """State of the latest version of ``task_id``; None if unknown (or discarded)."""
        rec = self._records.get(task_id)
        return None if rec is None else rec.state

    def version(self, task_id: Hashable) -> int:
        """Latest version number of ``task_id``; 0 if unknown."""
        rec = self._records.get(task_id)
        return 0 if rec is None else rec.version

    def cancel_requested(self, task_id: Hashable) -> bool:
        """True if the running version of ``task_id`` was asked to cancel."""
        rec = self._records.get(task_id)
        return rec is not None and rec.running != 0 and rec.cancel_requested

    def running_version(self, task_id: Hashable) -> int:
        """The version of ``task_id`` now running; 0 if none."""
        rec = self._records.get(task_id)
        return 0 if rec is None else rec.running

    def pending_ids(self) -> list[Hashable]:
        """The ids that have a pending version (deferred ones included)."""
        return [r.task_id for r in self._records.values() if r.state is PENDING]

    def pending_item(self, task_id: Hashable) -> Any:
        """The ``fn`` given with the pending version of ``task_id``; None if none is pending."""
        rec = self._records.get(task_id)
        return None if rec is None or rec.state is not PENDING else rec.fn

    def next_deadline(self) -> float | None:
        """run_at of the earliest live entry in the heap (drops stale tops); None if none."""
        heap = self._heap
        while heap:
            run_at, _, seq, rec = heap[0]
            if rec.seq == seq:
                return run_at
            heapq.heappop(heap)
        return None

    # ----------------------------------------------------------------- mutations
    def schedule(
        self, task_id: Hashable, run_at: float, priority: int, fn: Callable[..., Any]
    ) -> int:
        """Make a new version of ``task_id`` pending; supersede any pending one. Returns it."""
        rec = self._records.get(task_id)
        if rec is None:  # fast path: a new id (no pending, no running version)
            seq = next(self._seq)
            rec = self._records[task_id] = _Record(task_id, run_at, priority, fn, seq)
            neg = _negated_get(priority)
            heapq.heappush(self._heap, (run_at, -priority if neg is None else neg, seq, rec))
            self._in_heap += 1
            return 1
        if rec.state is PENDING:
            self._cancel_pending(rec)  # superseded (its state is set again below)
        rec.version += 1
        rec.state = PENDING
        rec.seq = next(self._seq)
        rec.run_at = run_at
        rec.priority = priority
        rec.fn = fn
        if rec.running:
            rec.deferred = True
            self._deferred += 1
        else:
            self._push(rec)
        self._maybe_prune()
        return rec.version

    def cancel(self, task_id: Hashable) -> bool:
        """Cancel the pending version and ask the running one to cancel. False if neither exists.

        A cancelled pending version never comes out of ``pop_due``: its heap entry is stale.
        """
        rec = self._records.get(task_id)
        if rec is None:
            return False
        found = False
        if rec.state is PENDING:
            self._cancel_pending(rec)
            found = True
            if self._remember and not rec.running:
                self._note_finished(task_id)
        if rec.running:
            rec.cancel_requested = True
            found = True
        return found

    def withdraw(self, task_id: Hashable, version: int = 0) -> Any:
        """Cancel the pending version of ``task_id`` (only if it is ``version``, unless that is
        0) and leave a running one alone, unlike ``cancel``. Returns the ``fn`` it was
        scheduled with, or None if no such version was pending."""
        rec = self._records.get(task_id)
        if rec is None or rec.state is not PENDING or (version and rec.version != version):
            return None
        fn = rec.fn
        self._cancel_pending(rec)
        if self._remember:  # _note_finished, inlined: a frame is ~5% of Pool.cancel
            finished = self._finished
            finished.append(task_id)
            if len(finished) > self._remember:
                self._forget_oldest()
        return fn

    def pop_due(self, now: float) -> Due | Wait | None:
        """Hand out the live task with the smallest key among those with ``run_at <= now``.

        The task becomes RUNNING. Returns a ``Wait`` if tasks are pending but none is due
        (``math.inf`` if all of them are deferred behind running versions), None if none pending.
        """
        heap = self._heap
        while heap:
            top = heap[0]
            rec = top[3]
            if rec.seq != top[2]:
                heapq.heappop(heap)  # stale: superseded or cancelled; popped this once only
                continue
            if top[0] > now:
                return Wait(top[0] - now)
            heapq.heappop(heap)
            self._in_heap -= 1
            rec.seq = NOT_IN_HEAP
            rec.state = RUNNING
            rec.running = rec.version
            rec.cancel_requested = False
            fn = rec.fn
            rec.fn = None
            # the live count fell: the bound may need a rebuild too (inlined: hot path)
            if len(heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
                self._prune()
            return _new_due(Due, (rec.task_id, rec.version, rec.run_at, rec.priority, fn))
        return Wait(math.inf) if self._deferred else None

    def finish(
        self, due: Due, error: BaseException | None = None, *, cancelled: bool = False
    ) -> TaskState:
        """End the running version ``due``; returns its terminal state.

        COMPLETED without error; CANCELLED if ``cancelled`` (the caller withdrew it before it
        started) or if ``error`` is a ``TaskCancelled`` and a cancel was requested; FAILED
        otherwise. A deferred newer version of the id becomes eligible.

        Raises:
            InvalidTransition: ``due`` is not the running version of its id (finished twice,
                stale, or never handed out).
        """
        rec = self._records.get(due.task_id)
        if rec is None or rec.running == 0 or rec.running != due.version:
            now_running = "none" if rec is None or not rec.running else f"v{rec.running}"
            raise InvalidTransition(
                f"cannot finish task {due.task_id!r} v{due.version}: it is not running "
                f"(running version: {now_running}); finish() takes each Due from next() once"
            )
        if cancelled:
            outcome = CANCELLED
        elif error is None:
            outcome = COMPLETED
        elif isinstance(error, TaskCancelled) and rec.cancel_requested:
            outcome = CANCELLED
        else:
            outcome = FAILED
        rec.running = 0
        rec.cancel_requested = False
        if rec.version == due.version:
            rec.state = outcome
            if self._remember:
                self._note_finished(rec.task_id)
        elif rec.deferred:
            rec.deferred = False
            self._deferred -= 1
            self._push(rec)
        return outcome

    def discard(self, task_id: Hashable) -> bool:
        """Forget a task id whose latest version is terminal and not running. True if dropped."""
        rec = self._records.get(task_id)
        if rec is None or not rec.state.is_terminal or rec.running:
            return False
        del self._records[task_id]
        return True

    # ----------------------------------------------------------------- internals
    def _note_finished(self, task_id: Hashable) -> None:
        finished = self._finished
        finished.append(task_id)
        if len(finished) > self._remember:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        finished = self._finished
        while len(finished) > self._remember:
            self.discard(finished.popleft())  # no-op if the id was scheduled again

    def _push(self, rec: _Record) -> None:
        heapq.heappush(self._heap, (rec.run_at, _negated(rec.priority), rec.seq, rec))
        self._in_heap += 1

    def _cancel_pending(self, rec: _Record) -> None:
        """The pending version of ``rec`` becomes CANCELLED (its heap entry, if any, goes stale).
        No helper calls inside: this is on ``Pool.cancel``'s measured path."""
        if rec.deferred:
            rec.deferred = False
            self._deferred -= 1
        else:
            self._in_heap -= 1
        rec.seq = NOT_IN_HEAP
        rec.fn = None
        rec.state = CANCELLED
        if len(self._heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
            self._prune()

    def _maybe_prune(self) -> None:
        if len(self._heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
            self._prune()

    def _prune(self) -> None:
        self._heap = [e for e in self._heap if e[3].seq == e[2]]
        heapq.heapify(self._heap)
        assert len(self._heap) == self._in_heap, "prune kept a stale entry or lost a live one"
