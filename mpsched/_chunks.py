"""The tasks that run one chunk of ``Pool.map`` in a worker.

Module-level so they pickle by reference (and enter the pool's function table once).

A map over one iterable sends its items as they are (a flat list), not as 1-tuples of
arguments: pickling 1,024 small ints as 1-tuples took 84 us to dump and 99 us to load here,
as a flat list 20 us and 36 us, and the tuples cost another ~60 us to build (``zip``) in the
caller. Several iterables need the tuples (``run_star_chunk``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import starmap
from typing import Any

from mpsched._worker import announce_result


def run_chunk(fn: Callable[[Any], Any], items: list[Any]) -> tuple[list[Any], float]:
    """``[fn(x) for x in items]`` and the seconds it took (map sizes chunks by it)."""
    start = time.perf_counter()
    results = list(map(fn, items))
    seconds = time.perf_counter() - start
    announce_result()  # map waits for the chunks in order: no batching of this result
    return results, seconds


def run_star_chunk(fn: Callable[..., Any], items: list[tuple[Any, ...]]) -> tuple[list[Any], float]:
    """``[fn(*args) for args in items]`` and the seconds it took."""
    start = time.perf_counter()
    results = list(starmap(fn, items))
    seconds = time.perf_counter() - start
    announce_result()
    return results, seconds
