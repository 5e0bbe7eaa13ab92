"""Wakeup: the lock-free wake-up of the coordinator loop (no processes)."""

from __future__ import annotations

import os
import select

import pytest

from mpsched._wakeup import Wakeup


def _readable(wakeup: Wakeup) -> bool:
    return bool(select.select([wakeup.fileno()], [], [], 0)[0])


@pytest.mark.timeout(10)
def test_wakeup_nowait_takes_no_lock_and_clear_consumes_its_byte() -> None:
    """A finalizer run by the garbage collector while this thread holds the wakeup's own lock
    must still wake the loop (it used to need that lock); clear() then leaves nothing."""
    wakeup = Wakeup()
    try:
        with wakeup._lock:  # as a collection inside wakeup() or clear() would find it
            wakeup.wakeup_nowait()
        assert _readable(wakeup)
        wakeup.clear()
        assert not _readable(wakeup)
        wakeup.wakeup()  # the armed flag was not left set by the lock-free write
        assert _readable(wakeup)
        wakeup.wakeup_nowait()
        wakeup.clear()
        assert not _readable(wakeup)
    finally:
        wakeup.close()
    wakeup.wakeup_nowait()  # closed: a no-op


@pytest.mark.timeout(10)
def test_a_closed_wakeup_leaves_the_file_that_reused_its_numbers_alone() -> None:
    """After the pool's close, a late ``wakeup()`` (a submit racing the shutdown),
    ``wakeup_nowait()`` (a finalizer) or ``clear()`` must not touch its fds: their numbers may
    belong to another file by then, here a pipe, which a stray byte would corrupt and a read
    would rob (or block on, the new pipe being blocking: it is made non-blocking here, so that
    a read fails the test rather than hang it)."""
    wakeup = Wakeup()
    numbers = (wakeup.fileno(), wakeup._writer)
    wakeup.close()
    reader, writer = os.pipe()
    try:
        assert (reader, writer) == numbers  # the lowest numbers free: the closed ones
        os.set_blocking(reader, False)
        os.write(writer, b"x")  # the new owner's byte
        wakeup.wakeup()
        wakeup.wakeup_nowait()
        wakeup.clear()
        wakeup.close()
        assert os.read(reader, 100) == b"x"  # no byte added, and its own one not read
    finally:
        os.close(reader)
        os.close(writer)
