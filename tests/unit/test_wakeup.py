"""Wakeup: the lock-free wake-up of the coordinator loop (no processes)."""

from __future__ import annotations

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
