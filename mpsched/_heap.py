"""VersionedHeap: the coordinator's time/priority queue with one live version per task id.

Owns the heap of pending tasks and the record of every task id it has seen. Pure: no I/O, no
locks, no clock; every time-dependent call takes ``now`` (trio's ``Deadlines`` and ``MockClock``),
so the whole module is deterministic and tested without processes. ``Scheduler`` (``_scheduler``)
wraps it with a clock, a lock, input validation and ``close()``; the pool's coordinator thread
drives it.

Ordering key: the first three fields of a record, which is also its heap entry::

    (run_at, -priority, seq, ...)

``seq`` is a counter over all schedule calls, so equal time and priority run in submission order,
and since ``seq`` is unique the tuple comparison never reaches the fields after it: the heap
never compares task ids or items (heapq docs, "Priority Queue Implementation Notes").

Nothing per task that the garbage collector keeps walking. A million pending tasks are a pool's
stated load, and CPython's full collections walk every tracked object each time the tracked set
grows by a quarter (about five walks of each object while it grows): measured, an object costs
~0.3 us plus ~0.06 us per reference held, summed over those walks. So a record is an exact tuple
of atomic values (numbers, and the id), which the collector untracks the first time it sees it,
and the only references to the callers' items (the futures) sit in one dict, ``_items``, keyed by
``seq``. (A ``__slots__`` record object, and heap entries that held it, cost 40% more per
``schedule`` with the collector on.)

* ``_records[task_id]`` is ``(run_at, -priority, seq, task_id, version, state, running,
  cancel_requested, priority)``, replaced on every change (``_R_*`` name the fields);
  ``state`` is a plain int (a ``TaskState`` member would keep the tuple tracked). The record of a
  pending version is its heap entry: one tuple per task, and ``pop_due`` reads it off the heap.
* A version is pending iff its record's ``seq`` has an item in ``_items``. ``withdraw`` (the
  pool's cancel) only drops the item: the record's state field still says PENDING, which for a
  ``seq`` without an item reads CANCELLED (``_state_of``). A new record per cancel would be one
  more tracked tuple to allocate, ~30% of the heap's part of a cancel.
* Lazy deletion (Java STPE without ``setRemoveOnCancelPolicy``, trio ``Deadlines``):
  rescheduling or cancelling never touches the heap, and an entry is *stale* iff its ``seq`` has
  no item (one dict probe per entry, no lookup of the id's record).
* ``pop_due`` drops stale entries when they reach the top; each is popped at most once, at
  O(log n).
* The prune check (inlined in ``schedule``, ``pop_due``, ``finish`` and ``discard``) rebuilds the
  heap from its live entries when ``len(heap) > PRUNE_FACTOR * in_heap + PRUNE_SLACK``, after
  every call that adds an entry (a reschedule's leaves a stale one), hands a live one out, or
  leaves a stale entry that the heap alone holds (``discard``). ``withdraw`` (the pool's cancel)
  has none: it adds no entry, and the record of the version it withdraws stays its id's record,
  so its stale entry costs its 8-byte slot in the list and nothing else (until a ``discard``,
  which checks, or the pool's forgetting of the id, 100,000 ends later). So the heap never
  holds more than ``PRUNE_FACTOR * live + PRUNE_SLACK`` entries for the live count after the
  last call that checks, and a run of cancels leaves it the length it had, as the dicts keep
  their tables: memory is O(live tasks as of the last schedule or hand-out) under any mix of
  reschedules and cancels. A rebuild in ``withdraw`` cost ~250 ns of the pool's ~1.5 us cancel
  by id (10,000 scheduled then cancelled, fresh pools: it walks every cold record), 16%.
  Time: a rebuild costs O(len(heap)); when it triggers, the stale entries outnumber the live
  ones (factor 2), so its cost is O(number of stale entries it removes). Each stale entry is
  created once (by one reschedule or cancel) and removed once (popped at the top, at O(log n),
  or dropped by one rebuild), so stale entries cost O(log n) amortized each.

One live version per id: scheduling an id again supersedes its pending version. If a version of
the id is RUNNING, the new version is *deferred*: it is not in the heap (so it can never come out
of ``pop_due``) and enters the heap, with the ``seq`` of its ``schedule`` call, when ``finish()``
ends the running one. Two versions of one id therefore never run at once.

The ended-id memory (``remember`` > 0; the pool's): the records of the last ``remember`` ids
that ended are kept for ``state()``, and the id whose latest end is the oldest is forgotten first
(as ``discard`` does). It counts ids, not ends: a recurrence ending a million times is one id.
``_finished`` holds the record of each end, in the order of the ends (one ``append`` per end, the
whole cost on ``withdraw``'s path, Pool.cancel's). An entry is *live* iff it is still its id's
record (``records[id] is entry``): those are exactly the remembered ids, one each. It goes
*stale* when its id is scheduled again or discarded; ``_stale`` counts those (one increment per
reschedule of an ended id, off the per-end path), so ``len(_finished) - _stale`` is the number
of ids remembered, checked only when the deque holds more than ``remember`` entries, as the
forgetting was before. Then one live entry too many forgets the oldest id (stale entries on the
way out go with it), and otherwise, past ``COMPACT_FACTOR * remember`` entries, one pass drops
every stale entry: it removes more entries than it keeps, so its cost is O(1) amortized per
stale entry. The deque never holds more than ``COMPACT_FACTOR * remember`` entries. (An
``OrderedDict`` keyed by id would count ids too, at a dict operation per end: ~+180 ns on
Pool.cancel's path.)

Not handled here: validation of arguments (``Scheduler``) and thread safety (callers
serialize). Without ``remember`` (``Scheduler``'s heap), a record stays after its id reaches a
terminal state so that ``state()`` can answer, until ``discard()`` drops it.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import operator
import sys
from collections.abc import Callable, Hashable
from typing import Any, Final

from mpsched._errors import InvalidTransition, TaskCancelled
from mpsched._task import Due, TaskState, Wait

# Record states as plain ints (TaskState values); _STATES turns one back into its member.
_PENDING = int(TaskState.PENDING)
_RUNNING = int(TaskState.RUNNING)
_COMPLETED = int(TaskState.COMPLETED)
_FAILED = int(TaskState.FAILED)
_CANCELLED = int(TaskState.CANCELLED)
_STATES = tuple(TaskState)

# Fields of a record (see the module doc). Invariants:
#   * The latest version is pending iff seq is in _items (seq is then the sequence number of its
#     schedule() call, and _items[seq] its item). Otherwise the state field is its state, except
#     that PENDING there means CANCELLED (withdrawn; see _state_of).
#   * A pending version is deferred (waits behind ``running``, not in the heap) iff running is
#     not 0; otherwise its record is in the heap (and a heap entry is live iff its seq has an
#     item).
#   * running is the version being run (0: none); it may be older than version.
_R_RUN_AT: Final = 0
_R_NEG_PRIORITY: Final = 1
_R_SEQ: Final = 2
_R_TASK_ID: Final = 3
_R_VERSION: Final = 4
_R_STATE: Final = 5
_R_RUNNING: Final = 6
_R_CANCEL: Final = 7
_R_PRIORITY: Final = 8
Record = tuple[float, int, int, Hashable, int, int, int, bool, int]
# For callers that keep the record ``schedule`` returns (the pool's future of a pending version
# holds it: its id and version, with no tuple of its own).
RECORD_TASK_ID: Final = _R_TASK_ID
RECORD_VERSION: Final = _R_VERSION

# Rebuild when the heap exceeds PRUNE_FACTOR x its live entries plus PRUNE_SLACK. Factor 2 bounds
# the heap at twice the live set (memory) while charging each rebuild to at least as many stale
# entries as there are live ones (time). The slack stops a small heap from being rebuilt on every
# second reschedule; 64 entries are ~6 KiB.
PRUNE_FACTOR = 2
PRUNE_SLACK = 64

# The ended-id memory's deque is compacted past COMPACT_FACTOR x remember entries: it then holds at
# most remember live ones, so a pass drops at least as many stale entries as it keeps (time), and
# the deque stays within twice the cap (memory: a reference and an old record per stale entry).
COMPACT_FACTOR = 2

NOT_IN_HEAP = -1  # record seq once its version left the heap to run (never a key of _items)
_MAX_WAIT = sys.float_info.max  # seconds: the longest finite Wait (see pop_due)

# -priority as one shared int object per priority level: CPython caches only -5..256, so every
# heap key would otherwise hold its own 28-byte int (8% of a pending task's memory).
_NEGATED = {p: -p for p in range(-1024, 1025)}
_negated_get = _NEGATED.get
_seq_of = operator.itemgetter(_R_SEQ)


class _Records(dict[Hashable, Record]):
    """``_records``: a dict that the garbage collector never untracks.

    A full collection untracks an exact dict whose keys and values are all untracked, which the
    records dict is once the collector has seen its tuples. The next ``schedule`` inserts a new
    (still tracked) tuple, which tracks the dict again, as a young object: every young
    collection after a full one then walked the whole dict (measured with a million pending
    tasks: half the time of the 2,600 young and 240 middle collections, ~0.3 s of 5.5 s). A
    subclass is never untracked (3.11 ``untrack_dicts`` takes exact dicts only), so it stays in
    the oldest generation, which only the full collections walk."""

    __slots__ = ()


# Due's constructor runs Python code (NamedTuple.__new__); tuple.__new__ builds the same object
# without it, saving ~0.2 us per next().
_new_due = tuple.__new__


class VersionedHeap:
    """Pending tasks ordered by ``(run_at, -priority, seq)``; one live version per task id.

    Arguments are trusted (``Scheduler`` validates them). Not thread-safe: one caller at a time.
    """

    def __init__(self, remember: int = 0) -> None:
        """``remember``: if > 0, keep the records of the last this many ids that reached a
        terminal state (the id whose latest end is the oldest forgotten first, as ``discard``
        does); 0 keeps them all."""
        self._remember = remember
        # The record of each end, in the order of the ends (the module doc, "ended-id memory"):
        # live while it is its id's record; ``_stale`` counts the others (schedule counts them
        # even without ``remember``, unread then: one test less on its path).
        self._finished: collections.deque[Record] = collections.deque()
        self._stale = 0
        # Invariant: every live version's record is once in _heap (stale entries may be too).
        self._heap: list[Record] = []
        # Invariant: the one record of every id seen and not discarded; see the module doc.
        self._records = _Records()
        self._items: dict[int, Any] = {}  # by seq: the item of each pending version
        # ``task_id in heap`` without a Python frame (asked on every Pool.schedule).
        self.knows: Callable[[Hashable], bool] = self._records.__contains__
        self._seq = itertools.count()
        self._in_heap = 0  # live entries in _heap
        self._deferred = 0  # pending versions waiting behind a running one of their id
        # The item of a withdraw that an exception (a Ctrl-C's KeyboardInterrupt) hit after the
        # removal: its caller's handler must still end it (take_interrupted).
        self._interrupted: Any = None

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        """Live pending versions: those in the heap plus the deferred ones."""
        return self._in_heap + self._deferred

    def __contains__(self, task_id: Hashable) -> bool:
        """Whether ``task_id`` has a record (pending, running or remembered)."""
        return task_id in self._records

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale included (bounded by PRUNE_FACTOR * live + PRUNE_SLACK
        for the live count after the last call with a prune check: not ``withdraw``)."""
        return len(self._heap)

    def state(self, task_id: Hashable) -> TaskState | None:
        """State of the latest version of ``task_id``; None if unknown (or discarded)."""
        rec = self._records.get(task_id)
        return None if rec is None else _STATES[self._state_of(rec)]

    def version(self, task_id: Hashable) -> int:
        """Latest version number of ``task_id``; 0 if unknown."""
        rec = self._records.get(task_id)
        return 0 if rec is None else rec[_R_VERSION]

    def cancel_requested(self, task_id: Hashable) -> bool:
        """True if the running version of ``task_id`` was asked to cancel."""
        rec = self._records.get(task_id)
        return rec is not None and rec[_R_RUNNING] != 0 and rec[_R_CANCEL]

    def running_version(self, task_id: Hashable) -> int:
        """The version of ``task_id`` now running; 0 if none."""
        rec = self._records.get(task_id)
        return 0 if rec is None else rec[_R_RUNNING]

    def pending_ids(self) -> list[Hashable]:
        """The ids that have a pending version (deferred ones included)."""
        items = self._items
        return [task_id for task_id, rec in self._records.items() if rec[_R_SEQ] in items]

    def pending_item(self, task_id: Hashable) -> Any:
        """The item given with the pending version of ``task_id``; None if none is pending."""
        rec = self._records.get(task_id)
        return None if rec is None else self._items.get(rec[_R_SEQ])

    def next_deadline(self) -> float | None:
        """run_at of the earliest live entry in the heap (drops stale tops); None if none."""
        heap = self._heap
        items = self._items
        while heap:
            top = heap[0]
            if top[_R_SEQ] in items:
                return top[_R_RUN_AT]
            heapq.heappop(heap)
        return None

    # ----------------------------------------------------------------- mutations
    def schedule(self, task_id: Hashable, run_at: float, priority: int, item: Any) -> Record:
        """Make a new version of ``task_id`` pending; supersede any pending one. Returns its
        record (immutable; ``[RECORD_VERSION]`` is the new version's number)."""
        # Order: every call (a point where the eval loop may raise a Ctrl-C's
        # KeyboardInterrupt) comes before the first store or after the last one that the
        # invariants tie together (record, item, counters, heap entry), so an exception leaves
        # the version scheduled or not at all (not an item with no record, or an entry in the
        # heap that ``_in_heap`` does not count: len() then said 0 and the drain ended with the
        # version pending, and the next prune failed its assertion).
        records = self._records
        old = records.get(task_id)
        seq = next(self._seq)
        items = self._items
        neg = _negated_get(priority)
        if neg is None:
            neg = -priority
        if old is None:  # fast path: a new id (no pending, no running version)
            rec = records[task_id] = (run_at, neg, seq, task_id, 1, _PENDING, 0, False, priority)
            items[seq] = item
            self._in_heap += 1
            heapq.heappush(self._heap, rec)
        else:
            _, _, old_seq, _, version, _, running, cancel_requested, _ = old
            # The record first: its store calls the id's __hash__ and __eq__ (user code, which
            # may raise, or where a Ctrl-C may land); after it the stores call nothing. (Stored
            # last, the superseded version was gone, uncounted, when it raised: cancelled by a
            # schedule() that failed. Found by a model hunt.)
            rec = records[task_id] = (run_at, neg, seq, task_id, version + 1, _PENDING, running,
                                      cancel_requested, priority)  # fmt: skip
            if old_seq in items:  # a pending version, superseded: its heap entry goes stale
                del items[old_seq]
                if running:  # it was deferred
                    self._deferred -= 1
                else:
                    self._in_heap -= 1
            elif not running:  # an ended id: its entry in the ended-id memory goes stale
                self._stale += 1
            items[seq] = item
            if running:  # deferred: it enters the heap when the running version finishes
                self._deferred += 1
            else:
                self._in_heap += 1
                heapq.heappush(self._heap, rec)
        # After a new id's push too: the entries of cancelled versions, left by withdraw, go
        # at the next schedule (batches of new ids scheduled and cancelled grew the heap for
        # ever).
        if len(self._heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
            self._prune()
        return rec

    def cancel(self, task_id: Hashable) -> bool:
        """Cancel the pending version and ask the running one to cancel. False if neither exists.

        A cancelled pending version never comes out of ``pop_due``: its heap entry is stale.
        """
        rec = self._records.get(task_id)
        if rec is None:
            return False
        pending = rec[_R_SEQ] in self._items
        if rec[_R_RUNNING]:
            self._records[task_id] = (*rec[:_R_CANCEL], True, rec[_R_PRIORITY])
        if pending:  # after the flag: withdraw may forget an ended id's record
            self.withdraw(task_id)
        return pending or rec[_R_RUNNING] != 0

    def withdraw(self, task_id: Hashable, version: int = 0) -> Any:
        """Cancel the pending version of ``task_id`` (only if it is ``version``, unless that is
        0) and leave a running one alone, unlike ``cancel``. Returns the item it was scheduled
        with, or None if no such version was pending. An exception after the removal leaves
        the item for ``take_interrupted``."""
        rec = self._records.get(task_id)
        if rec is None:
            return None
        # Flat (no helper frames): this is all of Pool.cancel's work in the heap. The record
        # stays: without its item, its version reads CANCELLED (see the module doc).
        if version and rec[_R_VERSION] != version:
            return None
        # No call from the check to the removal: an exception (a Ctrl-C's KeyboardInterrupt,
        # raised only as a call returns) cannot come between the removal and the count it
        # changes (the count stayed one too high: len() never fell to 0 and the drain waited
        # for ever). No prune either: the entry stays, stale, and costs its slot only (see the
        # module doc, "The prune check").
        items = self._items
        seq = rec[_R_SEQ]
        if seq not in items:
            return None
        item = items[seq]
        del items[seq]
        if rec[_R_RUNNING]:  # it was deferred
            self._deferred -= 1
        else:
            self._in_heap -= 1
        try:  # (no cost until an exception)
            # _note_finished, inlined; with a version running, its finish() notes the id instead
            if self._remember and not rec[_R_RUNNING]:
                finished = self._finished
                finished.append(rec)  # the record stays: its version reads CANCELLED
                if len(finished) > self._remember:
                    self._trim_finished()
        except BaseException:
            # Raised as one of these calls returned: the item is out, and only this frame
            # holds it (the pool's future of the version stayed pending for ever). The tail
            # is bookkeeping that may be left undone: an ended id not remembered (then never
            # forgotten: one record).
            self._interrupted = item
            raise
        return item

    def take_interrupted(self) -> Any:
        """The item of the last ``withdraw`` that an exception hit after it removed the
        version (None if none, or taken already): for the caller's handler to end it."""
        item, self._interrupted = self._interrupted, None
        return item

    def pop_due(self, now: float) -> Due | Wait | None:
        """Hand out the live task with the smallest key among those with ``run_at <= now``.

        The task becomes RUNNING. Returns a ``Wait`` if tasks are pending but none is due
        (``math.inf`` if all of them are deferred behind running versions), None if none pending.
        """
        heap = self._heap
        items = self._items
        while heap:
            top = heap[0]
            if top[_R_SEQ] not in items:
                heapq.heappop(heap)  # stale: superseded or cancelled; popped this once only
                continue
            if top[_R_RUN_AT] > now:
                # At most the largest float: the difference of two finite times can overflow,
                # and Wait(inf) means "only a finish() can make one eligible" (model hunt).
                return Wait(min(top[_R_RUN_AT] - now, _MAX_WAIT))
            # Stores first, the pop last (a call, whose return is a point where the eval loop
            # may raise a Ctrl-C's KeyboardInterrupt): interrupted there, the version is handed
            # out and the top entry is stale (its item is gone). Popped first, an interrupt as
            # the pop returned left the version counted and in no heap: never handed out,
            # len() never 0, its state PENDING for ever. The record's store comes first of
            # all: it calls the id's __hash__ and __eq__, which may raise (after the count's
            # decrement, the version stayed pending, uncounted, and was handed out again:
            # len() went to -1; found by a model hunt).
            # A live entry is its id's current record: no version runs beside one in the heap.
            run_at, neg, seq, task_id, version, _, _, _, priority = top
            self._records[task_id] = (run_at, neg, NOT_IN_HEAP, task_id, version, _RUNNING,
                                      version, False, priority)  # fmt: skip
            self._in_heap -= 1
            item = items[seq]
            del items[seq]
            heapq.heappop(heap)
            # the live count fell: the bound may need a rebuild too (inlined: hot path)
            if len(heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
                self._prune()
            return _new_due(Due, (task_id, version, run_at, priority, item))
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
        task_id = due.task_id
        rec = self._records.get(task_id)
        if rec is None or rec[_R_RUNNING] == 0 or rec[_R_RUNNING] != due.version:
            now_running = "none" if rec is None or not rec[_R_RUNNING] else f"v{rec[_R_RUNNING]}"
            raise InvalidTransition(
                f"cannot finish task {task_id!r} v{due.version}: it is not running "
                f"(running version: {now_running}); finish() takes each Due from next() once"
            )
        run_at, neg, seq, _, version, _, _, cancel_requested, priority = rec
        if cancelled:
            outcome = _CANCELLED
        elif error is None:
            outcome = _COMPLETED
        elif isinstance(error, TaskCancelled) and cancel_requested:
            outcome = _CANCELLED
        else:
            outcome = _FAILED
        # The latest version: this one, or a newer one (deferred, or withdrawn meanwhile).
        state = outcome if version == due.version else self._state_of(rec)
        rec = self._records[task_id] = (run_at, neg, seq, task_id, version, state, 0, False,
                                        priority)  # fmt: skip
        if state == _PENDING:  # a newer version waited: it may start now, in schedule() order
            self._deferred -= 1
            self._in_heap += 1  # before the push, as in schedule(): counted once in the heap
            heapq.heappush(self._heap, rec)
            if len(self._heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
                self._prune()
        elif self._remember:
            self._note_finished(rec)
        return _STATES[outcome]

    def discard(self, task_id: Hashable) -> bool:
        """Forget a task id whose latest version is terminal and not running. True if dropped."""
        rec = self._records.get(task_id)
        if rec is None or rec[_R_RUNNING] or rec[_R_SEQ] in self._items:
            return False  # unknown, running, or pending (every other state is terminal)
        del self._records[task_id]
        if self._remember:  # its end's entry in the ended-id memory goes stale
            self._stale += 1
        # A withdrawn version's record is its stale heap entry: held by the heap alone now.
        if len(self._heap) > PRUNE_FACTOR * self._in_heap + PRUNE_SLACK:
            self._prune()
        return True

    # ----------------------------------------------------------------- internals
    def _state_of(self, rec: Record) -> int:
        """The state of ``rec``'s latest version (its state field, except for a withdrawn one)."""
        state = rec[_R_STATE]
        return _CANCELLED if state == _PENDING and rec[_R_SEQ] not in self._items else state

    def _note_finished(self, rec: Record) -> None:
        finished = self._finished
        finished.append(rec)
        if len(finished) > self._remember:
            self._trim_finished()

    def _trim_finished(self) -> None:
        """After an end, with more than ``remember`` entries: forget the oldest ids while there
        are too many (one end adds one at most, but an exception may have cut an earlier trim
        short), else compact past ``COMPACT_FACTOR * remember`` entries. An id's lookup and its
        record's deletion call its __hash__ and __eq__ (user code, which may raise, or where a
        Ctrl-C may land), so each comes before its entry leaves, last: an entry gone before
        they raised was forgotten with its record kept, or left the count of stale entries one
        off, and a later compaction failed its assertion (found by a model hunt and a review).
        """
        finished = self._finished
        records = self._records
        if len(finished) - self._stale > self._remember:
            while len(finished) - self._stale > self._remember:
                ended = finished[0]
                if records.get(ended[_R_TASK_ID]) is ended:  # the id ended last with it
                    del records[ended[_R_TASK_ID]]
                else:
                    self._stale -= 1
                finished.popleft()
        elif len(finished) > COMPACT_FACTOR * self._remember:
            # The live entries, oldest first, in a new deque put in place by stores only: a
            # lookup that raised in an in-place rotation left the memory out of order.
            kept = collections.deque(e for e in finished if records.get(e[_R_TASK_ID]) is e)
            assert len(kept) == len(finished) - self._stale, "the stale count is wrong"
            self._finished = kept
            self._stale = 0

    def _prune(self) -> None:
        # The live entries, in C (no Python-level loop): ~50 instead of ~65 ns an entry, and
        # a cancel-heavy run prunes about two entries per cancel (at its next schedule).
        heap = self._heap
        self._heap = list(
            itertools.compress(heap, map(self._items.__contains__, map(_seq_of, heap)))
        )
        heapq.heapify(self._heap)
        assert len(self._heap) == self._in_heap, "prune kept a stale entry or lost a live one"
