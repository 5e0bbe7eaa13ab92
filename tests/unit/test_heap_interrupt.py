"""A Ctrl-C's KeyboardInterrupt inside ``VersionedHeap.schedule``, ``withdraw``, ``pop_due`` or
``finish``: the eval loop raises it only as a call returns (or at a function's entry, or a
loop's head), so each step's stores are ordered for every such point to leave the heap
consistent: the version is in, counted, or not at all."""

from __future__ import annotations

import collections
import contextlib
import heapq
from typing import Any

import pytest

from mpsched import _heap
from mpsched._future import Future
from mpsched._heap import VersionedHeap
from mpsched._task import Due, TaskState
from mpsched._timed import Timetable


def _interrupt_after_push(monkeypatch: pytest.MonkeyPatch) -> None:
    real = heapq.heappush

    def push_then_interrupt(heap: list[Any], entry: Any) -> None:
        real(heap, entry)
        monkeypatch.undo()
        raise KeyboardInterrupt

    monkeypatch.setattr(_heap.heapq, "heappush", push_then_interrupt)


@pytest.mark.parametrize("known", [False, True], ids=["new id", "superseding"])
def test_an_interrupt_as_a_version_enters_the_heap_leaves_it_counted(
    known: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted as ``heappush`` returned, ``_in_heap`` missed the entry: ``len()`` said 0
    with the version pending (the pool's drain ended without it, and a later prune failed its
    assertion)."""
    heap = VersionedHeap()
    if known:
        heap.schedule("a", 5.0, 0, "old")
    _interrupt_after_push(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        heap.schedule("a", 1.0, 0, "new")
    assert len(heap) == 1
    due = heap.pop_due(2.0)
    assert isinstance(due, Due)
    assert due.fn == "new"
    assert len(heap) == 0
    assert heap.pop_due(10.0) is None


def test_an_interrupt_as_a_due_version_leaves_the_heap_hands_it_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Interrupted as ``heappop`` returned in ``pop_due``, the version stayed counted and
    pending (its item kept) but in no heap: never handed out, ``len()`` never 0 (the pool's
    drain waited for ever), ``state()`` PENDING for ever. Now the pop is the last step: the
    version is handed out (RUNNING; the interrupted caller lost its Due, as any call that
    raises loses its return value)."""
    heap = VersionedHeap()
    heap.schedule("a", 0.0, 0, "job")
    heap.schedule("b", 5.0, 0, "later")
    real = heapq.heappop
    calls = []

    def pop_then_interrupt(entries: list[Any]) -> Any:
        calls.append(1)
        real(entries)
        raise KeyboardInterrupt

    monkeypatch.setattr(_heap.heapq, "heappop", pop_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        heap.pop_due(1.0)
    monkeypatch.undo()
    assert calls == [1]
    assert heap.state("a") is TaskState.RUNNING
    assert len(heap) == 1  # "b"
    due = heap.pop_due(10.0)
    assert isinstance(due, Due)
    assert due.fn == "later"
    assert len(heap) == 0
    assert heap.pop_due(10.0) is None
    heap._prune()  # its assertion: the live count is the heap's


def test_an_interrupt_as_a_deferred_version_enters_the_heap_leaves_it_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``finish`` of a running version moves the newer one deferred behind it into the heap;
    interrupted as ``heappush`` returned, the entry was in the heap but not counted: ``len()``
    said 0 with it pending, then raised ValueError (negative) once it was handed out, and the
    next prune failed its assertion."""
    heap = VersionedHeap()
    heap.schedule("a", 0.0, 0, "v1")
    running = heap.pop_due(0.0)
    assert isinstance(running, Due)
    heap.schedule("a", 0.0, 0, "v2")  # deferred behind v1
    _interrupt_after_push(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        heap.finish(running)
    assert len(heap) == 1
    due = heap.pop_due(1.0)
    assert isinstance(due, Due)
    assert due.fn == "v2"
    assert len(heap) == 0
    heap._prune()


class _PopThenInterrupt(dict[int, Any]):
    """The heap's items, whose ``pop`` is interrupted as it returns."""

    def pop(self, *args: Any) -> Any:
        super().pop(*args)
        raise KeyboardInterrupt


@pytest.mark.parametrize("deferred", [False, True], ids=["in the heap", "deferred"])
def test_an_interrupt_as_a_version_is_withdrawn_leaves_the_counts_right(deferred: bool) -> None:
    """Interrupted as the pending version's item was taken out, the live count kept it:
    ``len()`` never fell back to 0 (the pool's drain waited for ever)."""
    heap = VersionedHeap()
    if deferred:
        heap.schedule("a", 0.0, 0, "running")
        heap.pop_due(0.0)
    heap.schedule("a", 1.0, 0, "pending")
    heap._items = _PopThenInterrupt(heap._items)
    with contextlib.suppress(KeyboardInterrupt):
        heap.withdraw("a")
    pending = heap.pending_item("a") is not None
    assert len(heap) == int(pending)
    assert heap.pop_due(10.0) is None or pending


class _GetThenInterrupt(dict[Any, Any]):
    """The timetable's handed-out versions, whose ``get`` is interrupted as it returns."""

    def get(self, *args: Any) -> Any:
        super().get(*args)
        raise KeyboardInterrupt


def test_an_interrupt_as_a_handed_out_version_ends_leaves_it_ended() -> None:
    """Interrupted as ``Timetable.end`` looked the version up among the handed-out ones (after
    it cleared the future's due): the version stayed RUNNING in the heap for ever (now
    ``heap.finish`` runs in a ``finally``), and handed out (now ``end`` makes no call there:
    ``busy()`` stayed true, and the pool's drain waited for ever)."""
    timetable = Timetable()
    future = Future()
    timetable.schedule("a", 0.0, 0, future)
    timetable.release_due(1.0, lambda f, priority: None)
    assert timetable.handed["a"] is future
    timetable.handed = _GetThenInterrupt(timetable.handed)
    with contextlib.suppress(KeyboardInterrupt):
        timetable.end(future, None, cancelled=True)
    assert future._due is None
    assert timetable.heap.state("a") is TaskState.CANCELLED
    assert not timetable.busy()


class _AppendThenInterrupt(collections.deque[Any]):
    """The heap's ended-id memory, whose ``append`` is interrupted as it returns (from the
    ``after``-th call on)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.calls = 0
        self.after = after

    def append(self, entry: Any) -> None:
        super().append(entry)
        self.calls += 1
        if self.calls >= self.after:
            raise KeyboardInterrupt


def test_an_interrupt_in_the_bookkeeping_after_a_withdrawal_keeps_the_item_for_the_caller() -> None:
    """Interrupted after the version was taken out (as the ended-id memory noted it): the
    item was lost with the return value (the pool's future stayed pending for ever). The
    caller's handler takes it (``take_interrupted``), once."""
    heap = VersionedHeap(remember=10)
    heap.schedule("a", 1.0, 0, "item")
    heap._finished = _AppendThenInterrupt(after=1)
    assert heap.take_interrupted() is None
    with pytest.raises(KeyboardInterrupt):
        heap.withdraw("a")
    assert heap.take_interrupted() == "item"
    assert heap.take_interrupted() is None
    assert len(heap) == 0
    assert heap.state("a") is TaskState.CANCELLED
    assert heap.pop_due(10.0) is None


class _TrippingId:
    """An id whose ``__hash__`` raises at its ``trip_in``-th call from now (0: never): user code
    that the record's store calls (a frozen dataclass's generated ``__hash__`` is Python code,
    where a Ctrl-C may land too)."""

    trip_in = 0

    def __hash__(self) -> int:
        if _TrippingId.trip_in:
            _TrippingId.trip_in -= 1
            if not _TrippingId.trip_in:
                raise KeyboardInterrupt
        return 7


def _run_once(heap: VersionedHeap, task_id: Any) -> None:
    heap.schedule(task_id, 0.0, 0, "job")
    due = heap.pop_due(1.0)
    assert isinstance(due, Due)
    heap.finish(due)


def test_an_id_whose_hash_raises_as_it_is_handed_out_stays_pending_and_counted() -> None:
    """``pop_due`` decremented the count before the record's store, which raised: the version
    stayed pending, uncounted (``len()`` 0), and the next ``pop_due`` handed it out, the
    count going to -1 (``len()`` a ValueError). Found by a model hunt."""
    heap = VersionedHeap()
    task_id = _TrippingId()
    heap.schedule(task_id, 0.0, 0, "job")
    _TrippingId.trip_in = 1
    with pytest.raises(KeyboardInterrupt):
        heap.pop_due(1.0)
    assert len(heap) == 1
    assert heap.state(task_id) is TaskState.PENDING
    due = heap.pop_due(1.0)
    assert isinstance(due, Due)
    assert due.fn == "job"
    assert len(heap) == 0
    assert heap.pop_due(1.0) is None
    heap._prune()  # its assertion: the live count is the heap's


def test_an_id_whose_hash_raises_as_it_is_rescheduled_keeps_the_old_version() -> None:
    """A reschedule took the superseded version out before the new record's store (the id's
    second hash: the first is the lookup), which raised: ``schedule()`` failed, yet the old
    version was cancelled."""
    heap = VersionedHeap()
    task_id = _TrippingId()
    heap.schedule(task_id, 0.0, 0, "old")
    _TrippingId.trip_in = 2
    with pytest.raises(KeyboardInterrupt):
        heap.schedule(task_id, 0.0, 0, "new")
    assert len(heap) == 1
    due = heap.pop_due(1.0)
    assert isinstance(due, Due)
    assert (due.fn, due.version) == ("old", 1)
    assert heap.pop_due(1.0) is None
    heap._prune()


def test_an_id_whose_hash_raises_as_ended_ids_are_forgotten_keeps_the_count_of_stale_ones() -> None:
    """The oldest ended entry (a stale one: its id ended again since) left the memory before
    its id's lookup, which raised: the count of stale entries stayed one too high (a
    compaction would fail its assertion), and the memory kept one ended id more than
    ``remember`` from then on (one trim an end)."""
    heap = VersionedHeap(remember=2)
    tripping = _TrippingId()
    _run_once(heap, tripping)
    _run_once(heap, tripping)  # its first end's entry goes stale
    _run_once(heap, "b")
    _TrippingId.trip_in = 1  # the lookup of the oldest ended entry's id, as "c" ends
    with pytest.raises(KeyboardInterrupt):
        _run_once(heap, "c")
    stale = [heap._records.get(e[_heap._R_TASK_ID]) is not e for e in heap._finished]
    assert sum(stale) == heap._stale
    for task_id in range(50):
        _run_once(heap, task_id)
    assert [heap.state(task_id) for task_id in (47, 48, 49)] == [None, *[TaskState.COMPLETED] * 2]


def test_an_id_whose_hash_raises_as_its_record_is_forgotten_is_forgotten_later() -> None:
    """The trim took the oldest entry out of the ended-id memory, then its record's deletion
    (the id's second hash: the first is the lookup) raised: the id was remembered for ever,
    and a later end of it counted a stale entry that was not there (diff review)."""
    heap = VersionedHeap(remember=1)
    tripping = _TrippingId()
    _run_once(heap, tripping)
    _TrippingId.trip_in = 2
    with pytest.raises(KeyboardInterrupt):
        _run_once(heap, "b")
    _run_once(heap, "c")
    assert [heap.state(task_id) for task_id in (tripping, "b")] == [None, None]
    assert heap.state("c") is TaskState.COMPLETED
    stale = [heap._records.get(e[_heap._R_TASK_ID]) is not e for e in heap._finished]
    assert sum(stale) == heap._stale


def test_an_id_whose_hash_raises_in_a_compaction_leaves_the_memory_in_order() -> None:
    """The compaction rotated the ended-id memory in place: a lookup that raised midway left
    a newer id's entry behind an older one's, and the newer id was forgotten first (diff
    review). The compaction now puts a new memory in place once it is built."""
    heap = VersionedHeap(remember=2)
    tripping = _TrippingId()
    _run_once(heap, "x")
    for _ in range(3):  # its older ends' entries go stale
        _run_once(heap, tripping)
    heap.schedule(tripping, 0.0, 0, "job")
    due = heap.pop_due(1.0)
    assert isinstance(due, Due)
    _TrippingId.trip_in = 3  # finish's lookup and store, then the compaction's first lookup
    with pytest.raises(KeyboardInterrupt):
        heap.finish(due)
    _run_once(heap, "y")
    assert heap.state("x") is None  # the oldest end: forgotten first
    assert [heap.state(task_id) for task_id in (tripping, "y")] == [TaskState.COMPLETED] * 2
