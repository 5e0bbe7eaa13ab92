"""Public helpers for testing code that uses mpsched (trio.testing style)."""

from __future__ import annotations

import math
import numbers
import threading


class FakeClock:
    """A manual monotonic clock: time moves only when ``advance()`` or ``set()`` says so.

    Pass it as ``Scheduler(clock=FakeClock())``; calling the instance returns the current time.
    Thread-safe, so a test thread may advance it while another reads it.
    """

    def __init__(self, start: float = 0.0) -> None:
        """Raises TypeError if ``start`` is not a real number (a bool is not), ValueError if it
        is NaN or infinite (as every time of the API: ``run_at``, timeouts)."""
        self._now = _seconds("start", start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (>= 0) and return the new time.

        Raises:
            TypeError: ``seconds`` is not a real number (a bool is not).
            ValueError: ``seconds`` is negative, NaN or infinite, or the new time would be
                infinite (past the float range: ``set`` and the constructor refuse it too).
        """
        seconds = _seconds("seconds", seconds)
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, not by {seconds!r}")
        with self._lock:
            now = self._now + seconds
            if math.isinf(now):
                raise ValueError(f"a clock at {self._now!r} cannot move by {seconds!r}: infinite")
            self._now = now
            return now

    def set(self, now: float) -> None:
        """Jump to the absolute time ``now``, which must not be earlier than the current time.

        Raises:
            TypeError: ``now`` is not a real number (a bool is not).
            ValueError: ``now`` is earlier than the current time, NaN or infinite.
        """
        now = _seconds("now", now)
        with self._lock:
            if now < self._now:
                raise ValueError(f"a monotonic clock cannot go from {self._now} back to {now!r}")
            self._now = now


def _seconds(name: str, value: object) -> float:
    """``value`` as a finite float, or TypeError (not a real number, or a bool) / ValueError
    (NaN, infinite, or an int beyond floats), naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int or Fraction beyond the float range
        raise ValueError(
            f"{name} must be finite, not a {type(value).__name__} beyond floats"
        ) from None
    if not math.isfinite(seconds):
        raise ValueError(f"{name} must be finite, not {seconds!r}")
    return seconds
