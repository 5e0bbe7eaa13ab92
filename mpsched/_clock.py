"""The clock the scheduler reads: any zero-argument callable returning monotonic seconds.

``time.monotonic`` is the default. Tests inject ``mpsched.testing.FakeClock`` instead, so that no
test of time logic ever sleeps.

Also ``wait_seconds``: how a caller's ``timeout`` for a wait is read (the pool's waits and a
child's ``result()``, on both sides of the pool: this is a leaf module).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

Clock = Callable[[], float]

SYSTEM_CLOCK: Clock = time.monotonic


def wait_seconds(timeout: object) -> float | None:
    """A caller's ``timeout`` (not None) for a wait: TypeError if not a number (a bool is not),
    ValueError if NaN; infinite is None (no limit: a wait that long overflows the clock), and
    so is an int past the float range (``float()`` raised a bare OverflowError, also from an
    ``await_termination`` of a pool that had ended). Zero or negative stays: the wait times
    out at once, as the stdlib's waits do. For ``Pool.map``, ``Pool.await_termination``, and
    the ``result()``/``exception()`` of a pool's future and of a child's (in a join, a value
    that failed in its arithmetic was taken for an interrupt of mpsched's own code, and the
    worker exited)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int beyond any float
        seconds = math.inf if timeout > 0 else -math.inf
    if math.isnan(seconds):
        raise ValueError("timeout must be a number of seconds or None, not nan")
    return None if seconds == math.inf else seconds
