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
"""

from __future__ import annotations

import contextlib
import os
import threading

# Bytes read per clear(): wakeup() leaves at most one pending, wakeup_nowait() one per call; the
# rest (if ever more) keep the fd readable and are read on the loop's next pass.
WAKEUP_READ_BYTES = 4096


class Wakeup:
    def __init__(self) -> None:
        self._reader, self._writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._armed = False  # True while a byte written by wakeup() is pending in the pipe
        self._closed = False

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
        if self._closed:  # hint only: the pool is gone, nothing is left to wake
            return
        # OSError: full (a wake-up is pending anyway), or closed meanwhile.
        with contextlib.suppress(OSError):
            os.write(self._writer, b"\0")

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
            os.close(self._reader)
            os.close(self._writer)
