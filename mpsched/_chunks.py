"""The task that runs one chunk of ``Pool.map`` in a worker.

Module-level so it pickles by reference (and enters the pool's function table once).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def run_chunk(fn: Callable[..., Any], items: list[tuple[Any, ...]]) -> tuple[list[Any], float]:
    """``[fn(*args) for args in items]`` and the seconds it took (map sizes chunks by it)."""
    start = time.perf_counter()
    results = [fn(*args) for args in items]
    return results, time.perf_counter() - start
