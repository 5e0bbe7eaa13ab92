"""Pool.map's chunk task and chunk sizing, without processes."""

from __future__ import annotations

import math
import operator

import pytest

from mpsched import _map
from mpsched._chunks import run_chunk
from mpsched._protocol import load_exception


def test_run_chunk_runs_every_item_within_its_budget() -> None:
    items = list(range(1000))
    assert run_chunk(abs, items, False, math.inf)[0] == items
    assert run_chunk(operator.add, [(1, 2), (3, 4)], True, math.inf)[0] == [3, 7]
    assert run_chunk(abs, [], False, math.inf)[0] == []


def test_run_chunk_stops_at_its_budget_after_one_item_at_least() -> None:
    results, seconds, error = run_chunk(abs, list(range(-5, 5)), False, 0.0)
    assert results == [5]  # a prefix: map sends the rest again
    assert seconds >= 0.0
    assert error is None
    assert run_chunk(operator.add, [(1, 2), (3, 4)], True, 0.0)[0] == [3]


def test_chunk_size_grows_boundedly_up_to_the_cap() -> None:
    assert _map._next_chunksize(1e-9, 64, 4096) == 4096
    assert _map._next_chunksize(1e-9, 1, 4096) == _map.MAP_GROWTH
    assert _map._next_chunksize(1e-9, 64, 100) == 100
    assert _map._next_chunksize(1.0, 64, 4096) == 1  # slow items: one per chunk
    assert _map._next_chunksize(0.0, 64, 4096) == 4096


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
    results, _, error = run_chunk(_fail_at_3, [1, 2, 3, 4], False, math.inf)
    assert results == [1, 2]
    assert error is not None
    with pytest.raises(ValueError, match="three"):
        raise load_exception(error)
    with pytest.raises(ValueError, match="three"):  # the first item: the chunk's task fails
        run_chunk(_fail_at_3, [3, 4], False, math.inf)
