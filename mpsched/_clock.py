"""The clock the scheduler reads: any zero-argument callable returning monotonic seconds.

``time.monotonic`` is the default. Tests inject ``mpsched.testing.FakeClock`` instead, so that no
test of time logic ever sleeps.

Also ``wait_seconds``: how a caller's ``timeout`` for a wait is read (the pool's waits and a
child's ``result()``, on both sides of the pool: this is a leaf module); and
``wait_interruptibly``: how the pool's process waits in its main thread (a future's result,
``map``, ``await_termination`` and the shutdown), so that a Ctrl-C always ends such a wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

Clock = Callable[[], float]

SYSTEM_CLOCK: Clock = time.monotonic


def wait_seconds(timeout: object) -> float | None:
    """A caller's ``timeout`` (not None) for a wait: TypeError if not a real number (a bool is
    not; a ``Fraction`` or a numpy scalar is, as ``run_at`` takes them), ValueError if NaN;
    infinite is None (no limit: a wait that long overflows the clock), and so is a number past
    the float range (``float()`` raised a bare OverflowError, also from an
    ``await_termination`` of a pool that had ended) or past ``threading.TIMEOUT_MAX`` (~292
    years: a lock's wait raised OverflowError for ``1e10``, a common "for ever", outside the
    main thread, which waits in slices). Zero or negative stays: the wait times
    out at once, as the stdlib's waits do. For ``Pool.map``, ``Pool.await_termination``, and
    the ``result()``/``exception()`` of a pool's future and of a child's (in a join, a value
    that failed in its arithmetic was taken for an interrupt of mpsched's own code, and the
    worker exited)."""
    if isinstance(timeout, bool) or not is_real(timeout):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    try:
        seconds = float(timeout)  # type: ignore[arg-type]  # a numbers.Real
    except OverflowError:  # an int beyond any float
        seconds = math.inf if timeout > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(seconds):
        raise ValueError("timeout must be a number of seconds or None, not nan")
    return None if seconds > threading.TIMEOUT_MAX else seconds


def is_real(value: object) -> bool:
    """Whether ``value`` is a ``numbers.Real`` (bools included). ``numbers`` is imported only
    for a value that is neither an int nor a float: the zygote and the workers import this
    module, and do not load it otherwise."""
    if isinstance(value, (int, float)):
        return True
    import numbers

    return isinstance(value, numbers.Real)


# Python runs a signal's handler (a Ctrl-C's KeyboardInterrupt) in the main thread only, when its
# eval loop next checks for signals. A signal that came just before that thread blocked in a
# lock's wait (after the last check, before the wait's system call), or that the kernel handed
# to another thread, woke nothing: the wait went on until its lock was released, for as long as
# the task ran (1 in ~200 Ctrl-Cs at a ``result()`` under load). So the main thread waits in
# slices of this length, and the loop checks between them.
INTERRUPT_CHECK_S = 0.1  # s: how late such a Ctrl-C can be raised; ~10 wake-ups a second


def wait_interruptibly(wait: Callable[[float | None], bool], timeout: float | None) -> bool:
    """``wait(timeout)``, which returns True once what it waits for happened and False at its
    timeout (``timeout`` as ``wait_seconds`` reads it; None: no limit). In the main thread a
    wait longer than ``INTERRUPT_CHECK_S`` is made in slices of it (see that constant)."""
    if threading.get_ident() != threading.main_thread().ident or (
        timeout is not None and timeout <= INTERRUPT_CHECK_S
    ):
        return wait(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = INTERRUPT_CHECK_S
        if deadline is not None:
            left = min(left, deadline - time.monotonic())
            if left <= 0:
                return wait(0)
        if wait(left):
            return True


def thread_joined(thread: threading.Thread) -> Callable[[float | None], bool]:
    """``wait_interruptibly``'s ``wait`` for the end of ``thread``."""

    def joined(timeout: float | None) -> bool:
        thread.join(timeout)
        return not thread.is_alive()

    return joined


def join_interruptibly(thread: threading.Thread, timeout: float | None = None) -> bool:
    """``thread.join(timeout)`` through ``wait_interruptibly``; whether the thread ended."""
    return wait_interruptibly(thread_joined(thread), timeout)
