"""Wakeup: the coordinator's self-pipe. ``wakeup_nolock`` (a garbage collector's callback) may
write beside a pending byte and without arming; ``clear`` must leave the pipe empty anyway, or
the level-triggered epoll of the coordinator loop would spin."""

from __future__ import annotations

import select

import pytest

from mpsched._wakeup import Wakeup


def _readable(wakeup: Wakeup) -> bool:
    return bool(select.select([wakeup.fileno()], [], [], 0)[0])


@pytest.mark.timeout(10)
def test_clear_consumes_bytes_written_without_the_lock() -> None:
    wakeup = Wakeup()
    try:
        wakeup.wakeup_nolock()
        assert _readable(wakeup)
        wakeup.clear()
        assert not _readable(wakeup)
        wakeup.wakeup()
        wakeup.wakeup_nolock()
        wakeup.clear()
        assert not _readable(wakeup)
        wakeup.wakeup()  # armed again after clear: writes
        assert _readable(wakeup)
    finally:
        wakeup.close()
    wakeup.wakeup_nolock()  # after close: a no-op, not a write to a reused number
