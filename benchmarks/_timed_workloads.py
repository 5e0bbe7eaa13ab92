"""Task bodies and shapes of the timed-task benchmark (``bench_timed.py``).

Everything a worker runs is a module-level function here (or in ``_workloads``), so every pool
pickles it by reference, and APScheduler can name it by its textual reference
(``benchmarks._timed_workloads:stamp``). Only the standard library is imported.

- ``stamp(i)`` returns ``(i, time.monotonic())`` taken as the body starts: ``time.monotonic`` is
  ``CLOCK_MONOTONIC``, one clock for every process of the machine on Linux, so the coordinator
  subtracts the task's ``run_at`` from it to get the lateness (negative = started early);
- ``record(path, i)`` appends the line ``i`` to ``path`` (``O_APPEND``: one ``write`` of a few
  bytes is atomic), the side effect that shows whether a cancelled task ran anyway;
- ``hold(...)`` occupies a worker until a release file appears, so that queued tasks stay queued.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

HOLD_POLL_S = 0.001  # s; how often a holding task looks for its release file
APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT
FILE_MODE = 0o600


def stamp(i: int) -> tuple[int, float]:
    """Return ``i`` and the monotonic time at which this body started."""
    return i, time.monotonic()


def append_line(path: str, text: str) -> None:
    """Append one line with a single ``write`` on an ``O_APPEND`` descriptor (atomic here)."""
    fd = os.open(path, APPEND_FLAGS, FILE_MODE)
    try:
        os.write(fd, f"{text}\n".encode())
    finally:
        os.close(fd)


def record(path: str, i: int) -> int:
    """The side effect of a cancellable task: append ``i`` to ``path``; return ``i``."""
    append_line(path, str(i))
    return i


def hold(started_path: str, release_path: str, max_hold_s: float) -> int:
    """Occupy this worker until ``release_path`` exists (at most ``max_hold_s``); return the pid.

    Appends the pid to ``started_path`` first, so the benchmark knows the worker is taken.
    """
    append_line(started_path, str(os.getpid()))
    deadline = time.monotonic() + max_hold_s
    while not os.path.exists(release_path) and time.monotonic() < deadline:
        time.sleep(HOLD_POLL_S)
    return os.getpid()


def read_lines(path: str | Path) -> list[str]:
    """The lines of a side-effect file; none if no task ever wrote it."""
    try:
        return Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []


def uniform_offsets(count: int, spread_s: float, seed: int) -> list[float]:
    """``count`` seeded offsets drawn uniformly from ``[0, spread_s)``, sorted (seconds)."""
    rng = random.Random(seed)
    return sorted(rng.uniform(0.0, spread_s) for _ in range(count))
