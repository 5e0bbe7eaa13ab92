"""Public helpers for testing code that uses mpsched (trio.testing style)."""

from __future__ import annotations

import math
import threading


class FakeClock:
    """A manual monotonic clock: time moves only when ``advance()`` or ``set()`` says so.

    Pass it as ``Scheduler(clock=FakeClock())``; calling the instance returns the current time.
    Thread-safe, so a test thread may advance it while another reads it.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0) and return the new time."""
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"a clock only moves forward by a finite amount, not {seconds!r}")
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, now: float) -> None:
        """Jump to the absolute time ``now``, which must not be earlier than the current time."""
        with self._lock:
            if not now >= self._now or math.isinf(now):
                raise ValueError(f"a monotonic clock cannot go from {self._now} back to {now!r}")
            self._now = float(now)
