"""A Ctrl-C's KeyboardInterrupt as ``ReadyQueue``'s insert returns (``append`` runs in the
submitting thread): the item is queued and counted, so it and every item behind it go out."""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

import pytest

from mpsched import _ready
from mpsched._future import Future
from mpsched._ready import ReadyQueue


class _InterruptOnce(collections.deque):  # type: ignore[type-arg]
    """A level whose next insert raises KeyboardInterrupt once it is done (as the eval loop
    raises a Ctrl-C when the call returns)."""

    armed = False

    def _then_interrupt(self) -> None:
        if _InterruptOnce.armed:
            _InterruptOnce.armed = False
            raise KeyboardInterrupt

    def append(self, item: Any) -> None:
        super().append(item)
        self._then_interrupt()

    def appendleft(self, item: Any) -> None:
        super().appendleft(item)
        self._then_interrupt()

    def insert(self, index: int, item: Any) -> None:
        super().insert(index, item)
        self._then_interrupt()


def _future(name: str, due_at: float) -> Future:
    f = Future(None, name.encode(), 0)
    f._due_at = due_at
    return f


def _append(q: ReadyQueue, f: Future) -> None:
    q.append(f, 0)


def _append_due(q: ReadyQueue, f: Future) -> None:
    q.append_due(f, 0)


def _putback(q: ReadyQueue, f: Future) -> None:
    q.putback([f])


@pytest.mark.parametrize(
    ("insert", "expected"),
    [
        (_append, ["first", "queued", "late"]),
        (_append_due, ["first", "queued", "late"]),  # due at 2.0: ahead of "late" (3.0)
        (_putback, ["queued", "first", "late"]),
    ],
    ids=["append", "append_due", "putback"],
)
def test_an_item_interrupted_as_it_is_inserted_is_counted_and_everything_behind_it_goes_out(
    insert: Callable[[ReadyQueue, Future], None],
    expected: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the fix the count missed the interrupted item: ``take`` stopped one item short,
    and the last item queued never went out (a map waiting on that chunk hung)."""
    monkeypatch.setattr(_ready, "collections", types.SimpleNamespace(deque=_InterruptOnce))
    q = ReadyQueue()
    q.append(_future("first", 1.0), 0)
    _InterruptOnce.armed = True
    interrupted = _future("queued", 2.0)
    with pytest.raises(KeyboardInterrupt):
        insert(q, interrupted)
    assert not _InterruptOnce.armed  # the insert was reached
    assert interrupted._slot == _ready.QUEUED
    q.append(_future("late", 3.0), 0)
    assert (len(q), q.live()) == (3, 3)
    batch, _ = q.take(10)
    assert [f._payload.decode() for f in batch] == expected
    assert not q


def test_withdrawn_items_do_not_pile_up_while_nothing_takes() -> None:
    """While no inbox has room, nothing pops the ready queue: submits cancelled there kept
    their futures for good (500,000 of them, 100 MiB, in a review's loop)."""
    queue = ReadyQueue()
    kept = []
    for i in range(20_000):
        item: Future[Any] = Future()
        item._priority = i % 3
        queue.append(item, item._priority)
        if i % 1000 == 0:
            kept.append(item)
            continue
        item._withdrawn = True
        queue.note_withdrawn(item)
        assert queue.live() == len(kept)
        assert len(queue) <= 3 * len(kept) + 65  # COMPACT_FACTOR 2, COMPACT_SLACK 64
    by_priority = sorted(kept, key=lambda item: -item._priority)  # (stable: FIFO in a level)
    assert queue.take(100) == (by_priority, 0)
    assert not queue
