"""The clock the scheduler reads: any zero-argument callable returning monotonic seconds.

``time.monotonic`` is the default. Tests inject ``mpsched.testing.FakeClock`` instead, so that no
test of time logic ever sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]

SYSTEM_CLOCK: Clock = time.monotonic
