"""Pool.map's chunk task and chunk sizing, without processes."""

from __future__ import annotations

import math
import operator
import pickle
import threading
from typing import Any

import pytest

from mpsched import _map
from mpsched._chunks import run_chunk
from mpsched._errors import TaskCancelled
from mpsched._protocol import load_exception
from mpsched._serialize import dumps_result


def _results(*args: Any) -> list[Any]:
    """``run_chunk``'s results, unpickled (it returns them pickled: map reads their size)."""
    return _load(run_chunk(*args)[0])


def _load(pieces: list[bytes]) -> list[Any]:
    return [result for piece in pieces for result in pickle.loads(piece)]


def test_run_chunk_runs_every_item_within_its_budget() -> None:
    items = list(range(1000))
    assert _results(abs, items, False, math.inf, math.inf) == items
    assert _results(operator.add, [(1, 2), (3, 4)], True, math.inf, math.inf) == [3, 7]
    assert _results(abs, [], False, math.inf, math.inf) == []


def test_run_chunk_stops_at_its_budget_after_one_item_at_least() -> None:
    pieces, seconds, error, _ = run_chunk(abs, list(range(-5, 5)), False, 0.0, math.inf)
    assert _load(pieces) == [5]  # a prefix: map sends the rest again
    assert seconds >= 0.0
    assert error is None
    assert _results(operator.add, [(1, 2), (3, 4)], True, 0.0, math.inf) == [3]


def test_run_chunk_pickles_its_results_once_without_a_byte_limit() -> None:
    pieces, _, _, _ = run_chunk(abs, list(range(1000)), False, math.inf, math.inf)
    assert len(pieces) == 1


def test_run_chunk_stops_once_its_pickled_results_reach_max_bytes() -> None:
    """Runs of 1, 1, 2, 4, ... items, each pickled as it ends: 1,000-byte results and a
    limit of 3,000 bytes stop the chunk after the third run (4 items, ~4,000 bytes)."""
    pieces, _, error, _ = run_chunk(_kilobytes, list(range(64)), False, math.inf, 3000)
    assert [len(pickle.loads(piece)) for piece in pieces] == [1, 1, 2]
    assert _load(pieces) == [_kilobytes(i) for i in range(4)]
    assert error is None
    # A limit the whole chunk stays under: every item, one piece per run.
    pieces, _, _, _ = run_chunk(_kilobytes, list(range(5)), False, math.inf, 10**6)
    assert [len(pickle.loads(piece)) for piece in pieces] == [1, 1, 2, 1]
    assert _load(pieces) == [_kilobytes(i) for i in range(5)]


def _kilobytes(i: int) -> bytes:
    return bytes([i]) * 1000


def test_run_chunk_stops_once_its_pickled_results_hold_exactly_max_bytes() -> None:
    """ "Reached" includes equal: a limit of exactly one run's pickled bytes stops the chunk
    after that run (a mutation hunt found a strict comparison unnoticed)."""
    limit = len(dumps_result([1]))
    pieces, _, error, done = run_chunk(abs, [1, 2, 3, 4, 5, 6, 7, 8], False, math.inf, limit)
    assert (_load(pieces), error, done) == ([1], None, 1)
    pieces, _, _, done = run_chunk(abs, [1, 2, 3, 4, 5, 6, 7, 8], False, math.inf, limit + 1)
    assert (_load(pieces), done) == ([1, 2], 2)  # one byte more: the second run too


def _cancelled_at_3(x: int) -> int:
    if x == 3:
        raise TaskCancelled
    return x


def test_a_chunk_stops_by_bytes_while_its_results_size_is_unknown_or_large() -> None:
    assert _map._stop_bytes(64, None) == _map.MAP_CHUNK_STOP_BYTES  # nothing came back yet
    assert _map._stop_bytes(8, 64 * 1024.0) == _map.MAP_CHUNK_STOP_BYTES  # sized by bytes
    assert _map._stop_bytes(4096, 5.0) == math.inf  # tiny results: pickled once


def test_chunk_size_grows_boundedly_up_to_the_cap() -> None:
    target = _map.MAP_TARGET_CHUNK_SECONDS
    assert _map._next_chunksize(1e-9, 64, 4096, target) == 4096
    assert _map._next_chunksize(1e-9, 1, 4096, target) == _map.MAP_GROWTH
    assert _map._next_chunksize(1e-9, 64, 100, target) == 100
    assert _map._next_chunksize(1.0, 64, 4096, target) == 1  # slow items: one per chunk
    assert _map._next_chunksize(0.0, 64, 4096, target) == 4096
    assert _map._next_chunksize(1e-4, 64, 4096, target) == 20
    assert _map._next_chunksize(1e-4, 64, 4096, 0.1) == 1000  # a big fn's longer target


def test_the_bytes_of_the_results_lower_the_cap() -> None:
    assert _map._bytes_cap(4096, 10.0) == 4096  # small results: the arguments' cap
    assert _map._bytes_cap(4096, 100_000.0) == _map.MAP_CHUNK_BYTES // 100_000
    assert _map._bytes_cap(4096, 10.0**7) == 1  # one item at least
    assert _map._bytes_cap(4096, 0.0) == 4096


def test_max_chunk_bounds_the_pickled_bytes() -> None:
    assert _map._max_chunk(list(range(64))) == _map.MAP_MAX_CHUNK
    big = _map._max_chunk(["x" * 1000 + str(i) for i in range(64)])
    assert 64 <= big <= _map.MAP_CHUNK_BYTES // 1000
    assert _map._max_chunk([b"x" * 10**6]) == 1
    assert _map._max_chunk([lambda: 0]) == _map.MAP_MAX_CHUNK  # submit reports the error


def _fail_at_3(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


def test_run_chunk_returns_the_results_before_an_error_with_the_error() -> None:
    pieces, _, error, _ = run_chunk(_fail_at_3, [1, 2, 3, 4], False, math.inf, math.inf)
    assert _load(pieces) == [1, 2]
    assert error is not None
    with pytest.raises(ValueError, match="three"):
        raise load_exception(error)
    # The first item: its error the same way (the chunk's task fails only when no item ran
    # to its end, or its worker died: a dropped map sends nothing of it again then).
    pieces, _, error, done = run_chunk(_fail_at_3, [3, 4], False, math.inf, math.inf)
    assert _load(pieces) == []
    assert done == 1
    assert error is not None
    with pytest.raises(ValueError, match="three"):
        raise load_exception(error)


def test_run_chunk_by_pieces_returns_the_results_before_an_error_with_the_error() -> None:
    pieces, _, error, _ = run_chunk(_fail_at_3, [1, 2, 3, 4], False, math.inf, 10**6)
    assert _load(pieces) == [1, 2]
    assert error is not None
    pieces, _, error, done = run_chunk(_fail_at_3, [3, 4], False, math.inf, 10**6)
    assert (_load(pieces), done) == ([], 1)
    with pytest.raises(ValueError, match="three"):
        raise load_exception(error)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_bytes", [math.inf, 10**6])
def test_the_chunks_own_cancel_ends_it_cancelled_not_as_an_items_error(max_bytes: float) -> None:
    """``TaskCancelled`` raised by an item acknowledges the cancel of the chunk's task: it
    propagates (the task ends cancelled, as any task's), where another exception is the
    item's error returned beside the results before it."""
    with pytest.raises(TaskCancelled):
        run_chunk(_cancelled_at_3, [3, 4], False, math.inf, max_bytes)
    with pytest.raises(TaskCancelled):
        run_chunk(_cancelled_at_3, [1, 2, 3, 4], False, math.inf, max_bytes)


def _lock_at_3(x: int) -> Any:
    """A result that no pickler takes at item 3."""
    return threading.Lock() if x == 3 else x


@pytest.mark.parametrize("max_bytes", [math.inf, 10**6])  # pickled at the end, or by runs
def test_a_result_that_does_not_pickle_is_its_items_error(max_bytes: float) -> None:
    """The results before it come back, with its pickling error for ``map`` to raise after
    them (the chunk's task failing dropped them); at the chunk's first item too."""
    pieces, _, error, _ = run_chunk(_lock_at_3, [1, 2, 3, 4], False, math.inf, max_bytes)
    assert _load(pieces) == [1, 2]
    assert error is not None
    with pytest.raises(TypeError, match="pickle"):
        raise load_exception(error)
    pieces, _, error, done = run_chunk(_lock_at_3, [3, 4], False, math.inf, max_bytes)
    # Items run: both, if pickled at the end (the one after it ran too, its result dropped).
    assert (_load(pieces), done) == ([], 2 if max_bytes == math.inf else 1)
    with pytest.raises(TypeError, match="pickle"):
        raise load_exception(error)  # type: ignore[arg-type]


def test_a_result_that_does_not_pickle_comes_before_a_later_items_error() -> None:
    pieces, _, error, _ = run_chunk(_lock_or_fail, [1, 3, 4, 5], False, math.inf, math.inf)
    assert _load(pieces) == [1]
    assert error is not None
    with pytest.raises(TypeError, match="pickle"):  # item 3's, not item 5's ValueError
        raise load_exception(error)


def _lock_or_fail(x: int) -> Any:
    if x == 5:
        raise ValueError("five")
    return _lock_at_3(x)


class _InterruptedLock:
    """An RLock stand-in whose next ``acquire()`` raises KeyboardInterrupt (a Ctrl-C), before
    taking it or just after (``after``)."""

    def __init__(self, after: bool) -> None:
        self.after = after
        self.owned = False
        self.interrupts = 1

    def _is_owned(self) -> bool:
        return self.owned

    def acquire(self) -> None:
        if self.interrupts:
            self.interrupts -= 1
            self.owned = self.after
            raise KeyboardInterrupt
        self.owned = True


@pytest.mark.parametrize("after", [False, True])
def test_a_map_reader_holds_its_lock_again_through_a_ctrl_c(after: bool) -> None:
    """Raised from a plain ``acquire()``, the caller's ``with`` then failed to release a lock
    it did not hold (a RuntimeError in place of the Ctrl-C); taken twice, it stayed held."""
    lock = _InterruptedLock(after)
    with pytest.raises(KeyboardInterrupt):
        _map._hold_again(lock)
    assert lock.owned
    assert lock.interrupts == 0
