"""Wakeup: the coalescing, never-blocking self-pipe that wakes the coordinator thread.

Owned by the coordinator; ``wakeup()`` is called from any thread of the coordinator's process
(``submit``, ``cancel``, ``shutdown``), ``clear()`` only by the coordinator loop after its
``connection.wait()`` returned (CPython's ``_ThreadWakeup``). Its lock is private to this class and
never taken while another lock is held by the caller for anything else (gh-125451).

At most one byte written by ``wakeup()`` is ever pending: ``_armed`` is set when a byte is
written and cleared by ``clear()``, so ``wakeup()`` never blocks on a full pipe (gh-105829) and
costs one attribute test when the coordinator is already awake.

``wakeup_nowait()`` takes no lock, for a caller that may hold any lock of its own thread, this
class's included: a finalizer that the cyclic garbage collector runs inside any allocation
(``Coordinator.cancel_later``). It writes a byte without the flag (the pipe is non-blocking: a
full pipe already holds a wake-up); ``clear()`` reads every pending byte whatever the flag says.
``close()`` waits for a ``wakeup_nowait()`` caught between its ``_closed`` check and its write
(it waits for nothing itself), so that the byte never goes to a file that reused the number.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

# Bytes read per clear(): wakeup() leaves at most one pending, wakeup_nowait() one per call; the
# rest (if ever more) keep the fd readable and are read on the loop's next pass.
WAKEUP_READ_BYTES = 4096
WRITER_POLL_INTERVAL = 0.0001  # seconds close() sleeps while a wakeup_nowait() is mid-write
WRITER_WAIT_MAX = 1.0  # seconds close() waits for them at most (a write takes microseconds)


class Wakeup:
    def __init__(self) -> None:
        self._reader, self._writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._armed = False  # True while a byte written by wakeup() is pending in the pipe
        self._closed = False
        # One entry per wakeup_nowait() between its _closed check and its write (list append
        # and pop are atomic under the GIL): close() waits for them before it closes the fds.
        self._writing: list[None] = []

    def fileno(self) -> int:
        """The read end, for ``multiprocessing.connection.wait``."""
        return self._reader

    def wakeup(self) -> None:
        if self._armed:  # hint only: a stale False costs one extra locked check below
            return
        with self._lock:
            if self._armed or self._closed:
                return
            self._armed = True
            os.write(self._writer, b"\0")

    def wakeup_nowait(self) -> None:
        """Any thread, in any context (a finalizer run by the garbage collector while this
        thread holds ``_lock`` or another lock): wake the loop without taking a lock."""
        # Registered before the _closed check, so that close() (which sets _closed, then waits
        # until _writing is empty) cannot close the fds between the check and the write: a
        # thread that lost the CPU there wrote its byte into whatever file had reused the
        # number by then (tests/stress/test_lifecycle_races.py, the paused drop callback).
        writing = self._writing
        writing.append(None)
        try:
            if self._closed:  # the pool is gone, nothing is left to wake
                return
            # OSError: full (a wake-up is pending anyway).
            with contextlib.suppress(OSError):
                os.write(self._writer, b"\0")
        finally:
            writing.pop()

    def clear(self) -> None:
        """Coordinator loop only: consume the pending bytes so the next wakeup() writes again.
        Reads even when ``_armed`` is False: ``wakeup_nowait`` writes without the flag. The
        flag is cleared before the read: a ``wakeup_nowait`` byte written after the read stays
        pending and wakes the loop again."""
        with self._lock:
            if self._closed:
                return
            self._armed = False
            with contextlib.suppress(BlockingIOError):
                os.read(self._reader, WAKEUP_READ_BYTES)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # A wakeup_nowait() past its _closed check writes next (it waits for nothing and
            # takes no lock): let it, before the number can be reused. Not called from a
            # finalizer, so no wakeup_nowait() of this thread can be below this frame. Bounded:
            # an entry left by an interrupt (Ctrl-C) between append and try must not hang us.
            deadline = time.monotonic() + WRITER_WAIT_MAX
            while self._writing and time.monotonic() < deadline:
                time.sleep(WRITER_POLL_INTERVAL)
            os.close(self._reader)
            os.close(self._writer)
