"""Wakeup: the coalescing, never-blocking self-pipe that wakes the coordinator thread.

Owned by the coordinator; ``wakeup()`` is called from any thread of the coordinator's process
(``submit``, ``cancel``, ``shutdown``), ``clear()`` only by the coordinator loop after its
``connection.wait()`` returned (CPython's ``_ThreadWakeup``). Its lock is private to this class and
never taken while another lock is held by the caller for anything else (gh-125451).

At most one byte is ever pending from ``wakeup()``: ``_armed`` is set when a byte is written and
cleared by ``clear()``, so ``wakeup()`` never blocks on a full pipe (gh-105829) and costs one
attribute test when the coordinator is already awake. ``wakeup_nolock()`` (a dropped pool's
garbage-collector callback, which must take no lock) writes without arming, non-blocking.
"""

from __future__ import annotations

import contextlib
import os
import threading


class Wakeup:
    def __init__(self) -> None:
        self._reader, self._writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        self._armed = False  # True while a byte is pending in the pipe
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

    def wakeup_nolock(self) -> None:
        """From a garbage collector's callback, which may run in a thread that holds
        ``self._lock`` (inside ``wakeup``) or any other lock: write a byte without the lock.
        It may add a byte beside a pending one; ``clear()`` reads them all. Not after
        ``close()`` (the number could be another file's by then): the caller makes sure."""
        if self._closed:  # hint only: the callers never race close()
            return
        with contextlib.suppress(BlockingIOError):  # bytes pending: the waiter wakes anyway
            os.write(self._writer, b"\0")

    def clear(self) -> None:
        """Coordinator thread only: consume the pending bytes so the next wakeup() writes
        again. Reads even when not armed: ``wakeup_nolock`` writes without arming."""
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):
                os.read(self._reader, 64)
            self._armed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._reader)
            os.close(self._writer)
